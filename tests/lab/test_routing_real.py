"""The routing family on real processes and the peers' bench: what cannot flake.

Latencies depend on the machine; checked here: every policy of a cell gets the same
arrivals, the outside client and the heavy tails are what they say, the naive policy's
rule, the cell filter, the peers' pins and command lines, and (slow) the quick run
end to end: every request answered, every row there, no process left behind.
"""

from __future__ import annotations

import json
import random
import statistics
import uuid
from collections import Counter
from pathlib import Path

import pytest

from poller.errors import ConfigError
from poller_lab.peers.install import install, read_pins
from poller_lab.peers.routers import PEERS, Peer, _argv, peers_for
from poller_lab.routing.cellrun import gateway_records, summarise_cell
from poller_lab.routing.fleets import FLEETS, RealCell, arrivals, design, select
from poller_lab.routing.naive import Naive
from poller_lab.routing.policies import PolicyContext
from tests.support.procs import leftovers, poller_cli


def test_every_policy_of_a_cell_gets_the_same_arrivals_and_another_cell_others() -> None:
    cell = RealCell("six", 8, 0.9)
    first, again = arrivals(cell, 10.0, 1), arrivals(cell, 10.0, 1)
    assert first == again
    assert first != arrivals(cell, 10.0, 2)
    assert first != arrivals(RealCell("six", 8, 0.7), 10.0, 1)
    sent = [a for g in first.per_gateway for a in g]
    assert not first.outside
    assert {a.gateway for a in sent} == set(range(8))
    # 90 % of 70 requests a second, for 10 s
    assert 500 < len(sent) < 760


def test_the_outside_client_takes_its_share_spread_by_capacity() -> None:
    cell = RealCell("outside", 4, 0.9)
    arr = arrivals(cell, 200.0, 3)
    inside = sum(len(g) for g in arr.per_gateway)
    share = len(arr.outside) / (inside + len(arr.outside))
    assert 0.27 < share < 0.33
    targets = Counter(a.target for a in arr.outside)
    # slots 8, 8, 4, 4, 2, 2: the large engines get about four times the small ones'
    assert targets["outside-0"] > 3 * targets["outside-5"]


def test_heavy_tailed_sizes_keep_the_mean_and_stretch_the_tail() -> None:
    def sizes(fleet: str) -> list[int]:
        arr = arrivals(RealCell(fleet, 1, 0.9), 200.0, 5)
        return sorted(a.tokens for a in arr.per_gateway[0])

    exp, heavy = sizes("six"), sizes("heavy-tail")
    mean = FLEETS["six"].mean_tokens()
    assert abs(statistics.mean(heavy) - mean) < 0.1 * mean
    assert statistics.median(heavy) < statistics.median(exp)
    assert heavy[int(0.999 * len(heavy))] > exp[int(0.999 * len(exp))]


def test_the_cell_filter_takes_shell_patterns_and_refuses_what_matches_nothing() -> None:
    cells = design()
    assert [c.name() for c in select(cells, "lag:8:*")] == ["lag:8:0.9", "lag:8:0.7"]
    assert len(select(cells, "six:*,six:16:*")) == 4  # no cell twice
    assert select(cells, None) == cells
    with pytest.raises(ConfigError, match="matches no cell"):
        select(cells, "six:3:*")
    # A cell outside the design, named in full: a known fleet, 1-64 gateways, a load.
    named = select(cells, "six:4:0.9,lag:8:0.9")
    assert named == [RealCell("six", 4, 0.9), RealCell("lag", 8, 0.9)]
    for unknown in ("nope:4:0.9", "six:0:0.9", "six:4:2", "six:four:0.9"):
        with pytest.raises(ConfigError, match="matches no cell"):
            select(cells, unknown)


def test_the_naive_policy_takes_the_least_shared_in_flight_per_slot() -> None:
    ctx = PolicyContext(
        model="m",
        candidates=["big", "small"],
        rng=random.Random(1),
        options={"slots": {"big": 8, "small": 2}, "key": "k"},
    )
    naive = Naive(ctx)
    assert naive.choose() in ("big", "small")
    for _ in range(3):
        naive.started("big")
    assert naive.choose() == "small"  # 3/8 against 0/2
    naive.others.update({"small": 1})
    assert naive.choose() == "big"  # 3/8 against 1/2
    naive.finished("big")
    naive.others.update({"big": 3})
    assert naive.choose() == "small"  # 5/8 against 1/2


def test_a_cell_counts_the_gateways_requests_after_the_warm_up() -> None:
    def rec(at: float, endpoint: str, status: int = 200) -> dict[str, object]:
        return {"sent_at": at, "endpoint": endpoint, "status": status, "latency_s": 1.0,
                "first_s": 0.5, "cpu_ns": 2000, "fallback": False}  # fmt: skip

    seen = {"chosen": {"kv": 0.9, "running": 2, "waiting": 0, "age_ms": 300}, "saturated": 2}
    records = {
        "replica-0": [rec(99.0, "a"), rec(101.0, "a") | {"seen": seen}, rec(102.0, "b", 500)],
        "outside": [rec(101.0, "b")],
    }
    row = summarise_cell(gateway_records(records), start=98.0, warmup_s=2.0)
    assert (row["requests"], row["ok"], row["failed"]) == (2, 1, 1)
    assert row["split"] == {"a": 1, "b": 1}
    assert row["ttft_p99_by_endpoint_s"] == {"a": 0.5}
    assert row["view_at_pick"] == {
        "picks_seen": 1,
        "mean_saturated_pages": 2.0,
        "chosen_kv_ge_0.8": 1,
    }


