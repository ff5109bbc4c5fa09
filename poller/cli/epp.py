"""``poller epp``: the Endpoint Picker Envoy asks over ext_proc (docs/epp.md).

Settings as for ``poller run``: flags win over ``POLLER_*`` variables, which win over
the TOML file's ``[redis]`` and ``[epp]``; every problem is one ``Error:`` line, exit 2.
The server itself is poller/integrations/envoy/, behind the ``epp`` extra.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from poller.cli.common import LOG_FORMAT, LOG_LEVEL, NAMESPACE, REDIS_URL, config_option, sources
from poller.cli.oneline import BadInput
from poller.cli.register import settings_and_file
from poller.cli.run import _number
from poller.util.logs import setup_logging

EPP_HINT = "pip install 'llmgw-poller[epp]'"
F = TypeVar("F", bound=Callable[..., Any])


def _port(flag: str, env: str, default: str, what: str) -> Callable[[F], F]:
    return click.option(
        flag, envvar=env, show_envvar=True, show_default=default, metavar="N", help=what
    )


@click.command()
@config_option("TOML settings file ([redis], [epp]); flags and POLLER_* variables win over it.")
@REDIS_URL
@NAMESPACE
@_port("--grpc-port", "POLLER_GRPC_PORT", "9002", "ext_proc port Envoy dials (epp.grpc_port).")
@_port(
    "--grpc-health-port",
    "POLLER_GRPC_HEALTH_PORT",
    "9003",
    "gRPC health port (liveness, readiness, the ext_proc service); 0: on the ext_proc "
    "port only (epp.grpc_health_port).",
)
@_port("--metrics-port", "POLLER_METRICS_PORT", "9090", "Prometheus /metrics; 0 disables.")
@click.option(
    "--replica-id",
    envvar="POLLER_REPLICA_ID",
    show_envvar=True,
    show_default="HOSTNAME-PID-suffix",
    metavar="ID",
    help="This replica's id in the shared in-flight counts, e.g. the pod name.",
)
@click.option(
    "--fallbacks",
    envvar="POLLER_FALLBACKS",
    show_envvar=True,
    show_default="0: the primary alone, as ORIGINAL_DST needs",
    metavar="N",
    help="Name N fallback endpoints after the primary (ip:port,ip:port) for Envoy's "
    "override_host policy, which walks them on retry (epp.fallbacks).",
)
@click.option(
    "--when-saturated",
    envvar="POLLER_WHEN_SATURATED",
    show_envvar=True,
    show_default="least_loaded",
    type=click.Choice(["least_loaded", "none"]),
    help="Every endpoint saturated: the least loaded still takes it, or none (429 with "
    "Retry-After).",
)
@click.option(
    "--max-body-bytes",
    envvar="POLLER_MAX_BODY_BYTES",
    show_envvar=True,
    show_default="4194304",
    metavar="N",
    help="Refuse a request body over N bytes with 400 (epp.max_body_bytes).",
)
@click.option(
    "--tls-cert",
    envvar="POLLER_EPP__TLS_CERT_FILE",
    show_envvar=True,
    show_default="none: plaintext",
    metavar="FILE",
    help="Serve ext_proc and health over TLS with this certificate (PEM), with --tls-key.",
)
@click.option(
    "--tls-key",
    envvar="POLLER_EPP__TLS_KEY_FILE",
    show_envvar=True,
    show_default="none",
    metavar="FILE",
    help="The TLS certificate's private key (PEM).",
)
@LOG_FORMAT
@LOG_LEVEL
def epp(
    config_file: str | None,
    redis_url: str | None,
    namespace: str | None,
    grpc_port: str | None,
    grpc_health_port: str | None,
    metrics_port: str | None,
    replica_id: str | None,
    fallbacks: str | None,
    when_saturated: str | None,
    max_body_bytes: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    log_format: str | None,
    log_level: str | None,
) -> None:
    """Serve the Endpoint Picker Protocol to Envoy (ext_proc), routing with the view."""
    origins = {
        "redis.namespace": "namespace",
        "epp.grpc_port": "grpc_port",
        "epp.grpc_health_port": "grpc_health_port",
        "epp.metrics_port": "metrics_port",
        "epp.replica_id": "replica_id",
        "epp.fallbacks": "fallbacks",
        "epp.max_body_bytes": "max_body_bytes",
    }
    settings, _ = settings_and_file(
        config_file,
        {
            "redis.url": redis_url,
            "redis.namespace": namespace,
            "epp.grpc_port": _number(grpc_port, int),
            "epp.grpc_health_port": _number(grpc_health_port, int),
            "epp.metrics_port": _number(metrics_port, int),
            "epp.replica_id": replica_id,
            "epp.fallbacks": _number(fallbacks, int),
            "epp.when_saturated": when_saturated,
            "epp.max_body_bytes": _number(max_body_bytes, int),
            "epp.tls_cert_file": tls_cert,
            "epp.tls_key_file": tls_key,
            "log_format": log_format,
            "log_level": log_level.upper() if log_level else None,
        },
        origins=sources(origins),
    )
    try:
        from poller.integrations.envoy import EppOptions, run_epp
    except ModuleNotFoundError as exc:
        missing = (exc.name or "a module").split(".")[0]
        raise BadInput(
            f"poller epp needs the epp extra ({missing} is not installed): {EPP_HINT}"
        ) from None
    from poller.reader import RoutingOptions

    conf = settings.epp
    options = EppOptions(
        host=conf.host,
        grpc_port=conf.grpc_port,
        grpc_health_port=conf.grpc_health_port,
        fallbacks=conf.fallbacks,
        retry_after_s=conf.retry_after_s,
        max_body_bytes=conf.max_body_bytes,
        tls_cert_file=conf.tls_cert_file,
        tls_key_file=conf.tls_key_file,
        resolve_interval_s=conf.resolve_interval_s,
    )
    routing = RoutingOptions(when_saturated=conf.when_saturated, stale_grace_s=conf.stale_grace_s)
    setup_logging(settings.log_level, settings.log_format, conf.replica_id)
    sys.exit(
        asyncio.run(
            run_epp(
                settings.redis,
                routing,
                options,
                metrics_port=conf.metrics_port,
                replica_id=conf.replica_id,
            )
        )
    )
