"""Real redis-server processes for tests: free loopback ports, no persistence.

Each test that needs real Redis behaviour (TTL expiry, Lua, pub/sub, restarts, pauses,
Cluster) gets its own server, so it can stop, restart or SIGSTOP it without touching
anyone else's. A missing redis-server is a loud failure with the install hint.

Only a test marked ``redis_server`` may start one (``redis_cluster`` for a Cluster,
``sentinel`` for a server in Sentinel mode): tests/support/markers.py.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

from poller_lab.embedded import free_port, private_redis_args, wait_until
from tests.support.markers import require

START_TIMEOUT_S = 60.0  # a process start on a loaded 2-core machine: ample headroom
INSTALL_HINT = (
    "redis-server not found on PATH: the integration tests need it. "
    "Install it (Debian/Ubuntu: apt-get install redis-server) or run `make test`, "
    "which installs it."
)


def redis_server_binary() -> str:
    """The redis-server to start; only a test marked ``redis_server`` may ask for it."""
    require("redis_server", "a redis-server")
    path = shutil.which("redis-server")
    if path is None:
        raise RuntimeError(INSTALL_HINT)
    return path


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_cluster_port() -> int:
    """A port <= 55535 whose cluster bus port (port + 10000) is free too."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 45000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            # A server with requirepass or an ACL answers NOAUTH: it is up all the same.
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


class RedisProcess:
    """One redis-server on 127.0.0.1:<port>; restartable on the same port."""

    def __init__(
        self,
        port: int | None = None,
        extra_args: list[str] | None = None,
        config_file: Path | None = None,
    ):
        self.port = port or free_port()
        self.config_file = config_file  # must come first on the command line (sentinel)
        self.extra_args = list(extra_args or [])
        self.dir = Path(tempfile.mkdtemp(prefix="poller-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProcess:
        if "--sentinel" in self.extra_args:
            require("sentinel", "a redis-server in Sentinel mode")
        args = [
            redis_server_binary(),
            *([str(self.config_file)] if self.config_file else []),
            *private_redis_args(self.port, self.dir),
            "--logfile",
            str(self.dir / "redis.log"),
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            # Starting takes milliseconds; a loaded CI machine can take seconds.
            wait_until(
                lambda: _ping(self.port) or self.proc.poll() is not None,
                START_TIMEOUT_S,
                what=f"redis-server on port {self.port} to answer PING",
            )
        except TimeoutError as exc:
            self.stop()
            raise TimeoutError(f"{exc}; its log ends:\n{self._log_tail()}") from None
        if self.proc.poll() is not None:
            raise RuntimeError(f"redis-server exited at start:\n{self._log_tail()}")
        return self

    def _log_tail(self) -> str:
        try:
            return (self.dir / "redis.log").read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.kill()
            self.proc.wait(30)
        self.proc = None

    def restart(self) -> None:
        """Stop and start empty (no persistence): scripts, keys and clients are gone."""
        self.stop()
        self.start()

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisCluster:
    """Masters (and replicas) on loopback, made with redis-cli --cluster create."""

    def __init__(self, masters: int = 3, replicas: int = 0):
        self.nodes = [
            RedisProcess(
                port=free_cluster_port(),
                extra_args=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "1000",
                    # replicas must hold the data before a test kills their master
                    "--repl-diskless-sync-delay",
                    "0",
                ],
            )
            for _ in range(masters * (1 + replicas))
        ]
        self.replicas = replicas

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisCluster:
        require("redis_cluster", "a Redis Cluster")
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError(INSTALL_HINT.replace("redis-server", "redis-cli"))
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *addrs,
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=120,
        )

        def ok() -> bool:
            out = subprocess.run(
                [cli, "-p", str(self.nodes[0].port), "cluster", "info"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
            return "cluster_state:ok" in out

        wait_until(ok, 90, "cluster_state:ok", 0.1)

        def replicas_linked() -> bool:
            for node in self.nodes:
                info = subprocess.run(
                    [cli, "-p", str(node.port), "info", "replication"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                ).stdout
                if "role:slave" in info and "master_link_status:up" not in info:
                    return False
            return True

        wait_until(replicas_linked, 90, "replicas in sync", 0.1)
        return self

    def node(self, port: int) -> RedisProcess:
        return next(n for n in self.nodes if n.port == port)

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()
