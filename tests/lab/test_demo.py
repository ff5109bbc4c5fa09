"""The README's first command, the simulator CLI and `poller bench --quick`, end to end."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from poller.reader.view import EndpointView, View
from poller.service.coordinator import assign
from poller_lab import demo as demo_mod
from tests.support.procs import leftovers

REBALANCED = re.compile(
    r"> rebalanced: poller-1 owns (1 endpoint|(?!1 )\d+ endpoints) again; every poller holds "
    r"its rendezvous share \(poller-0 \d+, poller-1 \d+, poller-2 \d+\), [\d.]+ s after "
    r"its restart"
)


def marked(
    tmp_path: Path,
    command: str,
    *args: str,
    path_env: str | None = None,
    timeout_s: float = 240,
) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    """``poller COMMAND ARGS`` as a user runs it, a marker in its environment; its result
    and the pids of the processes it left behind (killed, so a failing test leaves none)."""
    marker = f"LLMGW_DEMO_TEST={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1], "TMPDIR": str(tmp_path)}
    if path_env is not None:
        env["PATH"] = path_env
    result = subprocess.run(
        [sys.executable, "-m", "poller", command, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )
    left = leftovers(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return result, left


def run_demo(tmp_path: Path, path_env: str | None) -> str:
    # The story's steps wait for the state they narrate (a loaded machine starts pollers
    # late); --exit-after-story ends the demo when it is told, the duration is only a cap
    # (a quiet machine takes ~25 s) and exit 1 names the step still awaited.
    result, left = marked(
        tmp_path, "demo", "--exit-after-story", "--duration", "150", path_env=path_env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert left == [], "the demo left processes behind"
    assert list(tmp_path.iterdir()) == [], "the demo left temporary files behind"
    return result.stdout


def check_story(out: str) -> None:
    lines = [line for line in out.splitlines() if line.startswith("> ")]
    assert any(line.startswith("> killed poller-1 (SIGKILL)") for line in lines), out
    assert any(line.startswith("> takeover: ") for line in lines), out
    assert any(line.startswith("> operator's page: http://127.0.0.1:") for line in lines), out
    assert any(line.startswith("> restarted poller-1") for line in lines), out
    # Rebalanced is said once the split is rendezvous's for the three, with its count.
    [rebalanced] = [line for line in lines if line.startswith("> rebalanced: ")]
    assert REBALANCED.fullmatch(rebalanced), rebalanced
    shares = dict(re.findall(r"(poller-\d) (\d+)", rebalanced.split("(")[1]))
    assert rebalanced.startswith(f"> rebalanced: poller-1 owns {shares['poller-1']} endpoint")
    assert sum(map(int, shares.values())) == 12  # the demo's default fleet
    assert "3 live pollers (poller-0, poller-1, poller-2)" in out
    assert "http_status" in out and "contract" in out  # the failing and the incomplete one


@pytest.mark.slow
@pytest.mark.redis_server
@pytest.mark.timeout(300)  # the subprocess's own 240 s bound fails first
def test_demo_with_redis_server(tmp_path: Path) -> None:
    out = run_demo(tmp_path, None)
    assert "> redis: redis-server at" in out
    check_story(out)


@pytest.mark.slow
@pytest.mark.timeout(300)  # the subprocess's own 240 s bound fails first
def test_demo_falls_back_to_fakeredis(tmp_path: Path) -> None:
    out = run_demo(tmp_path, "")  # no redis-server (nor anything else) on PATH
    assert "> redis: fakeredis at" in out
    check_story(out)


@pytest.mark.slow
@pytest.mark.redis_server
@pytest.mark.timeout(240)  # the subprocess's own 180 s bound fails first
def test_bench_quick_json_has_every_field() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "poller", "bench", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    expected = {
        "scrape": {
            "cpu_s_per_1000_scrapes",
            "endpoints_per_core",
            "scrape_ratio",
            "p99_lateness_s_le",
            "rss_mb",
            "redis_cpu_s_per_1000_scrapes",
        },
        "cluster": {
            "duplicates_per_endpoint_interval",
            "max_over_mean_ownership",
            "redis_cpu_s_per_1000_scrapes",
            "cpu_s_per_1000_scrapes",
        },
        "failover": {
            "sigkill_rewritten_max_s",
            "sigkill_rewritten_p50_s",
            "sigterm_missed_intervals",
            "sigterm_exit_code",
        },
        "reader": {"snapshot_p50_ms", "snapshot_p99_ms", "cached_lookup_us"},
    }
    for section, keys in expected.items():
        assert keys <= set(report[section]), (section, report[section])
    assert report["scrape"]["scrapes"] > 0
    assert report["cluster"]["duplicates_per_endpoint_interval"] == 0
    assert report["failover"]["sigterm_exit_code"] == 0
    # progress as it goes, on stderr since stdout is the JSON
    steps = [line.split("] ", 1)[1] for line in result.stderr.splitlines() if "bench [" in line]
    assert [step.split(":")[0] for step in steps] == [
        "scrape",
        "cluster and failover",
        "reader",
        "done",
    ], result.stderr


@pytest.mark.slow
def test_poller_sim_command_is_wired() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "poller", "sim", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0 and "--registry-out" in result.stdout


def test_demo_stops_what_it_started_when_redis_is_unreachable(tmp_path: Path) -> None:
    """The simulator starts before the registry is written: a Redis that does not answer
    ends the demo with the reason, and the simulator with it."""
    from tests.support.redisproc import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    result, left = marked(tmp_path, "demo", "--redis-url", url, "--duration", "5", timeout_s=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Redis unreachable" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert left == [], "the demo left its simulator running"
    assert list(tmp_path.iterdir()) == [], "the demo left temporary files behind"


def test_bench_stops_its_simulator_when_redis_is_unreachable(tmp_path: Path) -> None:
    from tests.support.redisproc import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    args = ("--redis-url", url, "--quick", "--section", "scrape")
    result, left = marked(tmp_path, "bench", *args, timeout_s=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Redis unreachable" in result.stderr and "Traceback" not in result.stderr
    assert left == [], "the bench left its simulator running"


class _Proc:
    def __init__(self) -> None:
        self.signals: list[int] = []

    def signal(self, sig: int) -> None:
        self.signals.append(sig)


class _Demo:
    ids = ["poller-0", "poller-1", "poller-2"]

    def __init__(self) -> None:
        self.procs = {i: _Proc() for i in self.ids}
        self.restarts = 0

    def start_poller(self, poller_id: str) -> None:
        self.restarts += 1


def _view(owners: dict[str, str | None], live: list[str]) -> View:
    endpoints = {e: SimpleNamespace(id=e, owner=o) for e, o in owners.items()}
    return View(now_ms=0, rev=1, endpoints=endpoints, pollers=live)  # type: ignore[arg-type]


def test_demo_story_steps_wait_for_the_state_they_narrate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A slow start (poller-1 holds nothing yet) delays the kill; a takeover not seen yet
    delays the restart: the story is told late, never told wrong."""
    clock = [1000.0]
    monkeypatch.setattr(demo_mod.time, "monotonic", lambda: clock[0])
    said: list[str] = []
    fake = _Demo()
    script = demo_mod.Script(fake, said.append)  # type: ignore[arg-type]
    all_live = ["poller-0", "poller-1", "poller-2"]
    script.step(_view({"a": "poller-0", "b": "poller-0"}, ["poller-0"]), 30.0)
    assert script.killed_at is None and "kill" in script.awaiting()
    script.step(_view({"a": "poller-0", "b": "poller-0"}, all_live), 31.0)
    assert script.killed_at is None  # all live, but poller-1 holds nothing: no takeover to show
    script.step(_view({"a": "poller-0", "b": "poller-1"}, all_live), 32.0)
    assert fake.procs["poller-1"].signals == [signal.SIGKILL]
    assert said[-1] == "killed poller-1 (SIGKILL) holding 1 endpoint: b"
    clock[0] += 60  # long after the kill, the lease has not been taken yet
    script.step(_view({"a": "poller-0", "b": "poller-1"}, ["poller-0", "poller-2"]), 92.0)
    assert fake.restarts == 0 and script.awaiting() == "the takeover of poller-1's endpoints"
    script.step(_view({"a": "poller-0", "b": "poller-2"}, ["poller-0", "poller-2"]), 93.0)
    assert said[-2].startswith("takeover: poller-2 now scrape")  # then the restart, at once
    assert said[-1].startswith("restarted poller-1")  # (the kill was 60 s ago)
    assert fake.restarts == 1 and not script.done
    script.step(_view({"a": "poller-0", "b": "poller-2"}, all_live), 94.0)
    assert not script.done and script.awaiting().startswith("the rebalancing")


