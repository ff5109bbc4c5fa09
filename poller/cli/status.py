"""``poller status``: the shared view as a table (or JSON), once or live."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import click

from poller.cli.common import NAMESPACE, REDIS_URL, load, store_failure
from poller.errors import SchemaMismatch, StoreError


@click.command()
@REDIS_URL
@NAMESPACE
@click.option("--json", "as_json", is_flag=True, help="Print the snapshot as JSON.")
@click.option(
    "--watch",
    is_flag=True,
    help="Refresh every second until Ctrl-C; piped, print a plain frame every second.",
)
@click.option(
    "--sort",
    type=click.Choice(["id", "engine", "state", "owner", "running", "waiting", "kv", "hit", "age"]),
    default="id",
    show_default=True,
    help="Order the rows by this column.",
)
@click.option(
    "--stale-after-ms",
    type=click.IntRange(1),
    metavar="MS",
    show_default="2 intervals of each endpoint",
    help="Stats older than this are stale.",
)
def status(
    redis_url: str | None,
    namespace: str | None,
    as_json: bool,
    watch: bool,
    sort: str,
    stale_after_ms: int | None,
) -> None:
    """Print the shared view: every endpoint, its state, load and owner."""
    from rich.console import Console, Group

    from poller.cli.fleet import Fleet, fleet_parts, read_fleet
    from poller.cli.render import render
    from poller.reader.reader import StatsReader
    from poller.reader.view import View
    from poller.service.web.format import with_entries

    settings = load(None, {"redis.url": redis_url, "redis.namespace": namespace})
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # piped: whole rows, never wrapped at 80 columns

    async def go() -> None:
        # from_settings, not from_url: POLLER_REDIS__TLS_* and cluster settings apply too
        reader = StatsReader.from_settings(settings.redis, stale_after_ms=stale_after_ms)

        async def read() -> tuple[View, list[dict[str, Any]], Fleet]:
            view = await reader.snapshot()
            found = await sources(reader)
            return view, found, await read_fleet(reader.client, reader.keys, view.endpoints)

        def draw(view: View, found: list[dict[str, Any]], fleet: Fleet) -> Group:
            return render(view, sort, found, fleet_parts(fleet) if fleet.members else [])

        async def frame() -> Any:
            """The next frame: the tables, or the error of this read (the watch goes on)."""
            try:
                return draw(*await read())
            except StoreError as exc:
                return f"[red]Error: {exc}[/red]"

        try:
            view, found, fleet = await read()
            if as_json:
                shown_json = {**with_entries(view), "sources": found, "members": fleet.to_json()}
                click.echo(json.dumps(shown_json, indent=2))
                return
            shown = draw(view, found, fleet)
            if watch:
                await _watch(console, shown, frame)
            else:
                console.print(shown)
        finally:
            await reader.aclose()

    try:
        asyncio.run(go())
    except KeyboardInterrupt:
        pass
    except StoreError as exc:
        if as_json and isinstance(exc, SchemaMismatch):
            # a script reading stdout learns why there is no view
            found = {"schema": exc.found, "reader_schema": exc.expected}
            click.echo(json.dumps({"error": "schema_mismatch", "message": str(exc), **found}))
        store_failure(exc)


async def _watch(console: Any, shown: Any, frame: Callable[[], Awaitable[Any]]) -> None:
    """A new frame every second until Ctrl-C."""
    from rich.live import Live

    if not console.is_terminal:
        # Piped: plain text, no cursor movement: a whole frame every second, with a blank
        # line between frames.
        while True:
            console.print(shown)
            console.file.flush()
            await asyncio.sleep(1.0)
            console.print()
            shown = await frame()
    with Live(shown, console=console, auto_refresh=False) as live:
        while True:
            await asyncio.sleep(1.0)
            live.update(await frame(), refresh=True)


async def sources(reader: Any) -> list[dict[str, Any]]:
    """The DNS discovery sources, for the table under the endpoints."""
    from poller.store.discovery import read_sources

    found: list[dict[str, Any]] = await read_sources(reader.client, reader.keys)
    return found
