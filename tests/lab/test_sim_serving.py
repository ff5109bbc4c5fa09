"""The simulator's request path: slots, FIFO queue, stream shapes, 404, lag, sleep, faults.

Served requests hold their slot through a ``Gate`` the test opens, and the metrics lag runs
on a fake clock: no verdict here depends on the machine's speed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from poller.errors import ConfigError
from poller.schema.stats import Signals
from poller.scrape.engines import mapping_for
from poller_lab.sim import EndpointSpec, Simulator, fleet

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Gate:
    """A ``hold`` that keeps each request's slot until the test releases it."""

    def __init__(self) -> None:
        self.held: list[tuple[float, asyncio.Event]] = []
        self.changed = asyncio.Event()

    async def hold(self, seconds: float) -> None:
        event = asyncio.Event()
        self.held.append((seconds, event))
        self.changed.set()
        await event.wait()

    def release(self) -> float:
        """Let the oldest held request finish; returns the seconds it asked to hold."""
        seconds, event = self.held.pop(0)
        event.set()
        return seconds


async def until(cond: Callable[[], bool], what: str) -> None:
    """Wait for ``cond`` (state on this loop); the bound only catches a broken test."""
    try:
        async with asyncio.timeout(30):
            # The simulator's queue has no event to await: look again each loop turn.
            while not cond():  # noqa: ASYNC110
                await asyncio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"never happened: {what}") from None


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as c:
        yield c


def chat(model: str = MODEL, max_tokens: int = 16, **extra: object) -> dict[str, object]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return {**body, "max_tokens": max_tokens, **extra}


def read_page(body: bytes) -> Signals:
    return mapping_for("vllm").read(body, "text/plain")


def queue(sim: Simulator, endpoint_id: str) -> tuple[int, int]:
    q = sim.queues()["endpoints"][endpoint_id]
    return q["running"], q["waiting"]


async def test_slots_then_fifo_queue_and_the_page_counts_them(
    client: httpx.AsyncClient,
) -> None:
    gate, clock = Gate(), FakeClock()
    spec = EndpointSpec("e", capacity=2, load=0, speed_tps=10.0)
    async with Simulator([spec], clock=clock, hold=gate.hold, warmup_s=0) as sim:
        url = sim.base_url("e") + "/v1/chat/completions"
        tasks = []
        # max_tokens 10, 20, 30, 40 -> 1, 2, 3, 4 s of hold: the order is readable.
        for i, expect in enumerate([(1, 0), (2, 0), (2, 1), (2, 2)]):
            body = chat(max_tokens=10 * (i + 1), messages=[{"role": "user", "content": f"q{i}"}])
            tasks.append(asyncio.create_task(client.post(url, json=body)))
            await until(lambda e=expect: queue(sim, "e") == e, f"queue {expect}")
        assert [s for s, _ in gate.held] == [1.0, 2.0]
        page = read_page((await client.get(sim.metrics_url("e"))).content)
        assert (page.running, page.waiting) == (2, 2)
        assert page.kv_cache_usage is not None and page.kv_cache_usage > 0
        assert gate.release() == 1.0
        await until(lambda: len(gate.held) == 2 and gate.held[-1][0] == 3.0, "the oldest waiter")
        assert queue(sim, "e") == (2, 1)  # FIFO: 30 tokens started before 40
        while gate.held or not all(t.done() for t in tasks):
            if gate.held:
                gate.release()
            await asyncio.sleep(0.005)
        answers = [t.result() for t in tasks]
        assert queue(sim, "e") == (0, 0)
        assert sim.queues()["endpoints"]["e"]["peak_waiting"] == 2
    for i, answer in enumerate(answers):
        assert answer.status_code == 200
        data = answer.json()
        assert data["object"] == "chat.completion"
        assert data["model"] == MODEL
        assert data["usage"]["completion_tokens"] == 10 * (i + 1)
        assert data["choices"][0]["message"]["role"] == "assistant"
        assert data["choices"][0]["finish_reason"] == "length"
        assert answer.headers["x-sim-endpoint"] == "e"


