"""The engine simulator: pages the mappings can read, load, URL styles, faults, admin API."""

from __future__ import annotations

import asyncio
import io
import json
import re
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from poller.errors import ConfigError, ContractError, ParseError
from poller.schema.endpoint import endpoint_from_dict
from poller.scrape.engines import mapping_for
from poller_lab.sim import ENGINES, FAULT_MODES, EndpointSpec, Simulator, fleet, main, run_sim
from poller_lab.sim.model import STEP_S, EndpointLoad, LoadParams
from tests.support.procs import until


class FakeClock:
    """Simulated seconds that move only when a test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    # Generous: every request through it should succeed; tests that expect a timeout
    # pass their own (a read timeout only, see read_timeout).
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as c:
        yield c


def sim_with(specs: Iterable[EndpointSpec], clock: FakeClock | None = None) -> Simulator:
    return Simulator(specs, seed=7, clock=clock or FakeClock())


def read_timeout(seconds: float) -> httpx.Timeout:
    """A short read timeout, the behaviour under test; connecting keeps the ample one."""
    return httpx.Timeout(30.0, read=seconds)


async def fetch(client: httpx.AsyncClient, url: str, **kw: object) -> httpx.Response:
    return await client.get(url, **kw)  # type: ignore[arg-type]


# --- pages ---------------------------------------------------------------------------------

PAGE_BYTES = {  # (min, max) for one rank: what real pages of these engines weigh
    "vllm": (55_000, 70_000),
    "vllm-v0": (40_000, 60_000),
    "sglang": (15_000, 40_000),
    "llamacpp": (1_000, 4_000),
    "trtllm": (6_000, 20_000),
    "triton": (5_000, 40_000),
    "tgi": (60_000, 120_000),
    "lmdeploy": (5_000, 20_000),
}


@pytest.mark.parametrize("engine", list(ENGINES))
async def test_every_engine_page_yields_its_signals(
    engine: str, clock: FakeClock, client: httpx.AsyncClient
) -> None:
    spec = EndpointSpec("e1", engine, load=0.8)
    async with sim_with([spec], clock) as sim:
        clock.advance(90)
        response = await fetch(client, sim.metrics_url("e1"))
        truth = sim.snapshot("e1")
    assert response.status_code == 200
    body = response.content
    low, high = PAGE_BYTES[engine]
    assert low <= len(body) <= high, len(body)
    # A full parser accepts the whole page, histograms and all.
    families = list(text_string_to_metric_families(body.decode()))
    assert len(families) > 10
    mapping = mapping_for(ENGINES[engine].registry_engine)
    signals = mapping.read(body, response.headers["content-type"])
    assert (signals.running, signals.waiting) == (truth.running, truth.waiting)
    assert truth.running > 0
    if engine != "tgi":  # TGI publishes no KV usage
        assert signals.kv_cache_usage == pytest.approx(truth.kv_cache_usage, abs=1e-6)
    if signals.prefix_cache_hits_total is not None:
        assert signals.prefix_cache_hits_total == truth.prefix_cache_hits
        assert signals.prefix_cache_queries_total == truth.prefix_cache_queries


async def test_vllm_data_parallel_and_lora_series(
    clock: FakeClock, client: httpx.AsyncClient
) -> None:
    spec = EndpointSpec("v", "vllm", dp=3, lora=("sql-lora", "chat-lora"), load=0.9)
    async with sim_with([spec], clock) as sim:
        clock.advance(120)
        response = await fetch(client, sim.metrics_url("v"))
        truth = sim.snapshot("v")
    text = response.text
    assert len(re.findall(r"^vllm:num_requests_running\{", text, re.M)) == 3
    assert {'engine="0"', 'engine="1"', 'engine="2"'} <= set(re.findall(r'engine="\d"', text))
    signals = mapping_for("vllm").read(response.content)
    assert signals.running == truth.running
    assert signals.kv_cache_usage == truth.kv_cache_usage
    # Old adapter combinations linger; the newest (largest timestamp) is the current one.
    assert len(re.findall(r"^vllm:lora_requests_info\{", text, re.M)) >= 2
    assert (signals.lora_running, signals.lora_waiting) == (truth.lora_running, truth.lora_waiting)
    assert signals.lora_max == 2
    stamps = [float(v) for v in re.findall(r"^vllm:lora_requests_info\{.*\} (\S+)$", text, re.M)]
    assert max(stamps) == pytest.approx(time.time(), abs=300)


async def test_lmdeploy_data_parallel_ranks(clock: FakeClock, client: httpx.AsyncClient) -> None:
    spec = EndpointSpec("lm", "lmdeploy", dp=2, load=0.9)
    async with sim_with([spec], clock) as sim:
        clock.advance(60)
        response = await fetch(client, sim.metrics_url("lm"))
        truth = sim.snapshot("lm")
    text = response.text
    assert len(re.findall(r"^lmdeploy:num_requests_running\{", text, re.M)) == 2
    assert {'engine="0"', 'engine="1"'} <= set(re.findall(r'engine="\d"', text))
    signals = mapping_for("lmdeploy").read(response.content)
    assert (signals.running, signals.waiting) == (truth.running, truth.waiting)
    assert signals.api_waiting == 0 and signals.kv_cache_usage == truth.kv_cache_usage
    assert signals.models == (spec.model or ENGINES["lmdeploy"].model,)


async def test_vllm_v0_and_sglang_shapes(clock: FakeClock, client: httpx.AsyncClient) -> None:
    specs = [EndpointSpec("v0", "vllm-v0"), EndpointSpec("sg", "sglang", dp=2)]
    async with sim_with(specs, clock) as sim:
        clock.advance(30)
        v0 = (await fetch(client, sim.metrics_url("v0"))).text
        sg = (await fetch(client, sim.metrics_url("sg"))).text
    for name in ("gpu_cache_usage_perc", "gpu_prefix_cache_hit_rate", "num_requests_swapped"):
        assert f"\nvllm:{name}{{" in v0
    assert "kv_cache_usage_perc" not in v0 and "engine=" not in v0
    assert "vllm:lora_requests_info" not in v0  # no adapters configured: no family
    assert mapping_for("vllm").read(v0.encode()).sources["kv_cache_usage"] == (
        "vllm:gpu_cache_usage_perc"
    )
    assert re.search(r'^sglang:num_running_reqs\{dp_rank="1",.*tp_rank="0"\}', sg, re.M)
    assert "sglang:cache_hit_rate{" in sg and "sglang:cached_tokens_total{" in sg


async def test_llamacpp_key_and_nan_before_first_decode(
    clock: FakeClock, client: httpx.AsyncClient
) -> None:
    spec = EndpointSpec("ll", "llamacpp", api_key="s3cret", load=0.0)
    async with sim_with([spec], clock) as sim:
        url = sim.metrics_url("ll")
        assert (await fetch(client, url)).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert (await fetch(client, url, headers=wrong)).status_code == 401
        good = await fetch(client, url, headers={"Authorization": "Bearer s3cret"})
    assert good.status_code == 200
    assert "\nllamacpp:n_busy_slots_per_decode -nan\n" in good.text
    assert "{" not in good.text  # llama.cpp writes no labels
    signals = mapping_for("llamacpp").read(good.content, good.headers["content-type"])
    assert (signals.running, signals.waiting) == (0, 0)


async def test_trtllm_json_metrics_and_prometheus_text(client: httpx.AsyncClient) -> None:
    async with sim_with([EndpointSpec("t", "trtllm")]) as sim:
        plain = await fetch(client, sim.metrics_url("t", json=True))
        text = await fetch(client, sim.metrics_url("t"))
    assert sim.metrics_url("t").endswith("/prometheus/metrics")
    assert plain.headers["content-type"] == "application/json"
    assert plain.json()[0]["kvCacheStats"]["maxNumBlocks"] > 0
    mapping = mapping_for("trtllm")
    with pytest.raises(ParseError, match="application/json"):
        mapping.read(plain.content, plain.headers["content-type"])
    assert mapping.read(text.content, text.headers["content-type"]).models == ()  # "undefined"


# --- load ----------------------------------------------------------------------------------


def test_load_is_deterministic_and_evolves() -> None:
    params = LoadParams(capacity=32, load=0.9, period_s=60.0)
    a = EndpointLoad(params, seed="s", t0=0.0, ranks=2)
    b = EndpointLoad(params, seed="s", t0=0.0, ranks=2)
    b.advance_to(37.3)  # looked at more often: the same state at the same time
    seen = set()
    previous = (0, 0, 0)
    for t in range(1, 301):
        a.advance_to(float(t))
        if t % 7 == 0:
            b.advance_to(float(t))
        s = a.states[0]
        seen.add((s.running, s.waiting))
        assert 0 <= s.running <= 32 and 0.0 <= s.kv <= 1.0
        assert s.waiting == 0 or s.running == 32  # a queue only forms at capacity
        counters = (s.prompt_tokens, s.prefix_hits, s.success)
        assert all(now >= before for now, before in zip(counters, previous, strict=True))
        previous = counters
    b.advance_to(300.0)
    assert a.states == b.states
    assert len(seen) > 20  # it moves
    assert a.states[0].prefix_hits < a.states[0].prefix_queries


def test_overload_builds_a_queue_and_idle_stays_empty() -> None:
    busy = EndpointLoad(LoadParams(capacity=16, load=3.0), seed="b", t0=0.0)
    idle = EndpointLoad(LoadParams(capacity=16, load=0.0), seed="i", t0=0.0)
    busy.advance_to(120.0)
    idle.advance_to(120.0)
    assert busy.states[0].running == 16 and busy.states[0].waiting > 16
    assert busy.states[0].kv > 0.5
    assert (idle.states[0].running, idle.states[0].kv, idle.states[0].decodes) == (0, 0.0, 0)


def test_a_long_idle_gap_is_cheap() -> None:
    load = EndpointLoad(LoadParams(capacity=64, load=1.0), seed="g", t0=0.0)
    started = time.process_time()
    load.advance_to(7 * 24 * 3600.0)  # a week unobserved
    assert time.process_time() - started < 0.5
    assert load.step == 7 * 24 * 3600 / STEP_S
    assert load.states[0].prompt_tokens > 0


async def test_restart_resets_counters_once(clock: FakeClock, client: httpx.AsyncClient) -> None:
    async with sim_with([EndpointSpec("r", "vllm", load=1.0)], clock) as sim:
        clock.advance(60)
        before = mapping_for("vllm").read((await fetch(client, sim.metrics_url("r"))).content)
        assert (await sim.set_fault("r", "restart")).mode == "ok"
        after = mapping_for("vllm").read((await fetch(client, sim.metrics_url("r"))).content)
        clock.advance(30)
        later = mapping_for("vllm").read((await fetch(client, sim.metrics_url("r"))).content)
    assert before.prefix_cache_queries_total and before.prefix_cache_queries_total > 0
    assert after.prefix_cache_queries_total == 0 and after.running == 0
    assert later.prefix_cache_queries_total and later.prefix_cache_queries_total > 0
    assert sim.snapshot("r").restarts == 1


# --- URL styles, admin API, hits -----------------------------------------------------------


async def test_both_url_styles(client: httpx.AsyncClient) -> None:
    specs = [EndpointSpec("by-port", "sglang", "port"), EndpointSpec("by-path", "sglang")]
    async with sim_with(specs) as sim:
        port_url, path_url = sim.base_url("by-port"), sim.base_url("by-path")
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", port_url)
        assert path_url == f"http://127.0.0.1:{sim.port}/e/by-path"
        for url in (port_url, path_url):
            assert (await fetch(client, url + "/metrics")).status_code == 200
            assert (await fetch(client, url + "/health")).status_code == 200
            assert (await fetch(client, url + "/nope")).status_code == 404
        missing = await fetch(client, f"http://127.0.0.1:{sim.port}/e/by-port/metrics")
        assert missing.status_code == 404  # a port-style endpoint is not under /e/
        assert (sim.hits("by-port"), sim.hits("by-path")) == (1, 1)
    with pytest.raises(httpx.ConnectError):  # stopped: nothing listens any more
        await fetch(client, port_url + "/metrics")


async def test_restarted_simulator_keeps_its_urls(client: httpx.AsyncClient) -> None:
    sim = sim_with([EndpointSpec("p", "tgi", "port"), EndpointSpec("q", "tgi")])
    await sim.start()
    urls = (sim.metrics_url("p"), sim.metrics_url("q"))
    await sim.stop()
    await sim.stop()  # idempotent
    async with sim:
        assert (sim.metrics_url("p"), sim.metrics_url("q")) == urls
        for url in urls:
            assert (await fetch(client, url)).status_code == 200


async def test_hit_counting_is_exact(client: httpx.AsyncClient) -> None:
    async with sim_with(fleet(3, style="path")) as sim:
        before = time.time()
        for _ in range(25):
            await fetch(client, sim.metrics_url("vllm-0"))
        await asyncio.gather(*(fetch(client, sim.metrics_url("sglang-1")) for _ in range(10)))
        await fetch(client, sim.base_url("vllm-0") + "/health")  # not a metrics request
        assert (sim.hits("vllm-0"), sim.hits("sglang-1"), sim.hits("llamacpp-2")) == (25, 10, 0)
        times = sim.hit_times("vllm-0")
        assert len(times) == 25 and times == sorted(times) and times[0] >= before
        sim.reset_hits("vllm-0")
        assert (sim.hits("vllm-0"), sim.hit_times("vllm-0"), sim.hits("sglang-1")) == (0, [], 10)


async def test_admin_api_over_http(client: httpx.AsyncClient) -> None:
    async with sim_with([EndpointSpec("a", "vllm")]) as sim:
        admin = sim.admin_url + "/admin"
        listed = (await fetch(client, admin + "/endpoints")).json()
        assert [(e["id"], e["engine"], e["fault"]["mode"], e["hits"]) for e in listed] == [
            ("a", "vllm", "ok", 0)
        ]
        added = await client.post(
            admin + "/endpoints",
            json=[{"id": "b", "engine": "llamacpp", "style": "port", "api_key": "k"}],
        )
        assert added.status_code == 201
        b_url = added.json()[0]["base_url"]
        assert (await fetch(client, b_url + "/metrics")).status_code == 401
        fault = await client.post(admin + "/endpoints/a/fault", json={"mode": "http500"})
        assert fault.json()["fault"] == {"mode": "http500"}
        assert (await fetch(client, sim.metrics_url("a"))).status_code == 500
        hits = (await fetch(client, admin + "/hits")).json()
        assert hits["hits"] == {"a": 1, "b": 1} and len(hits["times"]["a"]) == 1
        narrow = (await fetch(client, admin + "/hits", params={"id": "b", "times": "0"})).json()
        assert narrow == {"hits": {"b": 1}}
        await client.post(admin + "/hits/reset", json={})
        assert (await fetch(client, admin + "/hits")).json()["hits"] == {"a": 0, "b": 0}
        registry = (await fetch(client, admin + "/registry")).json()
        assert registry[1] == {"id": "b", "url": b_url, "engine": "llamacpp"} | {
            "api_key_env": "LLMGW_KEY_SIM"
        }
        snapshot = (await fetch(client, admin + "/endpoints/a/snapshot")).json()
        assert snapshot["restarts"] == 0
        for method, path, body, status in (
            ("POST", "/endpoints/a/fault", {"mode": "melt"}, 400),
            ("POST", "/endpoints/a/fault", {"mode": "slow", "delay_s": -1}, 400),
            ("POST", "/endpoints/zz/fault", {"mode": "ok"}, 404),
            ("POST", "/endpoints", {"id": "a"}, 400),
            ("POST", "/endpoints", {"id": "c", "engine": "nope"}, 400),
            ("GET", "/endpoints/zz", None, 404),
        ):
            answer = await client.request(method, admin + path, json=body)
            assert answer.status_code == status, (path, body, answer.text)
            assert "error" in answer.json()
        deleted = await client.delete(admin + "/endpoints/b")
        assert deleted.json() == {"deleted": "b"} and sim.ids == ["a"]
    with pytest.raises(httpx.ConnectError):
        await fetch(client, b_url + "/metrics")


# --- faults --------------------------------------------------------------------------------


async def test_down_and_refuse(client: httpx.AsyncClient) -> None:
    specs = [EndpointSpec("p", "vllm", "port"), EndpointSpec("q", "vllm")]
    async with sim_with(specs) as sim:
        p_url, q_url = sim.metrics_url("p"), sim.metrics_url("q")
        assert (await fetch(client, p_url)).status_code == 200  # a keep-alive connection
        for mode in ("down", "refuse"):
            await sim.set_fault("p", mode)
            with pytest.raises(httpx.ConnectError):
                await fetch(client, p_url)
        await sim.set_fault("p", "ok")
        assert (await fetch(client, p_url)).status_code == 200  # the same port again
        await sim.set_fault("q", "down")
        with pytest.raises(httpx.RemoteProtocolError):  # closed without a response
            await fetch(client, q_url)
        await sim.set_fault("q", "refuse")
        with pytest.raises(httpx.ReadError):  # reset
            await fetch(client, q_url)
        assert sim.hits("p") == 2  # refused connections never reach the simulator


async def test_hang_and_slow(client: httpx.AsyncClient) -> None:
    async with sim_with([EndpointSpec("h", "tgi")]) as sim:
        url = sim.metrics_url("h")
        await sim.set_fault("h", "hang")
        with pytest.raises(httpx.ReadTimeout):
            await fetch(client, url, timeout=read_timeout(0.2))
        await sim.set_fault("h", "slow", delay_s=0.3)
        with pytest.raises(httpx.ReadTimeout):
            await fetch(client, url, timeout=read_timeout(0.1))
        started = time.perf_counter()
        response = await fetch(client, url)
        assert response.status_code == 200 and time.perf_counter() - started >= 0.3
        await sim.set_fault("h", "hang")
        hits = sim.hits("h")
        pending = asyncio.ensure_future(fetch(client, url))
        # Stop only once the simulator holds the request (before that, stopping closes the
        # port and the client sees a ConnectError instead).
        await until(lambda: sim.hits("h") > hits, 30, "the hung request at the simulator")
    # Stopping releases a hung request: the client sees the connection close.
    with pytest.raises(httpx.RemoteProtocolError):
        await pending


async def test_drip_sends_the_page_slowly(client: httpx.AsyncClient) -> None:
    async with sim_with([EndpointSpec("d", "llamacpp")]) as sim:
        await sim.set_fault("d", "drip", chunk_bytes=400, interval_s=0.05)
        started = time.perf_counter()
        async with client.stream("GET", sim.metrics_url("d")) as response:
            body = await response.aread()
        total = time.perf_counter() - started
    pauses = -(-len(body) // 400) - 1  # one between consecutive chunks
    # Every pause of the drip lies between the request and the body's end, and a pause
    # lasts at least its interval however loaded the machine. (Not from the headers'
    # arrival: a client slow to see them would shorten that span by its own delay.)
    assert total >= 0.05 * pauses
    assert pauses >= 3  # a page long enough to drip
    mapping_for("llamacpp").read(body)


@pytest.mark.parametrize("kind", ["html", "binary", "mixed"])
async def test_garbage_is_not_exposition_text(kind: str, client: httpx.AsyncClient) -> None:
    async with sim_with([EndpointSpec("g", "vllm")]) as sim:
        await sim.set_fault("g", "garbage", kind=kind)
        for _ in range(2):
            response = await fetch(client, sim.metrics_url("g"))
            assert response.status_code == 200
            with pytest.raises(ParseError):
                mapping_for("vllm").read(response.content, response.headers["content-type"])


async def test_status_missing_and_json(client: httpx.AsyncClient) -> None:
    async with sim_with([EndpointSpec("s", "sglang"), EndpointSpec("t", "triton")]) as sim:
        url = sim.metrics_url("s")
        for mode, status in (("http500", 500), ("http401", 401)):
            await sim.set_fault("s", mode)
            assert (await fetch(client, url)).status_code == status
        await sim.set_fault("s", "missing")
        with pytest.raises(ContractError) as missing:
            mapping_for("sglang").read((await fetch(client, url)).content)
        assert missing.value.missing == (
            "sglang:token_usage|sglang_token_usage|sglang:num_used_tokens/sglang:max_total_num_tokens",
        )
        await sim.set_fault("s", "missing", metrics=["sglang:num_queue_reqs"])
        with pytest.raises(ContractError, match="num_queue_reqs"):
            mapping_for("sglang").read((await fetch(client, url)).content)
        await sim.set_fault("t", "missing")
        with pytest.raises(ContractError, match="kv_cache_block_type"):
            mapping_for("triton").read((await fetch(client, sim.metrics_url("t"))).content)
        await sim.set_fault("s", "json")
        response = await fetch(client, url)
        assert response.headers["content-type"] == "application/json"
        assert response.json()[0]["numActiveRequests"] >= 0


@pytest.mark.parametrize("declare_length", [False, True])
async def test_oversized_streams_more_than_asked(
    declare_length: bool, client: httpx.AsyncClient
) -> None:
    async with sim_with([EndpointSpec("o", "vllm")]) as sim:
        await sim.set_fault("o", "oversized", mb=2, declare_length=declare_length)
        async with client.stream("GET", sim.metrics_url("o")) as response:
            assert ("content-length" in response.headers) == declare_length
            chunks = [chunk async for chunk in response.aiter_bytes()]
    assert sum(map(len, chunks)) > 2 * 1024 * 1024
    assert chunks[0].startswith(b"# HELP ")  # it looks like a page


async def test_oversized_client_hanging_up_early(client: httpx.AsyncClient) -> None:
    async with sim_with([EndpointSpec("o", "vllm")]) as sim:
        await sim.set_fault("o", "oversized")  # 16 MB by default
        async with client.stream("GET", sim.metrics_url("o")) as response:
            async for _ in response.aiter_bytes():
                break  # a scraper's body cap: close mid-stream
        await sim.set_fault("o", "ok")
        assert (await fetch(client, sim.metrics_url("o"))).status_code == 200


async def test_flap_alternates_on_the_clock(clock: FakeClock, client: httpx.AsyncClient) -> None:
    async with sim_with([EndpointSpec("f", "vllm")], clock) as sim:
        await sim.set_fault("f", "flap", period_s=10, fail="http500")
        statuses = []
        for _ in range(4):
            statuses.append((await fetch(client, sim.metrics_url("f"))).status_code)
            clock.advance(10)
    assert statuses == [200, 500, 200, 500]


def test_fault_validation() -> None:
    assert set(FAULT_MODES) >= {"ok", "down", "refuse", "slow", "hang", "drip", "http500"}
    for mode, params in (
        ("melt", {}),
        ("slow", {"delay": 1}),
        ("slow", {"delay_s": "1"}),
        ("drip", {"chunk_bytes": 0}),
        ("oversized", {"mb": float("inf")}),
        ("flap", {"fail": "flap"}),
        ("garbage", {"kind": "xml"}),
        ("missing", {"metrics": 3}),
    ):
        sim = Simulator([EndpointSpec("x")], admin=False)
        with pytest.raises(ConfigError):
            asyncio.run(sim.set_fault("x", mode, **params))
    with pytest.raises(KeyError):
        Simulator().base_url("nope")


def test_spec_validation() -> None:
    for kwargs in (
        {"id": "a/b"},
        {"id": "a", "engine": "ollama"},
        {"id": "a", "style": "socket"},
        {"id": "a", "engine": "tgi", "dp": 2},
        {"id": "a", "engine": "sglang", "lora": ("x",)},
        {"id": "a", "model": 'bad"name'},
        {"id": "a", "load": -1},
    ):
        with pytest.raises(ConfigError):
            EndpointSpec(**kwargs)
    assert EndpointSpec.from_dict({"id": "a", "lora": "x,y"}).lora == ("x", "y")
    assert EndpointSpec.from_dict({"id": "a", "lora": ["x"], "dp": 2}).lora == ("x",)
    with pytest.raises(ConfigError):
        EndpointSpec.from_dict({"id": "a", "colour": "red"})


# --- fleet, registry and CLI ---------------------------------------------------------------


async def test_fleet_registry_entries_are_valid_poller_endpoints(
    client: httpx.AsyncClient,
) -> None:
    specs = fleet(14, style="port", api_key="k")
    assert [s.engine for s in specs[:6]] == [
        "vllm",
        "sglang",
        "llamacpp",
        "trtllm",
        "triton",
        "tgi",
    ]
    async with sim_with(specs) as sim:
        entries = sim.registry()
        for entry in entries:
            endpoint = endpoint_from_dict(None, entry)
            mapping = mapping_for(endpoint.engine or "")
            headers = {"Authorization": "Bearer k"}
            response = await fetch(client, endpoint.url + mapping.metrics_path, headers=headers)
            mapping.read(response.content, response.headers["content-type"])
    assert sum("api_key_env" in e for e in entries) == 2  # the llama.cpp ones
    assert len({e["url"] for e in entries}) == 14


async def test_run_sim_writes_the_registry(tmp_path: Path, client: httpx.AsyncClient) -> None:
    out_file = tmp_path / "registry.json"

    written = asyncio.Event()

    class Out(io.StringIO):
        def write(self, s: str) -> int:
            written.set()
            return super().write(s)

    out, stop = Out(), asyncio.Event()
    task = asyncio.create_task(
        run_sim(fleet(4, ["vllm", "trtllm"]), registry_out=out_file, out=out, stop=stop)
    )
    await asyncio.wait_for(written.wait(), 30)  # the simulator up; the bound ends a hang
    entries = json.loads(out_file.read_text())
    assert entries == json.loads(out.getvalue())
    assert [e["engine"] for e in entries] == ["vllm", "trtllm", "vllm", "trtllm"]
    assert (await fetch(client, entries[1]["url"] + "/prometheus/metrics")).status_code == 200
    stop.set()
    await task


def test_main_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--engines", "vllm,ollama", "--log-level", "ERROR"]) == 2
    assert "ollama" in capsys.readouterr().err
    assert main(["--load", "-1", "--log-level", "ERROR"]) == 2
    assert "load must be a number >= 0" in capsys.readouterr().err
