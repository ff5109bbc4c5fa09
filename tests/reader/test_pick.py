"""The picker on hand-built views and caches: eligibility, unknown signals, LoRA order,
saturation, local correction, the outage rule, the herd; and `poller status` with vLLM
sleep mode. Every random choice is seeded: the verdicts are exact."""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter

import pytest
from rich.console import Console

from poller.cli.render import render
from poller.errors import ConfigError
from poller.reader import ViewCache
from poller.reader.legacy import Picker, pick
from poller.reader.load.local import LocalLoad, clamp
from poller.reader.routing.indexer import FOLLOW_IDLE_MS
from poller.reader.view import EndpointView, Timing, View

NOW_MS = 1_000_000


def raw_stats(**fields: str) -> dict[str, str]:
    return {
        "engine": "vllm",
        "running": "0",
        "waiting": "0",
        "interval_ms": "1000",
        "scraped_at_ms": str(NOW_MS - 500),
        "poller": "p",
        "token": "1",
        "seq": "1",
    } | fields


def entry(endpoint_id: str, state: str = "fresh", **fields: str) -> EndpointView:
    """An endpoint as a snapshot judged it (no timing: its state is all there is)."""
    return EndpointView(
        endpoint_id,
        state=state,  # type: ignore[arg-type]
        age_ms=500,
        owner="p",
        token=1,
        raw=("", raw_stats(**fields), {}),
    )


def timed(
    endpoint_id: str, age_ms: int = 500, failing: bool = False, **fields: str
) -> EndpointView:
    """An endpoint with its timing (fresh for 2 intervals of 1 s after its scrape)."""
    scraped = NOW_MS - age_ms
    timing = Timing(scraped, 2000, scraped + 1 if failing else None, failing)
    state, age = timing.state_at(NOW_MS)
    raw = raw_stats(scraped_at_ms=str(scraped), **fields)
    return EndpointView(
        endpoint_id, state=state, age_ms=age, owner="p", token=1, raw=("", raw, {}), timing=timing
    )


def view_of(*entries: EndpointView, **kw: object) -> View:
    return View(NOW_MS, 1, {e.id: e for e in entries}, **kw)  # type: ignore[arg-type]


def picks(picker: Picker, view: object, n: int = 200, **kw: object) -> Counter[str | None]:
    return Counter(picker.pick(view, **kw) for _ in range(n))  # type: ignore[arg-type]


# --- eligibility ---------------------------------------------------------------------------


def test_only_fresh_awake_working_endpoints_are_eligible() -> None:
    v = view_of(
        entry("ok", running="30"),
        entry("old", state="stale"),
        entry("broken", state="failing"),
        entry("never", state="unknown"),
        entry("asleep", sleeping="1"),
    )
    assert picks(Picker(rng=random.Random(1)), v) == {"ok": 200}
    assert (
        Picker().pick(view_of(entry("old", state="stale"), entry("asleep", sleeping="1"))) is None
    )
    assert Picker().pick(view_of()) is None


def test_pick_never_chooses_a_sleeping_endpoint() -> None:
    # the asleep one is the least loaded: it would win on numbers alone
    asleep = entry("asleep", sleeping="1")
    awake = entry("awake", running="9", waiting="2", sleeping="0")
    unsaid = entry("unsaid", running="9", waiting="3")
    assert pick(view_of(asleep, awake, unsaid)) == "awake"
    assert pick(view_of(asleep, unsaid)) == "unsaid"  # absent means unknown, not asleep
    assert pick(view_of(asleep)) is None
    assert pick(view_of(asleep, awake), model="x") is None  # never another model


def test_a_model_nothing_serves_gets_none_never_another_model() -> None:
    v = view_of(
        entry("llama", models="llama"),
        entry("tgi", engine="tgi", models="mistral"),
        entry("lora", models="llama", lora_running="sql-lora"),
        entry("loading", models="llama", lora_waiting="sql-lora"),
    )
    picker = Picker(rng=random.Random(2))
    assert picks(picker, v, model="no/such-model") == {None: 200}
    assert pick(v, model="no/such-model") is None
    assert picks(picker, v, model="mistral") == {"tgi": 200}
    assert set(picks(picker, v, model="llama")) == {"llama", "lora", "loading"}
    assert set(picks(picker, v)) == {"llama", "tgi", "lora", "loading"}


