"""``poller endpoints add|rm|ls|sync|export``: read and change the registry in Redis."""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

import click

from poller.cli.common import (
    NAMESPACE,
    REDIS_URL,
    config_option,
    load,
    redis_json,
    redis_line,
    run_store_command,
    store_session,
)
from poller.cli.export import endpoints_export
from poller.cli.oneline import BadInput
from poller.cli.register import registration_problems, settings_and_file
from poller.config import ScrapeSettings, effective_timeout_s
from poller.errors import ConfigError
from poller.schema.endpoint import (
    ENGINES,
    Endpoint,
    endpoint_from_dict,
    validate_endpoint_id,
)
from poller.store.registry import EntryExists, UrlTaken, sync_diff
from poller.util.logs import count

T = TypeVar("T")


@click.group()
def endpoints() -> None:
    """Read and change the endpoint registry in Redis."""


CONFIG = config_option(
    "The pollers' TOML settings file: its [redis] and [scrape] (key rules, engine "
    "paths, default engine) apply to the checks, as on the pollers."
)


def _scrape_settings(
    config_file: str | None, redis_url: str | None, namespace: str | None
) -> ScrapeSettings:
    """The pollers' scrape settings as far as this shell knows them (``--config``,
    ``POLLER_SCRAPE__*``); a mistake there is refused like any other."""
    return load(config_file, {"redis.url": redis_url, "redis.namespace": namespace}).scrape


def _timeout_notes(entries: list[Endpoint], scrape: ScrapeSettings) -> None:
    """One line per entry whose timeout the pollers will lower (effective_timeout_s)."""
    for e in entries:
        timeout, lowered = effective_timeout_s(e.timeout_s, e.interval_s, scrape)
        if not lowered:
            continue
        interval = e.interval_s or scrape.interval_s
        named = e.timeout_s or scrape.timeout_s
        where = "" if e.interval_s else " (scrape.interval_s)"
        click.echo(
            f"note: {e.id}: timeout {named:g}s is not below its interval {interval:g}s{where}: "
            f"the pollers use {timeout:g}s, half the interval"
        )


async def _refusing_url_conflicts(coro: Awaitable[T]) -> T:
    """A write the registry refused for a URL another entry has: a mistake in what was
    registered (one line per entry, exit 2), not a Redis failure."""
    try:
        return await coro
    except UrlTaken as exc:
        raise BadInput(str(exc)) from None


def _labels(values: tuple[str, ...]) -> dict[str, str]:
    labels = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not k=v", param_hint="--label")
        labels[key] = value
    return labels


@endpoints.command("add")
@click.argument("endpoint_id", metavar="ID")
@click.argument("url")
@click.option(
    "--engine",
    type=click.Choice(list(ENGINES)),
    show_default="the pollers' scrape.default_engine, vllm",
    help="Engine mapping: which metrics the pollers read.",
)
@click.option(
    "--metrics-path",
    metavar="P",
    show_default="the engine's, e.g. /metrics",
    help="Path (and query) the pollers append to URL.",
)
@click.option(
    "--api-key-env",
    metavar="VAR",
    help="Variable on the pollers holding the key; must start with scrape.key_env_prefix "
    "(LLMGW_KEY_).",
)
@click.option(
    "--api-key-file",
    metavar="F",
    help="File on the pollers holding the key; must be inside scrape.key_dir.",
)
@click.option(
    "--interval",
    "interval_s",
    type=float,
    metavar="S",
    show_default="the pollers' scrape.interval_s",
    help="Scrape interval of this endpoint in seconds.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    metavar="S",
    show_default="the pollers' scrape.timeout_s",
    help="Scrape timeout of this endpoint in seconds, below its interval.",
)
@click.option(
    "--label",
    "labels",
    multiple=True,
    metavar="K=V",
    help="A label for readers to select by (zone=a); repeatable.",
)
@click.option(
    "--model",
    "models",
    multiple=True,
    metavar="NAME",
    show_default="none: only the names the pollers read",
    help="A model the endpoint serves, for engines whose page names none (llama.cpp, "
    "TGI) or an alias; added to the names the pollers read; repeatable.",
)
@click.option("--replace", is_flag=True, help="Overwrite an existing entry with this id.")
@CONFIG
@REDIS_URL
@NAMESPACE
def endpoints_add(
    endpoint_id: str,
    url: str,
    engine: str | None,
    metrics_path: str | None,
    api_key_env: str | None,
    api_key_file: str | None,
    interval_s: float | None,
    timeout_s: float | None,
    labels: tuple[str, ...],
    models: tuple[str, ...],
    replace: bool,
    config_file: str | None,
    redis_url: str | None,
    namespace: str | None,
) -> None:
    """Add (or with --replace, update) one endpoint."""
    data: dict[str, Any] = {"url": url, "labels": _labels(labels)}
    if models:
        data["models"] = list(models)
    for key, value in (
        ("engine", engine),
        ("metrics_path", metrics_path),
        ("api_key_env", api_key_env),
        ("api_key_file", api_key_file),
        ("interval_s", interval_s),
        ("timeout_s", timeout_s),
    ):
        if value is not None:
            data[key] = value
    # Every problem of the entry and the settings at once.
    problems: list[str] = []
    endpoint: Endpoint | None = None
    try:
        endpoint = endpoint_from_dict(endpoint_id, data)
    except ConfigError as exc:
        problems.append(str(exc))
    scrape: ScrapeSettings | None = None
    try:
        scrape = _scrape_settings(config_file, redis_url, namespace)
    except BadInput as exc:
        problems += exc.format_message().splitlines()
    if endpoint is not None:
        problems += registration_problems([endpoint], scrape or ScrapeSettings())
    if problems or endpoint is None or scrape is None:
        raise BadInput("\n".join(problems))

    async def go() -> int:
        async with store_session(redis_url, namespace, config_file) as store:
            try:
                return await store.put_endpoint(endpoint, replace=replace, unique_url=True)
            except EntryExists:
                click.echo(
                    f"Error: endpoint {endpoint_id!r} already exists: add --replace to "
                    "overwrite it",
                    err=True,
                )
                sys.exit(1)

    rev = run_store_command(_refusing_url_conflicts(go()))
    where = _where(config_file, redis_url, namespace)
    click.echo(f"{'updated' if replace else 'added'} {endpoint_id} (registry rev {rev} of {where})")
    _timeout_notes([endpoint], scrape)


