from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import fakeredis
import httpx
import pytest

from poller.config import ScrapeSettings, Settings
from poller.schema.endpoint import Endpoint
from poller.scrape.http.client import KeyPolicy
from poller.service.follow import RegistryFollower
from poller.service.owned import first_run
from poller.service.trigger import GridJitterTrigger
from poller.service.worker import Worker
from poller.store.store import RedisStore
from poller.util.logs import text_of
from tests.support.paths import DATA

#: These tests were written at a 1 s interval (the default is 2 s, timeout 1 s).
ONE_S = ScrapeSettings(interval_s=1.0, timeout_s=0.8)

VLLM = (DATA / "vllm-v1-synthetic-61k.txt").read_bytes()

Handler = Callable[[httpx.Request], httpx.Response]


class Engines:
    """A MockTransport per endpoint whose behaviour tests switch at will."""

    def __init__(self) -> None:
        self.handlers: dict[str, Handler] = {}
        self.requests: list[httpx.Request] = []

    def factory(self, endpoint: Endpoint) -> httpx.AsyncBaseTransport:
        def handle(request: httpx.Request) -> httpx.Response:
            self.requests.append(request)
            handler = self.handlers.get(endpoint.id, lambda r: httpx.Response(200, content=VLLM))
            return handler(request)

        return httpx.MockTransport(handle)


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
        await worker.store.put_endpoint(endpoint)
    await worker.store.ensure_schema()
    await worker.step()
    assert {e.id for e in endpoints} <= set(worker.owned)


def ep(endpoint_id: str = "e1", **extra: object) -> Endpoint:
    return Endpoint.model_validate({"id": endpoint_id, "url": "http://engine.test:8000", **extra})


async def test_scrape_writes_stats(worker: Worker, engines: Engines) -> None:
    await own(worker, ep())
    await worker.scrape_once("e1")
    stats = await worker.store.read_stats("e1")
    assert stats["running"] == "17" and stats["engine"] == "vllm"
    assert stats["interval_ms"] == "1000" and stats["poller"] == "p1"
    assert float(stats["prefix_cache_hit_rate"]) == pytest.approx(1.582691e6 / 5.314951e6)
    [request] = engines.requests
    assert str(request.url) == "http://engine.test:8000/metrics"
    assert request.headers["accept-encoding"] == "identity"
    assert "authorization" not in request.headers


async def test_hit_rate_is_windowed_and_survives_handover(worker: Worker, engines: Engines) -> None:
    counters = {"hits": 100.0, "queries": 200.0}

    def page(_: httpx.Request) -> httpx.Response:
        body = (
            "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
            "vllm:kv_cache_usage_perc 0.1\n"
            f"vllm:prefix_cache_hits_total {counters['hits']}\n"
            f"vllm:prefix_cache_queries_total {counters['queries']}\n"
        )
        return httpx.Response(200, text=body)

    engines.handlers["e1"] = page
    await own(worker, ep())
    await worker.scrape_once("e1")
    counters.update(hits=190.0, queries=300.0)  # 90 hits of 100 queries in this window
    await worker.scrape_once("e1")
    assert float((await worker.store.read_stats("e1"))["prefix_cache_hit_rate"]) == 0.9

    # a new owner continues the window from the counters in the stats hash
    other = Worker(Settings(id="p2", scrape=ONE_S), worker.store, transport_factory=engines.factory)
    await worker.coordinator.leave()
    worker.jobs.remove("e1")
    await other.step()
    counters.update(hits=200.0, queries=400.0)  # 10 of 100
    await other.scrape_once("e1")
    stats = await other.store.read_stats("e1")
    assert stats["poller"] == "p2" and float(stats["prefix_cache_hit_rate"]) == 0.1
    await other.jobs.stop()
    await other.scraper.aclose()


def fail_with(exc: Exception) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    return handler


