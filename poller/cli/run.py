"""``poller run``: serve, scraping the endpoints this poller holds leases for."""

from __future__ import annotations

import asyncio
import sys

import click

from poller.cli.common import (
    LOG_FORMAT,
    LOG_LEVEL,
    NAMESPACE,
    REDIS_URL,
    config_option,
    run_store_command,
    sources,
)
from poller.cli.register import settings_and_file
from poller.util.logs import setup_logging


@click.command()
@config_option("TOML settings file; flags and POLLER_* variables win over it.")
@REDIS_URL
@NAMESPACE
@click.option(
    "--id",
    "poller_id",
    envvar="POLLER_ID",
    show_envvar=True,
    show_default="HOSTNAME-PID",
    metavar="ID",
    help="Stable poller id, e.g. the pod name.",
)
@click.option(
    "--interval",
    "interval_s",
    envvar="POLLER_INTERVAL",
    show_envvar=True,
    show_default="2",
    metavar="S",
    help="Default scrape interval in seconds (scrape.interval_s); an entry's own wins.",
)
@click.option(
    "--timeout",
    "timeout_s",
    envvar="POLLER_TIMEOUT",
    show_envvar=True,
    show_default="1, or half the interval if that is not below it",
    metavar="S",
    help="Default scrape timeout in seconds (scrape.timeout_s), below the interval.",
)
@click.option(
    "--health-port",
    envvar="POLLER_HEALTH_PORT",
    show_envvar=True,
    show_default="9464, on 0.0.0.0",
    metavar="N",
    help="Port for /healthz, /readyz, /metrics and the operator's page (health.port, "
    "on health.host); 0 disables.",
)
@click.option(
    "--endpoints-file",
    envvar="POLLER_ENDPOINTS_FILE",
    show_envvar=True,
    show_default="none",
    metavar="FILE",
    help="Keep the registry equal to this YAML/JSON/TOML file (as `endpoints sync`).",
)
@click.option(
    "--discover",
    "discover",
    envvar="POLLER_DISCOVER",
    show_envvar=True,
    show_default="the settings' [[discovery]]",
    multiple=True,
    metavar="URI",
    help="Discover endpoints through DNS: dns+srv://NAME?engine=vllm or "
    "dns+a://NAME:PORT?engine=vllm; repeatable (space-separated in the variable).",
)
@click.option(
    "--redis-tls-ca",
    envvar="POLLER_REDIS__TLS_CA_FILE",
    show_envvar=True,
    show_default="the system trust store",
    metavar="FILE",
    help="rediss: CA bundle to verify Redis with.",
)
@click.option(
    "--redis-tls-cert",
    envvar="POLLER_REDIS__TLS_CERT_FILE",
    show_envvar=True,
    metavar="FILE",
    help="rediss: client certificate (PEM), for servers with tls-auth-clients.",
)
@click.option(
    "--redis-tls-key",
    envvar="POLLER_REDIS__TLS_KEY_FILE",
    show_envvar=True,
    metavar="FILE",
    help="rediss: the client certificate's key, when not in the certificate's file.",
)
@click.option(
    "--redis-tls-insecure",
    envvar="POLLER_REDIS__TLS_INSECURE",
    show_envvar=True,
    is_flag=True,
    help="rediss: do not verify the Redis certificate (logged as a WARNING).",
)
@LOG_FORMAT
@LOG_LEVEL
@click.option(
    "--check",
    is_flag=True,
    help="Validate the settings, reach Redis (schema version, live pollers, registry "
    "size) and exit without serving or writing: 0 ok, 2 bad settings or credentials, "
    "1 Redis unreachable or another schema version",
)
def run(
    config_file: str | None,
    redis_url: str | None,
    namespace: str | None,
    poller_id: str | None,
    interval_s: str | None,
    timeout_s: str | None,
    health_port: str | None,
    endpoints_file: str | None,
    discover: tuple[str, ...],
    redis_tls_ca: str | None,
    redis_tls_cert: str | None,
    redis_tls_key: str | None,
    redis_tls_insecure: bool,
    log_format: str | None,
    log_level: str | None,
    check: bool,
) -> None:
    """Serve: scrape the endpoints this poller holds leases for, forever."""
    # Every problem of the flags, variables, settings file and endpoints file at once:
    # the numbers too are checked by the settings (click would stop at the first).
    origins = {"scrape.interval_s": "interval_s", "scrape.timeout_s": "timeout_s"}
    origins |= {"health.port": "health_port", "redis.namespace": "namespace"}
    settings, _ = settings_and_file(
        config_file,
        {
            "redis.url": redis_url,
            "redis.namespace": namespace,
            "id": poller_id,
            "scrape.interval_s": _number(interval_s, float),
            "scrape.timeout_s": _number(timeout_s, float),
            "health.port": _number(health_port, int),
            "endpoints_file": endpoints_file,
            "discovery": list(discover) or None,
            "redis.tls_ca_file": redis_tls_ca,
            "redis.tls_cert_file": redis_tls_cert,
            "redis.tls_key_file": redis_tls_key,
            # An absent flag must not override the file or the environment.
            "redis.tls_insecure": True if redis_tls_insecure else None,
            "log_format": log_format,
            "log_level": log_level.upper() if log_level else None,
        },
        origins=sources(origins),
    )
    if check:
        from poller.cli.runcheck import check_run

        sys.exit(run_store_command(check_run(settings)))
    # Imported here: the service stack is most of `poller`'s start-up, and only run needs it.
    from poller.service.serve import serve

    setup_logging(settings.log_level, settings.log_format, settings.id)
    sys.exit(asyncio.run(serve(settings)))


def _number(text: str | None, kind: type[float] | type[int]) -> float | int | str | None:
    """The option's number, or its text for the settings to refuse beside the others."""
    try:
        return None if text is None else kind(text)
    except ValueError:
        return text
