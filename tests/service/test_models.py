"""Model names for every engine: declared in the registry, read from /v1/models once per
lease, combined with the page's into the stats' ``models``, and chosen by ``model=``.

The in-process tests drive a Worker on fakeredis with a MockTransport per endpoint; the
last one runs a real ``poller run`` against a real redis-server and a loopback engine.
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import fakeredis
import httpx
import pytest
import redis.asyncio as aioredis

from poller.config import ScrapeSettings, Settings
from poller.config.registry_file import endpoints_from_file
from poller.errors import ConfigError
from poller.reader import StatsReader
from poller.reader.legacy import Picker
from poller.reader.view import EndpointView, View
from poller.schema.endpoint import MAX_MODELS, Endpoint, endpoint_from_dict, endpoint_from_json
from poller.schema.stats import Signals, stats_fields
from poller.service.names import with_models
from poller.service.owned import JobSpec, Window
from poller.service.worker import Worker
from poller.store.store import RedisStore
from tests.support.httpserver import HTTPServer, answer, routes
from tests.support.paths import DATA
from tests.support.procs import PollerProc, until
from tests.support.redisproc import RedisProcess

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
TGI_PAGE = (DATA / "tgi-handwritten.txt").read_bytes()
LLAMACPP_PAGE = (DATA / "llamacpp-b11434-real-idle.txt").read_bytes()
VLLM_PAGE = (DATA / "vllm-v1-synthetic-61k.txt").read_bytes()


def listing(*names: str) -> bytes:
    return json.dumps({"object": "list", "data": [{"id": n} for n in names]}).encode()


# --- the registry field ----------------------------------------------------------------------


def test_an_entry_declares_models_and_keeps_them_in_its_json() -> None:
    e = endpoint_from_dict("l", {"url": "http://h:8080", "engine": "llamacpp", "models": [LLAMA]})
    assert e.models == (LLAMA,)
    assert json.loads(e.to_json())["models"] == [LLAMA]
    assert endpoint_from_json("l", e.to_json()) == e
    assert "models" not in json.loads(endpoint_from_dict("v", {"url": "http://h"}).to_json())


@pytest.mark.parametrize(
    ("models", "says"),
    [
        ([""], "empty"),
        (["a,b"], "comma"),
        (["a b"], "whitespace"),
        (["a\x00"], "control"),
        (["x" * 257], "longer than 256"),
        (["a", "a"], "listed twice"),
        ([f"m{i}" for i in range(MAX_MODELS + 1)], f"at most {MAX_MODELS}"),
        ("llama", "tuple"),  # one string, not a list
        ([3], "string"),
    ],
)
def test_bad_model_names_are_refused_naming_the_field(models: object, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        endpoint_from_dict("l", {"url": "http://h:8080", "models": models})
    assert caught.value.field is not None and caught.value.field.startswith("models")
    assert says in str(caught.value), str(caught.value)


@pytest.mark.parametrize("suffix", ["yaml", "toml"])
def test_registry_files_accept_models(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"endpoints.{suffix}"
    if suffix == "yaml":
        path.write_text(f"- id: l\n  url: http://h:8080\n  models: [{LLAMA}, llama3]\n")
    else:
        path.write_text(
            f'[[endpoints]]\nid = "l"\nurl = "http://h:8080"\nmodels = ["{LLAMA}", "llama3"]\n'
        )
    assert endpoints_from_file(path)["l"].models == (LLAMA, "llama3")


# --- the picker on a view ------------------------------------------------------------------

NOW_MS = 1_000_000


def spec_of(endpoint: Endpoint) -> JobSpec:
    return JobSpec(endpoint.id, 1, endpoint, None, None, 1.0, 0.5)


def view_row(
    endpoint: Endpoint, signals: Signals, read: tuple[str, ...] | None = None
) -> EndpointView:
    """The endpoint as a reader sees it after the poller wrote this page's stats."""
    window = Window()
    window.models = read
    written = with_models(signals, spec_of(endpoint), window)
    fields = stats_fields(written, prefix_cache_hit_rate=None, scrape_ms=1.0, interval_ms=1000)
    fields |= {"scraped_at_ms": str(NOW_MS - 500), "poller": "p", "token": "1", "seq": "1"}
    return EndpointView(
        endpoint.id, state="fresh", age_ms=500, owner="p", token=1, raw=("", fields, {})
    )


