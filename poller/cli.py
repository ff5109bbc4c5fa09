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
from .check import check_endpoint, format_report, serve_example
from .config import Settings, load_settings
from .engines import ENGINE_SPECS
from .errors import ConfigError, PollerError, SchemaMismatch, StoreError
from .registry import Endpoint, endpoint_from_dict, endpoints_from_file
from .store import RedisStore, diff_registry

log = logging.getLogger("poller")
SCRAPED_ENGINES = [name for name, spec in ENGINE_SPECS.items() if spec.scraped]


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


# --- check ------------------------------------------------------------------------------------


@cli.command()
@click.argument("url", required=False)
@click.option("--engine", type=click.Choice(SCRAPED_ENGINES), default="vllm", show_default=True)
@click.option(
    "--api-key-env", metavar="VAR", help="Send the key in this variable as a bearer token."
)
@click.option("--api-key-file", metavar="FILE", help="Send the key in this file as a bearer token.")
@click.option("--metrics-path", metavar="P", help="Path to append instead of the engine's default.")
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(0.01, 600),
    default=5.0,
    show_default=True,
    help="Seconds for the whole request.",
)
@click.option(
    "--max-body-bytes", type=click.IntRange(1024), default=8 * 1024 * 1024, show_default=True
)
@click.option(
    "--tls-ca-file",
    metavar="FILE",
    help="https: verify the engine against this CA bundle, not the system trust store.",
)
@click.option("--tls-insecure", is_flag=True, help="https: do not verify the engine's certificate.")
@click.option(
    "--example",
    is_flag=True,
    help="Check the bundled example page of --engine, served on a loopback port.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report.")
def check(
    url: str | None,
    engine: str,
    api_key_env: str | None,
    api_key_file: str | None,
    metrics_path: str | None,
    timeout_s: float,
    max_body_bytes: int,
    tls_ca_file: str | None,
    tls_insecure: bool,
    example: bool,
    as_json: bool,
) -> None:
    """Scrape one endpoint once: what it read, from which metric, and what is missing.

    URL is the engine's base URL (e.g. http://10.0.0.5:8000); the engine's metrics path
    is appended. Exit status 0 when the page satisfies the engine's contract, 1 when it
    does not or the scrape failed, 2 for bad arguments.
    """
    if bool(url) == example:
        raise click.UsageError("give a URL or --example (not both)")

    async def run() -> dict[str, Any]:
        async with serve_example(engine) if example else _nothing(url or "") as base:
            endpoint = _endpoint(
                base,
                engine,
                api_key_env=api_key_env,
                api_key_file=api_key_file,
                metrics_path=metrics_path,
                tls_ca_file=tls_ca_file,
                tls_insecure=tls_insecure or None,
            )
            return await check_endpoint(endpoint, engine, timeout_s, max_body_bytes)

    report = asyncio.run(run())
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(format_report(report))
    sys.exit(0 if report["ok"] else 1)


@asynccontextmanager
async def _nothing(value: str) -> AsyncIterator[str]:
    yield value


def _endpoint(url: str, engine: str, **options: Any) -> Endpoint:
    """The entry `check` scrapes; options left at None are not set."""
    data: dict[str, Any] = {"id": "check", "url": url, "engine": engine}
    data.update((key, value) for key, value in options.items() if value is not None)
    try:
        return endpoint_from_dict(None, data)
    except ConfigError as exc:
        raise click.BadParameter(str(exc).removeprefix("endpoint 'check' ")) from None


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


# --- demo, sim, bench ------------------------------------------------------------------------


@cli.command()
@click.option(
    "--redis-url",
    metavar="URL",
    help="Use this Redis (default: an embedded redis-server, else fakeredis).",
)
@click.option(
    "--duration",
    "duration_s",
    type=click.FloatRange(1, 86400),
    metavar="S",
    help="Stop after S seconds (default: run until Ctrl-C).",
)
@click.option("--endpoints", type=click.IntRange(3, 200), default=12, show_default=True)
def demo(redis_url: str | None, duration_s: float | None, endpoints: int) -> None:
    """Three pollers share simulated engines; one is killed and restarted. Ctrl-C stops."""
    from .demo import run_demo

    setup_logging("WARNING")
    try:
        sys.exit(run_demo(redis_url, duration_s, endpoints))
    except (RuntimeError, TimeoutError) as exc:
        click.echo(f"Error: demo failed: {exc}", err=True)
        sys.exit(1)


