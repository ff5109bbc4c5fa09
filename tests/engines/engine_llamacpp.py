"""A real llama-server (llama.cpp b11434, CPU, a tiny random-weight llama) against
``poller check`` and ``poller run``: idle, under concurrent completions, with
``--api-key``, and without ``--metrics``. Run by ``make test-engines`` only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from poller.schema.keys import Keys
from tests.support.procs import PollerProc
from tests.support.redisproc import RedisProcess, wait_until

NS = "engines"
SLOTS = 2  # llama-server -np 2 (conftest)
CONCURRENT = 6  # so SLOTS run and the rest are deferred
MAX_PREDICT = 8000  # a slot's context is 16384 / SLOTS tokens (conftest)


def poller_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "poller", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


def check_json(url: str, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    done = poller_cli("check", url, "--engine", "llamacpp", "--json", *args, env=env)
    assert done.returncode in (0, 1), done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    assert (done.returncode == 0) == report["ok"], report
    return report


def page_values(body: bytes) -> dict[str, float]:
    """The unlabelled llamacpp:* samples of a page, read naively (the page is flat)."""
    values = {}
    for line in body.decode().splitlines():
        if line.startswith("llamacpp:"):
            name, value = line.split(" ")
            values[name] = float(value)
    return values


def gauges(server: Any) -> tuple[float, float]:
    """(requests_processing, requests_deferred) of the server's page right now."""
    page = page_values(server.get("/metrics")[1])
    return page["llamacpp:requests_processing"], page["llamacpp:requests_deferred"]


class Load:
    """``CONCURRENT`` long completions on threads; counts the finished ones."""

    def __init__(self, server: Any, n_predict: int, key: str | None = None) -> None:
        self.done = 0
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._one, args=(server, n_predict, key), daemon=True)
            for _ in range(CONCURRENT)
        ]

    def _one(self, server: Any, n_predict: int, key: str | None) -> None:
        try:
            result = server.complete(n_predict, key)
            assert result["tokens_predicted"] == n_predict, result.get("tokens_predicted")
        except BaseException as exc:  # reported by join()
            self.errors.append(exc)
        with self._lock:
            self.done += 1

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.join()

    def join(self) -> None:
        for thread in self.threads:
            thread.join(120)
        assert not self.errors, self.errors


@pytest.fixture
def own_redis() -> Iterator[RedisProcess]:
    server = RedisProcess().start()
    yield server
    server.cleanup()


def stats(client: redis.Redis, endpoint_id: str) -> dict[str, str]:
    return client.hgetall(Keys(NS).stats(endpoint_id))  # type: ignore[return-value]


def failure(client: redis.Redis, endpoint_id: str) -> dict[str, str]:
    return client.hgetall(Keys(NS).failure(endpoint_id))  # type: ignore[return-value]


def n_predict_for(server: Any, seconds: float) -> int:
    """Tokens one request needs to keep a slot busy for about ``seconds`` on this CPU, with
    both slots decoding (measured, so a fast machine still sees a backlog)."""
    started = time.monotonic()
    server.complete(256)
    rate = 256 / max(time.monotonic() - started, 1e-3)
    return max(256, min(MAX_PREDICT, int(rate * seconds / SLOTS)))


# --- tests --------------------------------------------------------------------------------------


def test_check_reads_an_idle_server_as_its_page_says(llama: Any) -> None:
    server = llama("--metrics")
    server.complete(16)  # a finished request: counters move, gauges are back to 0
    report = check_json(server.url)
    assert report["ok"] and report["status"] == 200, report
    assert report["url"] == f"{server.url}/metrics"
    status, body = server.get("/metrics")
    assert status == 200
    page = page_values(body)
    signals = report["signals"]
    assert float(signals["running"]) == page["llamacpp:requests_processing"] == 0
    assert float(signals["waiting"]) == page["llamacpp:requests_deferred"] == 0
    # The current server publishes no KV usage: absent, not 0.
    assert signals.get("kv_cache_usage") is None
    assert "llamacpp:kv_cache_usage_ratio" not in page
    # Text output, as a person reads it.
    text = poller_cli("check", server.url, "--engine", "llamacpp")
    assert text.returncode == 0 and "running" in text.stdout, text.stdout + text.stderr