def test_the_installer_refuses_an_unpinned_peer(tmp_path: Path) -> None:
    pins = tmp_path / "peers.txt"
    pins.write_text("# routers\nsmg==1.13.0\n", encoding="utf-8")
    assert read_pins(pins) == {"smg": "1.13.0"}
    with pytest.raises(ConfigError, match="vllm-router is not pinned"):
        install("vllm-router", tmp_path / "venvs", pins)
    for line in ("smg>=1.13", "smg", "smg==1.*", "smg==1.13.0 ; python_version>'3'"):
        pins.write_text(f"{line}\n", encoding="utf-8")
        with pytest.raises(ConfigError, match="not an exact pin"):
            install("smg", tmp_path / "venvs", pins)
    assert not (tmp_path / "venvs").exists()  # nothing was installed


def test_the_checkout_pins_every_peer_exactly() -> None:
    from poller_lab.peers.install import constraints_file

    pins = read_pins(constraints_file())
    assert {p.package for p in PEERS} <= set(pins)


def test_peer_command_lines_stay_on_loopback_with_a_metrics_port_each() -> None:
    venv = Path("/venv")
    smg = _argv(Peer("smg", "cache_aware"), venv, 1000, 1001, ["http://127.0.0.1:9"])
    router = _argv(Peer("vllm-router", "power_of_two"), venv, 2000, 2001, ["u"])
    assert smg[:2] == ["/venv/bin/smg", "launch"]
    for argv, port in ((smg, "1001"), (router, "2001")):
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        assert argv[argv.index("--prometheus-port") + 1] == port
    assert smg[smg.index("--prometheus-host") + 1] == "127.0.0.1"
    assert [p.name() for p in peers_for(1)] == [p.name() for p in PEERS if not p.per_gateway]
    assert len(peers_for(8)) == len(PEERS)


@pytest.mark.slow
@pytest.mark.redis_server
def test_quick_real_family_end_to_end_with_the_virtual_twin() -> None:
    marker = f"ROUTING_FAMILY_TEST_{uuid.uuid4().hex}"
    args = ["bench", "--section", "routing", "--quick", "--json", "--compare"]
    result = poller_cli(*args, env={marker: "1"}, timeout_s=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    (row,) = report["rows"]
    assert row["cell"] == "six:2:0.7"
    assert set(row["policies"]) == {"oracle", "picker", "naive"}
    requests = {r["requests"] for r in row["policies"].values()}
    assert len(requests) == 1  # the same arrivals for every policy
    for name, r in row["policies"].items():
        assert r["requests"] > 0 and r["failed"] == 0, (name, r)
        assert r["p99_s"] is not None and r["ttft_p99_s"] is not None
        assert set(r["split"]) <= set(FLEETS["six"].ids())
    assert row["picker_p99_x"] is not None and row["naive_p99_x"] is not None
    assert report["headline"]["cell"] == "six:2:0.7"
    (twin,) = report["compare"]
    assert twin["virtual_cell"].startswith("six exp out=0 lag=0 R=2 load=0.7")
    assert "family" in report  # the virtual-time family ran first
    assert leftovers(marker) == []


@pytest.mark.slow
@pytest.mark.envoy
@pytest.mark.redis_server
def test_a_family_cell_through_envoy_and_an_epp_per_gateway() -> None:
    """``--policy envoy-epp``: the cell's gateways send through one Envoy in front of a
    ``poller epp`` each; every request answered by an engine of the fleet, and nothing
    (Envoy, the EPPs, the gateways) left running."""
    from tests.support.envoyproc import envoy_binary

    envoy_binary()  # the install hint when it is missing
    marker = f"ROUTING_FAMILY_TEST_{uuid.uuid4().hex}"
    args = ["bench", "--section", "routing", "--quick", "--cells", "six:2:0.7",
            "--policy", "oracle", "--policy", "envoy-epp", "--json"]  # fmt: skip
    result = poller_cli(*args, env={marker: "1"}, timeout_s=600)
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)["rows"]
    assert set(row["policies"]) == {"oracle", "envoy-epp"}
    through = row["policies"]["envoy-epp"]
    assert through["requests"] == row["policies"]["oracle"]["requests"] > 0
    assert through["failed"] == 0 and through["ttft_p99_s"] is not None
    assert set(through["split"]) <= set(FLEETS["six"].ids())
    assert row["envoy-epp_p99_x"] is not None
    assert "envoy-epp" in result.stderr  # its figures in the printed row
    assert leftovers(marker) == []


def test_the_prefix_engines_behind_the_peers_have_a_port_each_and_an_occupancy_gauge() -> None:
    from poller_lab.peers.prefix import PREFIX_PEERS, _specs
    from poller_lab.prefix.fleet import engine_specs

    specs = _specs("cached")
    assert [s["id"] for s in specs] == [s["id"] for s in engine_specs()]
    assert {(s["style"], s["kv_usage"]) for s in specs} == {("port", "cached")}
    assert {p.policy for p in PREFIX_PEERS} == {"cache_aware"}


def test_router_ports_are_distinct_and_below_the_ephemeral_range() -> None:
    from poller_lab.peers.routers import listen_port

    ports = [listen_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(20000 <= p < 32000 for p in ports)
