"""LoadAwareStrategy and LoadAwareFilter on a real litellm Router, against simulated
engines a real poller scrapes (``litellm_fleet``): the saturated, failing and sleeping
endpoints receive nothing, and every request is counted in flight exactly once."""

from __future__ import annotations

import asyncio
import logging
import random
import re
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.support.litellm_fleet import BAD, HELD, HOLD_TOKENS, MODEL, OK, Fleet, fleet
from tests.support.procs import until
from tests.support.redisproc import RedisProcess

# isort: off
# litellm_fleet first: it sets LITELLM_LOCAL_MODEL_COST_MAP before litellm loads.
import litellm
from poller.integrations.litellm import LoadAwareFilter, LoadAwareStrategy

# isort: on

pytestmark = [
    pytest.mark.slow,
    pytest.mark.redis_server,  # the fleet's own redis-server and `poller run`
    pytest.mark.timeout(400),  # the fleet starts a simulator, a poller and Redis
    pytest.mark.asyncio(loop_scope="module"),
    # LiteLLM's own types make pydantic warn; nothing of ours.
    pytest.mark.filterwarnings("ignore:Items? .* using the `ReadOnly` qualifier:UserWarning"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def f(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Fleet]:
    workdir: Path = tmp_path_factory.mktemp("litellm-fleet")
    async with fleet(workdir) as running:
        yield running


def deployment(f: Fleet, endpoint_id: str, group: str = "chat", **info: str) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "model_name": group,
        "litellm_params": {
            "model": f"openai/{MODEL}",
            "api_base": f.api_base(endpoint_id),
            "api_key": "unused",
        },
    }
    if info:
        entry["model_info"] = info
    return entry


def model_list(f: Fleet) -> list[dict[str, Any]]:
    """One group, "chat", over all six; half name their endpoint, half match by URL."""
    return [
        deployment(f, e, **({"llmgw_endpoint": e} if i % 2 else {}))
        for i, e in enumerate((*OK, *BAD))
    ]


def served_by(response: Any) -> str:
    headers = response._hidden_params["additional_headers"]
    return str(headers["llm_provider-x-sim-endpoint"])


async def ask(router: litellm.Router, i: int, stream: bool, group: str = "chat") -> str:
    """One request; the endpoint that answered (for a stream: "stream")."""
    response = await router.acompletion(
        model=group,
        messages=[{"role": "user", "content": f"q{i}"}],
        max_tokens=4,
        stream=stream,
    )
    if not stream:
        return served_by(response)
    async for _ in response:
        pass
    return "stream"


async def test_strategy_sends_nothing_to_saturated_failing_or_sleeping(f: Fleet) -> None:
    router = litellm.Router(model_list=model_list(f), num_retries=0)
    strategy = LoadAwareStrategy(router, poller_router=f.router, rng=random.Random(7)).install()
    try:
        served = Counter([await ask(router, i, stream=i % 3 == 0) for i in range(30)])
        # Every request succeeded (no retries: one sent to the failing or sleeping
        # endpoint would have raised), none queued behind the saturated one.
        assert served["stream"] == 10
        assert set(served) - {"stream"} <= set(OK), served
        assert len(set(served) - {"stream"}) >= 2, served  # spread, not one endpoint
        assert (await f.served())["saturated"] == HELD  # only the test's own
        assert strategy.fail_open_total == 0
        # Streams end in LiteLLM's success callback: every request ended exactly once.
        await until(lambda: strategy.tickets.in_flight() == 0, 30, "every request ended")
        assert all(strategy.local.in_flight(e) == 0 for e in (*OK, *BAD))
    finally:
        strategy.uninstall()


async def test_filter_under_litellm_strategy_sends_nothing_to_them(f: Fleet) -> None:
    load_filter = LoadAwareFilter(poller_router=f.router)
    router = litellm.Router(model_list=model_list(f), num_retries=0)
    litellm.logging_callback_manager.add_litellm_callback(load_filter)
    try:
        served = Counter([await ask(router, i, stream=i % 4 == 0) for i in range(24)])
        assert set(served) - {"stream"} <= set(OK), served
        assert (await f.served())["saturated"] == HELD
        assert load_filter.dropped_total == 3 * 24
        assert load_filter.fail_open_total == 0
    finally:
        litellm.logging_callback_manager.remove_callback_from_all_lists(load_filter)


async def test_a_model_no_endpoint_serves_gets_litellms_no_deployment_error(f: Fleet) -> None:
    # "other" is configured on the three good endpoints, none of which lists its model.
    other = [deployment(f, e, group="other", llmgw_model="acme/other-1") for e in OK]
    router = litellm.Router(model_list=[*model_list(f), *other], num_retries=0)
    strategy = LoadAwareStrategy(router, poller_router=f.router).install()
    try:
        with pytest.raises(litellm.RouterRateLimitError, match="No deployments available"):
            await ask(router, 0, stream=False, group="other")
        with pytest.raises(litellm.BadRequestError):  # not configured at all: LiteLLM's own
            await ask(router, 0, stream=False, group="no-such-group")
        assert strategy.tickets.in_flight() == 0
    finally:
        strategy.uninstall()


# --- deployments the view does not know, and saying why -----------------------------------

LOG = "poller.integrations.litellm"


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG and r.levelname == "WARNING"]


