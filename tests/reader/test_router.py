"""The Router a gateway replica holds: tickets from pick to end, fallbacks, why no
endpoint, eligibility, and the records it hands out. Seeded: the verdicts are exact."""

from __future__ import annotations

import copy
import json
import pickle
import threading

import pytest

from poller import ConfigError, EndpointView, Router, RoutingOptions, Ticket, ViewCache
from poller.reader.load.local import LocalLoad
from poller.reader.prefix.blocks import block_ids
from tests.reader.test_pick import Clock, raw_stats, timed, view_of
from tests.support.routers import cache_on, counted, router_on

URL = '{{"url": "http://10.0.0.{n}:8000"}}'


def served(endpoint_id: str, n: int, **fields: str) -> EndpointView:
    """A fresh endpoint of model "m" with its registry entry (a URL)."""
    view = timed(endpoint_id, models="m", **fields)
    entry = URL.format(n=n)
    return EndpointView(
        endpoint_id,
        state=view.state,
        age_ms=view.age_ms,
        owner=view.owner,
        token=view.token,
        raw=(entry, view.raw[1], view.raw[2]),
        timing=view.timing,
    )


def fleet(**running: int) -> Router:
    endpoints = [served(e, i + 1, running=str(n)) for i, (e, n) in enumerate(running.items())]
    return router_on(view_of(*endpoints), local=LocalLoad(clock=Clock()))


# --- tickets ------------------------------------------------------------------------------


def test_a_ticket_counts_the_request_until_the_block_ends() -> None:
    router = fleet(a=0, b=5)
    ticket = router.pick("m")
    assert isinstance(ticket, Ticket) and ticket.id == "a" and ticket.open
    assert ticket.url == "http://10.0.0.1:8000"
    assert ticket.endpoint is not None and ticket.endpoint.id == "a"
    assert router.local.in_flight("a") == 1
    with ticket:
        assert router.local.in_flight("a") == 1
    assert not ticket.open and router.local.in_flight("a") == 0


def test_a_ticket_ended_twice_counts_once() -> None:
    router = fleet(a=0)
    first, second = router.pick("m"), router.pick("m")
    assert first is not None and second is not None
    first.done()
    first.done(ok=False)
    with first:
        pass
    assert router.local.in_flight("a") == 1  # the second is still in flight
    assert router.local.failing("a") == 0.0  # the later ok=False counted nothing
    second.done()
    assert router.local.total() == 0


def test_a_cancelled_ticket_stops_counting_and_says_nothing_of_the_endpoint() -> None:
    clock = Clock()
    router = router_on(view_of(served("a", 1, running="0")), local=LocalLoad(clock=clock))
    with router.pick("m"):  # type: ignore[union-attr]
        clock.t += 2.0  # one answer in 2 s: the usual time
    usual, slowness = router.local.request_s, router.local.slowness("a")
    ticket = router.pick("m")
    assert ticket is not None and router.local.in_flight("a") == 1
    clock.t += 0.001
    ticket.cancel()  # never sent: not a 1 ms answer, not a failure
    ticket.done(ok=False)  # ended already: nothing more
    assert not ticket.open and router.local.total() == 0
    assert router.local.request_s == usual and router.local.slowness("a") == slowness
    assert router.local.failing("a") == 0.0


def test_an_exception_out_of_the_block_is_a_failed_request_a_cancel_is_not() -> None:
    import asyncio

    router = fleet(a=0)
    with pytest.raises(RuntimeError), router.pick("m"):  # type: ignore[union-attr]
        raise RuntimeError("the engine broke the connection")
    assert router.local.failing("a") > 0
    calm = fleet(a=0)
    with pytest.raises(asyncio.CancelledError), calm.pick("m"):  # type: ignore[union-attr]
        raise asyncio.CancelledError
    assert calm.local.failing("a") == 0.0 and calm.local.total() == 0


def test_a_ticket_moved_to_a_fallback_counts_there_and_fails_the_first() -> None:
    router = fleet(a=0, b=1)
    ticket = router.pick("m", fallbacks=1)
    assert ticket is not None and ticket.id == "a" and ticket.fallbacks == ("b",)
    moved = ticket.moved("b")
    assert not ticket.open and moved.open and moved.id == "b"
    assert router.local.in_flight("a") == 0 and router.local.in_flight("b") == 1
    assert router.local.failing("a") > 0  # a retry means the first did not serve
    assert moved.moved("b") is moved  # the same endpoint: nothing moves
    moved.done()
    assert moved.moved("a") is moved and router.local.total() == 0  # ended: nothing moves
    with pytest.raises(TypeError):
        moved.moved(3)  # type: ignore[arg-type]