def fleet_view() -> View:
    """A vLLM and an SGLang endpoint whose pages name the model, a llama.cpp one that
    declares it, a TGI one whose /v1/models gave it, and a TGI one with nothing."""

    def e(endpoint_id: str, engine: str, **extra: object) -> Endpoint:
        return Endpoint.model_validate(
            {"id": endpoint_id, "url": "http://h:1", "engine": engine, **extra}
        )

    rows = [
        view_row(e("vllm", "vllm"), Signals("vllm", 0, 0, 0.1, models=(LLAMA,))),
        view_row(e("sglang", "sglang"), Signals("sglang", 0, 0, 0.1, models=(LLAMA,))),
        view_row(e("llamacpp", "llamacpp", models=[LLAMA]), Signals("llamacpp", 0, 0)),
        view_row(e("tgi", "tgi"), Signals("tgi", 0, 0), read=(LLAMA,)),
        view_row(e("tgi-bare", "tgi"), Signals("tgi", 0, 0), read=()),
    ]
    return View(NOW_MS, 1, {r.id: r for r in rows})


def test_endpoints_with_declared_or_read_models_are_chosen_with_model() -> None:
    view = fleet_view()
    assert view["llamacpp"].stats.models == (LLAMA,)  # type: ignore[union-attr]
    picker = Picker(rng=random.Random(7))
    chosen = Counter(picker.pick(view, model=LLAMA) for _ in range(1000))
    assert set(chosen) == {"vllm", "sglang", "llamacpp", "tgi"}
    assert min(chosen.values()) > 100  # equal loads: each gets its share, roughly
    # The rule is unchanged: a model nobody lists gives None, never another model's endpoint.
    assert picker.pick(view, model="nobody/serves-this") is None
    assert "tgi-bare" in Counter(picker.pick(view) for _ in range(1000))


def test_page_names_come_first_then_read_then_declared_each_once() -> None:
    endpoint = Endpoint.model_validate(
        {"id": "x", "url": "http://h:1", "models": ["alias", "b", "a"]}
    )
    row = view_row(endpoint, Signals("vllm", 0, 0, 0.1, models=("a",)), read=("b", "c"))
    assert row.stats.models == ("a", "b", "c", "alias")  # type: ignore[union-attr]


# --- the poller's read of /v1/models, in process ------------------------------------------

ONE_S = ScrapeSettings(interval_s=1.0, timeout_s=0.8)
Handler = Callable[[httpx.Request], httpx.Response]


class Engines:
    """A MockTransport per endpoint: its page, and its /v1/models (a handler or None)."""

    def __init__(self) -> None:
        self.pages: dict[str, bytes] = {}
        self.models: dict[str, Handler] = {}
        self.requests: list[tuple[str, str]] = []

    def factory(self, endpoint: Endpoint) -> httpx.AsyncBaseTransport:
        def handle(request: httpx.Request) -> httpx.Response:
            self.requests.append((endpoint.id, request.url.path))
            if request.url.path.endswith("/v1/models"):
                handler = self.models.get(endpoint.id)
                return handler(request) if handler else httpx.Response(404)
            return httpx.Response(200, content=self.pages.get(endpoint.id, VLLM_PAGE))

        return httpx.MockTransport(handle)

    def asked(self, endpoint_id: str) -> int:
        return sum(1 for e, path in self.requests if e == endpoint_id and path == "/v1/models")


@pytest.fixture
def engines() -> Engines:
    return Engines()


@pytest.fixture
async def worker(engines: Engines) -> AsyncIterator[Worker]:
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    store = RedisStore(client, "t")
    w = Worker(Settings(id="p1", scrape=ONE_S), store, transport_factory=engines.factory)
    yield w
    await w.jobs.stop()
    await w.scraper.aclose()
    await client.aclose()


async def own(worker: Worker, *endpoints: Endpoint) -> None:
    for endpoint in endpoints:
        await worker.store.put_endpoint(endpoint, replace=True)
    await worker.store.ensure_schema()
    await worker.step()
    assert {e.id for e in endpoints} <= set(worker.owned)