def ghost(f: Fleet, group: str = "chat") -> dict[str, Any]:
    """A deployment naming an endpoint id the registry lacks (a typo), sending to ok-a."""
    entry = deployment(f, "ok-a", group=group, llmgw_endpoint="ok-x", id="ghost")
    return entry


def deployment_id(response: Any) -> str:
    return str(response._hidden_params["model_id"])


async def test_filter_keeps_an_unknown_endpoint_id_and_says_why_once(
    f: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    load_filter = LoadAwareFilter(poller_router=f.router)
    named = [deployment(f, e, id=e) for e in (*OK[:2], *BAD)]
    router = litellm.Router(model_list=[*named, ghost(f)], num_retries=0)
    litellm.logging_callback_manager.add_litellm_callback(load_filter)
    random.seed(3)  # LiteLLM's shuffle draws from the module's random source
    try:
        with caplog.at_level(logging.WARNING, LOG):
            chosen = []
            for i in range(40):
                response = await router.acompletion(
                    model="chat", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=2
                )
                chosen.append(deployment_id(response))
    finally:
        litellm.logging_callback_manager.remove_callback_from_all_lists(load_filter)
    served = Counter(chosen)
    assert set(served) <= {*OK[:2], "ghost"} and served["ghost"] > 0, served  # kept, chosen
    assert load_filter.dropped_total == 3 * 40  # the bad three, never the ghost
    lines = said(caplog)
    assert (
        lines.count(
            "LiteLLM deployment ghost of model group 'chat': names endpoint 'ok-x' in "
            "model_info.llmgw_endpoint, which the registry lacks: kept, uninformed (the view "
            "does not judge it; LiteLLM's strategy chooses among it and the deployments the "
            "filter keeps)"
        )
        == 1
    ), lines
    # Each dropped deployment once, with its reason, not once per request.
    dropped = [line for line in lines if " dropped: " in line]
    assert len(dropped) == 3, dropped
    assert (
        "LiteLLM deployment asleep of model group 'chat' (endpoint asleep) dropped: asleep "
        "(sleep mode)"
    ) in dropped
    assert any(
        line.startswith(
            "LiteLLM deployment failing of model group 'chat' (endpoint failing) "
            "dropped: failing (http_status"
        )
        for line in dropped
    ), dropped
    assert any(
        re.fullmatch(
            r"LiteLLM deployment saturated of model group 'chat' \(endpoint saturated\) "
            r"dropped: saturated \(KV usage 1\.00 >= 0\.8\)",
            line,
        )
        for line in dropped
    ), dropped
    assert not any("no endpoint may take requests" in line for line in lines), lines


async def test_strategy_with_nothing_eligible_says_why_once_and_uses_the_uninformed(
    f: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    # Failing and asleep: never eligible (a saturated one would be, as the last resort).
    bad = [deployment(f, e, group="bad", id=e) for e in BAD[1:]]
    router = litellm.Router(model_list=[*bad, ghost(f, "bad")], num_retries=0)
    strategy = LoadAwareStrategy(router, poller_router=f.router).install()
    try:
        with caplog.at_level(logging.WARNING, LOG):
            for i in range(5):
                assert await ask(router, i, stream=False, group="bad") == "ok-a"  # the ghost's
    finally:
        strategy.uninstall()
    lines = said(caplog)
    nothing = [line for line in lines if line.startswith("no endpoint may take requests")]
    assert len(nothing) == 1, lines  # once per change of the reasons, not per request
    assert re.fullmatch(
        r"no endpoint may take requests for model group 'bad' \(asleep asleep \(sleep mode\); "
        r"failing failing \(http_status: HTTP 500: [^)]*\)\): sending to its 1 uninformed "
        r"deployment",
        nothing[0],
    ), nothing[0]
    assert sum("LiteLLM deployment ghost of model group 'bad'" in line for line in lines) == 1


async def test_strategy_with_nothing_at_all_says_litellm_answers(
    f: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    bad = [deployment(f, e, group="only-bad", id=f"only-{e}") for e in BAD[1:]]
    router = litellm.Router(model_list=bad, num_retries=0)
    strategy = LoadAwareStrategy(router, poller_router=f.router).install()
    try:
        with caplog.at_level(logging.WARNING, LOG):
            for i in range(3):
                with pytest.raises(litellm.RouterRateLimitError, match="No deployments"):
                    await ask(router, i, stream=False, group="only-bad")
    finally:
        strategy.uninstall()
    nothing = [line for line in said(caplog) if line.startswith("no endpoint may take")]
    assert len(nothing) == 1 and nothing[0].endswith(
        ": LiteLLM answers 'No deployments available'"
    ), nothing


async def test_fail_open_line_before_redis_was_ever_reached(
    f: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    nobody = RedisProcess()  # a free port, nothing listening
    load_filter = LoadAwareFilter(redis_url=nobody.url, namespace="lt")
    router = litellm.Router(model_list=[deployment(f, "ok-a")], num_retries=0)
    litellm.logging_callback_manager.add_litellm_callback(load_filter)
    try:
        with caplog.at_level(logging.WARNING, LOG):
            for i in range(2):
                assert await ask(router, i, stream=False) == "ok-a"
    finally:
        litellm.logging_callback_manager.remove_callback_from_all_lists(load_filter)
        await load_filter.aclose()
    assert load_filter.fail_open_total == 2
    assert said(caplog) == [
        "the shared view cannot be read (cannot reach Redis: no view read from it yet): "
        "keeping LiteLLM's deployments until it can (counted in fail_open_total)"
    ]


async def test_fail_open_line_for_a_namespace_nothing_wrote_names_it(
    f: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    load_filter = LoadAwareFilter(redis_url=f.redis_url, namespace="nothing-here")
    router = litellm.Router(model_list=[deployment(f, "ok-a")], num_retries=0)
    litellm.logging_callback_manager.add_litellm_callback(load_filter)
    try:
        with caplog.at_level(logging.WARNING, LOG):
            assert await ask(router, 0, stream=False) == "ok-a"
    finally:
        litellm.logging_callback_manager.remove_callback_from_all_lists(load_filter)
        await load_filter.aclose()
    lines = [line for line in said(caplog) if line.startswith("the shared view cannot")]
    assert lines and "namespace nothing-here has no schema key" in lines[0], lines


async def test_every_end_counted_once_failure_stream_cancel(f: Fleet) -> None:
    """ok-c keeps one request of the test in flight throughout: an end counted twice
    would take it off the count, one never counted would leave an extra."""
    only_c = [deployment(f, "ok-c", group="c", llmgw_endpoint="ok-c")]
    # The engine answers 404 for this model; the view believes ok-c serves it.
    wrong = deployment(f, "ok-c", group="wrong", llmgw_model=MODEL)
    wrong["litellm_params"]["model"] = "openai/acme/not-served"
    # No cooldown: the 404s would take "wrong" out of LiteLLM's healthy list.
    router = litellm.Router(model_list=[*only_c, wrong], num_retries=0, disable_cooldowns=True)
    strategy = LoadAwareStrategy(router, poller_router=f.router).install()
    local = strategy.local
    try:
        held = asyncio.create_task(
            router.acompletion(
                model="c", messages=[{"role": "user", "content": "h"}], max_tokens=HOLD_TOKENS
            )
        )
        await until(lambda: local.in_flight("ok-c") == 1, 30, "the held request")
        for i in range(3):
            with pytest.raises(litellm.NotFoundError):
                await ask(router, i, stream=False, group="wrong")
            assert await ask(router, i, stream=True, group="c") == "stream"
            assert await ask(router, i, stream=False, group="c") == "ok-c"
        # The failure callbacks run after the calls return: wait for them.
        await until(lambda: strategy.tickets.in_flight() == 1, 30, "the ends reported")
        assert local.in_flight("ok-c") == 1
        # The 404s were counted as failures (3 of 9 ends on ok-c): it looks partly failing.
        assert 0.0 < local.failing("ok-c") < 1.0
        held.cancel()  # a cancelled request: no callback, its task's end counts
        with pytest.raises(asyncio.CancelledError):
            await held
        # Its task's done callback runs a loop turn after the await above returns.
        await until(lambda: local.in_flight("ok-c") == 0, 30, "the cancelled request ended")
        assert strategy.tickets.in_flight() == 0
    finally:
        strategy.uninstall()


async def counted(task: asyncio.Task[Any], in_flight: Callable[[], bool], what: str) -> None:
    """Until ``in_flight()`` says the request is counted, or its task ended first: then
    its error is the test's."""
    await until(lambda: task.done() or in_flight(), 30, what)
    if task.done():
        task.result()
        raise AssertionError(f"{what} ended before it was counted")


async def test_two_replicas_see_each_others_requests_in_flight_through_redis(f: Fleet) -> None:
    """Two gateway replicas, each a Router with its own ``LoadAwareStrategy`` and its own
    cached reader (as two proxy processes have): the requests one keeps in flight reach
    the other's picks through the shared counts in Redis, and leave them when they end."""
    from poller.reader import StatsReader
    from tests.support.litellm_fleet import NS, STALE_AFTER_MS

    group = [deployment(f, e, group="pair", llmgw_endpoint=e) for e in OK]
    body = {"messages": [{"role": "user", "content": "h"}], "max_tokens": HOLD_TOKENS}
    held: list[asyncio.Task[Any]] = []
    async with (
        StatsReader.from_url(f.redis_url, NS, stale_after_ms=STALE_AFTER_MS) as reader_a,
        StatsReader.from_url(f.redis_url, NS, stale_after_ms=STALE_AFTER_MS) as reader_b,
        reader_a.router(replica_id="gw-a", rng=random.Random(3)) as gateway_a,
        reader_b.router(replica_id="gw-b", rng=random.Random(4)) as gateway_b,
    ):
        await until(lambda: gateway_a.load_shared and gateway_b.load_shared, 30, "sharing")
        await until(lambda: all(gateway_b.get(e) for e in OK), 30, "the view in replica b")

        def quiet(cache: Any) -> bool:
            """No load on OK but the gateways': the earlier tests' requests (sent by
            no sharing replica: outside load to the estimate) are off the pages, the
            newest one included (its KV usage, full while a held request ran, would keep
            an endpoint out of the picks)."""
            extra = cache.fleet.extra
            for e in OK:
                stats = getattr(cache.get(e), "stats", None)
                if stats is None or stats.running + stats.waiting or extra.get(e) != 0:
                    return False
            return True

        # Up to PAGES scrapes (docs/reader.md) after the module's last request.
        await until(lambda: quiet(gateway_a) and quiet(gateway_b), 120, "the pages quiet")
        router_a = litellm.Router(model_list=group, num_retries=0)
        router_b = litellm.Router(model_list=group, num_retries=0)
        a = LoadAwareStrategy(router_a, poller_router=gateway_a, rng=random.Random(3)).install()
        b = LoadAwareStrategy(router_b, poller_router=gateway_b, rng=random.Random(4)).install()
        assert gateway_a.fleet is not None and gateway_b.fleet is not None

        def mine(strategy: LoadAwareStrategy) -> dict[str, int]:
            return {e: strategy.local.in_flight(e) for e in OK}

        def peers(cache: Any) -> dict[str, int]:
            return {e: cache.fleet.peer_in_flight(e) for e in OK}

        try:
            for n in (1, 2):  # replica a holds two requests, one at a time
                held.append(asyncio.create_task(router_a.acompletion(model="pair", **body)))
                await until(lambda n=n: sum(mine(a).values()) == n, 30, f"a's request {n}")
            assert sorted(mine(a).values()) == [0, 1, 1]  # on two of the three
            # Replica b learns them from Redis, not from its own requests.
            await until(lambda: peers(gateway_b) == mine(a), 30, "a's requests seen by b")
            assert sum(mine(b).values()) == 0
            free = next(e for e, n in mine(a).items() if n == 0)
            # So b sends its request to the one endpoint the fleet has nothing on, when
            # its pick sees the fleet as it is: a loop stalled past a's field's TTL (a
            # loaded machine) or a LiteLLM cooldown shows it another fleet; then again.
            seen: list[tuple[set[str], dict[str, float]]] = []
            choose = b.choose

            def spy(cache: Any, model: str, healthy: list[Any], *args: Any, **kw: Any) -> Any:
                ids = {d["model_info"]["llmgw_endpoint"] for d in healthy}
                seen.append((ids, dict(cache.fleet.extra)))
                return choose(cache, model, healthy, *args, **kw)

            b.choose = spy  # type: ignore[method-assign]
            for _ in range(5):
                task = asyncio.create_task(router_b.acompletion(model="pair", **body))
                held.append(task)
                await counted(task, lambda: sum(mine(b).values()) == 1, "b's request")
                ids, extra = seen[-1]
                busy = [e for e in OK if e != free]
                if ids == set(OK) and extra.get(free) == 0 and all(extra[e] for e in busy):
                    break
                held.remove(task)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await until(lambda: sum(mine(b).values()) == 0, 30, "b's request ended")
                await until(lambda: peers(gateway_b) == mine(a), 30, "a's requests seen by b")
            else:
                pytest.fail(f"b's picks never saw a's requests: {seen}")
            assert mine(b)[free] == 1, (seen[-1], mine(a), mine(b))
            await until(lambda: peers(gateway_a) == mine(b), 30, "b's request seen by a")
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
            held.clear()
            # Ended: gone from the other replica's view as well.
            await until(lambda: sum(mine(a).values()) + sum(mine(b).values()) == 0, 30, "ends")
            await until(lambda: not any(peers(gateway_a).values()), 30, "b's gone from a")
            await until(lambda: not any(peers(gateway_b).values()), 30, "a's gone from b")
        finally:
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
            a.uninstall()
            b.uninstall()
