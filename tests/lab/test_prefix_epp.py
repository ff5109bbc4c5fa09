"""The prefix bench's ``envoy-epp`` policy: gateways send to one Envoy, whose ``poller epp``
replicas choose (lab/poller_lab/prefix/gateway.py, run.py).

The fast tests check the wiring in-process (a stand-in for Envoy); the ``envoy`` ones run
the real chain: Envoy, ``poller epp``, the simulator's prefix caches. What they check does
not depend on the machine's speed: where each turn went and what every request answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from poller.errors import ConfigError
from poller_lab.prefix import fleet
from poller_lab.prefix.fleet import DEFAULT_POLICIES, POLICIES, PrefixConfig
from poller_lab.prefix.report import targets
from poller_lab.prefix.run import _check
from tests.support.procs import leftovers

MODEL = fleet.MODEL


def test_envoy_epp_runs_when_named_and_gives_the_engines_a_port_each() -> None:
    assert "envoy-epp" in POLICIES and "envoy-epp" not in DEFAULT_POLICIES
    assert PrefixConfig().policies == DEFAULT_POLICIES
    _check(PrefixConfig(policies=("envoy-epp", "prefix-shared")))  # known: no error
    with pytest.raises(ConfigError, match="envoy-eep"):
        _check(PrefixConfig(policies=("envoy-eep",)))
    assert {s["style"] for s in fleet.engine_specs("port")} == {"port"}
    assert {s["style"] for s in fleet.engine_specs()} == {"path"}


def test_bench_flags_choose_the_gateway_counts_and_the_workloads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from click.testing import CliRunner

    import poller_lab.prefix.run
    from poller_lab.cli import bench

    seen: list[PrefixConfig] = []

    def run(cfg: PrefixConfig, redis_url: str | None, out: Any) -> dict[str, Any]:
        seen.append(cfg)
        return {"elapsed_s": 0.0}

    monkeypatch.setattr(poller_lab.prefix.run, "run_prefix", run)
    args = ["--section", "prefix", "--policy", "envoy-epp", "--gateways", "4", "--gateways",
            "1", "--workload", "prefix-heavy"]  # fmt: skip
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 0, result.output
    (cfg,) = seen
    assert (cfg.policies, cfg.gateways, cfg.workloads) == (
        ("envoy-epp",), (1, 4), ("prefix-heavy",),
    )  # fmt: skip
    assert cfg.duration_s == PrefixConfig().duration_s  # the defaults otherwise
    result = CliRunner().invoke(bench, ["--section", "prefix", "--gateways", "0"])
    assert result.exit_code == 2 and "--gateways" in result.output


@contextlib.asynccontextmanager
async def _serving(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_the_gateway_sends_through_envoy_and_names_the_engine_that_answered(
    tmp_path: Path,
) -> None:
    """A stand-in for Envoy: an engine's streamed answer naming itself
    (``x-sim-endpoint``), or, for a prompt saying so, Envoy's own 503 (an EPP refusal)."""
    from poller_lab.prefix.gateway import serve

    received: list[dict[str, Any]] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        received.append(body)
        if body["messages"][-1]["content"] == "refuse":
            return web.json_response({"error": {"code": "not_fresh"}}, status=503)
        out = web.StreamResponse(headers={"x-sim-endpoint": "medium-1"})
        await out.prepare(request)
        await out.write(b"data: first\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    envoy = web.Application()
    envoy.router.add_post("/v1/chat/completions", chat)
    ready = tmp_path / "ready"
    async with _serving(envoy) as envoy_url:
        cfg = {"policy": "envoy-epp", "seed": 1, "model": MODEL,
               "candidates": fleet.candidates(), "urls": {}, "admin_url": "http://127.0.0.1:1",
               "redis_url": "redis://127.0.0.1:1/0", "namespace": "prefix",
               "ready": str(ready), "envoy_url": envoy_url}  # fmt: skip
        stop = asyncio.Event()
        task = asyncio.create_task(serve(cfg, stop))
        try:
            while not ready.exists():  # the gateway's own signal that it listens
                assert not task.done(), task
                await asyncio.sleep(0.01)
            gateway = f"http://127.0.0.1:{ready.read_text()}"
            async with aiohttp.ClientSession() as http:
                answers = []
                for content in ("hello", "refuse"):
                    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
                            "max_tokens": 4, "stream": True}  # fmt: skip
                    async with http.post(gateway + "/v1/chat/completions", json=body) as r:
                        answers.append((r.status, r.headers["x-gateway-endpoint"], await r.read()))
                async with http.get(gateway + "/stats") as r:
                    stats = await r.json()
        finally:
            stop.set()
            await task
    assert answers[0] == (200, "medium-1", b"data: first\n\ndata: [DONE]\n\n")
    assert answers[1][:2] == (503, "-")
    assert [b["messages"][-1]["content"] for b in received] == ["hello", "refuse"]
    assert received[0]["model"] == MODEL and received[0]["stream"] is True
    # The EPP's refusal is the gateway's fallback; the choice's CPU is the EPP's, not here.
    assert (stats["requests"], stats["fallbacks"], stats["errors"]) == (2, 1, 1)
    assert stats["cpu_ns"] == [] and stats["placements"] == {}