@cli.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.pass_context
def sim(ctx: click.Context) -> None:
    """Serve simulated engines (same options as `python -m poller.sim --help`)."""
    from .sim import main as sim_main

    sys.exit(sim_main(ctx.args))


@cli.command()
@click.option("--endpoints", type=click.IntRange(1, 5000), help="Simulated endpoints [200].")
@click.option("--pollers", type=click.IntRange(1, 16), help="Pollers in the cluster section [3].")
@click.option("--interval", "interval_s", type=click.FloatRange(0.1, 60), help="Seconds [1].")
@click.option(
    "--duration",
    "duration_s",
    type=click.FloatRange(1, 600),
    help="Measurement window per section, seconds [20].",
)
@click.option(
    "--section",
    "sections",
    multiple=True,
    type=click.Choice(["scrape", "cluster", "failover", "reader"]),
    help="Run only these sections (repeatable).",
)
@click.option(
    "--vs-prometheus",
    is_flag=True,
    help="Also scrape the same endpoints with a local `prometheus` binary.",
)
@click.option("--quick", is_flag=True, help="Small and short (CI): 30 endpoints, 4 s windows.")
@click.option("--redis-url", metavar="URL", help="Use this Redis instead of an embedded one.")
@click.option("--json", "as_json", is_flag=True)
def bench(
    endpoints: int | None,
    pollers: int | None,
    interval_s: float | None,
    duration_s: float | None,
    sections: tuple[str, ...],
    vs_prometheus: bool,
    quick: bool,
    redis_url: str | None,
    as_json: bool,
) -> None:
    """Measure scrape cost, cluster behaviour, failover and reader latency locally."""
    import dataclasses

    from .bench import BenchConfig, format_table, run_bench

    cfg = BenchConfig.quick() if quick else BenchConfig()
    changes: dict[str, Any] = {"vs_prometheus": vs_prometheus}
    for name, value in (
        ("endpoints", endpoints),
        ("pollers", pollers),
        ("interval_s", interval_s),
        ("duration_s", duration_s),
    ):
        if value is not None:
            changes[name] = value
    if sections:
        changes["sections"] = sections
    cfg = dataclasses.replace(cfg, **changes)
    try:
        result = run_bench(cfg, redis_url)
    except (RuntimeError, TimeoutError) as exc:
        click.echo(f"Error: bench failed: {exc}", err=True)
        sys.exit(1)
    click.echo(json.dumps(result, indent=2) if as_json else format_table(result))


@cli.command()
@click.option(
    "--duration",
    "duration_s",
    type=click.FloatRange(10, 86400),
    default=600,
    show_default=True,
    help="Seconds to run.",
)
@click.option("--endpoints", type=click.IntRange(10, 5000), default=300, show_default=True)
@click.option(
    "--every",
    "every_s",
    type=click.FloatRange(5, 3600),
    default=20,
    show_default=True,
    help="Seconds between disruptions.",
)
@click.option("--json", "as_json", is_flag=True)
def soak(duration_s: float, endpoints: int, every_s: float, as_json: bool) -> None:
    """Disrupt a local cluster for a while and check the invariants; exit 1 on a violation."""
    from .soak import SoakConfig, format_summary, run_soak, violations

    cfg = SoakConfig(endpoints=endpoints, duration_s=duration_s, every_s=every_s)
    try:
        result = run_soak(cfg, say=lambda line: click.echo(line, err=as_json))
    except (RuntimeError, TimeoutError) as exc:
        click.echo(f"Error: soak failed: {exc}", err=True)
        sys.exit(1)
    click.echo(json.dumps(result, indent=2) if as_json else format_summary(result))
    sys.exit(1 if violations(result) else 0)


def main() -> None:
    setup_logging("WARNING")
    try:
        cli(prog_name="poller")
    except PollerError as exc:  # a last resort: every command maps its own errors
        click.echo(f"Error: {exc}", err=True)
        sys.exit(1)
