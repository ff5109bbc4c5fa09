"""Count the log lines pollers write while Redis hangs: what an on-call reads after a failover.

Usage: python tests/bench/bench_hang_logs.py [--endpoints 1000] [--pollers 1] [--hang 8]
                                              [--interval 1]

Starts a private redis-server, the engine simulator with ``--endpoints`` vLLM endpoints
(path style, one port), registers them and starts ``--pollers`` `poller run` processes at
their default log level (INFO). Once every endpoint is held and written, it pauses the
redis-server (SIGSTOP: a hung master, as a Sentinel failover or a stuck disk shows it) for
``--hang`` seconds, resumes it (SIGCONT), and waits until every endpoint is held and
written again. It prints every line the pollers logged from the pause until then, grouped
by level, logger and message, with the total and the lines per second of hang. Bounded:
every wait has a deadline; everything it started is stopped by pid.
"""

from __future__ import annotations

import argparse
import collections
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a script run from a checkout

import redis

from poller_lab.embedded import (
    free_port,
    http_text,
    start_pollers,
    start_redis_server,
    start_sim,
    wait_until,
    workdir,
)

NS = "hang"
_HEAD = re.compile(r"level=(\w+) logger=(\S+)(?: poller=\S+)? (.*)$")
_FIELD = re.compile(r" [A-Za-z_]+=")
# The count in a summary line ("acquired 1000 endpoints"), so one message groups.
_NUMBER = re.compile(r"\b\d+\b")


def _leases_held(port: int) -> float:
    try:
        text = http_text(f"http://127.0.0.1:{port}/metrics", timeout_s=5)
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("poller_leases_held "):
            return float(line.split()[1])
    return 0.0


def _written_since(client: redis.Redis, since_ms: int, endpoints: int) -> bool:
    """Every endpoint's stats written at or after ``since_ms`` (Redis clock)."""
    fields = client.hgetall(f"{{{NS}}}:view:stats")
    if len(fields) < endpoints:
        return False
    # A record's header starts with its write time (docs/schema.md, the view hashes).
    written = sum(1 for r in fields.values() if int(r.split(" ", 1)[0] or 0) >= since_ms)
    return written >= endpoints


def _wait(cond, timeout_s: float, what: str) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout_s:
            raise SystemExit(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.1)
    return time.monotonic() - start


def _redis_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _group(line: str) -> tuple[str, str, str] | None:
    head = _HEAD.search(line)
    if head is None:
        return None
    level, logger, rest = head.groups()
    field = _FIELD.search(rest)
    message = rest[: field.start()] if field else rest
    return level, logger, _NUMBER.sub("N", message)[:120]


def main(
    endpoints: int, pollers: int, hang_s: float, interval_s: float, extra: tuple[str, ...] = ()
) -> None:
    with workdir("poller-bench-hang-") as work:
        port = free_port()
        redis_proc = start_redis_server(work, port)
        url = f"redis://127.0.0.1:{port}/0"
        sim = None
        procs = []
        client = redis.Redis.from_url(url, decode_responses=True)
        try:
            wait_until(lambda: redis_proc.alive(), 5, "redis")
            _wait(lambda: _ping(client), 30, "redis-server")
            sim, _, registry = start_sim(work, endpoints, "vllm", style="path")
            subprocess.run(
                [sys.executable, "-m", "poller", "endpoints", "sync", str(registry),
                 "--redis-url", url, "--namespace", NS],
                check=True, capture_output=True, timeout=120,
            )  # fmt: skip
            ids = [f"p{i}" for i in range(pollers)]
            pairs = start_pollers(work, url, NS, ids, interval_s=interval_s, extra=extra)
            procs = [p for p, _ in pairs]
            ports = [health for _, health in pairs]

            def all_held() -> bool:
                return sum(_leases_held(p) for p in ports) >= endpoints

            took = _wait(all_held, 180, "every endpoint held")
            now_ms = _redis_ms(client)
            _wait(lambda: _written_since(client, now_ms, endpoints), 120, "every write")
            print(f"{endpoints} endpoints held by {pollers} poller(s) after {took:.1f} s")
            time.sleep(3 * interval_s)  # steady state
            marks = [p.log.stat().st_size for p in procs]
            redis_proc.signal(signal.SIGSTOP)
            paused = time.monotonic()
            time.sleep(hang_s)
            redis_proc.signal(signal.SIGCONT)
            resumed_ms = _redis_ms(client)
            _wait(all_held, 180, "every endpoint held again")
            back = _wait(
                lambda: _written_since(client, resumed_ms, endpoints), 180, "every write again"
            )
            time.sleep(3 * interval_s)  # what the recovery still logs
            span = time.monotonic() - paused
            print(f"redis paused {hang_s:g} s; every endpoint written again {back:.1f} s after")
            groups: collections.Counter[tuple[str, str, str]] = collections.Counter()
            total = 0
            for proc, mark in zip(procs, marks, strict=True):
                with open(proc.log, "rb") as log:
                    log.seek(mark)
                    for raw in log.read().decode(errors="replace").splitlines():
                        total += 1
                        key = _group(raw)
                        groups[key or ("?", "?", raw[:120])] += 1
            print(f"\n{total} lines logged in the {span:.0f} s from the pause on")
            print(f"({total / hang_s:.0f} per second of hang)\n")
            for (level, logger, message), n in groups.most_common():
                print(f"{n:>7}  {level:<7} {logger:<34} {message}")
        finally:
            client.close()
            for proc in procs:
                proc.stop()
            if sim is not None:
                sim.stop()
            redis_proc.stop()


def _ping(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoints", type=int, default=1000)
    parser.add_argument("--pollers", type=int, default=1)
    parser.add_argument("--hang", type=float, default=8.0, help="seconds Redis stays paused")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--log-level", default="INFO", help="the pollers' (default INFO)")
    args = parser.parse_args()
    main(args.endpoints, args.pollers, args.hang, args.interval, ("--log-level", args.log_level))
