"""A real dnsmasq for discovery tests: a free loopback port, records from the test.

Records change the way they do in life for a poller: the server is restarted with a new
configuration on the same port. Queries are logged to a file, so tests can count what
the pollers asked. A missing dnsmasq is a loud failure with the install hint. Only a
test marked ``dnsmasq`` may start one (tests/support/markers.py).
"""

from __future__ import annotations

import getpass
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import dns.resolver

from poller_lab.embedded import free_port
from tests.support.markers import require

INSTALL_HINT = (
    "dnsmasq not found on PATH: the discovery tests need it. "
    "Install it (Debian/Ubuntu: apt-get install dnsmasq-base) or run `make test`, "
    "which installs it."
)

#: Every test zone lives under .test (RFC 2606); names there that have no record get
#: NXDOMAIN, anything else is REFUSED (no upstream): dnspython's NoNameservers.
ZONE = "test"


def dnsmasq_binary() -> str:
    """The dnsmasq to start; only a test marked ``dnsmasq`` may ask for it."""
    require("dnsmasq", "a dnsmasq")
    path = shutil.which("dnsmasq") or shutil.which("dnsmasq", path="/usr/sbin:/sbin")
    if path is None:
        raise RuntimeError(INSTALL_HINT)
    return path


class DnsProcess:
    """One dnsmasq on 127.0.0.1:<port>, serving only the records it is given."""

    def __init__(self) -> None:
        self.binary = dnsmasq_binary()
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="poller-dns-"))
        self.log_path = self.dir / "queries.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.srv: list[tuple[str, str, int]] = []
        self.a: list[tuple[str, str]] = []

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set(
        self,
        srv: Iterable[tuple[str, str, int]] = (),
        a: Iterable[tuple[str, str]] = (),
    ) -> DnsProcess:
        """Records to serve from the next (re)start: SRV (name, target, port), A/AAAA
        (name, address)."""
        self.srv, self.a = list(srv), list(a)
        return self

    def _config(self) -> Path:
        lines = [f"local=/{ZONE}/", "host-record=ready.test,127.0.0.1"]
        lines += [f"srv-host={name},{target},{port},0,0" for name, target, port in self.srv]
        lines += [f"host-record={name},{address}" for name, address in self.a]
        path = self.dir / "dnsmasq.conf"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start(self) -> DnsProcess:
        args = [
            self.binary,
            "--keep-in-foreground",
            f"--conf-file={self._config()}",
            "--no-resolv",
            "--no-hosts",
            "--no-poll",
            "--bind-interfaces",
            "--listen-address=127.0.0.1",
            f"--port={self.port}",
            "--pid-file=",
            f"--user={getpass.getuser()}",
            "--log-queries",
            f"--log-facility={self.log_path}",
            "--local-ttl=0",
        ]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 60  # milliseconds when idle; a loaded machine: seconds
        while not self._answers():
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"dnsmasq exited with {self.proc.returncode}: {err.strip()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"dnsmasq on port {self.port} did not answer within 60 s")
            time.sleep(0.05)
        return self

    def _answers(self) -> bool:
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers, resolver.port, resolver.lifetime = ["127.0.0.1"], self.port, 0.3
        try:
            resolver.resolve("ready.test.", "A", search=False)
        except Exception:
            return False
        return True

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()
        self.proc = None

    def restart(self) -> DnsProcess:
        self.stop()
        return self.start()

    def queries(self, name: str, rdtype: str = "SRV") -> int:
        """How many queries for ``name`` (type ``rdtype``) dnsmasq has logged so far."""
        if not self.log_path.exists():
            return 0
        needle = f"query[{rdtype}] {name.rstrip('.')} "
        return sum(needle in line for line in self.log_path.read_text().splitlines())

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
