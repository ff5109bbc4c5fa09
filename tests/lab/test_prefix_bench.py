"""`poller bench --section prefix`: the report's shape and the invariants that cannot flake.

Latency figures depend on the machine; what is checked here does not: every cell has its
row, every request counted is answered, the hit rates come from the engines' counters, a
policy the installed reader cannot run says so, and no process outlives the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import replace
from types import SimpleNamespace

import pytest

from poller.errors import ConfigError
from poller_lab.prefix.driver import gateway_for
from poller_lab.prefix.fleet import DEFAULT_POLICIES, PrefixConfig, cells
from poller_lab.prefix.gateway import sharing_counters
from poller_lab.prefix.policies import oracle_choice
from poller_lab.prefix.report import summarise, targets
from poller_lab.prefix.run import _check
from tests.support.procs import leftovers


@pytest.mark.slow
@pytest.mark.redis_server
@pytest.mark.timeout(960)  # the subprocess's own 900 s bound fails first
def test_quick_prefix_bench_end_to_end() -> None:
    marker = f"PREFIX_TEST_{uuid.uuid4().hex}"
    # Three of the five policies (the blind one, the shared prefix picker, the oracle):
    # the picker's load-only choice is tested by the routing bench's own run.
    policies = ("round-robin", "prefix-shared", "oracle")
    args = [sys.executable, "-m", "poller", "bench", "--section", "prefix", "--quick", "--json"]
    args += [a for p in policies for a in ("--policy", p)]
    result = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=900,
        stdin=subprocess.DEVNULL,
        env={**os.environ, marker: "1"},
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    cfg = replace(PrefixConfig.quick(), policies=policies)
    assert [(r["policy"], r["gateways"], r["workload"], r["load"]) for r in report["rows"]] == [
        tuple(c) for c in cells(cfg)
    ]
    for row in report["rows"]:
        assert row["requests"] > 0 and row["errors"] == 0, row
        assert row["fallbacks"] == 0, row
        assert set(row["per_endpoint"]) <= {"large-0", "large-1", "medium-0", "medium-1",
                                            "small-0", "small-1"}  # fmt: skip
        for key in ("ttft_p50_s", "ttft_p99_s", "p50_s", "p99_s", "hit_rate"):
            assert row[key] is not None, (key, row)
        assert row["ttft_p50_s"] <= row["p50_s"]
        if row["workload"] == "no-prefix":
            assert row["hit_rate"] == 0.0, row  # nothing shared: the counters say so
        sharing = row["policy"] == "prefix-shared"  # the policy with a cached view
        commands = row["redis_commands_per_s_per_replica"]
        assert (commands is not None and 0 < commands <= 20) if sharing else commands is None
    heavy = [r for r in report["rows"] if r["workload"] == "prefix-heavy"]
    assert heavy and all(r["hit_rate"] > 0 for r in heavy)
    # Placements were shared through Redis: written and read back by the gateways.
    assert all(r["redis_bytes_per_replica"] for r in heavy if r["policy"] == "prefix-shared")
    # The oracle reads the caches: it finds more cached blocks than the blind rotation.
    for g in cfg.gateways:
        by = {r["policy"]: r for r in heavy if r["gateways"] == g}
        assert by["oracle"]["hit_rate"] > by["round-robin"]["hit_rate"], by
    assert len(report["targets"]) == len(targets(report["rows"], cfg.gateways))
    assert "capacity" in result.stderr and "targets:" in result.stderr
    assert leftovers(marker) == []


def test_unknown_policies_and_workloads_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="no-such-policy"):
        _check(PrefixConfig(policies=("picker", "no-such-policy")))
    with pytest.raises(ConfigError, match="prefixy"):
        _check(PrefixConfig(workloads=("prefixy",)))


def test_cells_group_by_policy_and_gateways() -> None:
    grid = cells(PrefixConfig())
    assert len(grid) == len(DEFAULT_POLICIES) * 2 * 2 * 2
    firsts = [c[:2] for c in grid]
    runs = [k for i, k in enumerate(firsts) if i == 0 or firsts[i - 1] != k]
    assert len(runs) == len(set(runs)) == len(DEFAULT_POLICIES) * 2  # one set of gateways each


def test_turns_of_a_conversation_spread_over_the_gateways() -> None:
    landed = {gateway_for("c1-7", turn, 8) for turn in range(40)}
    assert len(landed) >= 6
    assert gateway_for("c1-7", 3, 8) == gateway_for("c1-7", 3, 8)


def test_the_oracle_takes_the_least_expected_time_to_first_token() -> None:
    def engine(cached: int, running: int, waiting: int = 0, serving: bool = True) -> dict:
        return {"cached_tokens": cached, "running": running, "waiting": waiting, "capacity": 2,
                "speed_tps": 50.0, "prefill_tps": 1000.0, "mean_service_s": 1.0,
                "serving": serving}  # fmt: skip

    answer = {"prompt_tokens": 2000, "endpoints": {"a": engine(0, 0), "b": engine(1900, 1)}}
    assert oracle_choice(answer, 16) == "b"  # a free slot and the prompt cached
    # b full with two waiting: 1.5 s of wait beats 2 s of prefill on a.
    answer["endpoints"]["b"] = engine(1900, 2, 2)
    assert oracle_choice(answer, 16) == "b"
    answer["endpoints"]["b"] = engine(1900, 2, 4)  # 2.5 s of wait: a's prefill is sooner
    assert oracle_choice(answer, 16) == "a"
    answer["endpoints"]["a"] = engine(0, 0, serving=False)
    assert oracle_choice(answer, 16) == "b"
    answer["endpoints"]["b"] = engine(0, 0, serving=False)
    assert oracle_choice(answer, 16) is None


def test_the_summary_counts_after_the_warm_up_and_diffs_the_counters() -> None:
    records = [
        {"sent_s": 0.5, "endpoint": "a", "status": 200, "ttft_s": 9.0, "latency_s": 9.0},
        {"sent_s": 2.0, "endpoint": "a", "status": 200, "ttft_s": 0.1, "latency_s": 1.0},
        {"sent_s": 3.0, "endpoint": "b", "status": 502, "ttft_s": None, "latency_s": 0.2},
    ]
    counters = ({"a": (100, 400), "b": (0, 0)}, {"a": (700, 1400), "b": (0, 600)})
    stats = [{"cpu_ns": [2000, 4000], "fallbacks": 1}, {"cpu_ns": [], "fallbacks": 0}]
    placements = (
        [{"commands": 10, "bytes_written": 100, "bytes_read": 50}, {"commands": 0}],
        [{"commands": 30, "bytes_written": 300, "bytes_read": 150}, {"commands": 20}],
    )
    row = summarise(records, 1.0, counters, stats, placements, 2.0)
    assert (row["requests"], row["ok"], row["errors"]) == (2, 1, 1)
    assert row["ttft_p50_s"] == 0.1 and row["p99_s"] == 1.0  # the warm-up's 9 s left out
    assert row["hit_rate"] == 0.375  # 600 hits of 1,600 queries over the window
    assert row["fallbacks"] == 1 and row["per_endpoint"] == {"a": 1}
    # (20 + 20) commands over 2 s and 2 replicas; bytes: only the first has byte counters.
    assert row["redis_commands_per_s_per_replica"] == 10.0
    assert row["redis_bytes_per_replica"] is None
    empty = summarise(records, 1.0, counters, stats, ([{}, {}], [{}, {}]), 2.0)
    assert empty["redis_commands_per_s_per_replica"] is None


def test_sharing_counters_are_the_exchange_calls_and_the_placements_bytes() -> None:
    from poller.reader import Router, ViewCache

    router = Router(ViewCache())
    assert sharing_counters(router) == {}  # no sharing: nothing to count
    router.exchange = SimpleNamespace(calls=7)  # type: ignore[assignment]
    router.placements.outbox.bytes_written, router.placements.bytes_read = 40, 12
    counters = sharing_counters(router)
    assert counters["commands"] == 7
    assert (counters["bytes_written"], counters["bytes_read"]) == (40, 12)


def test_targets_say_met_missed_and_not_measured() -> None:
    def row(policy: str, g: int, workload: str = "prefix-heavy", **figures: float) -> dict:
        return {"policy": policy, "gateways": g, "workload": workload, "load": 0.7,
                **figures}  # fmt: skip

    rows = [
        row("prefix-shared", 8, hit_rate=0.8, ttft_p50_s=0.1, p99_s=2.0, pick_cpu_p99_us=30.0),
        row("prefix-shared", 1, hit_rate=0.82),
        row("oracle", 8, hit_rate=0.85),
        row("picker", 8, ttft_p50_s=0.5, p99_s=1.9),
    ]
    lines = targets(rows, (1, 8))
    text = "\n".join(lines)
    assert "met           prefix-heavy, 8 gateways, load 0.7: shared hit rate vs 0.95x" in text
    assert "met           prefix-heavy, 8 gateways, load 0.7: shared TTFT p50" in text
    assert "MISSED        prefix-heavy, 8 gateways, load 0.7: shared request p99" in text
    assert "not measured  prefix-heavy, 8 gateways, load 0.7: own placements" in text
    assert "not measured  no-prefix, 1 gateways" in text
    assert lines[-1].startswith("  met") and "CPU p99" in lines[-1]
    # A run of 8 gateways alone has no fewer gateways to hold its hit rate against.
    alone = "\n".join(targets([r for r in rows if r["gateways"] == 8], (8,)))
    assert "not measured  prefix-heavy, 8 gateways, load 0.7: shared hit rate vs 0.95x" in alone


async def test_the_driver_sends_every_turn_in_order_through_the_hashed_gateway() -> None:
    import time

    from aiohttp import web

    from poller_lab.prefix.driver import drive
    from poller_lab.prefix.workload import Shape, conversations

    seen: list[tuple[int, int]] = []

    def app(index: int) -> web.Application:
        async def chat(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            seen.append((index, len(body["messages"])))
            out = web.StreamResponse(headers={"x-gateway-endpoint": f"e{index}"})
            await out.prepare(request)
            await out.write(b"data: first\n\n")
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
            return out

        a = web.Application()
        a.router.add_post("/v1/chat/completions", chat)
        return a

    runners = [web.AppRunner(app(i)) for i in range(3)]
    urls = []
    for runner in runners:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    try:
        shape = Shape(system_chars=100, document_chars=100, question_chars=20, think_s=0.0,
                      min_turns=3, max_turns=3)  # fmt: skip
        convs = conversations("prefix-heavy", 4, 1, shape)
        records, cut = await drive(convs, [0.0] * 4, urls, "m", time.monotonic())
        none, all_cut = await drive(convs, [0.0] * 4, urls, "m", time.monotonic(), -1.0)
    finally:
        for runner in runners:
            await runner.cleanup()
    assert cut == 0 and len(records) == 12
    for r in records:
        g = gateway_for(r["conversation"], r["turn"], 3)
        assert r["gateway"] == g and r["endpoint"] == f"e{g}" and r["status"] == 200
        assert 0 <= r["ttft_s"] <= r["latency_s"]
    for conv in convs:
        turns = [r["turn"] for r in records if r["conversation"] == conv.id]
        assert turns == [0, 1, 2]  # one after the other
    assert sorted(n for _, n in seen) == sorted([2, 4, 6] * 4)
    assert none == [] and all_cut == 12  # past the deadline nothing is sent
