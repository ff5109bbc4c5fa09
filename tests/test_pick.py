"""pick() and `poller status` with vLLM sleep mode (the `sleeping` stats field)."""

from __future__ import annotations

import json

from rich.console import Console

from poller.cli.render import render
from poller.reader.pick import pick
from poller.reader.view import EndpointView, View


def entry(endpoint_id: str, **fields: str) -> EndpointView:
    raw = {
        "engine": "vllm",
        "running": "0",
        "waiting": "0",
        "interval_ms": "1000",
        "scraped_at_ms": "1000",
        "poller": "p",
        "token": "1",
        "seq": "1",
    } | fields
    return EndpointView(endpoint_id, state="fresh", age_ms=0, owner="p", token=1, raw=("", raw, {}))


def view_of(*entries: EndpointView) -> View:
    return View(1000, 1, {e.id: e for e in entries})


def test_pick_never_chooses_a_sleeping_endpoint() -> None:
    # the asleep one is the least loaded: it would win on numbers alone
    asleep = entry("asleep", sleeping="1")
    awake = entry("awake", running="9", waiting="2", sleeping="0")
    unsaid = entry("unsaid", running="9", waiting="3")
    assert pick(view_of(asleep, awake, unsaid)) == "awake"
    assert pick(view_of(asleep, unsaid)) == "unsaid"  # absent means unknown, not asleep
    assert pick(view_of(asleep)) is None
    assert pick(view_of(asleep, awake), model="x") == "awake"


def test_sleeping_reaches_the_view_and_the_status_table() -> None:
    v = view_of(entry("asleep", sleeping="1"), entry("awake", sleeping="0"))
    data = json.loads(json.dumps(v.to_dict()))
    by_id = {e["id"]: e for e in data["endpoints"]}
    assert by_id["asleep"]["stats"]["sleeping"] is True
    assert by_id["awake"]["stats"]["sleeping"] is False
    console = Console(width=200, record=True, color_system=None)
    console.print(render(v))
    rows = {line.split()[0]: line for line in console.export_text().splitlines()[2:]}
    assert "fresh asleep" in rows["asleep"]
    assert "asleep" not in rows["awake"].removeprefix("awake")