def test_candidates_limit_the_choice() -> None:
    v = view_of(
        entry("a", waiting="2"), entry("b", waiting="1"), entry("c"), entry("busy", waiting="5")
    )
    picker = Picker(rng=random.Random(3))
    assert picks(picker, v, candidates=["a", "b", "missing"]) == {"b": 200}
    assert picks(picker, v, candidates=["busy", "missing"]) == {"busy": 200}
    assert picker.pick(v, candidates=[]) is None
    assert picker.pick(v, candidates=["c"], model="other") is None


# --- saturation ------------------------------------------------------------------------------


def test_saturated_endpoints_are_skipped_while_others_remain() -> None:
    v = view_of(
        entry("queue", waiting="5"),
        entry("kv", kv_cache_usage="0.8"),
        entry("busy", running="40", waiting="4", kv_cache_usage="0.79"),
    )
    assert picks(Picker(rng=random.Random(4)), v) == {"busy": 200}


def test_when_all_are_saturated_the_option_decides() -> None:
    v = view_of(entry("a", waiting="9"), entry("b", waiting="6", kv_cache_usage="0.9"))
    assert picks(Picker(rng=random.Random(5)), v) == {"b": 200}  # the less loaded
    assert picks(Picker(when_saturated="none"), v) == {None: 200}
    assert pick(v, when_saturated="none") is None
    assert picks(Picker(max_waiting=10, max_kv_cache_usage=0.95), v) == {"b": 200}


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="max_waiting"):
        Picker(max_waiting=0)
    with pytest.raises(ConfigError, match="max_kv_cache_usage"):
        Picker(max_kv_cache_usage=1.5)
    with pytest.raises(ConfigError, match="when_saturated"):
        Picker(when_saturated="random")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="stale_grace_s"):
        Picker(stale_grace_s=-1)
    # A config file's string or None is named too, not a bare comparison TypeError.
    for option, value in (
        ("max_kv_cache_usage", "0.8"),
        ("stale_grace_s", "5"),
        ("stale_grace_s", None),
        ("prefix_load_factor", True),
    ):
        with pytest.raises(ConfigError, match=f"^{option} must be"):
            Picker(**{option: value})  # type: ignore[arg-type]


def test_a_mapping_changed_in_place_is_read_again_at_the_next_pick() -> None:
    endpoints = {"a": entry("a"), "b": entry("b", running="30")}
    picker = Picker(rng=random.Random(1))
    assert picks(picker, endpoints, 20) == {"a": 20}
    endpoints["a"] = entry("a", state="failing")  # the caller's dict, updated
    assert picks(picker, endpoints, 20) == {"b": 20}
    del endpoints["b"]
    assert picker.pick(endpoints) is None


# --- unknown signals ---------------------------------------------------------------------------


def test_unknown_kv_scores_as_the_fleet_median_never_as_zero() -> None:
    v = view_of(
        entry("tgi", engine="tgi", running="2"),  # publishes no KV figure
        entry("low", running="2", kv_cache_usage="0.1"),
        entry("high", running="3", kv_cache_usage="0.5"),
    )
    # tgi and low tie on requests; tgi's unknown KV counts as the median 0.3, not 0 %
    picker = Picker(rng=random.Random(6))
    assert picks(picker, v, candidates=["tgi", "low"]) == {"low": 200}
    # against an endpoint above the median, the unknown one wins the tie
    v2 = view_of(
        entry("tgi", engine="tgi", running="2"),
        entry("low", running="9", kv_cache_usage="0.1"),
        entry("high", running="2", kv_cache_usage="0.5"),
    )
    assert picks(picker, v2, candidates=["tgi", "high"]) == {"tgi": 200}
    # unknown KV never makes an endpoint saturated
    assert picks(picker, view_of(entry("tgi", engine="tgi", running="2"))) == {"tgi": 200}


# --- LoRA affinity ------------------------------------------------------------------------------


