"""The prefix bench's diagnostic trace: how a traced request is classified and summed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from poller_lab.prefix.trace import classify, summarise


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
