"""The peers: which router, which policy, how many, and the command that starts one.

Each router runs at its defaults but for what running several on one loopback host
needs (docs/performance.md, "Against other routers", says why for each):

- ``--host 127.0.0.1``: loopback only (smg binds every interface by default);
- ``--prometheus-port``: a free port each (both default to 29000, so a second router
  would not start); smg's ``--prometheus-host 127.0.0.1`` (it binds every interface);
- smg's mesh: ``--enable-mesh --mesh-host 127.0.0.1 --mesh-port <free>`` and every other
  router's mesh address in ``--mesh-peer-urls``.

The engines (the simulator's vLLM endpoints) answer every probe these routers send, as
vLLM does: ``/health``, ``/v1/models`` (with ``root`` and ``max_model_len``),
``/version`` and ``/metrics``; vLLM serves no ``/v1/loads``, ``/loads`` or ``/get_load``
and neither does the simulator (404), which the routers take as "no load endpoint".
"""

from __future__ import annotations

import random
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from poller_lab.embedded import Proc, process_cpu_s

__all__ = ["PEERS", "Peer", "RouterSet", "listen_port", "peers_for", "start_routers"]

#: Listening ports come from below Linux's ephemeral range (32768-60999 by default): a
#: free port picked there could be taken by one of the bench's own outgoing connections
#: before the router binds it (seen with 8 routers beside 8 busy gateways).
_PORTS = (20000, 32000)
_taken: set[int] = set()


def listen_port() -> int:
    """A loopback port free now, outside the ephemeral range, not handed out before."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(*_PORTS)
        if port in _taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _taken.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {_PORTS[0]}-{_PORTS[1]}")


@dataclass(frozen=True)
class Peer:
    package: str  # the distribution in constraints/peers.txt
    policy: str
    #: Routers: 1 (every gateway sends to it) or one per gateway.
    per_gateway: bool = False
    mesh: bool = False

    def name(self) -> str:
        tool = "smg" if self.package == "smg" else "vllm-router"
        shape = "mesh" if self.mesh else "per-gateway" if self.per_gateway else "one"
        return f"{tool}/{self.policy}/{shape}"


PEERS: tuple[Peer, ...] = (
    Peer("smg", "least_load"),
    Peer("smg", "least_load", per_gateway=True),
    Peer("smg", "least_load", per_gateway=True, mesh=True),
    Peer("smg", "cache_aware"),
    Peer("smg", "cache_aware", per_gateway=True),
    Peer("smg", "cache_aware", per_gateway=True, mesh=True),
    Peer("vllm-router", "power_of_two"),
    Peer("vllm-router", "power_of_two", per_gateway=True),
    Peer("vllm-router", "cache_aware"),
    Peer("vllm-router", "cache_aware", per_gateway=True),
)


def peers_for(gateways: int, chosen: Sequence[Peer] = PEERS) -> list[Peer]:
    """The peers a cell with ``gateways`` gateways runs: one router always; a router per
    gateway (and the mesh) only where there are several."""
    return [p for p in chosen if gateways > 1 or not p.per_gateway]


def _argv(
    peer: Peer, venv: Path, port: int, metrics_port: int, workers: Sequence[str]
) -> list[str]:
    if peer.package == "smg":
        return [str(venv / "bin" / "smg"), "launch", "--host", "127.0.0.1",
                "--port", str(port), "--worker-urls", *workers, "--policy", peer.policy,
                "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(metrics_port)]  # fmt: skip
    return [str(venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *workers, "--policy", peer.policy,
            "--prometheus-port", str(metrics_port)]  # fmt: skip


class RouterSet:
    """The routers of one peer for one cell, started together and stopped by pid."""

    def __init__(
        self, peer: Peer, venv: Path, workers: Sequence[str], count: int, folder: Path
    ) -> None:
        self.peer = peer
        folder.mkdir(parents=True, exist_ok=True)
        self.ports = [listen_port() for _ in range(count)]
        mesh = [listen_port() for _ in range(count)] if peer.mesh else []
        self.procs: list[Proc] = []
        try:
            for i, port in enumerate(self.ports):
                args = _argv(peer, venv, port, listen_port(), workers)
                if peer.mesh:
                    others = [f"127.0.0.1:{m}" for j, m in enumerate(mesh) if j != i]
                    args += ["--enable-mesh", "--mesh-host", "127.0.0.1",
                             "--mesh-port", str(mesh[i]), "--mesh-peer-urls", *others]  # fmt: skip
                self.procs.append(Proc(f"router-{i}", args, folder / f"router-{i}.log"))
        except BaseException:
            self.stop()
            raise
        self._cpu0: list[float] = []

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def wait_ready(self, model: str, timeout_s: float = 60.0) -> None:
        """Until every router answers a one-token request for ``model`` (its engines
        registered and healthy)."""
        body = (
            b'{"model": "' + model.encode() + b'", "max_tokens": 1, '
            b'"messages": [{"role": "user", "content": "ready?"}]}'
        )
        deadline = time.monotonic() + timeout_s
        for proc, url in zip(self.procs, self.urls, strict=True):
            while True:
                if not proc.alive():
                    raise RuntimeError(f"{self.peer.name()} exited at start: see {proc.log}")
                try:
                    request = urllib.request.Request(
                        url + "/v1/chat/completions",
                        data=body,
                        headers={"Content-Type": "application/json"},
                    )
                    with urllib.request.urlopen(request, timeout=5) as answer:
                        if answer.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.peer.name()} not ready after {timeout_s:g} s")
                time.sleep(0.2)

    def cpu_mark(self) -> None:
        self._cpu0 = [process_cpu_s(p.pid) for p in self.procs]

    def cpu_since_mark_s(self) -> list[float]:
        return [process_cpu_s(p.pid) - c for p, c in zip(self.procs, self._cpu0, strict=True)]

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


def start_routers(
    peer: Peer, venv: Path, workers: Sequence[str], count: int, folder: Path, model: str,
    attempts: int = 3,
) -> RouterSet:  # fmt: skip
    """A ready ``RouterSet``; one whose router exits at start (a port taken meanwhile)
    is stopped and started again on other ports, ``attempts`` times at most."""
    for attempt in range(1, attempts + 1):
        routers = RouterSet(peer, venv, workers, count, folder / f"start-{attempt}")
        try:
            routers.wait_ready(model)
            return routers
        except RuntimeError:
            routers.stop()
            if attempt == attempts:
                raise
        except BaseException:
            routers.stop()
            raise
    raise AssertionError("unreachable")
