"""What asyncio tasks of ours need beside asyncio."""

from __future__ import annotations

import asyncio

__all__ = ["raise_if_cancelled"]


def raise_if_cancelled() -> None:
    """Raise CancelledError if this task was asked to stop and the request was lost on
    the way (Python 3.11: a timeout or a library's ``wait_for`` that met the cancel can
    swallow it). A loop that checks only its stop flag would then outlive its event
    loop: ``asyncio.run`` cancels a leftover task once, then waits for it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
