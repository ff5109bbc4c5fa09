"""The public API a gateway imports: one set of names, twin readers, one decode path."""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import inspect
import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

import poller
import poller.reader
from poller import (
    ConfigError,
    EndpointView,
    PollerError,
    RedisSettings,
    Router,
    RoutingOptions,
    StatsReader,
    SyncStatsReader,
    Ticket,
    View,
    ViewCache,
)
from poller.reader.legacy import Picker, pick
from poller.reader.load.local import LocalLoad
from poller.reader.view import decode
from poller.reader.view.decode import LazyEndpoints
from poller.redis.clock import server_ms
from poller.schema.endpoint import Endpoint
from poller.store.store import RedisStore
from tests.reader.test_reader import fields, setup, write
from tests.support.paths import REPO
from tests.support.redisproc import RedisCluster, RedisProcess

NS = "api"
DOC = REPO / "docs" / "reader.md"
#: Names docs/reader.md shows in backticks that are not this package's (redis-py's,
#: vLLM's).
FOREIGN = {"RedisCluster", "Redis", "BlockPool"}


# --- exports ------------------------------------------------------------------------------


def test_poller_and_poller_reader_export_the_same_names() -> None:
    assert set(poller.__all__) == set(poller.reader.__all__) | {"__version__"}
    for name in poller.reader.__all__:
        assert getattr(poller, name) is getattr(poller.reader, name), name


def _doc_names() -> set[str]:
    """The type-like names (``View``, ``StoreError``, ``ViewCache.get``'s ``ViewCache``)
    that start a backticked span of the prose: what the page says is raised or returned."""
    text = re.sub(r"```.*?```", "", DOC.read_text("utf-8"), flags=re.S)  # prose only
    found = set()
    for code in re.findall(r"`([^`]+)`", text):
        name = re.match(r"([A-Z][a-z]+)+(?![\w])", code)
        if name and name.group(0) not in vars(builtins):
            found.add(name.group(0))
    return found


def test_every_type_docs_reader_names_is_importable_from_poller() -> None:
    names = _doc_names() - FOREIGN
    assert {"StoreError", "SchemaMismatch", "ConfigError", "View", "Endpoint"} <= names
    assert {"Router", "RoutingOptions", "Ticket", "Refusal"} <= names
    # The earlier API, named where the page says what replaces it: importable, warned.
    known = set(poller.__all__) | set(poller.reader.DEPRECATED)
    assert names <= known, sorted(names - known)


def test_every_error_a_reader_raises_is_exported() -> None:
    for name in ("PollerError", "ConfigError", "StoreError", "StoreUnreachable"):
        assert issubclass(getattr(poller, name), PollerError)
    for name in ("StoreAuthError", "SchemaMismatch"):
        assert issubclass(getattr(poller, name), poller.StoreError)
    assert issubclass(ConfigError, ValueError)
    assert {"State", "WhenSaturated", "Endpoint", "Timing"} <= set(poller.__all__)


def test_prefix_affinity_is_in_the_public_api() -> None:
    """``prompt_of`` in both packages; ``prompt`` a keyword of the Router's pick (after
    the model, None by default) and of the earlier picks; ``share_placements`` a routing
    option (True by default); a Router's placements and their health."""
    assert "prompt_of" in poller.__all__ and "prompt_of" in poller.reader.__all__
    assert poller.prompt_of([{"role": "user", "content": "hi"}]) == "<|user|>\nhi\n"
    for fn in (Router.pick, pick, Picker.pick):
        prompt = inspect.signature(fn).parameters["prompt"]
        assert prompt.kind is inspect.Parameter.KEYWORD_ONLY and prompt.default is None
    assert RoutingOptions().share_placements is True
    router = Router(ViewCache())
    assert len(router.placements) == 0 and router.placements_shared is False


def test_a_router_is_opened_alike_by_both_readers() -> None:
    """``router(options=None, *, replica_id=None, rng=None)`` on both, the same shape."""
    shapes = [
        [(p.name, p.kind, p.default) for p in inspect.signature(r.router).parameters.values()]
        for r in (StatsReader, SyncStatsReader)
    ]
    assert shapes[0] == shapes[1]
    assert [name for name, _, _ in shapes[0]] == ["self", "options", "replica_id", "rng"]
    assert "Ticket" in poller.__all__ and Ticket.__module__ == "poller.reader.ticket"


