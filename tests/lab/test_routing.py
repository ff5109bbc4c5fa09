"""`poller bench --section routing` (the one fleet and the virtual family): the report's
shape and the invariants that cannot flake.

Latency figures depend on the machine; what is checked here does not: every request is
answered, none goes to an endpoint that does not serve the model, every policy has its row,
and no process outlives the run.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import uuid

import pytest

from poller.errors import ConfigError
from poller_lab.routing import POLICIES, PolicyContext, RoutingConfig, register
from poller_lab.routing.fleet import FAILER, SLEEPER, capacity_per_s, cells
from poller_lab.routing.report import summarise
from poller_lab.routing.run import _policies
from tests.support.procs import leftovers, poller_cli

POLICY_SET = ("round-robin", "pick-deterministic", "picker", "oracle")


@pytest.mark.slow
@pytest.mark.redis_server
def test_quick_routing_bench_end_to_end() -> None:
    marker = f"ROUTING_TEST_{uuid.uuid4().hex}"
    args = ["bench", "--section", "routing", "--quick", "--single-fleet", "--json"]
    args += ["--duration", "3"]
    for policy in POLICY_SET:
        args += ["--policy", policy]
    result = poller_cli(*args, env={marker: "1"}, timeout_s=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [row["policy"] for row in report["rows"]] == list(POLICY_SET)
    assert report["sleeper"] == SLEEPER and report["failer"] == FAILER
    for row in report["rows"]:
        assert row["requests"] > 0
        assert row["unanswered"] == 0, row  # every request got an answer
        assert row["wrong_model"] == 0 and row["status_404"] == 0, row
        assert row["ok"] + row["errors"] == row["requests"]
        for key in ("p50_s", "p99_s", "max_s", "largest_queue", "cpu_per_pick_p99_us"):
            assert row[key] is not None, key
        assert set(row["view_showed_after_s"]) == {SLEEPER, FAILER}
    # The table went to stderr as the cells ran, one line per cell.
    assert sum(1 for line in result.stderr.splitlines() if line.strip().startswith(POLICY_SET)) == 4
    assert leftovers(marker) == []


def _family(*extra: str) -> dict[str, object]:
    args = [sys.executable, "-m", "poller", "bench", "--section", "routing", "--quick"]
    args += ["--family-only", "--json", *extra]
    result = subprocess.run(
        args, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, object] = json.loads(result.stdout)
    return report


def test_family_only_runs_the_family_alone_and_its_seed_is_the_arrivals() -> None:
    """``--family-only`` reports the family without starting a process; ``--seed`` picks
    the arrivals: the same seed gives the same figures (virtual time), another seed
    other ones."""
    first, again, other = _family("--seed", "7"), _family("--seed", "7"), _family("--seed", "8")
    assert first["seed"] == 7 and other["seed"] == 8
    assert first["rows"] == again["rows"]
    assert first["rows"] != other["rows"]
    rows = first["rows"]
    assert isinstance(rows, list) and len(rows) == first["cells"] and rows
    assert {"p50_x", "p99_x", "known_p50_x"} <= set(rows[0])


def test_unknown_policies_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="no-such-policy"):
        _policies(RoutingConfig(policies=("round-robin", "no-such-policy")))


def test_the_registry_takes_new_policies() -> None:
    class First:
        def __init__(self, ctx: PolicyContext) -> None:
            self.ctx = ctx

        async def prepare(self) -> None:
            return None

        def choose(self) -> str | None:
            return self.ctx.candidates[0]

        def started(self, endpoint_id: str) -> None:
            return None

        def finished(self, endpoint_id: str) -> None:
            return None

    register("test-first", First)
    try:
        ctx = PolicyContext("m", ["a", "b"], random.Random(1))
        assert POLICIES["test-first"].factory(ctx).choose() == "a"
        assert "test-first" in _policies(RoutingConfig())
    finally:
        del POLICIES["test-first"]


def test_the_grid_and_the_capacity() -> None:
    cfg = RoutingConfig()
    grid = cells(cfg, ["round-robin", "picker", "oracle"])
    at_top = [c for c in grid if c[2] == 0.9 and c[3] == 1.0]
    assert {c[1] for c in at_top} == {1, 4, 8} and len(at_top) == 9
    assert [c for c in grid if c[2] == 0.7] == [
        (p, 4, 0.7, 1.0) for p in ("round-robin", "picker", "oracle")
    ]
    assert [c for c in grid if c[3] != 1.0] == [("picker", 8, 0.9, 0.5), ("picker", 8, 0.9, 2.0)]
    # 2 fast (8 x 50/20) + 3 medium (4 x 50/20) + 1 slow (2 x 25/20): the two events excluded
    assert capacity_per_s(20.0) == pytest.approx(40 + 30 + 2.5)


def test_summary_counts_requests_after_the_view_showed_an_event() -> None:
    records = [
        {"sent_at": 10.0, "endpoint": SLEEPER, "status": 200, "latency_s": 0.5, "cpu_ns": 1000,
         "fallback": False},
        {"sent_at": 12.5, "endpoint": SLEEPER, "status": 503, "latency_s": 0.01, "cpu_ns": 2000,
         "fallback": False},
        {"sent_at": 13.0, "endpoint": "other-0", "status": 404, "latency_s": 0.01, "cpu_ns": 3000,
         "fallback": True},
    ]  # fmt: skip
    row = summarise(records, [SLEEPER], {SLEEPER: 12.0, FAILER: None}, {SLEEPER: 11.0}, 3)
    assert (row["after_view"], row["after_view_max_s"]) == (1, 0.5)
    assert (row["wrong_model"], row["status_404"], row["fallbacks"]) == (1, 1, 1)
    assert (row["ok"], row["errors"], row["unanswered"]) == (1, 2, 0)
    assert row["view_showed_after_s"] == {SLEEPER: 1.0}
    assert row["largest_queue"] == 3


def test_the_family_design_covers_every_level_and_the_target_cells() -> None:
    from poller_lab.routing.cells import LEVELS, MIXES, design, full_design

    cells = design()
    for factor, levels in LEVELS.items():
        assert {getattr(c, factor) for c in cells} == set(levels), factor
    for mix in MIXES:
        assert any(c.mix == mix and c.gateways == 8 and c.load == 0.9 for c in cells)
    assert len(full_design()) == 512


def test_one_gateway_on_exact_counts_picks_as_the_oracle() -> None:
    """Virtual time: the same arrivals, a machine-independent verdict."""
    from poller_lab.routing.cells import Cell
    from poller_lab.routing.family import run_cell

    cell = Cell("six", "exp", 0.0, 0.0, 1, 0.9, 1.0)
    oracle, picker = (run_cell(cell, p, 20.0, 3) for p in ("oracle", "picker"))
    assert picker["requests"] == oracle["requests"] > 0
    assert picker["p99_s"] <= oracle["p99_s"] * 1.1
    assert picker["commands_per_s_per_replica"] <= 20


def test_the_gateways_best_knowledge_is_the_oracle_without_outside_load() -> None:
    """``known`` counts every gateway's requests exactly; with no outside load that is
    each engine's true load, so it makes the oracle's every choice (its random tie-breaks
    too); with outside load it only sees what the pages showed, and differs."""
    from poller_lab.routing.cells import Cell
    from poller_lab.routing.family import run_cell

    cell = Cell("one-slot", "exp", 0.0, 1.0, 8, 0.9, 1.0)
    assert run_cell(cell, "known", 20.0, 3) == run_cell(cell, "oracle", 20.0, 3)
    outside = Cell("one-slot", "exp", 0.3, 1.0, 8, 0.9, 1.0)
    known, oracle = (run_cell(outside, p, 20.0, 3) for p in ("known", "oracle"))
    assert known["requests"] == oracle["requests"] > 0
    assert known["p50_s"] != oracle["p50_s"]


def test_heard_counts_beat_read_ones_on_one_slot_engines() -> None:
    """Virtual time, 8 gateways on 16 one-slot engines at 90 %: with the others' writes
    heard as they happen the picker is within 1.15x of the oracle's p50; reading them
    on each call (a user without the channel's right) double-books slots, with more
    calls. A machine-independent verdict: the same arrivals for all three."""
    from poller_lab.routing.cells import Cell
    from poller_lab.routing.family import run_cell

    cell = Cell("one-slot", "exp", 0.0, 1.0, 8, 0.9, 1.0)
    oracle, heard = (run_cell(cell, p, 20.0, 3) for p in ("oracle", "picker"))
    read = run_cell(cell, "picker", 20.0, 3, push=False)
    assert heard["requests"] == read["requests"] == oracle["requests"] > 0
    assert heard["p50_s"] <= 1.15 * oracle["p50_s"] < read["p50_s"]
    assert heard["commands_per_s_per_replica"] < read["commands_per_s_per_replica"] <= 20


def test_the_envoy_policy_is_opt_in_and_sends_through_the_cell_s_envoy() -> None:
    """`envoy-epp` (routing/envoy_policy.py): run only when named, the bench starts its
    Envoy and EPPs (``uses_envoy``), the engines get a port each (Envoy dials
    addresses), and the policy refuses to run without the gateway's URL."""
    from poller_lab.routing.envoy_policy import EnvoyPolicy
    from poller_lab.routing.fleet import engine_specs

    definition = POLICIES["envoy-epp"]
    assert definition.uses_envoy and not definition.default and not definition.uses_view
    assert {s["style"] for s in engine_specs("port")} == {"port"}
    assert {s["style"] for s in engine_specs()} == {"path"}
    ctx = PolicyContext(model="m", candidates=["a"], rng=random.Random(1))
    with pytest.raises(ValueError, match="gateway_url"):
        EnvoyPolicy(ctx)
    ctx.gateway_url = "http://127.0.0.1:1"
    assert EnvoyPolicy(ctx).url == "http://127.0.0.1:1/v1/chat/completions"