def test_track_counts_a_request_sent_without_a_pick() -> None:
    router = fleet(a=0, b=0)
    with router.track("b") as ticket:
        assert ticket.id == "b" and router.local.in_flight("b") == 1
    assert router.local.total() == 0
    with pytest.raises(TypeError):
        router.track(None)  # type: ignore[arg-type]


def test_every_ticket_ended_from_many_threads_leaves_nothing_in_flight() -> None:
    router = fleet(a=0, b=0, c=0)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(300):
                ticket = router.pick("m")
                assert ticket is not None
                ticket.done()
                ticket.done()  # ended twice, from the same thread or another
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and router.local.total() == 0


# --- the choice ---------------------------------------------------------------------------


def test_fallbacks_are_the_next_best_in_the_picks_order() -> None:
    router = fleet(a=0, b=3, c=1, d=2)
    ticket = router.pick("m", fallbacks=2)
    assert ticket is not None and (ticket.id, ticket.fallbacks) == ("a", ("c", "d"))
    ticket.done()
    ticket = router.pick("m", fallbacks=9, candidates=["b", "d"])
    assert ticket is not None and (ticket.id, ticket.fallbacks) == ("d", ("b",))
    assert router.pick("m").fallbacks == ()  # type: ignore[union-attr]
    shedding = router_on(
        view_of(served("a", 1), served("full", 2, running="3", kv_cache_usage="0.95")),
        RoutingOptions(when_saturated="none"),
    )
    ticket = shedding.pick("m", fallbacks=3)
    assert ticket is not None and ticket.fallbacks == ()  # a saturated one is shed


def test_a_prompt_is_placed_on_the_endpoint_its_ticket_counts() -> None:
    router = fleet(a=1, b=1, c=1)
    prompt = "You are a careful assistant. " * 60
    with router.pick("m", prompt=prompt) as first:
        pass
    ids = block_ids(prompt, "m")
    assert router.placements.matches(ids) == [(first.id, len(ids))]
    for _ in range(10):  # the next turn goes where the prompt is held
        with router.pick("m", prompt=prompt + "and the next question") as ticket:
            assert ticket.id == first.id


@pytest.mark.parametrize(
    "call",
    [
        lambda r: r.pick(["m"]),  # ids where the model goes
        lambda r: r.pick("m", candidates="a"),  # one string is not a list of ids
        lambda r: r.pick("m", fallbacks=-1),
        lambda r: r.pick("m", fallbacks=True),
        lambda r: r.pick("m", prompt=["hi"]),
        lambda r: r.explain(3),
    ],
)
def test_a_wrong_argument_type_is_a_type_error_never_none(call: object) -> None:
    with pytest.raises(TypeError):
        call(fleet(a=0))  # type: ignore[operator]


def test_options_are_one_frozen_record_checked_at_construction() -> None:
    options = RoutingOptions(max_waiting=8)
    with pytest.raises(AttributeError):
        options.max_waiting = 9  # type: ignore[misc]
    for bad, said in (
        ({"max_waiting": 0}, "max_waiting"),
        ({"max_kv_cache_usage": 1.5}, "max_kv_cache_usage"),
        ({"when_saturated": "shed"}, "when_saturated"),
        ({"stale_grace_s": float("nan")}, "stale_grace_s"),
        ({"share": "yes"}, "share"),
        ({"prefix_load_slack": -1}, "prefix_load_slack"),
    ):
        with pytest.raises(ConfigError, match=said):
            RoutingOptions(**bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="RoutingOptions"):
        Router(ViewCache(), {"max_waiting": 8})  # type: ignore[arg-type]


# --- why not ------------------------------------------------------------------------------


