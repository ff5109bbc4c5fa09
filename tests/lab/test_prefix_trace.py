"""The prefix bench's diagnostic trace: how a traced request is classified and summed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from poller_lab.prefix.trace import at_pick, classify, summarise


def request(chosen: str, truth: dict[str, int], holders: list[list[Any]], ref: str) -> dict:
    return {
        "t": 10.0,
        "group": "gateways-1",
        "chosen": chosen,
        "truth": {i: [cached, 0] for i, cached in truth.items()},
        "pick": {"ref": ref, "holders": holders, "placed": {}},
    }


def test_a_request_is_classified_against_the_true_longest_holder() -> None:
    moved = request("a", {"a": 1024, "b": 0}, [["a", 8, "chosen", 1.0]], ref="b")
    assert classify(moved) == ("chosen = true holder (affinity moved it)", 0)
    turned_down = request("b", {"a": 1024, "b": 0}, [["a", 8, "over-bound", 9.0]], ref="b")
    assert classify(turned_down) == ("true holder known: over-bound", 1024)
    evicted = request("a", {"a": 0, "b": 512}, [["a", 8, "chosen", 1.0]], ref="b")
    assert classify(evicted) == ("table's holder evicted in truth", 512)
    assert classify(request("a", {"a": 0, "b": 0}, [], ref="a"))[0] == "nothing cached anywhere"


def test_the_summary_counts_requests_after_the_warm_up_per_cell(tmp_path: Path) -> None:
    cell = {"group": "gateways-1", "t0": 0.0, "warmup_s": 5.0, "label": "seed 1, 8 gateways"}
    (tmp_path / "cells.jsonl").write_text(json.dumps(cell) + "\n")
    early = {**request("b", {"a": 1024, "b": 0}, [], ref="b"), "t": 1.0}
    rows = [early, request("b", {"a": 1024, "b": 0}, [["a", 8, "over-bound", 9.0]], ref="b")]
    (tmp_path / "gw-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = summarise(tmp_path)
    assert "seed 1, 8 gateways: 1 requests" in text
    assert "true holder known: over-bound" in text and "never placed" not in text


def test_the_summary_says_what_the_chosen_engine_lacked_and_whether_it_was_full(
    tmp_path: Path,
) -> None:
    """Per cell: the prompt tokens the chosen engine did not hold at the pick (its
    prefill), the requests sent to an engine whose every slot was taken, and the time
    to the engine's first chunk past the prefill."""
    cell = {"group": "gateways-1", "t0": 0.0, "warmup_s": 0.0, "label": "seed 1, 8 gateways"}
    (tmp_path / "cells.jsonl").write_text(json.dumps(cell) + "\n")
    rows = []
    for lacked, queue in ((0, 0), (400, 2), (4000, 8), (3000, 8)):
        r = request("large-0", {"large-0": 4000 - lacked, "small-0": 0}, [], ref="large-0")
        r["truth"]["large-0"][1] = queue  # running + waiting; large-0 has 8 slots
        r["truth"]["small-0"][1] = 1 if lacked == 4000 else 2  # small-0 has 2
        rows.append({**r, "tokens": 4000, "first_s": lacked / 4000 + queue / 8})
    (tmp_path / "gw-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = summarise(tmp_path)
    assert "lacked: p50 3000 (0.750 s of prefill), p90 4000 (1.000 s)" in text
    assert "more than 1,000 on every engine: 2 of 4" in text
    assert "every slot taken: 2 of 4 (1 while another had one free)" in text
    assert "first chunk after the forward: p50 1.750 s;" in text
    assert "(a wait for a slot, the transport): p50 1.000 s, p90 1.000 s" in text
    assert at_pick({**rows[0], "truth": None}) is None


def test_the_trace_reads_the_parts_of_the_picker_s_own_estimate() -> None:
    """``_parts`` reads the fleet load model's score closure by name
    (``FleetLoadModel.scorer``): a renamed variable there must fail here, not in the
    middle of a traced bench run."""
    from types import SimpleNamespace

    from poller.reader.load.fleet import FleetLoad
    from poller.reader.load.local import LocalLoad
    from poller_lab.prefix.trace import _parts
    from tests.support.routers import fleet_score

    local, fleet = LocalLoad(), FleetLoad("g1")
    fleet.attach(local)
    local.started("a")
    fleet.extra = fleet.outside = {"a": 2.0}
    slots = {"a": SimpleNamespace(id="a", requests=5, weight=2.0)}
    slots["b"] = SimpleNamespace(id="b", requests=3, weight=1.0)
    parts = _parts(fleet_score(local, fleet), SimpleNamespace(slots=slots))
    assert parts == {"a": [2.0, 1, 2.0, 0.0, 1.0, 0.0], "b": [3, 0, 1.0, 0.0, 1.0, 0.0]}
