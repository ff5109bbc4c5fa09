"""`poller run` processes for integration tests: start, signal, read health and logs.

Each runs against a real Redis, so only a test marked ``redis_server`` may start one
(tests/support/markers.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from poller_lab.embedded import poller_args
from tests.support.markers import require
from tests.support.redisproc import free_port


class PollerProc:
    def __init__(
        self,
        poller_id: str,
        redis_url: str,
        namespace: str,
        log_dir: Path,
        *,
        interval_s: float = 1.0,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.id = poller_id
        self.health_port = free_port()
        self.log_path = log_dir / f"{poller_id}.log"
        self.args = poller_args(
            redis_url,
            namespace,
            poller_id,
            interval_s,
            self.health_port,
            ("--log-level", "DEBUG", *extra_args),
        )
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PollerProc:
        require("redis_server", "a `poller run` process against a real Redis")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                stdin=subprocess.DEVNULL,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def wait(self, timeout_s: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cleanup(self) -> None:
        if self.running():
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(30)

    def get(self, path: str) -> tuple[int, str]:
        url = f"http://127.0.0.1:{self.health_port}{path}"
        try:
            # Generous: single-shot checks read through here on a loaded machine too.
            with urllib.request.urlopen(url, timeout=15) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except (urllib.error.URLError, OSError):
            return 0, ""  # not listening (yet, or any more)

    def metric(self, name: str) -> float:
        """Sum of a metric's samples on our /metrics (0 if absent)."""
        _, text = self.get("/metrics")
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def pollers(
    n: int, redis_url: str, namespace: str, log_dir: Path, **kw: object
) -> Iterator[list[PollerProc]]:
    procs = [
        PollerProc(f"p{i}", redis_url, namespace, log_dir, **kw).start()  # type: ignore[arg-type]
        for i in range(n)
    ]
    try:
        yield procs
    except BaseException:
        # Said in the test's captured output: whether each poller ran, and its last words.
        for p in procs:
            state = "running" if p.running() else f"exited {p.proc and p.proc.poll()}"
            tail = "\n    ".join(p.log().splitlines()[-15:])
            print(f"poller {p.id} ({state}), the end of {p.log_path.name}:\n    {tail}")
        raise
    finally:
        for p in procs:
            p.cleanup()


async def until(
    cond: Callable[[], Awaitable[object] | object],
    timeout_s: float,
    what: str = "condition",
    interval_s: float = 0.05,
) -> object:
    """Poll ``cond`` (sync or async) until truthy; fail with ``what`` after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(interval_s)


def leftovers(marker: str) -> list[int]:
    """Pids of live processes whose environment carries ``marker`` (a test sets it on
    what it starts, so processes that outlive a run can be found)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def poller_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    """``poller ARGS`` as a user runs it: a process of its own, no standard input, and no
    ``POLLER_*`` variable but ``env``'s (the test's environment must not leak in). The
    timeout only ends a hang."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("POLLER_")}
    return subprocess.run(
        [sys.executable, "-m", "poller", *args],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        check=False,
    )