def test_rebalanced_waits_for_the_rendezvous_split_seen_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """poller-1 holding some endpoints is not the rebalancing: every endpoint with its
    rendezvous owner among the three, on two reads in a row, is; the count agrees."""
    clock = [1000.0]
    monkeypatch.setattr(demo_mod.time, "monotonic", lambda: clock[0])
    said: list[str] = []
    fake = _Demo()
    script = demo_mod.Script(fake, said.append)  # type: ignore[arg-type]
    script.killed_at, script.restarted_at = 900.0, 990.0  # the story so far
    all_live = ["poller-0", "poller-1", "poller-2"]
    ids = [f"e{i}" for i in range(12)]
    split = assign(all_live, ids)
    mine = [e for e in ids if split[e] == "poller-1"]
    assert len(mine) >= 2  # the fixture's premise: poller-1 wins several
    # poller-1 has one of its endpoints back, poller-0 still holds the rest of them.
    early = {e: ("poller-0" if o == "poller-1" and e != mine[0] else o) for e, o in split.items()}
    script.step(_view(early, all_live), 95.0)
    assert not script.done
    clock[0] = 1002.5
    script.step(_view(split, all_live), 96.0)
    assert not script.done  # steady once is not yet stable
    script.step(_view(split, ["poller-0", "poller-2"]), 96.5)  # a member not live: not it
    script.step(_view(split, all_live), 97.0)
    assert not script.done  # seen again, but the read between broke the run
    script.step(_view(split, all_live), 97.5)
    assert script.done
    shares = ", ".join(f"{p} {sum(1 for o in split.values() if o == p)}" for p in all_live)
    assert said == [
        f"rebalanced: poller-1 owns {len(mine)} endpoints again; every poller holds its "
        f"rendezvous share ({shares}), 12.5 s after its restart"
    ]


