"""The ``poller`` command: one module per command group, assembled in ``app.py``.

``main`` imports the command stack lazily, so that an install without the ``service``
extra (a gateway's: redis and pydantic only) gets one line naming the install command
instead of a traceback.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["cli", "main"]

SERVICE_HINT = "pip install 'llmgw-poller[service]'"


def main() -> None:
    try:
        from poller.cli.app import cli as group
    except ModuleNotFoundError as exc:
        missing = (exc.name or "a module").split(".")[0]
        print(  # noqa: T201 (no click to echo with)
            f"poller: the command needs the service extra ({missing} is not installed): "
            f"{SERVICE_HINT}",
            file=sys.stderr,
        )
        sys.exit(2)
    from poller.errors import PollerError
    from poller.util.logs import setup_logging

    setup_logging("WARNING")
    try:
        group(prog_name="poller")
    except PollerError as exc:  # a last resort: every command maps its own errors
        print(f"Error: {exc}", file=sys.stderr)  # noqa: T201
        sys.exit(1)


def __getattr__(name: str) -> Any:
    # `from poller.cli import cli` for tests and embedding, without importing click eagerly.
    if name == "cli":
        from poller.cli.app import cli

        return cli
    raise AttributeError(name)
