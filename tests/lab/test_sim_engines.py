"""Engines that behave like real ones: what the KV gauge counts, with and without a lag,
and the probes routers send (vLLM's ``/version`` and model cards).

Served requests hold their slot through a ``Gate`` the test opens, and time is a fake
clock: every step waits for an event of the simulator, never for the wall clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from poller.errors import ConfigError
from poller_lab.sim import EndpointSpec, Simulator
from tests.lab.test_sim_serving import (
    MODEL,
    FakeClock,
    Gate,
    chat,
    instant,
    queue,
    read_page,
    until,
)


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as c:
        yield c


async def _kv(http: httpx.AsyncClient, sim: Simulator) -> float:
    page = read_page((await http.get(sim.metrics_url("e"))).content)
    assert page.kv_cache_usage is not None
    return page.kv_cache_usage


def _prompt(i: int) -> list[dict[str, str]]:
    # 64 characters a block: each conversation its own three blocks
    return [{"role": "user", "content": f"conversation {i:04d} " + "x" * 180}]


async def test_occupancy_tracks_the_running_requests_and_free_cached_blocks_do_not_count(
    http: httpx.AsyncClient,
) -> None:
    gate, clock = Gate(), FakeClock()
    spec = EndpointSpec("e", capacity=4, load=0, kv_usage="occupancy", kv_fill=0.9)
    async with Simulator([spec], clock=clock, hold=gate.hold, warmup_s=0) as sim:
        url = sim.base_url("e") + "/v1/chat/completions"
        assert await _kv(http, sim) == 0.0
        tasks = []
        seen = []
        for i, expect in enumerate([(1, 0), (2, 0), (3, 0), (4, 0), (4, 1)]):
            body = chat(messages=_prompt(i))
            tasks.append(asyncio.create_task(http.post(url, json=body)))
            await until(lambda e=expect: queue(sim, "e") == e, f"queue {expect}")
            seen.append(await _kv(http, sim))
        # 0.9 x running / slots: a waiting request holds no block
        assert seen == pytest.approx([0.225, 0.45, 0.675, 0.9, 0.9])
        while gate.held or not all(t.done() for t in tasks):
            if gate.held:
                gate.release()
            await asyncio.sleep(0)
        assert queue(sim, "e") == (0, 0)
        assert sim.snapshot("e").prefix_cache_queries > 0  # the blocks were cached...
        assert await _kv(http, sim) == 0.0  # ...and, free, count as free (vLLM's gauge)


async def test_the_cached_variant_counts_idle_cached_blocks_until_the_cache_is_reset(
    http: httpx.AsyncClient,
) -> None:
    spec = EndpointSpec("e", capacity=2, load=0, kv_blocks=12, kv_usage="cached")
    async with Simulator([spec], clock=FakeClock(), hold=instant) as sim:
        url = sim.base_url("e") + "/v1/chat/completions"
        usage = []
        for i in range(3):
            assert (await http.post(url, json=chat(messages=_prompt(i)))).status_code == 200
            usage.append(await _kv(http, sim))
        assert queue(sim, "e") == (0, 0)  # nothing runs: only the cache is left
        assert usage[0] == pytest.approx(3 / 12)
        assert usage == sorted(usage) and usage[-1] >= 0.75
        sim.reset_prefix_cache("e")
        assert await _kv(http, sim) == 0.0


async def test_an_occupancy_page_lags_with_the_queue(http: httpx.AsyncClient) -> None:
    gate, clock = Gate(), FakeClock()
    spec = EndpointSpec("e", capacity=2, load=0, kv_usage="occupancy", metrics_lag_s=1.0)
    async with Simulator([spec], clock=clock, hold=gate.hold, warmup_s=0) as sim:
        url = sim.base_url("e") + "/v1/chat/completions"
        tasks = [asyncio.create_task(http.post(url, json=chat())) for _ in range(2)]
        await until(lambda: queue(sim, "e") == (2, 0), "both running")
        assert await _kv(http, sim) == 0.0  # the page is a second behind
        clock.now += 1.0
        assert await _kv(http, sim) == pytest.approx(0.9)
        gate.release()
        gate.release()
        await asyncio.gather(*tasks)
        assert await _kv(http, sim) == pytest.approx(0.9)  # the batch that was full
        clock.now += 1.0
        assert await _kv(http, sim) == 0.0


async def test_vllm_answers_the_version_and_model_card_probes(http: httpx.AsyncClient) -> None:
    specs = [EndpointSpec("e", load=0, lora=("ad",)), EndpointSpec("s", "sglang", load=0)]
    async with Simulator(specs, clock=FakeClock(), hold=instant) as sim:
        version = await http.get(sim.base_url("e") + "/version")
        cards = (await http.get(sim.base_url("e") + "/v1/models")).json()["data"]
        other = await http.get(sim.base_url("s") + "/version")
    assert version.status_code == 200 and isinstance(version.json()["version"], str)
    base, adapter = cards
    assert (base["id"], base["root"], base["parent"]) == (MODEL, MODEL, None)
    assert (adapter["id"], adapter["parent"]) == ("ad", MODEL)
    assert base["max_model_len"] > 0 and base["owned_by"] == "vllm"
    assert other.status_code == 404  # SGLang serves no /version


@pytest.mark.parametrize(
    ("field", "value"),
    [("kv_usage", "blocks"), ("kv_fill", 0), ("kv_fill", 1.5), ("kv_fill", True)],
)
def test_bad_kv_settings_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        EndpointSpec.from_dict({"id": "e", field: value})