def test_rebalanced_says_1_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo_mod.time, "monotonic", lambda: 1000.0)
    said: list[str] = []
    script = demo_mod.Script(_Demo(), said.append)  # type: ignore[arg-type]
    script.killed_at, script.restarted_at = 900.0, 990.0
    all_live = ["poller-0", "poller-1", "poller-2"]
    # Endpoints of which rendezvous gives poller-1 exactly one.
    ids = [f"e{i}" for i in range(40)]
    split = assign(all_live, ids)
    one = [next(e for e in ids if split[e] == "poller-1")]
    one += [e for e in ids if split[e] != "poller-1"]
    view = _view({e: split[e] for e in one}, all_live)
    script.step(view, 1.0)
    script.step(view, 2.0)
    assert said[-1].startswith("rebalanced: poller-1 owns 1 endpoint again; ")


def _demo_view() -> View:
    """The demo's fleet as the table shows it: twelve endpoints of the demo's engines, in
    turn, among three pollers; the first lacks its KV metric, the second answers 500."""
    now_ms = 1_000_000_000
    engines = demo_mod.ENGINES.split(",")
    ids = [f"{engines[i % len(engines)]}-{i}" for i in range(12)]
    owners = assign(["poller-0", "poller-1", "poller-2"], ids)
    endpoints = {}
    for i, e in enumerate(ids):
        entry = json.dumps({"url": f"http://127.0.0.1:41234/e/{e}", "engine": "vllm"})
        stats = {
            "engine": "vllm",
            "running": str(100 + i),
            "waiting": str(i),
            "kv_cache_usage": "0.4237",
            "prefix_cache_hit_rate": "0.31",
            "interval_ms": "1000",
            "scraped_at_ms": str(now_ms - 400),
            "models": "meta-llama/Llama-3.1-8B-Instruct",
        }
        failure: dict[str, str] = {}
        if i < 2:
            stats = {}
            failure = {"reason": "contract", "since_ms": str(now_ms - 9000)}
            failure |= {"missing": "vllm:kv_cache_usage_perc|vllm:gpu_cache_usage_perc"}
            if i == 1:
                failure = {"reason": "http_status", "since_ms": str(now_ms - 9000)}
                failure["detail"] = "HTTP 500 Internal Server Error: simulated failure (http500)"
        endpoints[e] = EndpointView(
            e,
            state="failing" if failure else "fresh",
            age_ms=None if failure else 400,
            owner=owners[e],
            token=1,
            raw=(entry, stats, failure),
        )
    return View(now_ms, 3, endpoints, pollers=["poller-0", "poller-1", "poller-2"])


def test_the_demo_table_reads_at_80_columns() -> None:
    """At 80x24 every cell was cut to 3-4 characters (OWNER read `pol…` on every row),
    the failure cell wrapped one word a line, and the last rows fell off the screen."""
    view = _demo_view()
    console = Console(width=80, record=True, color_system=None)
    console.print(demo_mod.frame(view, 80))
    lines = console.export_text().splitlines()
    assert len(lines) <= 24 and all(len(line) <= 80 for line in lines), lines
    [head] = [line for line in lines if line.startswith("ID ")]
    at = head.index("OWNER")
    rows = {
        line.split()[0]: line
        for line in lines
        if line.split()[:1] and line.split()[0] in view.endpoints
    }
    assert rows.keys() == view.endpoints.keys(), lines  # no row lost
    for endpoint_id, line in rows.items():
        assert line[at:].split()[0] == view[endpoint_id].owner, line  # the whole poller id
    # One line per row: nothing wrapped (the rows, the column header and the text above).
    assert len(lines) == len(rows) + 1 + lines.index(head), lines
    assert "http_status for 9.0s" in rows["sglang-1"] and "contract for 9.0s" in rows["vllm-0"]
    wide = Console(width=200, record=True, color_system=None)
    wide.print(demo_mod.frame(view, None))  # piped: every column, as before
    assert "MODELS" in wide.export_text() and "not shown" not in wide.export_text()