def test_targets_hold_the_most_epp_replicas_against_one_and_against_prefix_shared() -> None:
    def row(policy: str, g: int, hit: float) -> dict[str, Any]:
        return {"policy": policy, "gateways": g, "workload": "prefix-heavy", "load": 0.9,
                "hit_rate": hit}  # fmt: skip

    rows = [row("envoy-epp", 1, 0.70), row("envoy-epp", 4, 0.68), row("prefix-shared", 4, 0.74)]
    text = "\n".join(targets(rows, (1, 4)))
    assert ("met           prefix-heavy, 4 EPP replicas, load 0.9: envoy-epp hit rate vs "
            "0.95x 1 replica's: 0.68 >= 0.665") in text  # fmt: skip
    assert ("MISSED        prefix-heavy, 4 EPP replicas, load 0.9: envoy-epp hit rate vs "
            "0.95x prefix-shared's at 4 gateways: 0.68 >= 0.703") in text  # fmt: skip
    # Without an envoy-epp row the run measured none: no lines about it.
    assert "EPP" not in "\n".join(targets(rows[2:], (1, 4)))


@pytest.mark.envoy
@pytest.mark.redis_server
@pytest.mark.timeout(300)
def test_through_envoy_every_turn_goes_where_its_conversation_is_cached(
    tmp_path: Path,
) -> None:
    """The bench's own gateway and EPP start-up (``_Bench.start_gateways``), one EPP:
    each conversation's later turns go to the engine of its first, which holds its
    prefix: the EPP reads the prompt from the body Envoy buffered and routes on it.
    (Routed on load alone, the turns of an idle fleet spread over its engines.)"""
    from poller_lab.bench_fleet import sync_registry
    from poller_lab.embedded import start_sim
    from poller_lab.prefix.driver import drive
    from poller_lab.prefix.run import NS, _Bench, _wait_fresh
    from poller_lab.prefix.workload import Shape, conversations
    from tests.support.envoyproc import envoy_binary
    from tests.support.procs import PollerProc
    from tests.support.redisproc import RedisProcess

    envoy_binary()  # skips, or fails under `make test`, when Envoy is not installed
    redis = RedisProcess().start()
    sim = poller = None
    procs: list[Any] = []
    try:
        specs = tmp_path / "specs.json"
        specs.write_text(json.dumps(fleet.engine_specs("port")))
        sim, admin, registry = start_sim(
            tmp_path, 1, "vllm", cpu=None, extra=["--spec-file", str(specs)]
        )
        asyncio.run(sync_registry(redis.url, NS, registry))
        # A long interval: a page stays fresh for two, so no engine goes stale between
        # two turns unless a scrape is 10 s late (the picks rest on the EPP's own
        # counts); the first scrape comes within one.
        poller = PollerProc("p0", redis.url, NS, tmp_path, interval_s=10.0).start()
        _wait_fresh(redis.url, len(fleet.ENGINES))
        bench = _Bench(PrefixConfig(), tmp_path, redis.url, admin, {})
        bench.urls = {e["id"]: e["url"] for e in json.loads(registry.read_text())}
        procs, gateways = bench.start_gateways("envoy-epp", 1)
        shape = Shape(system_prompts=2, system_chars=1200, document_chars=1200,
                      question_chars=100, min_turns=3, max_turns=3, answer_tokens=8.0,
                      think_s=0.0)  # fmt: skip
        records = []
        for conv in conversations("prefix-heavy", 6, 7, shape):  # one at a time: idle
            done, cut = asyncio.run(drive([conv], [0.0], gateways, MODEL, time.monotonic()))
            assert cut == 0
            records += done
    finally:
        for p in procs:
            p.stop()
        if poller is not None:
            poller.cleanup()
        if sim is not None:
            sim.stop()
        redis.cleanup()
    assert len(records) == 18 and all(r["status"] == 200 for r in records), records
    by_conversation: dict[str, list[str]] = {}
    for r in sorted(records, key=lambda r: (r["conversation"], r["turn"])):
        by_conversation.setdefault(r["conversation"], []).append(r["endpoint"])
    for conversation, endpoints in by_conversation.items():
        assert endpoints[0] in fleet.candidates(), endpoints
        assert endpoints == [endpoints[0]] * 3, (conversation, endpoints)


@pytest.mark.slow
@pytest.mark.envoy
@pytest.mark.redis_server
@pytest.mark.timeout(660)  # the subprocess's own 600 s bound fails first
def test_quick_prefix_bench_through_envoy_end_to_end() -> None:
    """``poller bench --section prefix --policy envoy-epp``: an Envoy and one EPP per
    gateway for each gateway count, every request answered by an engine of the fleet,
    the targets printed, no process left behind."""
    from tests.support.envoyproc import envoy_binary

    envoy_binary()
    marker = f"PREFIX_EPP_TEST_{uuid.uuid4().hex}"
    args = [sys.executable, "-m", "poller", "bench", "--section", "prefix", "--quick", "--json",
            "--policy", "envoy-epp", "--gateways", "1", "--gateways", "2",
            "--workload", "prefix-heavy"]  # fmt: skip
    clean = {k: v for k, v in os.environ.items() if not k.startswith("POLLER_")}
    result = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
        env={**clean, marker: "1"},
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["config"]["gateways"] == [1, 2]
    assert [(r["policy"], r["gateways"], r["workload"]) for r in report["rows"]] == [
        ("envoy-epp", 1, "prefix-heavy"),
        ("envoy-epp", 2, "prefix-heavy"),
    ]
    for row in report["rows"]:
        assert row["requests"] > 0 and row["errors"] == 0 and row["fallbacks"] == 0, row
        assert set(row["per_endpoint"]) <= set(fleet.candidates()), row
        assert row["hit_rate"] is not None and row["hit_rate"] > 0, row
        assert row["pick_cpu_p99_us"] is None  # the EPP's, not the gateway's
    lines = "\n".join(report["targets"])
    assert "2 EPP replicas, load 0.7: envoy-epp hit rate vs 0.95x 1 replica's" in lines
    assert leftovers(marker) == []