# --- pick ---------------------------------------------------------------------------------


def _stats(now_ms: int, **extra: str) -> dict[str, str]:
    """The JSON of a stats record (what write_stats.lua stores)."""
    stats = {"engine": "vllm", "running": "1", "waiting": "0", "interval_ms": "1000"}
    return stats | {"scraped_at_ms": str(now_ms), "poller": "p1", "token": "1", "seq": "1"} | extra


def _view(**models: str) -> View:
    now = 10_000
    stats = {
        e: f"{now} 1000 {now + 5000} p1 1|" + json.dumps(_stats(now, models=m))
        for e, m in models.items()
    }
    return View(now, 1, LazyEndpoints({e: "" for e in models}, stats, {}, now))


def test_pick_takes_the_model_second_like_picker_pick() -> None:
    params = list(inspect.signature(pick).parameters.values())
    picker_params = list(inspect.signature(Picker.pick).parameters.values())[1:]  # self
    assert [(p.name, p.kind) for p in params[:3]] == [(p.name, p.kind) for p in picker_params[:3]]
    view = _view(a="meta-llama/Llama-3.1-8B-Instruct", b="other")
    assert pick(view, "meta-llama/Llama-3.1-8B-Instruct") == "a"
    assert pick(view, None, candidates=["b"]) == "b"


@pytest.mark.parametrize(
    "call",
    [
        lambda v: pick(v, ["a", "b"]),  # the old order: ids where the model goes
        lambda v: pick(v, candidates="a"),  # one string is not a list of ids
        lambda v: pick(v, candidates=7),
        lambda v: pick("a", "m"),
        lambda v: pick(v, local="me"),
        lambda v: Picker().pick(v, candidates="ab"),
        lambda v: Picker().pick(v, 3),
    ],
)
def test_a_wrong_argument_type_is_a_type_error_never_none(call: Any) -> None:
    with pytest.raises(TypeError):
        call(_view(a="m"))


# --- twin readers -------------------------------------------------------------------------

#: The asyncio name of the sync reader's ``close`` (Python's convention: ``aclose``).
ASYNC_NAME = {"close": "aclose", "__enter__": "__aenter__", "__exit__": "__aexit__"}


def _public(cls: type) -> dict[str, inspect.Signature]:
    out = {}
    for name, member in inspect.getmembers(cls):
        special = name == "__init__" or name in ASYNC_NAME or name in ASYNC_NAME.values()
        if (not name.startswith("_") or special) and (
            inspect.isfunction(member) or inspect.ismethod(member)
        ):
            out[name] = inspect.signature(member)
    return out


def test_the_readers_are_twins() -> None:
    sync, aio = _public(SyncStatsReader), _public(StatsReader)
    assert {ASYNC_NAME.get(n, n) for n in sync} == set(aio)
    assert {"__init__", "from_url", "from_settings", "snapshot", "get", "live_pollers"} <= set(sync)
    for name, signature in sync.items():
        twin = aio[ASYNC_NAME.get(name, name)]
        shape = [(p.name, p.kind, p.default) for p in signature.parameters.values()]
        assert shape == [(p.name, p.kind, p.default) for p in twin.parameters.values()], name
        if name not in ("__init__", "__exit__"):  # the client's type; exc types
            for p in signature.parameters.values():
                assert p.annotation == twin.parameters[p.name].annotation, (name, p.name)
    for name in ("snapshot", "get", "live_pollers", "aclose", "__aenter__", "__aexit__"):
        assert inspect.iscoroutinefunction(getattr(StatsReader, name)), name


