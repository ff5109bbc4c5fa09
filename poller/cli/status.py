"""``poller status``: the shared view as a table (or JSON), once or live."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import click

from poller.cli.common import NAMESPACE, REDIS_URL, load
from poller.errors import SchemaMismatch, StoreError


@click.command()
@REDIS_URL
@NAMESPACE
@click.option("--json", "as_json", is_flag=True, help="Print the snapshot as JSON.")
@click.option("--watch", is_flag=True, help="Refresh every second until Ctrl-C.")
@click.option(
    "--sort",
    type=click.Choice(["id", "engine", "state", "owner", "running", "waiting", "kv", "hit", "age"]),
    default="id",
    show_default=True,
)
@click.option(
    "--stale-after-ms",
    type=click.IntRange(1),
    metavar="MS",
    help="Freshness bound (default: 2 intervals of each endpoint).",
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
    from rich.console import Console
    from rich.live import Live

    from poller.cli.render import render
    from poller.reader.reader import StatsReader
    from poller.redis.discovery import read_sources

    settings = load(None, {"redis.url": redis_url, "redis.namespace": namespace})
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # piped: whole rows, never wrapped at 80 columns

    async def go() -> None:
        # from_settings, not from_url: POLLER_REDIS__TLS_* and cluster settings apply too
        reader = StatsReader.from_settings(settings.redis, stale_after_ms=stale_after_ms)

        async def sources() -> list[dict[str, Any]]:
            return await read_sources(reader.client, reader.keys)

        try:
            view = await reader.snapshot()
            found = await sources()
            if as_json:
                click.echo(json.dumps({**view.to_dict(), "sources": found}, indent=2))
                return
            if not watch:
                console.print(render(view, sort, found))
                return
            with Live(render(view, sort, found), console=console, auto_refresh=False) as live:
                while True:
                    await asyncio.sleep(1.0)
                    try:
                        view = await reader.snapshot()
                        found = await sources()
                    except StoreError as exc:
                        live.update(f"[red]{exc}[/red]", refresh=True)
                        continue
                    live.update(render(view, sort, found), refresh=True)
        finally:
            await reader.aclose()

    try:
        asyncio.run(go())
    except KeyboardInterrupt:
        pass
    except SchemaMismatch as exc:
        if as_json:  # a script reading stdout learns why there is no view
            found = {"schema": exc.found, "reader_schema": exc.expected}
            click.echo(json.dumps({"error": "schema_mismatch", "message": str(exc), **found}))
        click.echo(f"Error: {exc}", err=True)
        sys.exit(1)
    except StoreError as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(1)