def ep(endpoint_id: str, engine: str, **extra: object) -> Endpoint:
    return Endpoint.model_validate(
        {"id": endpoint_id, "url": "http://engine.test:8080", "engine": engine, **extra}
    )


async def models_of(worker: Worker, endpoint_id: str) -> str | None:
    return (await worker.store.read_stats(endpoint_id)).get("models")


async def test_models_are_read_once_per_lease_where_the_page_has_none(
    worker: Worker, engines: Engines
) -> None:
    engines.pages["tgi"] = TGI_PAGE
    engines.models["tgi"] = lambda _: httpx.Response(200, content=listing(LLAMA))
    engines.pages["vllm"] = VLLM_PAGE  # its page names its model: nothing more is asked
    await own(worker, ep("tgi", "tgi"), ep("vllm", "vllm"))
    for _ in range(3):
        await worker.scrape_once("tgi")
        await worker.scrape_once("vllm")
    assert await models_of(worker, "tgi") == LLAMA
    assert engines.asked("tgi") == 1
    assert engines.asked("vllm") == 0
    assert await models_of(worker, "vllm")  # the page's own names

    # The entry changes under the same lease (a label): the names read still count.
    await own(worker, ep("tgi", "tgi", labels={"zone": "a"}))
    await worker.scrape_once("tgi")
    assert engines.asked("tgi") == 1 and await models_of(worker, "tgi") == LLAMA

    # Its URL changes: another engine, asked again.
    engines.models["tgi"] = lambda _: httpx.Response(200, content=listing("other/model"))
    await own(worker, ep("tgi", "tgi").model_copy(update={"url": "http://moved.test:8080"}))
    await worker.scrape_once("tgi")
    assert engines.asked("tgi") == 2 and await models_of(worker, "tgi") == "other/model"

    # A new lease asks again.
    await worker.coordinator.leave()
    worker.jobs.remove("tgi")
    await worker.step()
    await worker.scrape_once("tgi")
    assert engines.asked("tgi") == 3


async def test_engines_whose_page_names_the_model_are_never_asked(
    worker: Worker, engines: Engines
) -> None:
    # a vLLM page without model_name (hand-written, or an old version): not asked either
    engines.pages["v"] = b"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n" + (
        b"vllm:kv_cache_usage_perc 0.1\n"
    )
    await own(worker, ep("v", "vllm", models=["declared"]))
    await worker.scrape_once("v")
    assert engines.asked("v") == 0
    assert await models_of(worker, "v") == "declared"


async def test_declared_models_join_the_read_ones(worker: Worker, engines: Engines) -> None:
    engines.pages["l"] = LLAMACPP_PAGE
    engines.models["l"] = lambda _: httpx.Response(200, content=listing("qwen3-8b"))
    await own(worker, ep("l", "llamacpp", models=[LLAMA, "qwen3-8b"]))
    await worker.scrape_once("l")
    assert await models_of(worker, "l") == f"qwen3-8b,{LLAMA}"


async def test_a_failed_read_never_fails_the_scrape_and_is_logged_once(
    worker: Worker, engines: Engines, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="poller.service.names")
    engines.pages["declared"] = engines.pages["bare"] = LLAMACPP_PAGE
    # "declared" has no /v1/models (404); "bare" answers something that is no model list
    engines.models["bare"] = lambda _: httpx.Response(200, text="<html>hello</html>")
    await own(worker, ep("declared", "llamacpp", models=[LLAMA]), ep("bare", "llamacpp"))
    for _ in range(2):
        await worker.scrape_once("declared")
        await worker.scrape_once("bare")
    assert await models_of(worker, "declared") == LLAMA  # it keeps its declared names
    stats = await worker.store.read_stats("bare")
    assert stats["running"] == "0" and "models" not in stats  # written, without names
    assert await worker.store.read_failure("bare") == {}

    for _ in range(2):  # a lease lost and taken again: asked again, not logged again
        await worker.coordinator.leave()
        for endpoint_id in ("declared", "bare"):
            worker.jobs.remove(endpoint_id)
        await worker.step()
        await worker.scrape_once("declared")
        await worker.scrape_once("bare")
    assert engines.asked("declared") == engines.asked("bare") == 3
    said = [
        (r.levelno, r.getMessage(), getattr(r, "endpoint", ""))
        for r in caplog.records
        if "/v1/models not read" in r.getMessage() and r.levelno > logging.DEBUG
    ]
    assert [(level, endpoint) for level, _, endpoint in said] == [
        (logging.INFO, "declared"),
        (logging.WARNING, "bare"),
    ]
    assert "keeps its declared models" in said[0][1]
    assert "declare them" in said[1][1]
    reasons = {getattr(r, "why", "").split(":")[0] for r in caplog.records if hasattr(r, "why")}
    assert {"http_status", "parse"} <= reasons