@pytest.mark.parametrize(
    ("handler", "reason", "detail"),
    [
        (fail_with(httpx.ConnectError("refused")), "unreachable", "refused"),
        (fail_with(httpx.ReadTimeout("slow")), "timeout", "ReadTimeout"),
        (fail_with(httpx.RemoteProtocolError("reset")), "unreachable", "reset"),
        (lambda r: httpx.Response(500), "http_status", "HTTP 500"),
        (lambda r: httpx.Response(302, headers={"location": "/x"}), "http_status", "HTTP 302"),
        (lambda r: httpx.Response(401), "auth", "HTTP 401"),
        (lambda r: httpx.Response(403), "auth", "HTTP 403"),
        (lambda r: httpx.Response(200, content=b"<html>oops</html>"), "parse", "not Prometheus"),
        (lambda r: httpx.Response(200, content=b"\xff\xfe garbage"), "parse", ""),
        (lambda r: httpx.Response(200, json=[{"numActiveRequests": 1}]), "parse", "json"),
        (lambda r: httpx.Response(200, content=b"x 1\n" * 3_000_000), "too_large", "cap"),
        (
            lambda r: httpx.Response(200, content=b"vllm:num_requests_running 1\n"),
            "contract",
            "vllm:num_requests_waiting",
        ),
    ],
)
async def test_failures_are_written_with_their_reason(
    worker: Worker, engines: Engines, handler: Handler, reason: str, detail: str
) -> None:
    await own(worker, ep())
    await worker.scrape_once("e1")  # a good scrape first
    engines.handlers["e1"] = handler
    await worker.scrape_once("e1")
    failure = await worker.store.read_failure("e1")
    assert failure["reason"] == reason, failure
    assert detail in failure["detail"]
    assert (await worker.store.read_stats("e1"))["running"] == "17"  # last good stats stay
    if reason == "contract":
        assert failure["missing"].startswith("vllm:num_requests_waiting,")
    # recovery clears the failure
    engines.handlers.pop("e1")
    await worker.scrape_once("e1")
    assert await worker.store.read_failure("e1") == {}


