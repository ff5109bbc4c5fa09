"""How an ``Exchange`` is driven: a task beside the asyncio follower (``run``), or a
thread beside the threaded one (``run_sync``). Each loop takes in what was heard, makes
the call when the pacer says, sleeps until a change, a message or the next call, and
makes a last call as it stops (``Exchange.leaving``: this replica leaves the totals at
once rather than at its TTL).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from poller.reader.exchange.exchange import Exchange
from poller.util.tasks import raise_if_cancelled

__all__ = ["run", "run_sync"]

#: The bound on one call (seconds): Redis away, the loop goes on to its retry.
CALL_BOUND_S = 1.0


async def run(exchange: Exchange, stop: asyncio.Event) -> None:
    """Until ``stop`` is set: take in what was heard, call when the pacer says."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    owner = threading.get_ident()

    def waker() -> None:  # from the loop's own thread, or a gateway's thread
        if threading.get_ident() == owner:
            wake.set()
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(wake.set)

    exchange.install(waker)
    try:
        while not stop.is_set():
            raise_if_cancelled()
            wake.clear()
            prepared, sleep_s = exchange.next_step()
            if prepared is not None:
                keys, args, pages = prepared
                try:
                    async with asyncio.timeout(CALL_BOUND_S):
                        reply = await exchange.script(keys=keys, args=args)
                    exchange.answered(reply, pages)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # Redis away, NOPERM: routing goes on, locally
                    exchange.failed(exc, pages)
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(sleep_s):
                    await wake.wait()
        leaving = exchange.leaving()
        if leaving is not None:
            with contextlib.suppress(Exception):  # best effort: the TTL does it anyway
                async with asyncio.timeout(CALL_BOUND_S):
                    await exchange.script(keys=leaving[0], args=leaving[1])
    finally:
        exchange.install(None)


def run_sync(
    exchange: Exchange, stop: threading.Event, wake: threading.Event | None = None
) -> None:
    """Until ``stop`` is set (the threaded reader's thread); ``wake``: the event the loop
    sleeps on, set by a change or a message (a test passes its own)."""
    wake = wake or threading.Event()
    exchange.install(wake.set)
    try:
        while not stop.is_set():
            wake.clear()
            prepared, sleep_s = exchange.next_step()
            if prepared is not None:
                keys, args, pages = prepared
                try:
                    exchange.answered(exchange.script(keys=keys, args=args), pages)
                except Exception as exc:
                    exchange.failed(exc, pages)
                continue
            wake.wait(sleep_s)
        leaving = exchange.leaving()
        if leaving is not None:
            with contextlib.suppress(Exception):  # best effort: the TTL does it anyway
                exchange.script(keys=leaving[0], args=leaving[1])
    finally:
        exchange.install(None)