def test_explain_says_why_no_endpoint_may_take_a_request() -> None:
    assert Router(ViewCache()).explain("m").reason == "not_ready"  # nothing read yet
    router = router_on(
        view_of(
            served("a", 1, running="2"),
            served("asleep", 2, sleeping="1"),
            served("old", 3, age_ms=5_000_000),  # past the bound of an hour
        )
    )
    assert router.explain("m") == ("", "")
    assert router.explain("other").reason == "no_endpoint"
    refusal = router.explain("m", candidates=["asleep", "old"])
    assert refusal.reason == "not_fresh" and "asleep" in refusal.detail
    assert "stale" in refusal.detail
    shedding = router_on(
        view_of(served("full", 1, running="3", kv_cache_usage="0.95")),
        RoutingOptions(when_saturated="none"),
    )
    assert shedding.pick("m") is None
    assert shedding.explain("m").reason == "saturated"


def test_an_explanation_is_worked_out_once_per_view_and_moment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gateway that refuses every request (every engine asleep) asks ``explain`` per
    request: on the same view within ``EXPLAINED_S`` it is worked out once; a change
    of the view, of the request or of the moment works it out again."""
    import poller.reader.router as router_module

    cache = cache_on(view_of(served("asleep", 1, sleeping="1")))
    router = Router(cache)
    worked: list[object] = []
    explain = router._explain

    def counted_explain(model: str | None, ids: list[str]) -> object:
        worked.append(model)
        return explain(model, ids)

    router._explain = counted_explain  # type: ignore[method-assign,assignment]
    for _ in range(5):
        assert router.explain("m").reason == "not_fresh"
    assert worked == ["m"]
    assert router.explain("other").reason == "no_endpoint" and worked == ["m", "other"]
    cache.load(view_of(served("asleep", 1, sleeping="1"), served("b", 2, sleeping="1")))
    router.explain("other")
    monkeypatch.setattr(router_module, "EXPLAINED_S", -1.0)  # every moment a new one
    router.explain("other")
    assert worked == ["m", "other", "other", "other"]


def test_eligible_and_saturated_answer_for_one_endpoint() -> None:
    router = router_on(
        view_of(
            served("a", 1), served("full", 2, running="3", kv_cache_usage="0.95"), served("b", 3)
        )
    )
    assert router.eligible("a", "m") and not router.eligible("a", "other")
    assert router.eligible("full", "m") and router.saturated("full")  # least_loaded: it may
    assert not router.saturated("a") and not router.eligible("missing", "m")
    strict = router_on(router.cache, RoutingOptions(when_saturated="none"))
    assert not strict.eligible("full", "m") and strict.eligible("a", "m")


def test_ready_follows_the_view_and_the_grace() -> None:
    cache = cache_on(view_of(served("a", 1)))
    router = Router(cache)
    assert router.ready and router.healthy
    cache.healthy = False
    cache.confirmed_at = 0.0  # Redis last answered long ago: past stale_grace_s
    assert not router.ready and router.pick("m") is None
    assert router.explain("m").reason == "not_ready"


# --- the records it hands out -------------------------------------------------------------


def test_an_endpoint_view_is_a_record_not_a_tuple() -> None:
    """Fields by name, equal by value (its parse cache left out), immutable, copied and
    pickled whole; no tuple behaviour (``len``, iteration, indexing)."""
    view = served("a", 1, running="3")
    assert not isinstance(view, tuple)
    with pytest.raises(TypeError):
        len(view)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        iter(view)  # type: ignore[call-overload]
    with pytest.raises(AttributeError, match="immutable"):
        view.state = "stale"  # type: ignore[misc]
    assert view.stats is not None and view.stats.running == 3  # parsed: cached inside
    for twin in (copy.copy(view), copy.deepcopy(view), pickle.loads(pickle.dumps(view))):
        assert twin == view and twin is not view and twin.stats == view.stats
    assert view != served("a", 1, running="4") and view != ("a", "fresh")
    assert json.loads(json.dumps(view.to_dict()))["stats"]["running"] == 3
    with pytest.raises(TypeError):
        hash(view)
    assert view.at(10**15).state == "stale" and view.state == "fresh"


def test_a_router_built_by_hand_shares_nothing() -> None:
    router = Router(cache_on(view_of(timed("a", models="m", running="1"))))
    assert router.fleet is not None and router.exchange is None
    assert not router.load_shared and not router.placements_shared
    assert counted(router, 5, "m") == {"a": 5}
    assert Router(ViewCache(), RoutingOptions(share=False)).fleet is None
    assert "Router(" in repr(router) and raw_stats()["engine"] == "vllm"
