"""``poller check``: scrape one endpoint once and say what it read and what is missing."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import click

from poller.cli.common import config_option, load
from poller.cli.oneline import BadInput
from poller.cli.register import url_problem
from poller.config import ScrapeSettings
from poller.errors import ConfigError
from poller.schema.endpoint import Endpoint, endpoint_from_dict
from poller.scrape.specs import ENGINE_SPECS

SCRAPED_ENGINES = [name for name, spec in ENGINE_SPECS.items() if spec.scraped]


# --- check ------------------------------------------------------------------------------------


@click.command()
@click.argument("url", required=False)
@click.option(
    "--engine",
    type=click.Choice(SCRAPED_ENGINES),
    show_default="detected from the page (--example: vllm)",
    help="Engine mapping to read the page with.",
)
@click.option(
    "--api-key-env", metavar="VAR", help="Send the key in this variable as a bearer token."
)
@click.option("--api-key-file", metavar="FILE", help="Send the key in this file as a bearer token.")
@click.option(
    "--metrics-path",
    metavar="P",
    show_default="the engine's, e.g. /metrics",
    help="Path (and query) to append to URL.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(0.01, 600),
    default=5.0,
    show_default=True,
    help="Seconds for the whole request.",
)
@click.option(
    "--max-body-bytes",
    type=click.IntRange(1024),
    default=8 * 1024 * 1024,
    show_default=True,
    help="A larger page is a too_large failure (scrape.max_body_bytes).",
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
@config_option("Apply this settings file's [scrape.engines.<engine>] path and overrides.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print a JSON report: signals under the stats hash's names, numbers as numbers, "
    "lora as {running, waiting, max}; a failure has reason, detail, status and body.",
)
def check(
    url: str | None,
    engine: str | None,
    api_key_env: str | None,
    api_key_file: str | None,
    metrics_path: str | None,
    timeout_s: float,
    max_body_bytes: int,
    tls_ca_file: str | None,
    tls_insecure: bool,
    example: bool,
    config_file: str | None,
    as_json: bool,
) -> None:
    """Scrape one endpoint once: what it read, from which metric, and what is missing.

    URL is the engine's base URL (e.g. http://10.0.0.5:8000); the engine's metrics path
    is appended (a URL ending in it or in /v1 is refused, naming the base URL). Without
    --engine, the page says which engine it is. Exit status 0 when the page satisfies
    the engine's contract, 1 when it does not or the scrape failed, 2 for bad arguments.
    """
    # Imported here: the HTTP stack is most of `poller`'s start-up, and only check needs it.
    from poller.scrape.check import check_endpoint, format_report, serve_example

    if bool(url) == example:
        raise click.UsageError("give a URL or --example (not both)")
    scrape: ScrapeSettings | None = None
    if config_file is not None:
        scrape = load(config_file, {}).scrape
    if url:
        # The URL mistakes `endpoints add` refuses, refused here alike.
        entry = _endpoint(url, engine, metrics_path=metrics_path)
        problem = url_problem(entry, scrape or ScrapeSettings())
        if problem:
            raise BadInput(problem)

    async def run() -> dict[str, Any]:
        shown = engine or "vllm"
        async with serve_example(shown) if example else _nothing(url or "") as base:
            endpoint = _endpoint(
                base,
                engine,
                api_key_env=api_key_env,
                api_key_file=api_key_file,
                metrics_path=metrics_path,
                tls_ca_file=tls_ca_file,
                tls_insecure=tls_insecure or None,
            )
            return await check_endpoint(endpoint, engine, timeout_s, max_body_bytes, scrape)

    report = asyncio.run(run())
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(format_report(report))
    sys.exit(0 if report["ok"] else 1)


@asynccontextmanager
async def _nothing(value: str) -> AsyncIterator[str]:
    yield value


def _endpoint(url: str, engine: str | None, **options: Any) -> Endpoint:
    """The entry `check` scrapes; options left at None are not set."""
    data: dict[str, Any] = {"id": "check", "url": url, "engine": engine}
    data.update((key, value) for key, value in options.items() if value is not None)
    try:
        return endpoint_from_dict(None, data)
    except ConfigError as exc:
        raise click.BadParameter(str(exc).removeprefix("endpoint 'check' ")) from None