def test_the_options_are_typed_keywords() -> None:
    for factory in (
        StatsReader.__init__,
        StatsReader.from_url,
        StatsReader.from_settings,
        SyncStatsReader.__init__,
        SyncStatsReader.from_url,
        SyncStatsReader.from_settings,
    ):
        params = inspect.signature(factory).parameters
        assert not any(p.kind is p.VAR_KEYWORD for p in params.values()), factory
        options = {n: p for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
        assert {n: p.default for n, p in options.items()} == {
            "stale_after_intervals": 2.0,
            "stale_after_ms": None,
            "resync_s": 5.0,
        }
        assert all(p.annotation != inspect.Parameter.empty for p in options.values())


def test_an_unknown_option_is_a_type_error_and_a_bad_value_a_config_error() -> None:
    with pytest.raises(TypeError):
        StatsReader.from_url("redis://127.0.0.1:9/0", resync=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        SyncStatsReader.from_url("redis://127.0.0.1:9/0", stale_after=1)  # type: ignore[call-arg]
    client = redis.Redis(port=9)
    with pytest.raises(TypeError):
        SyncStatsReader(client, NS, stale_ms=5)  # type: ignore[call-arg]
    for bad in ({"resync_s": 0}, {"stale_after_intervals": -1}, {"stale_after_ms": 2.5}):
        with pytest.raises(ConfigError):
            SyncStatsReader(client, NS, **bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="namespace"):
        SyncStatsReader(client, "has space")
    client.close()


@pytest.mark.parametrize("reader", [StatsReader, SyncStatsReader])
def test_a_bad_url_is_a_config_error_with_the_url_check_message(reader: Any) -> None:
    with pytest.raises(ConfigError) as raised:
        reader.from_url("localhost:6390")
    assert "'localhost:6390' has no scheme: use redis://HOST:PORT/DB" in str(raised.value)
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, PollerError)
    with pytest.raises(ConfigError, match="did you mean 'redis://h:1'"):
        reader.from_url("redis//h:1")


class _Closed:
    def __init__(self) -> None:
        self.calls = 0


async def test_the_async_reader_closes_its_client_on_exit(redis_server: RedisProcess) -> None:
    closed = _Closed()
    async with StatsReader.from_url(redis_server.url, NS) as reader:
        assert isinstance(await reader.snapshot(), View)
        real = reader.client.aclose

        async def aclose() -> None:
            closed.calls += 1
            await real()

        reader.client.aclose = aclose  # type: ignore[method-assign]
        assert closed.calls == 0
    assert closed.calls == 1


def test_the_sync_reader_closes_its_client_on_exit(redis_server: RedisProcess) -> None:
    closed = _Closed()
    with SyncStatsReader.from_url(redis_server.url, NS) as reader:
        assert isinstance(reader.snapshot(), View)
        real = reader.client.close

        def close() -> None:
            closed.calls += 1
            real()

        reader.client.close = close  # type: ignore[method-assign]
    assert closed.calls == 1


def test_live_pollers_is_one_script_call_in_both(redis_server: RedisProcess) -> None:
    async def prepare() -> None:
        client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        await client.flushall()
        await setup(RedisStore(client, NS), "a")
        await client.aclose()

    asyncio.run(prepare())
    sent: list[str] = []

    class Counting(redis.Redis):
        def execute_command(self, *args: Any, **options: Any) -> Any:
            sent.append(str(args[0]).upper())
            return super().execute_command(*args, **options)

    with SyncStatsReader(Counting.from_url(redis_server.url, decode_responses=True), NS) as r:
        assert r.live_pollers() == ["p1"]  # loads the script on first use
        sent.clear()
        assert r.live_pollers() == ["p1"]
    assert sent == ["EVALSHA"]

    class CountingAsync(aioredis.Redis):
        async def execute_command(self, *args: Any, **options: Any) -> Any:
            sent.append(str(args[0]).upper())
            return await super().execute_command(*args, **options)

    async def run() -> None:
        client = CountingAsync.from_url(redis_server.url, decode_responses=True)
        async with StatsReader(client, NS) as r:
            assert await r.live_pollers() == ["p1"]
            sent.clear()
            assert await r.live_pollers() == ["p1"]

    asyncio.run(run())
    assert sent == ["EVALSHA"]


def test_the_sync_reader_reads_a_cluster_through_from_settings(
    redis_cluster: RedisCluster,
) -> None:
    async def prepare() -> RedisStore:
        client = aioredis.RedisCluster.from_url(redis_cluster.url, decode_responses=True)
        await client.flushall(target_nodes=aioredis.RedisCluster.PRIMARIES)
        store = RedisStore(client, NS)
        t = await setup(store, "a", "b")
        await write(store, "a", t["a"], running=4)
        await client.aclose()
        return store

    asyncio.run(prepare())
    settings = RedisSettings(url=redis_cluster.url, namespace=NS, cluster=True)
    with SyncStatsReader.from_settings(settings, resync_s=60) as reader:
        assert isinstance(reader.client, redis.cluster.RedisCluster)
        view = reader.snapshot()
        assert view["a"].state == "fresh" and view["b"].state == "unknown"
        assert reader.live_pollers() == ["p1"]
        assert (a := reader.get("a")) is not None and a.owner == "p1"
        with reader.router() as router:
            assert router.healthy

            async def more() -> None:
                client = aioredis.RedisCluster.from_url(redis_cluster.url, decode_responses=True)
                store = RedisStore(client, NS)
                holder = await store.lease_holder("b")
                assert holder is not None
                await write(store, "b", holder[1], running=6)
                await client.aclose()

            asyncio.run(more())
            deadline = time.monotonic() + 30  # ends a hang; the wait is for the update
            while (e := router.get("b")) is None or e.state != "fresh":
                assert time.monotonic() < deadline, "the update never reached the cache"
                time.sleep(0.01)


@pytest.mark.sentinel
def test_the_sync_reader_reads_through_sentinel(tmp_path: Path) -> None:
    master = RedisProcess().start()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(f"sentinel monitor mymaster 127.0.0.1 {master.port} 1\n")
    sentinel = RedisProcess(config_file=conf, extra_args=["--sentinel"]).start()
    try:

        async def prepare() -> None:
            client = aioredis.Redis.from_url(master.url, decode_responses=True)
            store = RedisStore(client, NS)
            t = await setup(store, "a")
            await write(store, "a", t["a"], running=3)
            await client.aclose()

        asyncio.run(prepare())
        url = f"redis+sentinel://127.0.0.1:{sentinel.port}/mymaster/0"
        with SyncStatsReader.from_url(url, NS) as reader:
            assert reader.snapshot()["a"].state == "fresh"
            with reader.router() as router:
                assert router.healthy and (a := router.get("a")) is not None
                assert a.stats is not None and a.stats.running == 3
    finally:
        sentinel.cleanup()
        master.cleanup()


# --- immutable views, one decode ----------------------------------------------------------


async def test_views_are_immutable_and_built_whole(redis_server: RedisProcess) -> None:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    await client.flushall()
    t = await setup(RedisStore(client, NS), "a")
    await write(RedisStore(client, NS), "a", t["a"])
    view = await StatsReader(client, NS).snapshot()
    assert view.offset_ms is not None  # set when it was built, not patched after
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.offset_ms = 0.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.healthy = False  # type: ignore[misc]
    endpoint = view["a"]
    for name in ("state", "owner", "stats", "id"):
        with pytest.raises(AttributeError):
            setattr(endpoint, name, None)
    assert endpoint.at(view.now_ms + 60_000).state == "stale" and endpoint.state == "fresh"
    await client.aclose()


async def test_get_shows_what_a_snapshot_shows_through_a_takeover(
    redis_server: RedisProcess,
) -> None:
    """p1 wrote the stats, then p2 took the lease over and has not written yet: the
    owner shown is the writer of the newer record, p1, by ``get`` as by ``snapshot``."""
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    await client.flushall()
    store = RedisStore(client, NS)
    t = await setup(store, "a")
    await write(store, "a", t["a"], running=2)
    assert await store.release_leases("p1", {"a": t["a"]}) == 1
    [taken] = await store.acquire_leases("p2", ["a"], 10_000)
    assert taken.token is not None and await store.lease_holder("a") == ("p2", taken.token)
    reader = StatsReader(client, NS)

    async def both_agree(owner: str) -> None:
        snapshot = await reader.snapshot()
        one = await reader.get("a")
        assert one is not None and one.owner == snapshot["a"].owner == owner
        assert one.at(snapshot.now_ms).to_dict() == snapshot["a"].to_dict()
        sync = SyncStatsReader(redis.Redis.from_url(redis_server.url, decode_responses=True), NS)
        with sync:
            other = await asyncio.to_thread(sync.get, "a")
        assert other is not None
        assert other.at(snapshot.now_ms).to_dict() == snapshot["a"].to_dict()

    await both_agree("p1")
    failed = await store.write_failure(
        "a", "p2", taken.token, reason="timeout", detail="d",
        lease_ttl_ms=10_000, failure_ttl_ms=10_000,
    )  # fmt: skip
    assert failed.accepted
    await both_agree("p2")  # the newer record is p2's failure now
    assert await reader.get("missing") is None
    await client.aclose()


def test_a_change_is_decoded_once_for_the_cache_the_view_and_the_routers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    decoded: list[str] = []
    real = decode.view_from_records

    def counting(endpoint_id: str, *args: Any) -> EndpointView:
        decoded.append(endpoint_id)
        return real(endpoint_id, *args)

    monkeypatch.setattr("poller.reader.view.cache.view_from_records", counting)
    monkeypatch.setattr("poller.reader.view.decode.view_from_records", counting)
    now = int(time.monotonic() * 1000)  # any clock: the cache keeps the offset

    def record(seq: int, running: int) -> str:
        body = json.dumps(_stats(now, running=str(running), models="m", seq=str(seq)))
        return f"{now} 1000 {now + 60_000} p1 1|{body}"

    cache = ViewCache()
    ids = ["a", "b", "c"]
    snapshot = View(
        now, 1, LazyEndpoints(dict.fromkeys(ids, ""), {e: record(1, 1) for e in ids}, {}, now)
    )
    cache.load(snapshot)
    cache.healthy = True
    routers = [Router(cache), Router(cache)]
    for router in routers:
        with router.pick("m") as ticket:
            assert ticket.id in ids
    assert sorted(decoded) == ids  # one decode each, shared by both routers
    for seq in range(2, 6):
        decoded.clear()
        cache.set_stats("b", record(seq, 0))
        for router in routers:
            with router.pick("m", candidates=["b", "c"]) as ticket:
                assert ticket.id == "b"
        view = cache.view()
        assert view["b"].stats is not None and view["b"].stats.seq == seq
        assert cache.get("b") is not None
        assert decoded == ["b"], seq


# --- deprecated names ---------------------------------------------------------------------


@pytest.mark.parametrize("module", [poller, poller.reader])
@pytest.mark.parametrize("name", ["Picker", "LocalLoad", "pick"])
def test_the_picker_api_still_works_with_a_warning_naming_the_router(
    module: Any, name: str
) -> None:
    with pytest.warns(
        DeprecationWarning, match=rf"{module.__name__}\.{name} is deprecated: .*Router"
    ):
        found = getattr(module, name)
    assert found is {"Picker": Picker, "LocalLoad": LocalLoad, "pick": pick}[name]
    assert name not in module.__all__


async def test_cached_still_works_with_a_warning_naming_the_router(
    redis_server: RedisProcess,
) -> None:
    async with StatsReader.from_url(redis_server.url, NS) as reader:
        with pytest.warns(DeprecationWarning, match=r"cached\(\) is deprecated: .*router\(\)"):
            async with reader.cached() as cache:
                assert cache.fleet is not None and len(cache.placements) == 0
    with SyncStatsReader.from_url(redis_server.url, NS) as sync:
        with pytest.warns(DeprecationWarning, match=r"cached\(\) is deprecated"):
            with sync.cached(share=False) as cache:
                assert cache.fleet is None and not cache.load_shared


# --- the Redis clock, the local load's locking -------------------------------------------


def test_server_ms_reads_a_time_reply_of_either_form() -> None:
    assert server_ms((1_700_000_000, 123_456)) == 1_700_000_000_123
    assert server_ms(["1700000000", "999", "extra"]) == 1_700_000_000_000


def test_local_load_reads_take_no_lock_and_writes_take_one() -> None:
    """As its docstring says: a pick's reads never wait for a request's bookkeeping."""
    local = LocalLoad()
    local.started("a")
    started = threading.Event()
    with local._lock:  # another thread is in the middle of a write
        assert local.since("a", 0.0) == 1 and local.in_flight("a") == 1
        assert local.total() == 1 and local.slowness("a") == 1.0
        writer = threading.Thread(target=lambda: (local.started("a"), started.set()))
        writer.start()
        assert not started.wait(0.05)  # the write waits for the lock
    writer.join(30)
    assert started.is_set() and local.in_flight("a") == 2


def test_the_endpoint_entry_is_the_registry_entry() -> None:
    view = _view(a="m")
    entry = view["a"].entry
    assert entry is None or isinstance(entry, Endpoint)
    hand = EndpointView(
        "x", state="fresh", age_ms=0, owner=None, token=None,
        raw=('{"url": "http://127.0.0.1:9"}', fields(), {}),
    )  # fmt: skip
    assert isinstance(hand.entry, Endpoint) and hand.entry.url == "http://127.0.0.1:9"
