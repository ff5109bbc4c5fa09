"""The soak in its short form: one minute of disruptions, every invariant held."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest

from tests.support.procs import leftovers

pytestmark = [pytest.mark.slow, pytest.mark.redis_server]

# A minute of soak plus start-up and the final checks; the bound only ends a hung run.
SOAK_TIMEOUT_S = 240


# pytest's own timeout stays above the subprocess bound, so a slow run fails with the
# subprocess's TimeoutExpired (and its output), not with pytest killing the test.
@pytest.mark.timeout(SOAK_TIMEOUT_S + 60)
def test_one_minute_soak_holds_every_invariant() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "poller",
            "soak",
            "--duration",
            "60",
            "--endpoints",
            "60",
            "--every",
            "8",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=SOAK_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    report = json.loads(result.stdout)
    assert result.returncode == 0, (report, result.stderr[-2000:])
    assert report["disruptions"] >= 5
    assert report["stale_writes_accepted"] == 0
    assert report["stats_older_than_ttl"] == 0 and report["stats_without_ttl"] == 0
    assert report["slow_recoveries"] == 0 and report["recovery_max_s"] <= 10
    assert report["held_unscheduled_leases"] == 0
    assert report["endpoints_unwritten_within_ttl"] == 0
    # a handover or a Redis restart may double one interval of a few endpoints: fenced,
    # but visible at the engine; anything more would be a regression
    assert report["duplicate_scrapes"] <= 0.02 * 60 * 60
    assert report["rss_end_mb"] - report["rss_start_mb"] < 20


def _children(pid: int) -> set[int]:
    """Every live process descended from ``pid`` (Linux /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # ended while we looked
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
@pytest.mark.timeout(SOAK_TIMEOUT_S)
def test_sigterm_stops_every_process_the_soak_started() -> None:
    """SIGTERM (a CI job cancelled, `timeout`, a service manager) ends the soak as Ctrl-C
    does: the redis-server, simulator and pollers it started are stopped, not orphaned."""
    marker = f"SOAK_TEST_{uuid.uuid4().hex}"  # every process the soak starts carries it
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "poller",
            "soak",
            "--duration",
            "600",
            "--endpoints",
            "20",
            "--every",
            "5",
            "--json",
        ],  # fmt: skip
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env={**os.environ, marker: "1"},
    )
    started: set[int] = set()
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # the first disruption recovered: everything is running
            if "recovered in" in line:
                break
        else:
            pytest.fail(f"the soak ended before its first disruption (exit {proc.wait()})")
        started = _children(proc.pid)
        assert len(started) >= 3, started  # redis-server, the simulator, pollers
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        left = set(leftovers(marker))  # a poller restarted since the snapshot too
        assert not left, f"still running after the soak ended: {left}"
    finally:
        for pid in started | set(leftovers(marker)) | {proc.pid}:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def test_a_signal_during_a_start_waits_until_the_process_is_recorded() -> None:
    """SIGTERM (turned into KeyboardInterrupt, as `poller soak` does) while the soak
    starts a process: its handler runs once the block that records it has ended."""
    from poller_lab.soak import _signals_held

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    recorded: list[str] = []
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            with _signals_held():
                os.kill(os.getpid(), signal.SIGTERM)
                recorded.append("started")  # the interrupt has not unwound past this
        assert recorded == ["started"]
    finally:
        signal.signal(signal.SIGTERM, previous)