async def test_api_key_from_env_or_file(
    worker: Worker, engines: Engines, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("file-secret\n")
    monkeypatch.setenv("LLMGW_KEY_ENGINE", "env-secret")
    # The rules of scrape.key_env_prefix and scrape.key_dir (tmp_path as the key directory).
    worker.scraper.key_policy = KeyPolicy.from_settings(ScrapeSettings(key_dir=str(tmp_path)))
    await own(
        worker,
        ep("a", api_key_env="LLMGW_KEY_ENGINE"),
        ep("b", api_key_file=str(key_file)),
        ep("c", api_key_env="LLMGW_KEY_UNSET_VARIABLE"),
        ep("d", api_key_file=str(tmp_path / "no")),
    )
    for endpoint_id in "abcd":
        await worker.scrape_once(endpoint_id)
    auth = [r.headers.get("authorization") for r in engines.requests]
    assert auth == ["Bearer env-secret", "Bearer file-secret"]
    c = await worker.store.read_failure("c")
    d = await worker.store.read_failure("d")
    assert c["reason"] == "config" and "LLMGW_KEY_UNSET_VARIABLE" in c["detail"]
    assert d["reason"] == "config" and "api_key_file" in d["detail"]
    values = [v for e in "abcd" for v in (await worker.store.read_failure(e)).values()]
    assert not any("secret" in v for v in values)


async def test_the_worker_follows_the_registry_through_its_follower(worker: Worker) -> None:
    """``Worker.follower`` is the registry as last read; ``registry`` names nothing here."""
    await own(worker, ep("e1"), ep("e2"))
    assert isinstance(worker.follower, RegistryFollower)
    assert worker.follower.ids() == ["e1", "e2"] and set(worker.follower.entries) == {"e1", "e2"}
    assert not hasattr(worker, "registry")


async def test_invalid_registry_entry_is_a_config_failure(worker: Worker) -> None:
    await worker.store.client.hset("{t}:endpoints", "broken", '{"url": "http://x:1", "engine": 5}')
    await own(worker, ep())
    assert sorted(worker.owned) == ["broken", "e1"]
    await worker.scrape_once("broken")
    failure = await worker.store.read_failure("broken")
    assert failure["reason"] == "config" and "engine" in failure["detail"]


async def test_engine_path_and_overrides(worker: Worker, engines: Engines) -> None:
    engines.handlers["t"] = lambda r: httpx.Response(
        200, content=(DATA / "trtllm-prefixed-handwritten.txt").read_bytes()
    )
    engines.handlers["m"] = lambda r: httpx.Response(200, text="a 1\nb 2\nc 0.5\n")
    await own(
        worker,
        ep("t", engine="trtllm"),
        ep(
            "m",
            metrics_path="/custom",
            overrides={"running": ["a"], "waiting": ["b"], "kv_cache_usage": ["c"]},
        ),
    )
    await worker.scrape_once("t")
    await worker.scrape_once("m")
    # trtllm-serve's page names no model ("undefined"): its /v1/models is read, once
    paths = ["/prometheus/metrics", "/v1/models", "/custom"]
    assert [r.url.path for r in engines.requests] == paths
    assert (await worker.store.read_stats("t"))["engine"] == "trtllm"
    assert (await worker.store.read_stats("m"))["running"] == "1"


async def test_rejected_write_drops_the_endpoint(worker: Worker) -> None:
    await own(worker, ep())
    await worker.store.client.set("{t}:lease:e1", "thief 99")
    await worker.scrape_once("e1")
    assert "e1" not in worker.owned and "e1" not in worker.coordinator.held
    assert await worker.store.read_stats("e1") == {}
    assert worker.metrics.write_rejections._value.get() == 1


async def test_failures_are_logged_once_per_reason(
    worker: Worker, engines: Engines, caplog: pytest.LogCaptureFixture
) -> None:
    await own(worker, ep())
    engines.handlers["e1"] = fail_with(httpx.ConnectError("refused"))
    with caplog.at_level(logging.INFO, logger="poller.service.reporting"):
        for _ in range(3):
            await worker.scrape_once("e1")
        engines.handlers["e1"] = lambda r: httpx.Response(200, text="vllm:num_requests_running 1\n")
        for _ in range(2):
            await worker.scrape_once("e1")
        engines.handlers.pop("e1")
        await worker.scrape_once("e1")
    messages = [(r.levelname, text_of(r)) for r in caplog.records]
    assert [m for m in messages if "scrape failed" in m[1]] == [
        ("INFO", 'scrape failed endpoint=e1 reason=unreachable detail="ConnectError: refused"'),
        (
            "WARNING",
            "scrape failed: the engine does not serve the metrics this endpoint is read with; "
            "routing to it is uninformed endpoint=e1 reason=contract missing=vllm:num_requests_"
            "waiting,vllm:kv_cache_usage_perc|vllm:gpu_cache_usage_perc",
        ),
    ]
    assert ("INFO", "endpoint recovered endpoint=e1 after=contract") in messages


async def test_first_run_keeps_the_previous_owners_rhythm(worker: Worker) -> None:
    await own(worker, ep())
    owned = worker.owned["e1"]
    now = datetime.now(UTC)
    now_ms = now.timestamp() * 1000
    offset = worker.clock_offset_ms
    soon = first_run(owned, {"scraped_at_ms": str(int(now_ms - 300))}, offset)
    assert timedelta(milliseconds=600) < soon - now < timedelta(milliseconds=800)
    overdue = first_run(owned, {"scraped_at_ms": str(int(now_ms - 5000))}, offset)
    assert overdue - now < timedelta(milliseconds=150)
    fresh = [first_run(owned, None, offset) - now for _ in range(200)]
    assert min(fresh) >= timedelta(0) and max(fresh) <= timedelta(seconds=1.01)
    assert max(fresh) - min(fresh) > timedelta(milliseconds=500)  # spread, not lockstep


def test_grid_jitter_does_not_drift() -> None:
    start = datetime(2026, 1, 1, tzinfo=UTC)
    trigger = GridJitterTrigger(seconds=1.0, start_date=start, jitter_s=0.1)
    fire = trigger.get_next_fire_time(None, start)
    times = [fire]
    for _ in range(1000):
        fire = trigger.get_next_fire_time(fire, fire)
        times.append(fire)
    offsets = [(t - start).total_seconds() - k for k, t in enumerate(times)]
    assert all(-0.1 <= o <= 0.1 for o in offsets)
    assert (times[-1] - times[0]).total_seconds() == pytest.approx(1000, abs=0.2)
    assert len({round(o, 6) for o in offsets}) > 900  # jitter really applied


def test_grid_jitter_on_a_tick_shares_fire_times_and_still_does_not_drift() -> None:
    """Runs land on multiples of the tick (of the epoch), so jobs started at different
    moments share their fire times, and the mean period stays the interval."""
    tick = 0.05
    starts = [datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=i * 0.0137) for i in range(50)]
    fires: set[datetime] = set()
    for start in starts:
        trigger = GridJitterTrigger(seconds=1.0, start_date=start, jitter_s=0.1, tick_s=tick)
        fire = trigger.get_next_fire_time(None, start - timedelta(seconds=1))
        times = [fire]
        for _ in range(200):
            fire = trigger.get_next_fire_time(fire, fire)
            times.append(fire)
        for t in times:
            ticks = t.timestamp() / tick
            assert abs(ticks - round(ticks)) < 1e-3, t  # on the tick
        offsets = [(t - start).total_seconds() - k for k, t in enumerate(times)]
        assert all(-0.1 <= o <= 0.1 + tick for o in offsets)  # jitter, then up to a tick
        assert all(b > a for a, b in zip(times, times[1:], strict=False))
        assert (times[-1] - times[0]).total_seconds() == pytest.approx(200, abs=0.2)
        fires.update(times[50:60])
    # 50 jobs x 10 runs over ~10 s fall on at most ~10 / tick distinct moments.
    assert len(fires) <= 10 / tick + 10