async def test_a_fleets_first_endpoint_answers_at_once_unless_given_a_load(
    client: httpx.AsyncClient,
) -> None:
    """A newcomer's first ``curl`` goes to the first endpoint (or the lone one): with a
    seeded background load it waited behind a queue (256 running, 189 waiting)."""
    assert [s.load for s in fleet(3, engines="vllm")] == [0.0, None, None]
    assert [s.load for s in fleet(2, engines="vllm", load=0.5)] == [0.5, 0.5]
    gate = Gate()
    async with Simulator(fleet(2, engines="vllm"), seed=1, hold=gate.hold) as sim:
        first = read_page((await client.get(sim.metrics_url("vllm-0"))).content)
        busy = read_page((await client.get(sim.metrics_url("vllm-1"))).content)
        assert (first.running, first.waiting) == (0, 0)
        assert busy.running > 0  # the others keep the seed's load: the demo's story
        url = sim.base_url("vllm-0") + "/v1/chat/completions"
        answer = asyncio.create_task(client.post(url, json=chat()))
        await until(lambda: len(gate.held) == 1, "the request in a slot")
        assert queue(sim, "vllm-0") == (1, 0)  # running at once, nothing before it
        gate.release()
        assert (await answer).status_code == 200


def _events(text: str) -> list[str]:
    return [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]


async def instant(seconds: float) -> None:
    del seconds