def _where(config_file: str | None, redis_url: str | None, namespace: str | None) -> str:
    """The Redis and namespace a command changed, for its last line."""
    return redis_line(
        load(config_file, {"redis.url": redis_url, "redis.namespace": namespace}).redis
    )


@endpoints.command("rm")
@click.argument("endpoint_id", metavar="ID")
@REDIS_URL
@NAMESPACE
def endpoints_rm(endpoint_id: str, redis_url: str | None, namespace: str | None) -> None:
    """Remove an endpoint with its stats, failure and lease."""
    try:
        validate_endpoint_id(endpoint_id)  # before Redis: a bad id is the mistake to name
    except ConfigError as exc:
        raise BadInput(str(exc)) from None

    async def go() -> int | None:
        async with store_session(redis_url, namespace, claim=False) as store:
            return await store.remove_endpoint(endpoint_id)

    rev = run_store_command(go())
    if rev is None:
        click.echo(f"Error: no endpoint {endpoint_id!r}", err=True)
        sys.exit(1)
    click.echo(
        f"removed {endpoint_id} (registry rev {rev} of {_where(None, redis_url, namespace)})"
    )


@endpoints.command("ls")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the registry as JSON with its revision and invalid entries (a report: "
    "`endpoints export` writes a file `sync` reads).",
)
@REDIS_URL
@NAMESPACE
def endpoints_ls(as_json: bool, redis_url: str | None, namespace: str | None) -> None:
    """List the registry (invalid entries are shown with their error); reads only."""
    settings = load(None, {"redis.url": redis_url, "redis.namespace": namespace})

    async def go() -> Any:
        async with store_session(redis_url, namespace, claim=False) as store:
            return await store.read_registry()

    registry = run_store_command(go())
    if as_json:
        out = {
            **redis_json(settings.redis),
            "rev": registry.rev,
            "endpoints": [
                {"id": e.id, **e.model_dump(exclude={"id"}, exclude_defaults=True)}
                for e in sorted(registry.endpoints.values(), key=lambda e: e.id)
            ],
            "invalid": registry.invalid,
        }
        click.echo(json.dumps(out, indent=2, default=list))
        return
    click.echo(redis_line(settings.redis))
    click.echo(
        f"registry rev {registry.rev}: {count(len(registry.endpoints), 'endpoint')}"
        + (f", {len(registry.invalid)} invalid" if registry.invalid else "")
    )
    for e in sorted(registry.endpoints.values(), key=lambda e: e.id):
        extra = f" interval={e.interval_s}s" if e.interval_s else ""
        click.echo(
            f"  {e.id:<24} {e.engine or '(default)':<9} {e.url}{e.metrics_path or ''}" + extra
        )
    for endpoint_id, error in sorted(registry.invalid.items()):
        click.echo(f"  {endpoint_id:<24} INVALID   {error}")


@endpoints.command("sync")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--dry-run", is_flag=True, help="Print the changes without applying them.")
@CONFIG
@REDIS_URL
@NAMESPACE
def endpoints_sync(
    file: str, dry_run: bool, config_file: str | None, redis_url: str | None, namespace: str | None
) -> None:
    """Make the registry exactly FILE (YAML, JSON or TOML), atomically."""
    # Every problem of the settings and the file at once.
    settings, entries = settings_and_file(
        config_file, {"redis.url": redis_url, "redis.namespace": namespace}, file
    )
    scrape = settings.scrape
    wanted = entries or {}

    async def go() -> tuple[int, list[str], list[str], list[str]]:
        async with store_session(redis_url, namespace, config_file, claim=not dry_run) as store:
            if dry_run:
                current = await store.read_registry()
                diff = sync_diff(current, {e.id: e.to_json() for e in wanted.values()})
                return (current.rev, *diff)
            return await store.replace_registry(wanted, unique_url=True)

    rev, added, changed, removed = run_store_command(_refusing_url_conflicts(go()))
    for sign, ids in (("+", added), ("~", changed), ("-", removed)):
        for endpoint_id in ids:
            click.echo(f"{sign} {endpoint_id}")
    if dry_run:
        click.echo(
            f"would add {len(added)}, change {len(changed)}, remove {len(removed)} "
            f"(registry rev {rev} of {redis_line(settings.redis)})"
        )
    else:
        click.echo(
            f"added {len(added)}, changed {len(changed)}, removed {len(removed)} "
            f"(registry rev {rev} of {redis_line(settings.redis)})"
        )
    _timeout_notes([wanted[endpoint_id] for endpoint_id in sorted(wanted)], scrape)


endpoints.add_command(endpoints_export)
