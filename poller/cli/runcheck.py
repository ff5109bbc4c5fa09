"""``poller run --check``: the settings are valid and Redis answers; then exit.

For a deploy pipeline, an init container or an operator about to start a poller: it
reads, never writes (no schema claimed, no membership, no lease), and says what a poller
would find: the schema version, the live pollers, the registry's size.
It also listens on the health port for a moment, as a poller would, so a port in use
fails here rather than at the start of the real run.
Exit status: 0 ready to run; 2 a bad setting (before anything is contacted) or Redis
refusing the credentials; 1 the health port in use, Redis unreachable or holding another
schema version.
"""

from __future__ import annotations

import asyncio
import errno
import sys

import click

from poller.config import Settings
from poller.errors import SchemaMismatch
from poller.redis.errors import redis_call
from poller.schema.keys import SCHEMA_VERSION
from poller.service.ttl import stats_ttl_ms
from poller.store.members import read_members
from poller.store.namespaces import namespaces
from poller.store.store import RedisStore
from poller.util.logs import count
from poller.util.urls import redact_url

__all__ = ["check_run"]


async def _check_health_port(host: str, port: int) -> None:
    """Listen on the health port as ``poller run`` would (``asyncio.start_server``), and
    let go at once; one line and exit 1 when it cannot (0: no health server)."""
    if not port:
        return
    try:
        server = await asyncio.start_server(_refuse, host, port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            said = f"health port {port} on {host} is in use"
        else:
            said = f"cannot listen on health port {port} on {host}: {exc.strerror or exc}"
        click.echo(
            f"Error: {said}: stop what holds it, or set another (--health-port, "
            "POLLER_HEALTH_PORT; 0 turns the health server off)",
            err=True,
        )
        sys.exit(1)
    server.close()
    await server.wait_closed()


async def _refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()


async def check_run(settings: Settings) -> int:
    sc = settings.scrape
    ttl_s = stats_ttl_ms(sc.interval_s, sc.timeout_s, settings.coordination, sc.stats_ttl_intervals)
    click.echo(
        f"settings ok: poller {settings.id}, namespace {settings.redis.namespace}, "
        f"interval {sc.interval_s:g}s (timeout {sc.timeout_s:g}s, stats live {ttl_s / 1000:g}s), "
        f"health port {settings.health.port or 'off'}"
        + (f", endpoints file {settings.endpoints_file}" if settings.endpoints_file else "")
    )
    await _check_health_port(settings.health.host, settings.health.port)
    store = RedisStore.from_settings(settings.redis)
    try:
        schema = await redis_call(store.client.get(store.keys.schema), "GET schema")
        if schema is not None and schema != SCHEMA_VERSION:
            raise SchemaMismatch(
                f"Redis holds schema version {schema!r}, this poller speaks version "
                f"{SCHEMA_VERSION}; upgrade the poller or use another namespace"
            )
        _, members = await read_members(store.client, store.keys)
        registry = await store.read_registry()
        # Nothing ever wrote this namespace: a typo beside one that exists, most likely.
        others = await namespaces(store.client) if schema is None else None
    finally:
        await store.close()
    pollers = ", ".join(m.id if m.state == "serving" else f"{m.id} {m.state}" for m in members)
    said_schema = f"schema {schema}" if schema else "no schema yet (the first poller claims 1)"
    invalid = f", {len(registry.invalid)} invalid" if registry.invalid else ""
    click.echo(
        f"redis ok: {redact_url(settings.redis.url)}, {said_schema}, "
        f"{count(len(members), 'live poller')}"
        + (f" ({pollers})" if pollers else "")
        + f", registry rev {registry.rev}: {count(len(registry.ids), 'endpoint')}{invalid}"
    )
    if others:
        click.echo(
            f"note: nothing ever wrote namespace {settings.redis.namespace}; namespaces on "
            f"this Redis: {', '.join(others)} (wrong --namespace?)"
        )
    return 0
