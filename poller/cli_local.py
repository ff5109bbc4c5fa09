"""The ``poller`` commands that run on this machine alone: check, demo, sim, bench, soak.

They register on the ``cli`` group of ``poller.cli`` (which imports this module).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import click

from .check import check_endpoint, format_report, serve_example
from .cli import cli, setup_logging
from .engines import ENGINE_SPECS
from .errors import ConfigError
from .registry import Endpoint, endpoint_from_dict

SCRAPED_ENGINES = [name for name, spec in ENGINE_SPECS.items() if spec.scraped]


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
