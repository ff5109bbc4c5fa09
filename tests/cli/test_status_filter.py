"""``poller status --state/--engine``: the rows an operator asked for, in the table and
in ``--json``, run as a subprocess against a real redis-server."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import redis

from poller.schema.keys import Keys
from tests.support.redisproc import RedisProcess

NS = "status-filter"


def poller(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "poller", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,  # only a hang ends it
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def env(redis_server: RedisProcess) -> dict[str, str]:
    """A registry of a vLLM endpoint with fresh stats and two never read (unknown)."""
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    client.flushall()
    env = {"POLLER_REDIS_URL": redis_server.url, "POLLER_NAMESPACE": NS}
    for endpoint_id, url, engine in (
        ("a", "http://10.0.0.1:8000", "vllm"),
        ("b", "http://10.0.0.2:8080", "llamacpp"),
        ("c", "http://10.0.0.3:30000", "sglang"),
    ):
        added = poller(env, "endpoints", "add", endpoint_id, url, "--engine", engine)
        assert added.returncode == 0, added.stderr
    now_ms = int(client.time()[0]) * 1000
    fields = {
        "engine": "vllm",
        "running": "2",
        "waiting": "0",
        "interval_ms": "60000",  # fresh for two minutes: the test takes seconds
        "scraped_at_ms": str(now_ms),
        "poller": "p0",
        "token": "1",
        "seq": "1",
    }
    client.hset(Keys(NS).stats("a"), mapping=fields)
    record = f"{now_ms} 60000 {now_ms + 600_000} p0 1|{json.dumps(fields)}"
    client.hset(Keys(NS).view_stats, "a", record)
    return env


def rows(out: str) -> list[str]:
    """The ids of the table's rows (the first word of each line under the ID header)."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:2] == ["ID", "ENGINE"])
    return [line.split()[0] for line in lines[at + 1 :] if line.strip()]


@pytest.mark.slow
def test_status_shows_only_the_states_and_engines_asked_for(env: dict[str, str]) -> None:
    fresh = poller(env, "status", "--state", "fresh")
    assert fresh.returncode == 0, fresh.stderr
    assert rows(fresh.stdout) == ["a"]
    assert "showing 1 of 3 endpoints" in fresh.stdout.splitlines()
    # the header still counts the whole view
    assert "3 endpoints: fresh 1  stale 0  failing 0  unknown 2" in fresh.stdout

    either = poller(env, "status", "--engine", "llamacpp", "--engine", "sglang")
    assert rows(either.stdout) == ["b", "c"]
    both = poller(env, "status", "--state", "unknown", "--engine", "vllm")
    assert rows(both.stdout) == [] and "showing 0 of 3 endpoints" in both.stdout

    shown = json.loads(poller(env, "status", "--json", "--state", "unknown").stdout)
    assert [e["id"] for e in shown["endpoints"]] == ["b", "c"]
    assert shown["counts"]["fresh"] == 1  # counts are the whole view's


def test_an_unknown_state_is_one_error_line() -> None:
    done = poller({}, "status", "--state", "broken")
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert line.startswith("Error: Invalid value for '--state': 'broken' is not one of")


@pytest.mark.slow
def test_status_json_holds_the_view_to_dict_and_what_it_adds(
    env: dict[str, str], redis_server: RedisProcess
) -> None:
    """docs/reader.md: `poller status --json` is `View.to_dict()` with more beside it."""
    from poller.reader import SyncStatsReader

    shown = json.loads(poller(env, "status", "--json").stdout)
    with SyncStatsReader.from_url(redis_server.url, namespace=NS) as reader:
        view = json.loads(reader.snapshot().to_json())
    for key in ("schema", "rev", "pollers"):
        assert shown[key] == view[key], key
    assert {"redis", "namespace", "sources", "members"} <= shown.keys()
    assert [e["id"] for e in shown["endpoints"]] == [e["id"] for e in view["endpoints"]]
    for row, base in zip(shown["endpoints"], view["endpoints"], strict=True):
        assert {"url", "labels", "registry_engine"} <= row.keys()
        assert {k: row[k] for k in ("id", "engine", "owner", "token", "stats")} == {
            k: base[k] for k in ("id", "engine", "owner", "token", "stats")
        }
