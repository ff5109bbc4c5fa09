"""Local processes for ``poller demo`` and ``poller bench``: Redis, the simulator, pollers.

Everything binds 127.0.0.1, keeps nothing on disk, and is stopped by pid (SIGTERM, then
SIGKILL after a grace period) when its context ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "Proc",
    "embedded_redis",
    "free_port",
    "process_cpu_s",
    "poller_args",
    "private_redis_args",
    "process_rss_mb",
    "redis_for",
    "start_redis_server",
    "start_pollers",
    "start_sim",
    "wait_until",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(cond: Any, timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(interval_s)


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def process_cpu_s(pid: int) -> float:
    """user+sys CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Proc:
    """A child process we started; stopped by pid, never by name."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        log: Path,
        env: dict[str, str] | None = None,
        cpu: int | None = None,
    ) -> None:
        self.name = name
        self.args = list(args)
        if cpu is not None and shutil.which("taskset") and (os.cpu_count() or 1) > cpu:
            self.args = ["taskset", "-c", str(cpu), *self.args]
        self.log = log
        with open(log, "ab") as out:
            self.popen = subprocess.Popen(
                self.args,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def stop(self, grace_s: float = 5.0) -> int | None:
        if self.alive():
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                return self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        return self.popen.wait(5)


def start_redis_server(workdir: Path, port: int, cpu: int | None = None) -> Proc:
    """redis-server from PATH on 127.0.0.1:``port``, keeping nothing on disk."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server not found on PATH (apt-get install redis-server)")
    return Proc(
        "redis", [binary, *private_redis_args(port, workdir)], workdir / "redis.log", cpu=cpu
    )


def private_redis_args(port: int, workdir: Path) -> list[str]:
    """redis-server options for a private server: loopback ``port``, nothing kept on disk
    (no RDB snapshots, no AOF), its working files in ``workdir``."""
    return [
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
    ]


@contextlib.contextmanager
def embedded_redis(workdir: Path) -> Iterator[tuple[str, Proc | None]]:
    """A private Redis on a free loopback port: redis-server from PATH when there is one,
    else fakeredis's TCP server in a thread. Yields (url, process or None)."""
    port = free_port()
    binary = shutil.which("redis-server")
    if binary is not None:
        proc = start_redis_server(workdir, port, cpu=1)
        try:
            # milliseconds when idle; seconds on a loaded machine
            wait_until(lambda: _port_open(port) or not proc.alive(), 30, "redis-server")
            if not proc.alive():
                raise RuntimeError(f"redis-server exited: see {proc.log}")
            yield f"redis://127.0.0.1:{port}/0", proc
        finally:
            proc.stop()
        return
    try:
        from fakeredis import TcpFakeServer
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise RuntimeError(
            "no redis-server on PATH and fakeredis is not installed: install redis-server "
            "(apt-get install redis-server) or pass --redis-url"
        ) from exc
    server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
    thread = threading.Thread(target=server.serve_forever, daemon=True, name="fakeredis")
    thread.start()
    try:
        yield f"redis://127.0.0.1:{port}/0", None
    finally:
        server.shutdown()
        server.server_close()


def redis_for(
    work: Path, url: str | None
) -> contextlib.AbstractContextManager[tuple[str, Proc | None]]:
    """The given Redis URL as is, or an embedded Redis when there is none."""
    if url is not None:
        return contextlib.nullcontext((url, None))
    return embedded_redis(work)


def start_sim(
    workdir: Path,
    endpoints: int,
    engines: str,
    *,
    style: str = "path",
    seed: int = 1,
    cpu: int | None = 1,
    extra: Sequence[str] = (),
) -> tuple[Proc, str, Path]:
    """The simulator as a process; returns (process, admin URL, registry file)."""
    admin_port = free_port()
    registry = workdir / "sim-endpoints.json"
    proc = Proc(
        "sim",
        [
            sys.executable,
            "-m",
            "poller_lab.sim",
            "--endpoints",
            str(endpoints),
            "--engines",
            engines,
            "--style",
            style,
            "--seed",
            str(seed),
            "--admin-port",
            str(admin_port),
            "--registry-out",
            str(registry),
            *extra,
        ],
        workdir / "sim.log",
        cpu=cpu,
    )
    wait_until(
        lambda: registry.exists() and registry.stat().st_size > 0 or not proc.alive(),
        60,
        "the simulator to write its registry file",
    )
    if not proc.alive():
        raise RuntimeError(f"simulator exited: see {proc.log}")
    return proc, f"http://127.0.0.1:{admin_port}", registry


def poller_args(
    redis_url: str,
    namespace: str,
    poller_id: str,
    interval_s: float,
    health_port: int,
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line of one ``poller run`` process."""
    return [
        sys.executable, "-m", "poller", "run",
        "--redis-url", redis_url, "--namespace", namespace, "--id", poller_id,
        "--interval", str(interval_s), "--health-port", str(health_port),
        *extra,
    ]  # fmt: skip


def start_pollers(
    workdir: Path,
    redis_url: str,
    namespace: str,
    ids: Sequence[str],
    *,
    interval_s: float = 1.0,
    cpu: int | None = None,
    extra: Sequence[str] = (),
) -> list[tuple[Proc, int]]:
    """``poller run`` processes; returns (process, health port) pairs."""
    out = []
    for poller_id in ids:
        port = free_port()
        proc = Proc(
            poller_id,
            poller_args(redis_url, namespace, poller_id, interval_s, port, extra),
            workdir / f"{poller_id}.log",
            cpu=cpu,
        )
        out.append((proc, port))
    return out


def http_json(url: str, data: Any = None, timeout_s: float = 5.0) -> Any:
    body = None if data is None else json.dumps(data).encode()
    request = urllib.request.Request(
        url,
        data=body,
        method="POST" if body else "GET",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def http_text(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return str(response.read().decode())


@contextlib.contextmanager
def workdir(prefix: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
