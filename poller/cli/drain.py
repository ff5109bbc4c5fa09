"""``poller drain ID``: take a poller out of service gently, or (``--undo``) back.

A drained poller hands its leases over at its next heartbeat (the others take them at
once), takes no new ones, and keeps serving its health port, where ``/readyz`` says
``draining``. The request lives in Redis (``P:members:drain``), so every poller,
``poller status`` and the operator's page see it; it ends with ``--undo`` or when the
poller stops. SIGUSR1 to a ``poller run`` process does the same as this command.
"""

from __future__ import annotations

import asyncio
import time

import click

from poller.cli.common import NAMESPACE, REDIS_URL, run_store_command, store_session
from poller.cli.oneline import BadInput
from poller.store.members import cancel_drain, leases_of, read_members, request_drain
from poller.store.store import RedisStore
from poller.util.logs import count

__all__ = ["drain"]


@click.command()
@click.argument("poller_id", metavar="ID")
@click.option("--undo", is_flag=True, help="Return the poller to service.")
@click.option(
    "--force",
    is_flag=True,
    help="Drain even the last serving poller (then nothing is scraped until --undo).",
)
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(0, 3600),
    metavar="S",
    show_default="do not wait",
    help="Wait up to S seconds until the poller holds no lease; exit 1 if it still does.",
)
@REDIS_URL
@NAMESPACE
def drain(
    poller_id: str,
    undo: bool,
    force: bool,
    wait_s: float | None,
    redis_url: str | None,
    namespace: str | None,
) -> None:
    """Drain poller ID: it hands its endpoints over, takes no new ones and keeps serving
    its health port (SIGUSR1 to the process does the same); --undo ends the drain."""

    async def go() -> int:
        async with store_session(redis_url, namespace, claim=False) as store:
            if undo:
                return await _undo(store, poller_id)
            return await _drain(store, poller_id, force, wait_s)

    raise SystemExit(run_store_command(go()))


async def _undo(store: RedisStore, poller_id: str) -> int:
    if await cancel_drain(store.client, store.keys, poller_id):
        click.echo(f"{poller_id} returns to service: it takes its share of the endpoints again")
    else:
        click.echo(f"{poller_id} was not draining: nothing to undo")
    return 0


async def _drain(store: RedisStore, poller_id: str, force: bool, wait_s: float | None) -> int:
    _, members = await read_members(store.client, store.keys)
    live = {m.id: m for m in members}
    if poller_id not in live:
        names = ", ".join(live) or "none"
        raise BadInput(f"no live poller {poller_id!r} (live pollers: {names})")
    serving = [m.id for m in members if m.state == "serving" and m.id != poller_id]
    if not serving and live[poller_id].state == "serving" and not force:
        raise BadInput(
            f"{poller_id} is the last serving poller: draining it stops every scrape "
            "(add --force to drain it anyway)"
        )
    outcome = await request_drain(store.client, store.keys, poller_id, "cli")
    if outcome == "not live":  # it left between the two reads
        raise BadInput(f"no live poller {poller_id!r}: it left")
    if outcome == "already":
        click.echo(f"{poller_id} is already draining; `poller drain {poller_id} --undo` ends it")
    else:
        click.echo(
            f"draining {poller_id}: it hands its endpoints over at its next heartbeat and "
            f"takes no new ones; `poller drain {poller_id} --undo` returns it to service"
        )
    if wait_s is None:
        return 0
    return await _wait_empty(store, poller_id, wait_s)


async def _wait_empty(store: RedisStore, poller_id: str, wait_s: float) -> int:
    started = time.monotonic()
    while True:
        held = await leases_of(store.client, store.keys, poller_id)
        _, members = await read_members(store.client, store.keys)
        acknowledged = any(m.id == poller_id and m.state == "draining" for m in members)
        took_s = time.monotonic() - started
        if acknowledged and not held:
            click.echo(f"{poller_id} holds no lease ({took_s:.1f}s)")
            return 0
        if took_s >= wait_s:
            if acknowledged:
                why = f"still holds {count(len(held), 'lease')}"
            else:  # a version without drain, or a poller not heartbeating
                why = "has not acknowledged the drain"
            click.echo(f"{poller_id} {why} after {wait_s:g}s", err=True)
            return 1
        await asyncio.sleep(0.2)