def test_check_and_run_follow_concurrent_completions(
    llama: Any, own_redis: RedisProcess, tmp_path: Path
) -> None:
    server = llama("--metrics")
    # Each wave of two requests must outlast several `poller check` runs (a Python start
    # each, slow on a busy machine), so that one of them sees no request finish.
    started = time.monotonic()
    check_json(server.url)
    n_predict = n_predict_for(server, max(6.0, 5 * (time.monotonic() - started)))
    client = redis.Redis.from_url(own_redis.url, decode_responses=True)
    added = poller_cli(
        "endpoints", "add", "llama", server.url, "--engine", "llamacpp",
        "--redis-url", own_redis.url, "--namespace", NS,
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    poller = PollerProc("p0", own_redis.url, NS, tmp_path, interval_s=1.0).start()
    try:
        wait_until(lambda: stats(client, "llama").get("running") == "0", 30, "idle stats")
        with Load(server, n_predict) as load:

            def busy() -> dict[str, float] | None:
                values = page_values(server.get("/metrics")[1])
                return values if values["llamacpp:requests_processing"] == SLOTS else None

            wait_until(busy, 30, "both slots busy")
            # poller check, with the page's own numbers on either side of it: while no
            # request finished in between, the gauges cannot have moved.
            for _ in range(20):
                done_before = load.done
                before = gauges(server)
                report = check_json(server.url)
                after = gauges(server)
                if load.done == done_before and before == after or load.done >= CONCURRENT:
                    break
            assert load.done < CONCURRENT, "the load ended before a quiet check: raise n_predict"
            assert report["ok"], report
            running, waiting = (
                float(report["signals"]["running"]),
                float(report["signals"]["waiting"]),
            )
            assert (running, waiting) == after
            assert running == SLOTS
            assert waiting == CONCURRENT - SLOTS - load.done
            # The server's own /slots agrees with what the poller read: with a backlog
            # waiting, a slot that finishes takes the next request, so every slot decodes.
            status, body = server.get("/slots")
            assert status == 200, body[:200]
            processing = sum(1 for slot in json.loads(body) if slot.get("is_processing"))
            assert processing == running, (processing, running)
            # poller run writes the same: both slots running, a backlog waiting.
            wait_until(
                lambda: (
                    (s := stats(client, "llama")).get("running") == str(SLOTS)
                    and float(s.get("waiting", "0")) >= 1
                ),
                30,
                "poller run's stats under load",
            )
        # The load is over: every request finished; the stats go back to idle.
        wait_until(
            lambda: (s := stats(client, "llama")).get("running") == "0" and s.get("waiting") == "0",
            30,
            "poller run's stats idle again",
        )
        assert failure(client, "llama") == {}
    finally:
        poller.cleanup()


def test_api_key_guarded_server(llama: Any, own_redis: RedisProcess, tmp_path: Path) -> None:
    key = "llama-test-key-0123456789"
    server = llama("--metrics", "--api-key", key)
    # The key guards /metrics too.
    assert server.get("/metrics")[0] == 401 and server.get("/metrics", key)[0] == 200
    refused = check_json(server.url)
    assert not refused["ok"] and refused["reason"] == "auth", refused
    # poller check: the operator's own variable, under any name (the rules are the pollers').
    env = {"MY_LLAMA_KEY": key}
    report = check_json(server.url, "--api-key-env", "MY_LLAMA_KEY", env=env)
    assert report["ok"] and float(report["signals"]["running"]) == 0, report

    # poller run: keys from an LLMGW_KEY_* variable and from the key directory work; a
    # variable without the prefix is a config failure and nothing is sent.
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "llama").write_text(key + "\n")
    entries = {
        "by-env": ["--api-key-env", "LLMGW_KEY_LLAMA"],
        "by-file": ["--api-key-file", "llama"],
        "no-prefix": ["--api-key-env", "MY_LLAMA_KEY"],
    }
    for endpoint_id, source in entries.items():
        added = poller_cli(
            "endpoints", "add", endpoint_id, server.url, "--engine", "llamacpp", *source,
            "--redis-url", own_redis.url, "--namespace", NS,
        )  # fmt: skip
        assert added.returncode == 0, added.stderr
    env = {"LLMGW_KEY_LLAMA": key, "MY_LLAMA_KEY": key, "CREDENTIALS_DIRECTORY": str(keys)}
    client = redis.Redis.from_url(own_redis.url, decode_responses=True)
    poller = PollerProc("p0", own_redis.url, NS, tmp_path, interval_s=1.0, env=env).start()
    try:
        with Load(server, 64, key):
            pass
        wait_until(
            lambda: all(stats(client, e).get("running") == "0" for e in ("by-env", "by-file")),
            30,
            "stats of the keyed endpoints",
        )
        wait_until(lambda: failure(client, "no-prefix"), 30, "the unprefixed key's failure")
        refused_entry = failure(client, "no-prefix")
        assert refused_entry["reason"] == "config"
        assert "does not start with LLMGW_KEY_" in refused_entry["detail"]
        assert key not in json.dumps(refused_entry)
    finally:
        poller.cleanup()


def test_server_without_metrics_is_an_http_status_failure(llama: Any) -> None:
    server = llama()  # no --metrics: llama-server answers 501
    assert server.get("/metrics")[0] == 501
    report = check_json(server.url)
    assert not report["ok"] and report["reason"] == "http_status", report
    assert "501" in report["detail"]