def test_lora_affinity_in_the_inference_extension_order() -> None:
    def fleet(*saturated: str) -> View:
        extra = {e: {"waiting": "5"} for e in saturated}
        return view_of(
            entry(
                "running",
                models="base",
                lora_running="sql",
                running="20",
                **extra.get("running", {}),
            ),
            entry(
                "waiting",
                models="base,sql",
                lora_waiting="sql",
                running="10",
                **extra.get("waiting", {}),
            ),
            entry(
                "free", models="base,sql", lora_running="x", lora_max="2", **extra.get("free", {})
            ),
            entry(
                "full", models="base,sql", lora_running="x,y", lora_max="2", **extra.get("full", {})
            ),
            entry("other", models="base"),
        )

    picker = Picker(rng=random.Random(7))
    assert picks(picker, fleet(), model="sql") == {"running": 200}
    assert picks(picker, fleet("running"), model="sql") == {"waiting": 200}
    assert picks(picker, fleet("running", "waiting"), model="sql") == {"free": 200}
    assert picks(picker, fleet("running", "waiting", "free"), model="sql") == {"full": 200}
    # all saturated: the best tier among them
    assert picks(picker, fleet("running", "waiting", "free", "full"), model="sql") == {
        "running": 200
    }
    # the base model needs no adapter slot: one tier, the least loaded win most
    assert set(picks(picker, fleet(), model="base")) == {"free", "full", "other", "waiting"}


# --- local correction ---------------------------------------------------------------------------


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_local_load_counts_what_started_after_the_scrape() -> None:
    clock = Clock(100.0)
    local = LocalLoad(clock)
    # the view was read at local time 100.0 s, at Redis time NOW_MS; scrapes 500 ms before
    v = view_of(
        entry("a", running="4", kv_cache_usage="0.1"),
        entry("b", running="5", kv_cache_usage="0.2"),
        offset_ms=NOW_MS - 100_000.0,
    )
    picker = Picker(rng=random.Random(8), scale_local=False)  # counted as they are
    assert picks(picker, v, local=local) == {"a": 200}
    clock.t = 99.0  # before the scrape: the scrape counted it already
    local.started("a")
    clock.t = 99.8
    first = local.started("a")
    assert local.since("a", 99.5) == 1 and local.in_flight("a") == 2
    assert picks(picker, v, local=local) == {"a": 200}  # 4 + 1 = 5, a tie on load: a's KV
    local.started("a")
    assert picks(picker, v, local=local) == {"b": 200}  # 4 + 2 > 5
    local.finished("a", first)
    local.finished("a")  # the oldest: the one before the scrape
    assert local.since("a", 99.5) == 1 and local.in_flight("a") == 1
    with local.track("b"), local.track("b"):
        assert picks(picker, v, local=local) == {"a": 200}
    assert local.in_flight("b") == 0
    local.finished("nothing")  # no error: a retry path may report twice


def test_endpoints_that_came_and_went_are_forgotten() -> None:
    """A rollout's addresses come and go: what a ``LocalLoad`` keeps of an endpoint with
    nothing in flight goes once it has faded (``FORGET_S``), so memory follows the
    endpoints in use, not every one ever seen."""
    from poller.reader.load.local import FORGET_S

    clock = Clock(100.0)
    local = LocalLoad(clock)
    for generation in range(30):
        for k in range(20):
            with local.track(f"g{generation}-{k}"):
                clock.t += 0.01
            local.finished(f"g{generation}-{k}", -1.0)  # nothing in flight: no error
        clock.t += 10.0
    kept = set(local._done) | set(local._took) | set(local._failed)
    assert kept and len(kept) <= 20 * (FORGET_S / 10.0 + 2), len(kept)
    assert {e.split("-")[0] for e in kept} <= {f"g{g}" for g in range(22, 30)}
    assert "g29-0" in local._took  # the recent ones stay known
    # With no exchange to take them, the changes kept are of the endpoints still known.
    assert local._waker is None and local._changed <= set(local._done) | set(local._starts)


def test_fast_failures_count_as_slow_without_feeding_the_usual_time() -> None:
    """A failure counts as ``FAILED_TIMES`` the usual time, the usual time being that
    of the answers: an engine that fails fast, a third of the requests for a long
    while, leaves the replica's ``request_s`` where its answers put it, and the failing
    engine the slowest."""
    clock = Clock(100.0)
    local = LocalLoad(clock)

    def request(endpoint_id: str, took_s: float, ok: bool = True) -> None:
        started = local.started(endpoint_id)
        clock.t += took_s
        local.finished(endpoint_id, started, ok=ok)

    for _ in range(3000):
        request("fast", 0.2)
        request("slow", 0.8)
        request("bad", 0.005, ok=False)
    assert 0.2 <= local.request_s <= 0.8, local.request_s
    now = clock.t
    assert local.slowness("bad", now) > local.slowness("slow", now) > local.slowness("fast", now)


