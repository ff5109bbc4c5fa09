"""The ``poller`` command. Logging is configured here and nowhere else.

Exit status: 0 success, 1 the job failed (a scrape, a contract, Redis), 2 bad usage.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import click

from ._version import __version__
from .config import Settings, load_settings
from .engines import ENGINE_SPECS
from .errors import ConfigError, PollerError, SchemaMismatch, StoreError
from .registry import endpoint_from_dict, endpoints_from_file
from .store import RedisStore, diff_registry

log = logging.getLogger("poller")


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # APScheduler logs every job run at INFO: far too chatty at 1,000 jobs a second.
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="poller")
def cli() -> None:
    """llmgw-poller: scrape LLM engines once, share their load through Redis."""


# --- run --------------------------------------------------------------------------------------


def _load(config: str | None, overrides: dict[str, Any]) -> Settings:
    try:
        return load_settings(config, overrides)
    except ConfigError as exc:
        raise click.UsageError(f"invalid setting: {exc}") from None


async def serve(settings: Settings) -> int:
    """Run one poller until SIGTERM/SIGINT; returns the exit status."""
    from .health import HealthServer
    from .worker import Worker

    worker = Worker(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    worker.on_fatal = stop.set
    health = None
    if settings.health.port:
        from .reader import StatsReader

        view_reader = StatsReader(worker.store.client, settings.redis.namespace)

        async def view() -> dict[str, Any]:
            return (await view_reader.snapshot()).to_dict()

        health = HealthServer(
            settings.health.host,
            settings.health.port,
            ready=lambda: worker.ready,
            registry=worker.metrics.registry,
            routes={"/v1/view": view},
        )
        try:
            await health.start()
        except OSError as exc:
            log.error(
                "cannot listen on %s:%d: %s",
                settings.health.host,
                settings.health.port,
                exc.strerror,
            )
            await worker.store.close()
            return 1
    log.info(
        "poller %s starting: redis=%s namespace=%s",
        settings.id,
        _redact(settings.redis.url),
        settings.redis.namespace,
    )
    await worker.start()
    try:
        await stop.wait()
    finally:
        log.info("stopping")
        await worker.stop()
        if health is not None:
            await health.stop()
    if worker.fatal is not None:
        log.error("%s", worker.fatal)
        return 1
    return 0


def _redact(url: str) -> str:
    """The Redis URL without its password, for logs."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (
        f":{parts.port}" if parts.port else ""
    )
    return urlunsplit(parts._replace(netloc=netloc))


_REDIS_URL = click.option(
    "--redis-url",
    envvar="POLLER_REDIS_URL",
    metavar="URL",
    help="redis://, rediss://, unix:// or redis+sentinel://HOST:PORT[,...]/MASTER URL "
    "[env POLLER_REDIS_URL]",
)
_NAMESPACE = click.option(
    "--namespace",
    envvar="POLLER_NAMESPACE",
    metavar="NS",
    help="Key namespace (prefix {NS}) [env POLLER_NAMESPACE; default llmgw]",
)


