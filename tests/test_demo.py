"""The README's first command, the simulator CLI and `poller bench --quick`, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def leftovers(marker: str) -> list[int]:
    """Pids of live processes whose environment carries ``marker``."""
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


def run_demo(tmp_path: Path, path_env: str | None) -> str:
    marker = f"LLMGW_DEMO_TEST={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1], "TMPDIR": str(tmp_path)}
    if path_env is not None:
        env["PATH"] = path_env
    result = subprocess.run(
        [sys.executable, "-m", "poller", "demo", "--duration", "27"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert leftovers(marker) == [], "the demo left processes behind"
    assert list(tmp_path.iterdir()) == [], "the demo left temporary files behind"
    return result.stdout


def check_story(out: str) -> None:
    lines = [line for line in out.splitlines() if line.startswith("> ")]
    assert any(line.startswith("> killed poller-1 (SIGKILL)") for line in lines), out
    assert any(line.startswith("> takeover: ") for line in lines), out
    assert any(line.startswith("> operator's page: http://127.0.0.1:") for line in lines), out
    assert any(line.startswith("> restarted poller-1") for line in lines), out
    assert any(line.startswith("> rebalanced: poller-1 owns") for line in lines), out
    assert "3 live pollers (poller-0, poller-1, poller-2)" in out
    assert "http_status" in out and "contract" in out  # the failing and the incomplete one


def test_demo_with_redis_server(tmp_path: Path) -> None:
    out = run_demo(tmp_path, None)
    assert "> redis: redis-server at" in out
    check_story(out)


def test_demo_falls_back_to_fakeredis(tmp_path: Path) -> None:
    out = run_demo(tmp_path, "")  # no redis-server (nor anything else) on PATH
    assert "> redis: fakeredis at" in out
    check_story(out)


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


def test_poller_sim_command_is_wired() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "poller", "sim", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0 and "--registry-out" in result.stdout