def test_an_end_reported_twice_ends_one_request_only() -> None:
    """The same request's end reported again (its start time) leaves the others in
    flight counted; a start time never handed out ends the oldest."""
    clock = Clock(100.0)
    local = LocalLoad(clock)
    first = local.started("a")
    clock.t = 100.5
    local.started("a")
    clock.t = 101.0
    local.finished("a", first)
    local.finished("a", first)  # again: nothing more ends
    assert local.in_flight("a") == 1
    local.finished("a", 12.34)  # unknown: the oldest
    assert local.in_flight("a") == 0


def test_recent_requests_count_for_the_replicas_like_this_one() -> None:
    # The view shows 33 requests in all; this replica has 1 in flight: it sends ~1/17 of
    # the fleet's requests, so its one request since a's scrape stands for ~17.
    clock = Clock(100.0)
    local = LocalLoad(clock)
    v = view_of(
        entry("a", running="16", kv_cache_usage="0.1"),
        entry("b", running="17", kv_cache_usage="0.2"),
        offset_ms=NOW_MS - 100_000.0,
    )
    local.started("a")
    assert picks(Picker(rng=random.Random(14), scale_local=False), v, local=local) == {"a": 200}
    assert picks(Picker(rng=random.Random(14)), v, local=local) == {"b": 200}
    # alone in the fleet (what the view shows is ours), it counts as itself
    for _ in range(32):
        local.started("b")
    assert picks(Picker(rng=random.Random(14)), v, local=local) == {"a": 200}


def test_the_herd_eight_replicas_on_one_view_spread() -> None:
    # 8 gateway replicas read the same view of 4 equal endpoints: least-loaded on it
    # would send all 400 requests to one endpoint until the next scrape.
    clock = Clock(100.0)
    v = view_of(*(entry(f"e{i}", running="3") for i in range(4)), offset_ms=NOW_MS - 100_000.0)
    replicas = [(Picker(rng=random.Random(seed)), LocalLoad(clock)) for seed in range(8)]
    counts: Counter[str | None] = Counter()
    for k in range(400):
        clock.t = 100.0 + k / 1000
        picker, local = replicas[k % 8]
        target = picker.pick(v, local=local)
        assert target is not None
        local.started(target)
        counts[target] += 1
    assert sum(counts.values()) == 400
    assert max(counts.values()) <= 160, counts


# --- capacity -----------------------------------------------------------------------------------


def test_capacity_weights_the_draw_and_the_load() -> None:
    # big has 4x the median capacity: 8 requests there load it less than 4 on small
    v = view_of(
        entry("big", running="8", kv_capacity_tokens="400000"),
        entry("small", running="4", kv_capacity_tokens="100000"),
        entry("mid", running="4", kv_capacity_tokens="100000"),
        entry("tgi", engine="tgi", running="4"),  # capacity unknown: the median
    )
    picker = Picker(rng=random.Random(12))
    assert picks(picker, v, candidates=["big", "small"]) == {"big": 200}
    # unknown capacity counts as the median: tgi ties with small, KV unknown on both
    assert set(picks(picker, v, candidates=["small", "tgi"])) == {"small", "tgi"}
    # candidates are drawn in proportion to capacity: big is in nearly every pair
    idle = view_of(
        entry("big", kv_capacity_tokens="400000", kv_cache_usage="0.1"),
        *(entry(f"s{i}", kv_capacity_tokens="100000", kv_cache_usage="0.2") for i in range(4)),
    )
    counts = picks(picker, idle, n=1000)
    assert counts["big"] > 600, counts  # uniform pairs would give it 2 in 5: 400


# --- the outage rule ----------------------------------------------------------------------------