@cli.command()
@click.option(
    "--config",
    "config_file",
    envvar="POLLER_CONFIG",
    metavar="FILE",
    type=click.Path(dir_okay=False),
    help="TOML settings file [env POLLER_CONFIG]",
)
@_REDIS_URL
@_NAMESPACE
@click.option(
    "--id",
    "poller_id",
    envvar="POLLER_ID",
    metavar="ID",
    help="Stable poller id, e.g. the pod name [env POLLER_ID; default hostname-pid]",
)
@click.option(
    "--interval",
    "interval_s",
    envvar="POLLER_INTERVAL",
    type=float,
    metavar="S",
    help="Default scrape interval in seconds [env POLLER_INTERVAL]",
)
@click.option(
    "--timeout",
    "timeout_s",
    envvar="POLLER_TIMEOUT",
    type=float,
    metavar="S",
    help="Default scrape timeout, below the interval [env POLLER_TIMEOUT]",
)
@click.option(
    "--health-port",
    envvar="POLLER_HEALTH_PORT",
    type=int,
    metavar="N",
    help="Port for /healthz, /readyz, /metrics; 0 disables [env POLLER_HEALTH_PORT]",
)
@click.option(
    "--endpoints-file",
    envvar="POLLER_ENDPOINTS_FILE",
    metavar="FILE",
    help="Keep the registry equal to this YAML/TOML file [env POLLER_ENDPOINTS_FILE]",
)
@click.option(
    "--redis-tls-ca",
    metavar="FILE",
    help="rediss: CA bundle to verify Redis with [env POLLER_REDIS__TLS_CA_FILE; "
    "default: the system trust store]",
)
@click.option(
    "--redis-tls-cert",
    metavar="FILE",
    help="rediss: client certificate (PEM) [env POLLER_REDIS__TLS_CERT_FILE]",
)
@click.option(
    "--redis-tls-key",
    metavar="FILE",
    help="rediss: client certificate's key [env POLLER_REDIS__TLS_KEY_FILE]",
)
@click.option(
    "--redis-tls-insecure",
    is_flag=True,
    help="rediss: do not verify the Redis certificate [env POLLER_REDIS__TLS_INSECURE]",
)
@click.option("--log-format", envvar="POLLER_LOG_FORMAT", type=click.Choice(["text", "json"]))
@click.option(
    "--log-level",
    envvar="POLLER_LOG_LEVEL",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
def run(
    config_file: str | None,
    redis_url: str | None,
    namespace: str | None,
    poller_id: str | None,
    interval_s: float | None,
    timeout_s: float | None,
    health_port: int | None,
    endpoints_file: str | None,
    redis_tls_ca: str | None,
    redis_tls_cert: str | None,
    redis_tls_key: str | None,
    redis_tls_insecure: bool,
    log_format: str | None,
    log_level: str | None,
) -> None:
    """Serve: scrape the endpoints this poller holds leases for, forever."""
    settings = _load(
        config_file,
        {
            "redis.url": redis_url,
            "redis.namespace": namespace,
            "id": poller_id,
            "scrape.interval_s": interval_s,
            "scrape.timeout_s": timeout_s,
            "health.port": health_port,
            "endpoints_file": endpoints_file,
            "redis.tls_ca_file": redis_tls_ca,
            "redis.tls_cert_file": redis_tls_cert,
            "redis.tls_key_file": redis_tls_key,
            # An absent flag must not override the file or the environment.
            "redis.tls_insecure": True if redis_tls_insecure else None,
            "log_format": log_format,
            "log_level": log_level.upper() if log_level else None,
        },
    )
    if settings.endpoints_file:
        try:
            endpoints_from_file(settings.endpoints_file)
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from None
    setup_logging(settings.log_level, settings.log_format)
    sys.exit(asyncio.run(serve(settings)))


# --- endpoints (the registry) -----------------------------------------------------------------


@asynccontextmanager
async def _store(redis_url: str | None, namespace: str | None) -> AsyncIterator[RedisStore]:
    settings = _load(None, {"redis.url": redis_url, "redis.namespace": namespace})
    store = RedisStore.from_settings(settings.redis)
    try:
        await store.ensure_schema()
        yield store
    finally:
        await store.close()


def _run_store_command(coro: Any) -> Any:
    try:
        return asyncio.run(coro)
    except SchemaMismatch as exc:
        raise click.ClickException(str(exc)) from None
    except StoreError as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(1)


@cli.group()
def endpoints() -> None:
    """Read and change the endpoint registry in Redis."""


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
    type=click.Choice(list(ENGINE_SPECS)),
    help="Engine mapping (default: the pollers' default engine, vllm unless set).",
)
@click.option("--metrics-path", metavar="P")
@click.option("--api-key-env", metavar="VAR", help="Variable on the pollers holding the key.")
@click.option("--api-key-file", metavar="F", help="File on the pollers holding the key.")
@click.option("--interval", "interval_s", type=float, metavar="S")
@click.option("--timeout", "timeout_s", type=float, metavar="S")
@click.option("--label", "labels", multiple=True, metavar="K=V")
@click.option("--replace", is_flag=True, help="Overwrite an existing entry with this id.")
@_REDIS_URL
@_NAMESPACE
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
    replace: bool,
    redis_url: str | None,
    namespace: str | None,
) -> None:
    """Add (or with --replace, update) one endpoint."""
    data: dict[str, Any] = {"url": url, "labels": _labels(labels)}
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
    try:
        endpoint = endpoint_from_dict(endpoint_id, data)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None

    async def go() -> int:
        async with _store(redis_url, namespace) as store:
            return await store.put_endpoint(endpoint, replace=replace)

    rev = _run_store_command(go())
    click.echo(f"{'updated' if replace else 'added'} {endpoint_id} (registry rev {rev})")


