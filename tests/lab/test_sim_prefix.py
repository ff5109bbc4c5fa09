"""The simulator's prefix cache: blocks in an LRU, prefill time, the counters, the oracle.

Served requests hold their slot through the ``Gate`` of test_sim_serving (the test opens
it), so no verdict here depends on the machine's speed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from poller.errors import ConfigError
from poller_lab.sim import EndpointSpec, Simulator
from poller_lab.sim.prefix import BLOCK_CHARS, BLOCK_TOKENS, PrefixCache, block_ids
from tests.lab.test_sim_serving import MODEL, FakeClock, Gate, read_page, until


def text(tag: str, blocks: int) -> str:
    """``blocks`` whole blocks of text, every one different (and from ``tag`` on)."""
    return "".join(f"{tag}:{i:04d}:".ljust(BLOCK_CHARS, ".") for i in range(blocks))


async def instant(seconds: float) -> None:
    return None


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as c:
        yield c


def test_block_ids_share_exactly_the_shared_prefix() -> None:
    a = text("a", 5)
    b = a[: 2 * BLOCK_CHARS + 10] + "x" * (3 * BLOCK_CHARS)  # 2 whole blocks in common
    ids_a, ids_b = block_ids(a), block_ids(b)
    assert len(ids_a) == len(ids_b) == 5
    assert ids_a[:2] == ids_b[:2] and not set(ids_a[2:]) & set(ids_b[2:])
    # The same block text after another prefix is another block.
    assert block_ids("y" + a[1:])[1:] != ids_a[1:]
    assert block_ids(a[: BLOCK_CHARS - 1]) == []  # a partial block is never cached
    cache = PrefixCache(100)
    cache.store(ids_a)
    assert cache.cached_blocks(ids_b) == 2
    assert cache.cached_blocks(block_ids("z" + a)) == 0


def test_the_lru_is_bounded_and_evicts_a_chain_from_its_tail() -> None:
    cache = PrefixCache(4)
    a, b = block_ids(text("a", 3)), block_ids(text("b", 3))
    assert cache.store(a) == 0
    assert cache.store(a) == 3
    assert cache.store(b) == 0
    assert len(cache) == 4 and cache.evicted == 2
    # a's tail went first: its head is still a usable prefix, with no hole behind it.
    assert cache.cached_blocks(a) == 1 and a[0] in cache and a[2] not in cache
    assert cache.cached_blocks(b) == 3
    cache.store(a)  # a is used again: b's oldest blocks (its tail) go
    assert cache.cached_blocks(a) == 3 and cache.cached_blocks(b) == 1
    # A prompt longer than the pool keeps its head.
    long = block_ids(text("c", 9))
    cache.store(long)
    assert cache.cached_blocks(long) == 4 and len(cache) == 4
    with pytest.raises(ValueError, match="blocks"):
        PrefixCache(-1)


def completion(prompt: str, max_tokens: int = 10, stream: bool = False) -> dict[str, object]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}


async def test_serving_time_is_uncached_prefill_then_decode_and_the_first_chunk_ends_the_prefill(
    client: httpx.AsyncClient,
) -> None:
    gate = Gate()
    spec = EndpointSpec("e", capacity=1, load=0, speed_tps=10.0, prefill_tps=100.0)
    prompt = text("doc", 10)  # 640 characters: 160 tokens, 10 blocks
    async with Simulator([spec], clock=FakeClock(), hold=gate.hold, warmup_s=0) as sim:
        url = sim.base_url("e") + "/v1/completions"
        prefill_released = asyncio.Event()
        seen_after_prefill: list[bool] = []

        async def first_chunk() -> None:
            body = completion(prompt, max_tokens=20, stream=True)
            async with client.stream("POST", url, json=body) as response:
                async for _ in response.aiter_bytes():
                    seen_after_prefill.append(prefill_released.is_set())
                    break

        task = asyncio.create_task(first_chunk())
        await until(lambda: len(gate.held) == 1, "the prefill hold")
        assert gate.held[0][0] == pytest.approx(160 / 100)  # nothing cached yet
        prefill_released.set()
        gate.release()
        await until(lambda: len(gate.held) == 1 and gate.held[0][0] == 2.0, "the decode hold")
        await task
        assert seen_after_prefill == [True]  # the first chunk came after the prefill
        gate.release()
        # The same prompt again: found whole, only its last token is computed again.
        second = asyncio.create_task(client.post(url, json=completion(prompt)))
        await until(lambda: len(gate.held) == 1, "the second prefill")
        assert gate.release() == pytest.approx(1 / 100)
        await until(lambda: len(gate.held) == 1, "the second decode")
        assert gate.release() == 1.0
        assert (await second).is_success
        # A longer prompt with that prefix prefills only what is new.
        third = asyncio.create_task(client.post(url, json=completion(prompt + "q" * 400)))
        await until(lambda: len(gate.held) == 1, "the third prefill")
        assert gate.release() == pytest.approx(100 / 100)  # 400 new characters: 100 tokens
        await until(lambda: len(gate.held) == 1, "the third decode")
        gate.release()
        assert (await third).is_success
        truth = sim.snapshot("e")
        page = read_page((await client.get(sim.metrics_url("e"))).content)
        answer = sim.prefix(prompt)["endpoints"]["e"]
    assert truth.prefix_cache_queries == 160 + 160 + 260
    assert truth.prefix_cache_hits == 159 + 160
    assert page.prefix_cache_queries_total == truth.prefix_cache_queries
    assert page.prefix_cache_hits_total == truth.prefix_cache_hits
    assert answer["cached_tokens"] == 159 and answer["prefill_tps"] == 100.0
    assert answer["mean_service_s"] > 0


async def test_the_pool_bounds_the_prefix_cache_of_an_engine(client: httpx.AsyncClient) -> None:
    spec = EndpointSpec("e", capacity=2, load=0, kv_blocks=4)
    a, b = text("a", 3), text("b", 3)
    async with Simulator([spec], clock=FakeClock(), hold=instant) as sim:
        url = sim.base_url("e") + "/v1/completions"
        for prompt in (a, b, a):
            assert (await client.post(url, json=completion(prompt))).is_success
        truth = sim.snapshot("e")
        body = (await client.get(sim.metrics_url("e"))).text
    assert 'num_gpu_blocks="4"' in body
    assert truth.prefix_cache_hits == 1 * BLOCK_TOKENS  # a's head survived b, its tail not


async def test_the_oracle_call_and_the_reset_through_the_admin_api(
    client: httpx.AsyncClient,
) -> None:
    specs = [EndpointSpec(i, capacity=4, load=0, prefill_tps=1000.0) for i in ("a", "b")]
    specs.append(EndpointSpec("other", capacity=4, load=0, model="another/model"))
    system = text("system", 20)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]
    async with Simulator(specs, clock=FakeClock(), hold=instant) as sim:
        chat = {"model": MODEL, "messages": messages, "max_tokens": 4}
        answer = await client.post(sim.base_url("a") + "/v1/chat/completions", json=chat)
        assert answer.is_success
        admin = sim.admin_url + "/admin/prefix"
        reply = (await client.post(admin, json={"messages": messages, "model": MODEL})).json()
        assert set(reply["endpoints"]) == {"a", "b"}  # only those serving the model
        a, b = reply["endpoints"]["a"], reply["endpoints"]["b"]
        # Every whole block of the prompt is on a (the partial last one never is).
        assert a["cached_tokens"] == reply["blocks"] * BLOCK_TOKENS < reply["prompt_tokens"]
        assert b["cached_tokens"] == 0
        assert (a["running"], a["waiting"], a["capacity"], a["serving"]) == (0, 0, 4, True)
        # The system prompt alone: every one of its blocks is on a, none on b.
        head = (await client.post(admin, json={"prompt": "system: " + system})).json()
        assert head["endpoints"]["a"]["cached_tokens"] == head["blocks"] * BLOCK_TOKENS
        assert head["endpoints"]["other"]["cached_tokens"] == 0
        for bad in ({}, {"prompt": 3}, {"prompt": "x", "messages": messages}, [1]):
            refused = await client.post(admin, json=bad)
            assert refused.status_code == 400 and "error" in refused.json(), bad
        before = read_page((await client.get(sim.metrics_url("a"))).content)
        assert before.prefix_cache_queries_total == reply["prompt_tokens"]
        reset = await client.post(admin + "/reset", json={"id": "a"})
        assert reset.json() == {"reset": ["a"]}
        after = read_page((await client.get(sim.metrics_url("a"))).content)
        again = (await client.post(admin, json={"messages": messages})).json()
        unknown = await client.post(admin + "/reset", json={"id": "nope"})
    assert after.prefix_cache_queries_total == 0 and after.prefix_cache_hits_total == 0
    assert again["endpoints"]["a"]["cached_tokens"] == 0
    assert again["endpoints"]["a"]["cached_blocks"] == 0
    assert unknown.status_code == 404


@pytest.mark.parametrize(("field", "value"), [("prefill_tps", 0), ("kv_blocks", 0)])
def test_bad_prefix_settings_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        EndpointSpec.from_dict({"id": "e", field: value})