async def test_stream_and_plain_shapes_of_both_routes(client: httpx.AsyncClient) -> None:
    spec = EndpointSpec("e", capacity=4, load=0)
    async with Simulator([spec], clock=FakeClock(), hold=instant) as sim:
        base = sim.base_url("e")
        streamed = await client.post(base + "/v1/chat/completions", json=chat(stream=True))
        plain = await client.post(
            base + "/v1/completions", json={"model": MODEL, "prompt": "once upon"}
        )
        text_stream = await client.post(
            base + "/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "stream": True}
        )
        models = (await client.get(base + "/v1/models")).json()
        served = sim.snapshot("e").request_success
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = _events(streamed.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content.split()[:2] == ["the", "engine"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 16
    data = plain.json()
    assert data["object"] == "text_completion"
    assert data["choices"][0]["text"] and data["usage"]["completion_tokens"] == 16
    completion_chunks = [json.loads(e) for e in _events(text_stream.text)[:-1]]
    assert {c["object"] for c in completion_chunks} == {"text_completion"}
    assert models["data"][0]["id"] == MODEL
    assert served == 3


async def test_another_model_is_a_404_and_bad_input_a_400(client: httpx.AsyncClient) -> None:
    spec = EndpointSpec("e", load=0, lora=("sql-lora",))
    async with Simulator([spec], clock=FakeClock(), hold=instant) as sim:
        url = sim.base_url("e") + "/v1/chat/completions"
        other = await client.post(url, json=chat(model="other/model"))
        adapter = await client.post(url, json=chat(model="sql-lora"))
        bad = [
            await client.post(url, content=b"{not json"),
            await client.post(url, json=chat(max_tokens=0)),
            await client.post(url, json={"model": MODEL}),
            await client.post(url, json=chat(stream="yes")),
        ]
        assert queue(sim, "e") == (0, 0)
    assert other.status_code == 404
    error = other.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("NotFoundError", "model", 404)
    assert "other/model" in error["message"]
    assert adapter.status_code == 200
    assert [b.status_code for b in bad] == [400] * 4
    assert [b.json()["error"]["param"] for b in bad[1:]] == ["max_tokens", "messages", "stream"]


async def test_the_page_shows_the_queue_as_it_was_lag_seconds_ago(
    client: httpx.AsyncClient,
) -> None:
    gate, clock = Gate(), FakeClock()
    spec = EndpointSpec("e", capacity=1, load=0, metrics_lag_s=5.0)
    async with Simulator([spec], clock=clock, hold=gate.hold, warmup_s=0) as sim:
        url = sim.base_url("e") + "/v1/chat/completions"
        tasks = [asyncio.create_task(client.post(url, json=chat())) for _ in range(2)]
        await until(lambda: queue(sim, "e") == (1, 1), "one running, one waiting")

        async def page() -> tuple[int, int]:
            signals = read_page((await client.get(sim.metrics_url("e"))).content)
            return signals.running, signals.waiting

        assert await page() == (0, 0)  # the truth is 5 s old on the page
        clock.now += 4.5  # binary fractions: the sums are exact
        assert await page() == (0, 0)
        clock.now += 0.5
        assert await page() == (1, 1)
        gate.release()
        await until(lambda: queue(sim, "e") == (1, 0), "the second starts")
        assert await page() == (1, 1)
        clock.now += 5
        assert await page() == (1, 0)
        gate.release()
        await asyncio.gather(*tasks)


async def test_sleep_and_wake_up_through_vllm_routes_and_the_admin_api(
    client: httpx.AsyncClient,
) -> None:
    spec = EndpointSpec("e", load=0.5)
    async with Simulator([spec], clock=FakeClock(), hold=instant) as sim:
        base = sim.base_url("e")
        assert (await client.post(base + "/sleep", params={"level": "2"})).status_code == 200
        assert (await client.get(base + "/is_sleeping")).json() == {"is_sleeping": True}
        asleep = await client.post(base + "/v1/chat/completions", json=chat())
        page = read_page((await client.get(sim.metrics_url("e"))).content)
        queues = sim.queues()["endpoints"]["e"]
        assert (await client.post(base + "/wake_up")).status_code == 200
        awake_page = read_page((await client.get(sim.metrics_url("e"))).content)
        served = await client.post(base + "/v1/chat/completions", json=chat())
        admin = sim.admin_url + "/admin/endpoints/e"
        slept = (await client.post(admin + "/sleep", json={"level": 1})).json()
        refused = await client.post(admin + "/sleep", json={"level": 3})
        woke = (await client.post(admin + "/wake_up")).json()
    assert asleep.status_code == 503
    assert asleep.json()["error"]["code"] == 503
    assert (page.sleeping, page.running, page.waiting) == (True, 0, 0)
    assert queues["serving"] is False
    assert awake_page.sleeping is False
    assert served.status_code == 200
    assert (slept["sleep_level"], woke["sleep_level"]) == (1, 0)
    assert refused.status_code == 400


async def test_a_failing_endpoint_fails_requests_and_the_oracle_sees_it(
    client: httpx.AsyncClient,
) -> None:
    specs = [EndpointSpec("bad", load=0), EndpointSpec("gone", load=0, style="port")]
    async with Simulator(specs, clock=FakeClock(), hold=instant) as sim:
        await sim.set_fault("bad", "http500")
        failed = await client.post(sim.base_url("bad") + "/v1/completions", json={"model": MODEL})
        gone_url = sim.base_url("gone") + "/v1/completions"
        await sim.set_fault("gone", "down")
        with pytest.raises(httpx.TransportError):
            await client.post(gone_url, json={"model": MODEL, "prompt": "x"})
        answer = (await client.get(sim.admin_url + "/admin/queue")).json()
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "InternalServerError"
    endpoints = answer["endpoints"]
    assert endpoints["bad"]["serving"] is False and endpoints["gone"]["serving"] is False
    assert set(endpoints["bad"]) == {
        "running",
        "waiting",
        "capacity",
        "speed_tps",
        "models",
        "serving",
        "peak_waiting",
    }
    assert answer["time"] > 1e9  # unix seconds, comparable across processes


async def test_kv_capacity_follows_the_slots_and_prefix_counters_count_requests(
    client: httpx.AsyncClient,
) -> None:
    spec = EndpointSpec("e", capacity=8, load=0)
    async with Simulator([spec], clock=FakeClock(), hold=instant) as sim:
        prompt = "a shared system prompt that is long enough for several blocks " * 8
        for _ in range(2):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
            assert (await client.post(sim.base_url("e") + "/v1/completions", json=body)).is_success
        body_text = (await client.get(sim.metrics_url("e"))).text
        truth = sim.snapshot("e")
    assert 'num_gpu_blocks="895"' in body_text  # round(8 * 28642 / 256)
    assert truth.prefix_cache_queries == 2 * (len(prompt) // 4)
    assert 0 < truth.prefix_cache_hits < truth.prefix_cache_queries  # the second one hits
    page = read_page(body_text.encode())
    assert page.prefix_cache_hits_total == truth.prefix_cache_hits


@pytest.mark.parametrize(
    ("field", "value"), [("speed_tps", 0), ("speed_tps", "fast"), ("metrics_lag_s", -1)]
)
def test_bad_serving_parameters_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        EndpointSpec.from_dict({"id": "e", field: value})


@pytest.mark.parametrize("engine", ["vllm", "sglang", "triton"])
async def test_every_engine_publishes_a_kv_pool_sized_by_its_slots(
    engine: str, client: httpx.AsyncClient
) -> None:
    from poller_lab.sim import ENGINES

    spec = EndpointSpec("e", engine, capacity=8, load=0)
    async with Simulator([spec], clock=FakeClock(), hold=instant) as sim:
        response = await client.get(sim.metrics_url("e"))
    mapping = mapping_for(ENGINES[engine].registry_engine)
    signals = mapping.read(response.content, response.headers["content-type"])
    assert signals.kv_capacity_tokens == round(8 * 28642 / 256) * 16