@endpoints.command("rm")
@click.argument("endpoint_id", metavar="ID")
@_REDIS_URL
@_NAMESPACE
def endpoints_rm(endpoint_id: str, redis_url: str | None, namespace: str | None) -> None:
    """Remove an endpoint with its stats, failure and lease."""

    async def go() -> int | None:
        async with _store(redis_url, namespace) as store:
            return await store.remove_endpoint(endpoint_id)

    try:
        rev = _run_store_command(go())
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if rev is None:
        click.echo(f"Error: no endpoint {endpoint_id!r}", err=True)
        sys.exit(1)
    click.echo(f"removed {endpoint_id} (registry rev {rev})")


@endpoints.command("ls")
@click.option("--json", "as_json", is_flag=True)
@_REDIS_URL
@_NAMESPACE
def endpoints_ls(as_json: bool, redis_url: str | None, namespace: str | None) -> None:
    """List the registry (invalid entries are shown with their error)."""

    async def go() -> Any:
        async with _store(redis_url, namespace) as store:
            return await store.read_registry()

    registry = _run_store_command(go())
    if as_json:
        out = {
            "rev": registry.rev,
            "endpoints": [
                {"id": e.id, **e.model_dump(exclude={"id"}, exclude_defaults=True)}
                for e in sorted(registry.endpoints.values(), key=lambda e: e.id)
            ],
            "invalid": registry.invalid,
        }
        click.echo(json.dumps(out, indent=2, default=list))
        return
    click.echo(
        f"registry rev {registry.rev}: {len(registry.endpoints)} endpoints"
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
@_REDIS_URL
@_NAMESPACE
def endpoints_sync(file: str, dry_run: bool, redis_url: str | None, namespace: str | None) -> None:
    """Make the registry exactly FILE (YAML or TOML), atomically."""
    try:
        wanted = endpoints_from_file(file)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None

    async def go() -> tuple[int, list[str], list[str], list[str]]:
        async with _store(redis_url, namespace) as store:
            if dry_run:
                current = await store.read_registry()
                diff = diff_registry(current.raw, {e.id: e.to_json() for e in wanted.values()})
                return (current.rev, *diff)
            return await store.replace_registry(wanted)

    rev, added, changed, removed = _run_store_command(go())
    verb = "would" if dry_run else "did"
    for sign, ids in (("+", added), ("~", changed), ("-", removed)):
        for endpoint_id in ids:
            click.echo(f"{sign} {endpoint_id}")
    click.echo(
        f"{verb} add {len(added)}, change {len(changed)}, remove {len(removed)}"
        + ("" if dry_run else f" (registry rev {rev})")
    )


# --- status -----------------------------------------------------------------------------------


@cli.command()
@_REDIS_URL
@_NAMESPACE
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

    from .reader import StatsReader
    from .status import render

    settings = _load(None, {"redis.url": redis_url, "redis.namespace": namespace})
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # piped: whole rows, never wrapped at 80 columns

    async def go() -> None:
        # from_settings, not from_url: POLLER_REDIS__TLS_* and cluster settings apply too
        reader = StatsReader.from_settings(settings.redis, stale_after_ms=stale_after_ms)
        try:
            view = await reader.snapshot()
            if as_json:
                click.echo(json.dumps(view.to_dict(), indent=2))
                return
            if not watch:
                console.print(render(view, sort))
                return
            with Live(render(view, sort), console=console, auto_refresh=False) as live:
                while True:
                    await asyncio.sleep(1.0)
                    try:
                        view = await reader.snapshot()
                    except StoreError as exc:
                        live.update(f"[red]{exc}[/red]", refresh=True)
                        continue
                    live.update(render(view, sort), refresh=True)
        finally:
            await reader.aclose()

    try:
        asyncio.run(go())
    except KeyboardInterrupt:
        pass
    except StoreError as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(1)


# The local tools (check, demo, sim, bench, soak) register themselves on `cli`.
from . import cli_local  # noqa: E402,F401


def main() -> None:
    setup_logging("WARNING")
    try:
        cli(prog_name="poller")
    except PollerError as exc:  # a last resort: every command maps its own errors
        click.echo(f"Error: {exc}", err=True)
        sys.exit(1)