def test_a_view_read_while_redis_was_lost_is_used_for_the_grace_only() -> None:
    endpoints = (timed("a", age_ms=2500), timed("b", age_ms=2900))
    assert [e.state for e in endpoints] == ["stale", "stale"]  # as of now
    # Redis last answered 1 s ago, when both were fresh
    lost = view_of(*endpoints, healthy=False, confirmed_ms=NOW_MS - 1000)
    assert set(picks(Picker(rng=random.Random(9)), lost)) == {"a", "b"}
    assert Picker(stale_grace_s=0.5).pick(lost) is None
    # 6 s after the last answer: past the default grace of 5 s
    assert Picker().pick(view_of(*endpoints, healthy=False, confirmed_ms=NOW_MS - 6000)) is None
    # what was not fresh when Redis last answered is not used either
    old = view_of(timed("a", age_ms=3500), healthy=False, confirmed_ms=NOW_MS - 1000)
    assert Picker().pick(old) is None


def cache_of(*entries: EndpointView) -> ViewCache:
    cache = ViewCache()
    cache.load(View(NOW_MS, 1, {e.id: e for e in entries}))
    cache.healthy = True
    return cache


def test_a_cache_that_lost_redis_serves_picks_for_the_grace_then_none() -> None:
    cache = cache_of(timed("a", age_ms=100), timed("b", age_ms=100))
    picker = Picker(rng=random.Random(10), stale_grace_s=5.0)
    assert set(picks(picker, cache)) == {"a", "b"}
    cache.healthy = False
    cache.confirmed_at = time.monotonic() - 1.0  # within the grace
    assert set(picks(picker, cache)) == {"a", "b"}
    cache.confirmed_at = time.monotonic() - 30.0
    assert picker.pick(cache) is None
    cache.healthy = True
    assert set(picks(picker, cache)) == {"a", "b"}
    assert Picker().pick(ViewCache()) is None  # nothing loaded yet


def test_a_cache_pick_follows_changes_and_freshness_running_out() -> None:
    cache = cache_of(timed("a", age_ms=100), timed("b", age_ms=1990), timed("c", failing=True))
    picker = Picker(rng=random.Random(11))
    # b's stats stop being fresh 10 ms after NOW_MS: the cache's clock passes that soon
    deadline = time.monotonic() + 5.0
    while cache.now_ms() <= NOW_MS + 10 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert picks(picker, cache) == {"a": 200}
    # a goes to sleep; b gets new stats: the index follows the change log
    scraped = cache.now_ms()
    asleep = f"{scraped} 1000 {scraped + 3000} p 1|" + json.dumps(
        raw_stats(scraped_at_ms=str(scraped), sleeping="1")
    )
    cache.set_stats("a", asleep)
    record = f"{scraped} 1000 {scraped + 3000} p 1|" + json.dumps(
        raw_stats(scraped_at_ms=str(scraped))
    )
    cache.set_stats("b", record)
    assert picks(picker, cache) == {"b": 200}
    cache.set_stats("c", record)  # new stats replace c's failure
    assert set(picks(picker, cache)) == {"b", "c"}


# --- the one-call form and the status table ----------------------------------------------------


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


def test_the_cache_change_log_names_what_changed_and_forgets_in_bounds() -> None:
    cache = cache_of(timed("a"), timed("b"))
    start = cache.version
    assert cache.changes_since(start, start) == []
    scraped = cache.now_ms()
    record = f"{scraped} 1000 {scraped + 3000} p 1|" + json.dumps(raw_stats())
    cache.set_stats("a", record)
    cache.set_failure("b", f"{scraped} {scraped + 3000} p 1|{{}}")
    assert cache.changes_since(start, cache.version) == ["a", "b"]
    assert cache.changes_since(start, start + 1) == ["a"]  # bounded by what was read
    cache.load(View(NOW_MS, 2, {}))  # a snapshot replaces everything: rebuild
    assert cache.changes_since(start, cache.version) is None
    assert cache.changes_since(cache.version, cache.version) == []
    before = cache.version
    for _ in range(ViewCache.CHANGE_LOG_MAX + 1):
        cache.set_stats("a", record)
    assert cache.changes_since(before, cache.version) is None  # too far behind
    assert cache.changes_since(cache.version - 1, cache.version) == ["a"]


