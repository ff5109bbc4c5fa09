"""``poller status``: the shared view as a table (or JSON), once or live."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import click

from poller.cli.common import NAMESPACE, REDIS_URL, load, redis_json, redis_line, store_failure
from poller.errors import SchemaMismatch, StoreError
from poller.schema.keys import Keys
from poller.service.web.render import STATES
from poller.store.namespaces import namespaces


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
    "--state",
    "states",
    multiple=True,
    type=click.Choice(STATES),
    show_default="every state",
    help="Show only endpoints in this state (repeatable: any of them).",
)
@click.option(
    "--engine",
    "engines",
    multiple=True,
    metavar="ENGINE",
    show_default="every engine",
    help="Show only endpoints of this engine, as the ENGINE column shows it (repeatable).",
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
    states: tuple[str, ...],
    engines: tuple[str, ...],
    stale_after_ms: int | None,
) -> None:
    """Print the shared view: every endpoint, its state, load and owner; first, the
    Redis and namespace read."""
    from rich.console import Console, Group
    from rich.text import Text

    from poller.cli.fleet import Fleet, fleet_parts, read_fleet
    from poller.cli.render import render, selected
    from poller.reader.reader import StatsReader
    from poller.reader.view import View
    from poller.service.web.format import with_entries

    settings = load(None, {"redis.url": redis_url, "redis.namespace": namespace})
    console = Console()
    narrow: int | None = console.width  # a terminal: the table fits it, cells never wrap
    if not console.is_terminal:
        console, narrow = Console(width=200), None  # piped: whole rows, every column

    async def go() -> None:
        # from_settings, not from_url: POLLER_REDIS__TLS_* and cluster settings apply too
        reader = StatsReader.from_settings(settings.redis, stale_after_ms=stale_after_ms)

        async def read() -> tuple[View, list[dict[str, Any]], Fleet, list[str] | None]:
            view = await reader.snapshot()
            found = await sources(reader)
            fleet = await read_fleet(reader.client, reader.keys, view.endpoints)
            others = await namespaces(reader.client) if view.schema_missing else None
            return view, found, fleet, others

        def draw(
            view: View, found: list[dict[str, Any]], fleet: Fleet, others: list[str] | None
        ) -> Group:
            lines = [Text(redis_line(settings.redis))]
            lines += [Text(line, style="yellow") for line in no_schema(view, reader.keys, others)]
            extra = fleet_parts(fleet) if fleet.members else []
            only = selected(view, states, engines)
            table = render(view, sort, found, extra, only, width=narrow)
            return Group(*lines, table)

        async def frame() -> Any:
            """The next frame: the tables, or the error of this read (the watch goes on)."""
            try:
                return draw(*await read())
            except StoreError as exc:
                return f"[red]Error: {exc}[/red]"

        try:
            view, found, fleet, others = await read()
            if as_json:
                said = {**with_entries(view), "sources": found, "members": fleet.to_json()}
                said["endpoints"] = _only(said["endpoints"], selected(view, states, engines))
                click.echo(json.dumps(_read_from(settings, view, others) | said, indent=2))
                return
            shown = draw(view, found, fleet, others)
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
            said = {"error": "schema_mismatch", "message": str(exc), **found}
            click.echo(json.dumps({**redis_json(settings.redis), **said}))
        store_failure(exc)


def _only(rows: list[dict[str, Any]], ids: list[str] | None) -> list[dict[str, Any]]:
    """The rows ``--state``/``--engine`` selected (the counts stay the whole view's)."""
    if ids is None:
        return rows
    keep = set(ids)
    return [row for row in rows if row["id"] in keep]


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


def _read_from(settings: Any, view: Any, others: list[str] | None) -> dict[str, Any]:
    """``--json``'s first keys: the Redis and namespace read, and whether the namespace
    has a schema key (with the namespaces that do, when it has none)."""
    said = {**redis_json(settings.redis), "schema_missing": view.schema_missing}
    return said if others is None else {**said, "namespaces": others}


def no_schema(view: Any, keys: Keys, others: list[str] | None) -> list[str]:
    """What status says of a namespace without a schema key, and the namespaces that
    have one on this Redis (when a bounded SCAN could find them); nothing for one with."""
    if not view.schema_missing:
        return []
    said = [
        f"namespace {keys.namespace} has no schema key ({keys.schema}): nothing ever wrote "
        "it: wrong namespace?"
    ]
    if others:
        said.append(f"namespaces on this Redis: {', '.join(others)} (--namespace NS)")
    elif others is not None:
        said.append("no namespace on this Redis has a schema key: no poller has run here")
    return said
