"""Where one ``poller run``'s CPU goes: py-spy samples grouped by the library on the stack.

Usage: python tests/bench/profile_scrape.py [--endpoints 1000] [--seconds 20] [--page 61k]
       [--raw FILE] [--extra "--option value" ...]

Starts what ``poller bench --section scrape`` starts (an embedded redis-server, the engine
simulator on core 1, one ``poller run`` pinned to core 0), waits until every endpoint is
fresh, then samples the poller with ``py-spy record`` (``pip install py-spy``; root or
ptrace rights) and prints each group's share of the samples. A sample counts for the
innermost frame that belongs to a known group (``GROUPS``), so time in ``str.find``
called from our parser counts as parsing, and time in the selector called from asyncio's
loop as the event loop. Also prints the poller's CPU per scrape over the same window (the
sampler's own cost included: compare shares, not this figure, across runs).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from poller_lab.bench_fleet import NS, BenchConfig, Fleet, _wait_fresh  # noqa: E402
from poller_lab.embedded import (  # noqa: E402
    process_cpu_s,
    process_rss_mb,
    redis_for,
    start_pollers,
    workdir,
)

#: (group, substrings of a frame's file name), innermost match wins; checked in order.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "reading the page (parse, mapping, decode)",
        (
            "poller/scrape/parse",
            "poller/scrape/engines",
            "poller/scrape/http/body",
            "poller/scrape/specs",
        ),
    ),
    ("our HTTP path (scrape/http*, wire, h1)", ("poller/scrape/",)),
    (
        "our job body, reporting, metrics",
        (
            "poller/service/jobs",
            "poller/service/names",
            "poller/service/reporting",
            "poller/service/metrics",
            "poller/schema/stats",
        ),
    ),
    ("our Redis writes and batching", ("poller/redis/",)),
    ("our coordination, follow, health", ("poller/service/", "poller/")),
    ("llhttp (httptools)", ("httptools/",)),
    ("httpx", ("httpx/", "httpcore/")),
    ("redis-py", ("redis/",)),
    ("APScheduler", ("apscheduler/",)),
    ("prometheus_client", ("prometheus_client/",)),
    ("the event loop, selectors, sockets", ("asyncio/", "selectors", "socket", "ssl")),
)


def group_of(stack: list[str]) -> str:
    for frame in reversed(stack):  # innermost first
        for name, needles in GROUPS:
            if any(n in frame for n in needles):
                return name
    return "other"


def shares(raw: Path) -> list[tuple[str, float]]:
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            counts[group_of(stack.split(";"))] += int(n)
    total = sum(counts.values()) or 1
    return [(name, c / total) for name, c in counts.most_common()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoints", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--page", choices=("61k", "200k"), default="61k")
    parser.add_argument("--raw", type=Path, help="keep py-spy's collapsed stacks here")
    parser.add_argument("--extra", action="append", default=[], help="more `poller run` args")
    args = parser.parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("py-spy not found: pip install py-spy", file=sys.stderr)
        return 2
    cfg = BenchConfig(endpoints=args.endpoints, page=args.page, sections=("scrape",))
    extra = [part for option in args.extra for part in option.split()]
    with workdir("llmgw-profile-") as work, redis_for(work, None) as (url, redis_proc):
        fleet = Fleet(work, cfg, url, redis_proc)
        procs = start_pollers(work, url, NS, ["profile-0"], interval_s=1.0, cpu=0, extra=extra)
        try:
            _wait_fresh(fleet, 30 + args.endpoints / 50)
            time.sleep(2.0)
            pid = procs[0][0].pid
            raw = args.raw or work / "stacks.txt"
            fleet.reset_hits()
            cpu0, t0 = process_cpu_s(pid), time.monotonic()
            subprocess.run(
                [
                    spy,
                    "record",
                    "--nonblocking",
                    "-r",
                    "200",
                    "-d",
                    str(int(args.seconds)),
                    "-f",
                    "raw",
                    "-o",
                    str(raw),
                    "-p",
                    str(pid),
                ],
                check=True,
                capture_output=True,
                timeout=args.seconds + 60,
            )
            cpu, elapsed = process_cpu_s(pid) - cpu0, time.monotonic() - t0
            scrapes = sum(fleet.hits()[0].values())
            print(
                f"{args.endpoints} endpoints, {args.page} page, {elapsed:.0f} s sampled: "
                f"{scrapes / elapsed:.0f} scrapes/s, {cpu / max(scrapes, 1) * 1e3:.3f} ms CPU "
                f"per scrape (sampler included), RSS {process_rss_mb(pid):.0f} MB"
            )
            for name, share in shares(raw):
                print(f"  {share:6.1%}  {name}")
        finally:
            for p, _ in procs:
                p.stop()
            fleet.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
