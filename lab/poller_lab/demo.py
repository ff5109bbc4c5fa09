"""``poller demo``: watch three pollers share a dozen simulated engines and take over.

Starts (all on loopback, all stopped by pid at the end): a Redis (``--redis-url``, else
an embedded redis-server, else fakeredis's TCP server), the engine simulator with a mixed
fleet (one endpoint failing, one missing a metric), three ``poller run`` processes, and
shows the shared view live. About 10 s in, once all three pollers hold endpoints, it SIGKILLs
one to show the takeover, and restarts it 10 s after the takeover was seen to show the
rebalancing, narrating each event in one line. Each step waits for the state it narrates,
not for the clock alone, so a slow (loaded) machine tells the same story, later.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live

from poller.cli.render import render
from poller.reader.reader import StatsReader
from poller.reader.view import View
from poller.service.coordinator import assign
from poller.util.logs import count
from poller_lab.bench_fleet import sync_registry
from poller_lab.embedded import Proc, http_json, redis_for, start_pollers, start_sim, workdir

__all__ = ["run_demo"]

NS = "demo"
ENGINES = "vllm,sglang,llamacpp,trtllm,triton,tgi,lmdeploy,vllm-v0"
KILL_AT_S = 10.0  # the earliest kill; it also waits for poller-1 to hold endpoints
RESTART_AFTER_S = 10.0  # after the kill, and never before the takeover was seen


class Demo:
    def __init__(self, work: Path, redis_url: str, endpoints: int, say: Callable[[str], None]):
        self.work = work
        self.redis_url = redis_url
        self.say = say
        self.procs: dict[str, Proc] = {}
        self.ports: dict[str, int] = {}
        self.sim, self.admin, registry = start_sim(work, endpoints, ENGINES, cpu=None)
        try:
            self._start(registry)
        except BaseException:  # Redis unreachable, a poller that would not start
            self.stop()  # nothing started is left running
            raise

    def _start(self, registry: Path) -> None:
        asyncio.run(sync_registry(self.redis_url, NS, registry))
        ids = [e["id"] for e in http_json(f"{self.admin}/admin/registry")]
        self.missing, self.failing = ids[0], ids[1]
        http_json(f"{self.admin}/admin/endpoints/{self.failing}/fault", {"mode": "http500"})
        http_json(f"{self.admin}/admin/endpoints/{self.missing}/fault", {"mode": "missing"})
        self.say(
            f"simulator: {count(len(ids), 'endpoint')}, in turn of "
            f"{len(ENGINES.split(','))} engine kinds ({ENGINES}); {self.failing} answers HTTP 500, "
            f"{self.missing} lacks its KV-cache metric"
        )
        self.ids = ["poller-0", "poller-1", "poller-2"]
        for poller_id in self.ids:
            self.start_poller(poller_id)
        self.say("started poller-0, poller-1, poller-2: they divide the endpoints by leases")
        self.say(
            f"operator's page: http://127.0.0.1:{self.ports['poller-0']}/ (every poller's "
            "health port serves it; watch the takeover there too)"
        )

    def start_poller(self, poller_id: str) -> None:
        [(proc, port)] = start_pollers(self.work, self.redis_url, NS, [poller_id])
        self.procs[poller_id] = proc
        self.ports[poller_id] = port

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop()
        self.sim.stop()


def _owned(view: View, poller: str) -> list[str]:
    return sorted(e.id for e in view.endpoints.values() if e.owner == poller)


def _steady_split(view: View, pollers: list[str]) -> dict[str, str] | None:
    """endpoint -> owner when all ``pollers`` are live and every endpoint is held by the
    one rendezvous gives it among the live members; None while that is not so."""
    live = sorted(view.pollers)
    if not set(pollers) <= set(live):
        return None
    split = assign(live, view.endpoints)
    if any(view[e].owner != owner for e, owner in split.items()):
        return None
    return split


def run_demo(
    redis_url: str | None,
    duration_s: float | None,
    endpoints: int = 12,
    *,
    exit_after_story: bool = False,
) -> int:
    """Run the demo; 0, or 1 when ``exit_after_story`` and the duration ended the story early."""
    console = Console()
    interactive = console.is_terminal
    if not interactive:
        console = Console(width=160)  # piped: whole lines, not a table wrapped at 80

    def say(line: str) -> None:
        console.print(f"[bold cyan]>[/bold cyan] {line}", highlight=False)

    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    old = signal.signal(signal.SIGTERM, on_signal)
    try:
        with workdir("poller-demo-") as work:
            with redis_for(work, redis_url) as (url, redis_proc):
                kind = "redis-server" if redis_proc else ("fakeredis" if redis_url is None else url)
                say(f"redis: {kind} at {url} (namespace {NS})")
                demo = Demo(work, url, endpoints, say)
                script = Script(demo, say)
                if exit_after_story:
                    stop["story"] = True
                try:
                    asyncio.run(_watch(demo, script, console, interactive, duration_s, stop))
                except KeyboardInterrupt:
                    pass
                finally:
                    say("stopping every process the demo started")
                    demo.stop()
    finally:
        signal.signal(signal.SIGTERM, old)
    if exit_after_story and not script.done:
        console.print(f"demo: the duration ended before {script.awaiting()}", highlight=False)
        return 1
    return 0


class Script:
    """The scripted events: kill poller-1, report the takeover, restart, report rebalance."""

    def __init__(self, demo: Demo, say: Callable[[str], None]) -> None:
        self.demo = demo
        self.say = say
        self.killed_at: float | None = None
        self.victims: list[str] = []
        self.restarted_at: float | None = None
        self.rebalanced = False
        #: The steady split seen on the last read (endpoint -> owner), None: not steady.
        self.split: dict[str, str] | None = None

    @property
    def done(self) -> bool:
        return self.rebalanced

    def awaiting(self) -> str:
        """What the story waits for now, for the message when it could not finish."""
        if self.killed_at is None:
            return "all three pollers were live with poller-1 holding endpoints (the kill)"
        if self.victims:
            return "the takeover of poller-1's endpoints"
        if self.restarted_at is None:
            return "the restart of poller-1"
        return "the rebalancing after poller-1's restart"

    def step(self, view: View, elapsed_s: float) -> None:
        now = time.monotonic()
        if self.killed_at is None:
            # Kill a poller that holds endpoints, or there is no takeover to show: on a
            # loaded machine the pollers may take longer than KILL_AT_S to start.
            ready = set(self.demo.ids) <= set(view.pollers) and _owned(view, "poller-1")
            if elapsed_s >= KILL_AT_S and ready:
                self.victims = _owned(view, "poller-1")
                self.demo.procs["poller-1"].signal(signal.SIGKILL)
                self.killed_at = now
                self.say(
                    f"killed poller-1 (SIGKILL) holding {count(len(self.victims), 'endpoint')}: "
                    f"{', '.join(self.victims) or 'none'}"
                )
            return
        if self.victims:
            owners = {view[e].owner for e in self.victims if e in view.endpoints}
            if owners and None not in owners and "poller-1" not in owners:
                who = ", ".join(sorted(str(o) for o in owners))
                verb = "scrapes" if len(owners) == 1 else "scrape"
                self.say(
                    f"takeover: {who} now {verb} poller-1's endpoints "
                    f"({now - self.killed_at:.1f} s after the kill: its lease and "
                    "heartbeat lapsed)"
                )
                self.victims = []
        if self.restarted_at is None:
            # Restarting before the takeover would let poller-1 win its leases back unseen.
            if not self.victims and now - self.killed_at >= RESTART_AFTER_S:
                self.demo.start_poller("poller-1")
                self.restarted_at = now
                self.say("restarted poller-1: rendezvous hashing gives it back its share")
        elif not self.rebalanced:
            # The steady split: every endpoint with its rendezvous owner among the three,
            # seen on two reads in a row (leases still moving show on the second).
            split = _steady_split(view, self.demo.ids)
            if split is None or split != self.split:
                self.split = split
                return
            self.rebalanced = True
            held = Counter(split.values())
            shares = ", ".join(f"{p} {held[p]}" for p in self.demo.ids)
            self.say(
                f"rebalanced: poller-1 owns {count(held['poller-1'], 'endpoint')} again; "
                f"every poller holds its rendezvous share ({shares}), "
                f"{now - self.restarted_at:.1f} s after its restart"
            )


def frame(view: View, width: int | None) -> Group:
    """The view as the demo shows it, in a terminal of ``width`` columns (None: piped,
    every column): at 80 columns the table leaves columns out rather than wrap a cell,
    so the owners (the story) stay readable and every row fits in 24 lines."""
    return render(view, "id", width=width)


async def _watch(
    demo: Demo,
    script: Script,
    console: Console,
    interactive: bool,
    duration_s: float | None,
    stop: dict[str, bool],
) -> None:
    reader = StatsReader.from_url(demo.redis_url, NS)
    started = time.monotonic()
    last_plain = 0.0
    live = None

    def table(view: View) -> Group:
        return frame(view, console.width if interactive else None)

    if interactive:
        live = Live(table(await reader.snapshot()), console=console, auto_refresh=False)
        live.start()
    try:
        while not stop["now"]:
            elapsed = time.monotonic() - started
            if duration_s is not None and elapsed >= duration_s:
                break
            view = await reader.snapshot()
            script.step(view, elapsed)
            if stop.get("story") and script.done:
                break
            if live is not None:
                live.update(table(view), refresh=True)
            elif time.monotonic() - last_plain >= 5.0:
                console.print(table(view))
                last_plain = time.monotonic()
            await asyncio.sleep(0.5)
        if live is None:
            console.print(table(await reader.snapshot()))
    finally:
        if live is not None:
            live.stop()
        await reader.aclose()
