"""LoadAwareStrategy passes a chat request's messages to the picker as its prompt: a
conversation's next turn goes to the deployment its earlier turns went to."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import redis.asyncio as aioredis

from tests.support.litellm_fleet import MODEL
from tests.support.redisproc import RedisProcess

# isort: off
# litellm_fleet first: it sets LITELLM_LOCAL_MODEL_COST_MAP before litellm loads.
import litellm
from poller.integrations.litellm import LoadAwareStrategy
from poller.integrations.litellm.strategy import _prompt
from poller.reader import StatsReader, prompt_of
from poller.reader.prefix.blocks import block_ids
from poller.schema.endpoint import Endpoint
from poller.store.store import RedisStore
from tests.support.procs import until

# isort: on

pytestmark = [
    # LiteLLM's own types make pydantic warn; nothing of ours.
    pytest.mark.filterwarnings("ignore:Items? .* using the `ReadOnly` qualifier:UserWarning"),
]

NS = "lp"
PORTS = (1, 2, 3, 4)


async def publish(url: str) -> None:
    """Four idle endpoints serving MODEL, fresh for two minutes."""
    client = aioredis.Redis.from_url(url, decode_responses=True)
    store = RedisStore(client, NS)
    await store.heartbeat("p1", 60_000)
    ids = [f"e{p}" for p in PORTS]
    for port in PORTS:
        await store.put_endpoint(Endpoint(id=f"e{port}", url=f"http://h:{port}"))
    for acquired in await store.acquire_leases("p1", ids, 60_000):
        assert acquired.token is not None
        stats = {"engine": "vllm", "running": "0", "waiting": "0", "models": MODEL}
        stats |= {"interval_ms": "60000", "kv_capacity_tokens": "65536"}
        written = await store.write_stats(
            acquired.endpoint_id, "p1", acquired.token, stats, lease_ttl_ms=60_000,
            stats_ttl_ms=120_000,
        )  # fmt: skip
        assert written.accepted
    await client.aclose()


def conversation(i: int, turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": f"Conversation {i}. " + "Be careful. " * 60}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Question {t} " * 40})
        messages.append({"role": "assistant", "content": f"Answer {t} " * 40})
    return messages


async def test_a_conversations_next_turn_goes_where_its_earlier_turns_went(
    redis_server: RedisProcess,
) -> None:
    await publish(redis_server.url)
    reader = StatsReader.from_url(redis_server.url, NS)
    model_list = [
        {
            "model_name": "chat",
            "litellm_params": {"model": f"openai/{MODEL}", "api_base": f"http://h:{p}/v1"},
            "model_info": {"id": f"d{p}"},
        }
        for p in PORTS
    ]
    async with reader.router(rng=random.Random(5)) as gateway:
        await until(lambda: all(gateway.get(f"e{p}") for p in PORTS), 30, "the view")
        router = litellm.Router(model_list=model_list, num_retries=0)
        strategy = LoadAwareStrategy(router, poller_router=gateway).install()
        try:
            first: dict[int, str] = {}
            for i in range(8):
                chosen = await strategy.async_get_available_deployment(
                    "chat", messages=conversation(i, 1)
                )
                first[i] = chosen["model_info"]["id"]
            assert len(set(first.values())) > 1  # new conversations spread
            for i in range(8):
                later = await strategy.async_get_available_deployment(
                    "chat", messages=conversation(i, 3)
                )
                assert later["model_info"]["id"] == first[i], i
            # The sync path too, and what it placed is the messages' text.
            again = strategy.get_available_deployment("chat", messages=conversation(0, 4))
            assert again["model_info"]["id"] == first[0]
            ids = block_ids(prompt_of(conversation(0, 4)), MODEL)
            assert gateway.placements.matches(ids) == [(f"e{first[0][1:]}", len(ids))]
            # Without messages (an embedding, a text completion): load only, nothing placed.
            placed = len(gateway.placements)
            blind: Counter[str] = Counter()
            for _ in range(8):
                chosen = await strategy.async_get_available_deployment("chat")
                blind[chosen["model_info"]["id"]] += 1
            assert len(gateway.placements) == placed and len(blind) > 1, blind
        finally:
            strategy.uninstall()
    await reader.aclose()


def test_messages_that_are_not_chat_messages_give_no_prompt() -> None:
    assert _prompt(None) is None and _prompt([]) is None
    assert _prompt(["not a message"]) is None  # LiteLLM judges the request, not us
    assert _prompt([{"role": "user", "content": "hi"}]) == "<|user|>\nhi\n"