def test_threads_share_one_picker_and_one_local_load() -> None:
    import threading

    v = view_of(*(entry(f"e{i}", running="3") for i in range(4)), offset_ms=NOW_MS - 100_000.0)
    picker, local = Picker(rng=random.Random(13)), LocalLoad()
    chosen: list[str] = []
    lock = threading.Lock()

    def gateway_thread() -> None:
        for _ in range(500):
            target = picker.pick(v, local=local)
            assert target is not None
            with local.track(target):
                with lock:
                    chosen.append(target)

    threads = [threading.Thread(target=gateway_thread) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(chosen) == 2000 and set(chosen) == {"e0", "e1", "e2", "e3"}
    assert all(local.in_flight(f"e{i}") == 0 for i in range(4))


def test_slowness_from_this_replicas_request_times() -> None:
    clock = Clock(100.0)
    local = LocalLoad(clock)
    assert local.slowness("a") == 1.0  # nothing known: neutral
    for _ in range(5):  # a answers in 2 s, b in 0.5 s
        a, b = local.started("a"), local.started("b")
        clock.t += 0.5
        local.finished("b", b)
        clock.t += 1.5
        local.finished("a", a)
    assert local.slowness("a") > 1.5 > 1.0 > local.slowness("b")
    v = view_of(
        entry("a", running="2", kv_cache_usage="0.1"),
        entry("b", running="3", kv_cache_usage="0.2"),
        offset_ms=NOW_MS - clock.t * 1000,
    )
    assert picks(Picker(rng=random.Random(15)), v, local=local) == {"b": 200}
    assert picks(Picker(rng=random.Random(15), use_latency=False), v, local=local) == {"a": 200}
    clock.t += 60.0  # a minute without news: back to neutral
    assert local.slowness("a") == pytest.approx(1.0, abs=0.01)
    assert picks(Picker(rng=random.Random(15)), v, local=local) == {"a": 200}


def test_clamp_is_min_of_max_exactly() -> None:
    """The picker's clamp gives what ``min(high, max(low, value))`` gives, for ties, the
    infinities and NaN too: a pick's choice must not move with it."""
    values = [-math.inf, -1.0, 0.0, 0.25, 0.5, 1.0, 3.0, 8.0, 64.0, 100.0, math.inf, math.nan]
    for low, high in ((0.25, 8.0), (1.0, 64.0), (1.0, 1.0)):
        for value in values:
            want, got = min(high, max(low, value)), clamp(value, low, high)
            assert got == want or (math.isnan(got) and math.isnan(want)), (value, low, high)


def test_a_failed_request_makes_its_endpoint_look_slow() -> None:
    clock = Clock(100.0)
    local = LocalLoad(clock)
    for _ in range(3):
        with local.track("ok"):
            clock.t += 1.0
    with pytest.raises(OSError):
        with local.track("broken"):  # fails at once: must not look fast
            raise OSError("connection reset")
    local.finished("broken", local.started("broken"), ok=False)
    assert local.slowness("broken") > local.slowness("ok")
    assert local.in_flight("broken") == 0 and local.total() == 0


def test_a_cache_pick_follows_an_adapter_loaded_after_the_index_was_built() -> None:
    cache = cache_of(
        timed("a", models="base,sql", lora_max="2"),
        timed("b", models="base,sql", lora_max="2", lora_running="x,y"),
    )
    picker = Picker(rng=random.Random(16))
    # "sql" runs nowhere yet: a base model to the picker, both endpoints one tier
    assert set(picks(picker, cache, model="sql")) == {"a", "b"}
    scraped = cache.now_ms()
    fields = raw_stats(
        scraped_at_ms=str(scraped), models="base,sql", lora_max="2", lora_running="x,sql"
    )
    cache.set_stats("b", f"{scraped} 1000 {scraped + 3000} p 1|" + json.dumps(fields))
    # now b runs the adapter: affinity sends it there; a (a free slot) is next in line
    assert picks(picker, cache, model="sql") == {"b": 200}
    assert set(picks(picker, cache, model="base")) == {"a", "b"}


def test_the_cache_index_kept_by_changes_equals_one_built_from_scratch() -> None:
    # Random changes to a cache (load, saturation, sleep, failures, models, adapters):
    # after each batch, the picker's index, kept current from the change log, files every
    # endpoint exactly where an index built from the cache anew files it.
    rng = random.Random(17)
    ids = [f"e{i}" for i in range(30)]
    cache = cache_of(*(timed(i, models="m1") for i in ids))
    picker = Picker(rng=random.Random(18))
    models = [None, "m1", "m2", "sql"]

    def filed(index: object) -> dict[object, set[tuple[str, int, bool]]]:
        now_ms = cache.now_ms()  # expired entries leave the bags only when drawn: skip them
        out = {}
        for model in models:
            bags = index.model(model).bags  # type: ignore[attr-defined]
            out[model] = {
                (e.id, tier, saturated)
                for tier, pair in enumerate(bags)
                for saturated, bag in enumerate(pair)
                for e in bag.items
                if e.fresh_until_ms >= now_ms
            }
        return out

    for _ in range(40):
        for endpoint_id in rng.sample(ids, 5):
            scraped = cache.now_ms()
            fields = raw_stats(
                scraped_at_ms=str(scraped),
                running=str(rng.randrange(10)),
                waiting=str(rng.randrange(8)),
                models=rng.choice(["m1", "m2", "m1,m2", "m1,sql"]),
                lora_max="2",
                lora_running=rng.choice(["", "x", "sql", "x,y"]),
                sleeping=rng.choice(["0", "0", "0", "1"]),
            )
            record = f"{scraped} 1000 {scraped + 60_000} p 1|" + json.dumps(fields)
            if rng.random() < 0.1:
                cache.set_failure(endpoint_id, f"{scraped} {scraped + 60_000} p 1|{{}}")
            else:
                cache.set_stats(endpoint_id, record)
        for model in models:
            picker.pick(cache, model)
        kept = picker._indexer._caches[cache]
        anew = Picker()
        anew.pick(cache)
        assert filed(kept) == filed(anew._indexer._caches[cache])


def test_a_cache_index_is_kept_current_as_changes_are_applied_not_at_the_pick() -> None:
    # The picker follows the cache it picked on: each change is applied to its index
    # when the cache applies it (the reader's task), so the next pick decodes nothing.
    cache = cache_of(timed("a", running="3"), timed("b", running="3"))
    picker = Picker(rng=random.Random(19))
    assert set(picks(picker, cache)) == {"a", "b"}
    index = picker._indexer._caches[cache]
    scraped = cache.now_ms()
    record = f"{scraped} 1000 {scraped + 3000} p 1|" + json.dumps(
        raw_stats(scraped_at_ms=str(scraped), running="0")
    )
    cache.set_stats("a", record)
    assert index.version == cache.version and index.slots["a"].requests == 0
    cache.set_failure("b", f"{scraped} {scraped + 3000} p 1|{{}}")
    assert index.version == cache.version and "b" not in index.slots
    decoded: list[str] = []
    base = cache.base
    cache.base = lambda endpoint_id: decoded.append(endpoint_id) or base(endpoint_id)  # type: ignore[method-assign]
    assert picks(picker, cache) == {"a": 200}
    assert decoded == []  # nothing left for the picks to bring up to date
    cache.load(View(NOW_MS, 2, {"c": timed("c")}))  # a snapshot: the index is rebuilt
    assert set(picker._indexer._caches[cache].slots) == {"c"}
    assert picker._indexer._caches[cache].version == cache.version
    # A picker that has not picked on the cache for FOLLOW_IDLE_MS stops following it:
    # its next pick brings the index up to date.
    index = picker._indexer._caches[cache]
    index.picked_ms = cache.now_ms() - FOLLOW_IDLE_MS - 1
    cache.set_stats("c", record)
    assert index.version == cache.version - 1
    assert picker.pick(cache) == "c" and index.version == cache.version
    cache.set_stats("c", record)  # it picked: it follows again
    assert index.version == cache.version


def test_a_picker_dropped_stops_following_and_a_failing_follower_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import gc

    cache = cache_of(timed("a"), timed("b"))
    picker = Picker(rng=random.Random(20))
    assert picker.pick(cache) is not None
    scraped = cache.now_ms()
    record = f"{scraped} 1000 {scraped + 3000} p 1|" + json.dumps(raw_stats())
    del picker
    gc.collect()
    cache.set_stats("a", record)  # nobody follows any more: no error

    class Broken:
        def follow(self, _cache: ViewCache) -> None:
            raise RuntimeError("broken follower")

    broken = Broken()
    cache.follow(broken.follow)
    cache.set_stats("a", record)  # the change is applied, the failure logged
    assert cache.changes_since(cache.version - 1, cache.version) == ["a"]
    assert "a follower of the view cache failed" in caplog.text