# --- a real poller against a real redis-server ---------------------------------------------

NS = "models"


@pytest.mark.slow
async def test_the_running_poller_writes_the_names_it_read(
    own_redis: RedisProcess, tmp_path: Path
) -> None:
    llama_page = answer(200, LLAMACPP_PAGE)
    llama_models = answer(
        200,
        json.dumps({"object": "list", "data": [{"id": "qwen3-8b", "aliases": ["qwen3"]}]}),
        content_type="application/json",
    )
    script = routes(
        {
            "/metrics": llama_page,
            "/v1/models": llama_models,
        }
    )
    client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    store, reader = RedisStore(client, NS), StatsReader(client, NS)
    async with HTTPServer(script) as engine:
        entries = {
            "llama": endpoint_from_dict(
                None, {"id": "llama", "url": engine.url, "engine": "llamacpp"}
            ),
            "llama-declared": endpoint_from_dict(
                None,
                {
                    "id": "llama-declared",
                    "url": engine.url + "/",
                    "engine": "llamacpp",
                    "models": [LLAMA],
                },
            ),
        }
        await store.replace_registry(entries)
        proc = PollerProc("p0", own_redis.url, NS, tmp_path).start()
        try:

            async def named() -> View | None:
                view = await reader.snapshot()
                rows = [view[i] for i in entries]
                stats = [r.stats for r in rows]
                ok = all(s is not None and s.seq >= 3 for s in stats)
                return view if ok else None

            # process start on a loaded machine takes seconds: the wait is ample
            view = await until(named, 60, "three scrapes of each endpoint")
            assert isinstance(view, View)
            assert view["llama"].stats.models == ("qwen3-8b", "qwen3")  # type: ignore[union-attr]
            assert view["llama-declared"].stats.models == (  # type: ignore[union-attr]
                "qwen3-8b",
                "qwen3",
                LLAMA,
            )
            # once per lease, not per scrape: one lease each, three scrapes each
            asked = [r.target for r in engine.requests if r.path == "/v1/models"]
            assert len(asked) == 2, asked
            picker = Picker(rng=random.Random(3))
            assert picker.pick(view, model="qwen3") in entries
            assert picker.pick(view, model=LLAMA) == "llama-declared"
        finally:
            proc.cleanup()
            await client.aclose()


# --- the operator's page -------------------------------------------------------------------


def test_the_page_shows_each_endpoints_models() -> None:
    from poller.service.web.render import Fleet, Query, render_main

    rows = [
        {
            "id": endpoint_id,
            "state": "fresh",
            "engine": "llamacpp",
            "age_ms": 100,
            "owner": "p0",
            "token": 1,
            "stats": stats,
            "failure": None,
            "url": "http://10.0.0.1:8080",
            "labels": {},
            "registry_engine": "llamacpp",
        }
        for endpoint_id, stats in (
            ("named", {"running": 0, "waiting": 0, "models": [LLAMA, "<b>x</b>"]}),
            ("bare", {"running": 0, "waiting": 0, "models": []}),
            ("never", None),
        )
    ]
    view = {"schema": 1, "now_ms": 1, "rev": 1, "pollers": [], "counts": {}, "endpoints": rows}
    html = render_main(view, Fleet("p0", "0", 2000), Query())
    assert '<th class="models">models</th>' in html
    assert f'<td class="models" title="{LLAMA}, &lt;b&gt;x&lt;/b&gt;">' in html
    assert f"{LLAMA}, &lt;b&gt;x&lt;/b&gt;</td>" in html  # escaped: names are untrusted
    assert html.count('<td class="models" title="">-</td>') == 2
