"""DNS discovery: settings, the reconcile plan, and runners against a real
dnsmasq and a real redis-server; the takeover with real `poller run` processes."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from click.testing import CliRunner

from poller.cli import cli as cli_main
from poller.config import Settings, load_settings, parse_discovery_uri
from poller.errors import ConfigError, StoreError
from poller.schema.endpoint import Endpoint, endpoint_from_dict
from poller.service.discovery.resolve import Answer, Target, resolve
from poller.service.discovery.runner import DiscoveryRunner, endpoint_id, plan
from poller.service.metrics import PollerMetrics
from poller.store.discovery import read_sources
from poller.store.store import RedisStore
from poller_lab.sim import EndpointSpec, Simulator
from tests.support.dnsproc import DnsProcess
from tests.support.paths import REPO
from tests.support.procs import pollers, until
from tests.support.redisproc import RedisProcess

SRV = "_metrics._tcp.vllm.test"


@pytest.fixture
def dns_server() -> Iterator[DnsProcess]:
    server = DnsProcess()
    yield server
    server.cleanup()


@pytest.fixture
async def rstore(real_client: aioredis.Redis) -> AsyncIterator[RedisStore]:
    yield RedisStore(real_client, "test")


def settings(poller_id: str, *uris: str) -> Settings:
    return load_settings(None, {"id": poller_id, "discovery": list(uris)}, environ={})


def srv_uri(dns: DnsProcess, extra: str = "") -> str:
    return f"dns+srv://{SRV}?engine=vllm&refresh=1&nameserver={dns.nameserver}{extra}"


async def owned(store: RedisStore, source: str) -> dict[str, Endpoint]:
    registry = await store.read_registry()
    return {e: v for e, v in registry.endpoints.items() if v.source == source}


# --- settings ----------------------------------------------------------------------------


def test_uri_options_become_the_entries_fields() -> None:
    s = parse_discovery_uri(
        "dns+srv://_metrics._tcp.vllm.llm.svc.cluster.local?engine=vllm&labels=pool=a,zone=b"
        "&refresh=5&nameserver=10.0.0.10:53&interval_s=2&timeout_s=1&metrics_path=/m"
    )
    assert (s.kind, s.query, s.name, s.refresh_s) == (
        "srv",
        "_metrics._tcp.vllm.llm.svc.cluster.local.",
        "vllm.llm.svc.cluster.local",
        5.0,
    )
    assert s.nameserver == ("10.0.0.10", 53)
    assert s.entry_template() == {
        "engine": "vllm",
        "metrics_path": "/m",
        "interval_s": 2.0,
        "timeout_s": 1.0,
        "labels": {"pool": "a", "zone": "b"},
        "source": "vllm.llm.svc.cluster.local",
    }
    a = parse_discovery_uri("dns+a://vllm.llm:8000?name=pool-a&allow_empty=true&scheme=https")
    assert (a.kind, a.port, a.name, a.allow_empty, a.scheme, a.refresh_s) == (
        "a",
        8000,
        "pool-a",
        True,
        "https",
        10.0,
    )


@pytest.mark.parametrize(
    ("uri", "names"),
    [
        ("dns+srv://x.test?color=red&size=2", "unknown option(s) color, size"),
        ("dns+srv://x.test?engine=nope", "engine: unknown engine 'nope'"),
        ("dns+srv://x.test?refresh=soon", "refresh:"),
        ("dns+srv://x.test?nameserver=dns.test", "nameserver: 'dns.test' is not HOST:PORT"),
        ("dns+srv://x.test?allow_empty=maybe", "allow_empty: 'maybe'"),
        ("dns+srv://x.test?labels=novalue", "labels: 'novalue' is not KEY=VALUE"),
        ("dns+srv://x.test?api_key_env=A&api_key_file=/k", "api_key_env or api_key_file"),
        ("dns+srv://x.test:80", "must not name one"),
        ("dns+a://x.test", "needs the engines' port"),
        ("http://x.test", "scheme must be dns+srv:// or dns+a://"),
        ("dns+srv://x.test?name=a%20b", "name:"),
        ("dns+srv://x.test?engine=vllm&engine=tgi", "'engine' given twice"),
    ],
)
def test_bad_uris_are_one_line_errors_naming_the_option(uri: str, names: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_discovery_uri(uri)
    assert names in str(err.value) and "\n" not in str(err.value)


def test_run_exits_2_on_a_bad_discover_option() -> None:
    result = CliRunner().invoke(
        cli_main, ["run", "--discover", "dns+srv://x.test?engine=vllm&colour=red"]
    )
    assert result.exit_code == 2
    assert "unknown option(s) colour" in result.output


def test_sources_from_toml_tables_env_and_flags(tmp_path: Path) -> None:
    config = tmp_path / "poller.toml"
    config.write_text(
        "[[discovery]]\n"
        'uri = "dns+srv://_metrics._tcp.a.test"\n'
        'engine = "sglang"\n'
        "refresh = 3\n"
        'labels = { pool = "a" }\n'
        "[[discovery]]\n"
        'uri = "dns+a://b.test:8000?engine=vllm"\n'
    )
    from_file = load_settings(config, environ={}).discovery
    assert [(s.name, s.engine, s.refresh_s) for s in from_file] == [
        ("a.test", "sglang", 3.0),
        ("b.test", "vllm", 10.0),
    ]
    assert from_file[0].labels == {"pool": "a"}
    # POLLER_DISCOVER is space-separated; --discover (and the env) replace the file's list
    env = {"POLLER_DISCOVER": "dns+srv://c.test dns+srv://d.test"}
    result = subprocess.run(
        [sys.executable, "-m", "poller", "run", "--config", str(config), "--discover",
         "dns+srv://x.test?nope=1"],
        capture_output=True, text=True, env={**env, "PATH": "/usr/bin:/bin"}, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "unknown option(s) nope" in result.stderr
    with pytest.raises(ConfigError, match="table needs uri"):
        load_settings(None, {"discovery": [{"engine": "vllm"}]}, environ={})
    with pytest.raises(ConfigError, match="named 'x.test'"):
        load_settings(None, {"discovery": ["dns+srv://x.test", "dns+a://x.test:1"]}, environ={})


def test_poller_discover_env_is_space_separated() -> None:
    from poller.cli.run import run

    captured = {}

    def fake_serve(s: Settings) -> int:
        captured["sources"] = [x.name for x in s.discovery]
        return 0

    # `poller run` imports the service stack when it runs: patch it where it lives
    import poller.service.serve as serve_module

    original = serve_module.serve
    serve_module.serve = fake_serve  # type: ignore[assignment]
    try:
        result = CliRunner().invoke(
            run,
            [],
            env={"POLLER_DISCOVER": "dns+srv://c.test?engine=vllm  dns+a://d.test:80"},
        )
    finally:
        serve_module.serve = original
    assert captured.get("sources") == ["c.test", "d.test"], result.output


# --- the plan (pure) ---------------------------------------------------------------------


SOURCE = parse_discovery_uri("dns+srv://_m._tcp.pool.test?engine=vllm&labels=pool=a")


def registry_of(*entries: Endpoint) -> tuple[dict[str, Endpoint], dict[str, str]]:
    return {e.id: e for e in entries}, {e.id: e.to_json() for e in entries}


def test_plan_adds_at_once_and_removes_after_two_answers() -> None:
    t1, t2 = Target("e1.pool.test", 8000), Target("e2.pool.test", 8000)
    p = plan(SOURCE, (t1, t2), {}, {}, {})
    assert sorted(p.put) == ["pool.test/e1.pool.test:8000", "pool.test/e2.pool.test:8000"]
    entry = json.loads(p.put["pool.test/e1.pool.test:8000"])
    assert entry == {
        "url": "http://e1.pool.test:8000",
        "engine": "vllm",
        "labels": {"pool": "a"},
        "source": "pool.test",
    }
    reg, raw = registry_of(*(endpoint_from_dict(e, json.loads(j)) for e, j in p.put.items()))
    first = plan(SOURCE, (t1,), reg, raw, {})
    assert (first.put, first.remove, first.owned) == ({}, [], 2)
    assert first.misses == {"pool.test/e2.pool.test:8000": 1}
    second = plan(SOURCE, (t1,), reg, raw, first.misses)
    assert second.remove == ["pool.test/e2.pool.test:8000"] and second.owned == 1
    # back before the second answer: the count starts over
    back = plan(SOURCE, (t1, t2), reg, raw, first.misses)
    assert back.misses == {} and back.remove == []


def test_plan_changes_nothing_on_failure_and_leaves_other_entries_alone() -> None:
    mine = endpoint_from_dict("pool.test/e1.pool.test:8000", {"url": "http://e1.pool.test:8000",
                                                              "source": "pool.test"})  # fmt: skip
    hand = endpoint_from_dict("pool.test/e9.pool.test:8000", {"url": "http://h:1"})
    other = endpoint_from_dict("other/x:1", {"url": "http://x:1", "source": "other"})
    reg, raw = registry_of(mine, hand, other)
    failed = plan(SOURCE, None, reg, raw, {"pool.test/e1.pool.test:8000": 1})
    assert (failed.put, failed.remove, failed.owned) == ({}, [], 1)
    p = plan(SOURCE, (Target("e9.pool.test", 8000),), reg, raw, {})
    assert p.conflicts == ["pool.test/e9.pool.test:8000"]  # a hand-written entry's id
    assert p.put == {} and "other/x:1" not in p.remove and hand.id not in p.remove


def test_ids_are_sanitised_readable_and_unique() -> None:
    assert endpoint_id("pool", Target("fd00::1", 8000)) == "pool/fd00::1:8000"
    assert endpoint_id("pool", Target("a b*c", 1)) == "pool/a-b-c:1"
    long_a, long_b = endpoint_id("p", Target("a" * 250, 1)), endpoint_id("p", Target("a" * 251, 1))
    assert len(long_a) <= 200 and long_a != long_b
    p = plan(SOURCE, (Target("fd00::1", 8000),), {}, {}, {})
    assert json.loads(p.put["pool.test/fd00::1:8000"])["url"] == "http://[fd00::1]:8000"


async def test_a_file_sync_leaves_discovered_entries(fake_client: aioredis.Redis) -> None:
    store = RedisStore(fake_client, "test")
    found = endpoint_from_dict("src/e:1", {"url": "http://e:1", "source": "src"})
    await store.put_endpoint(found)
    await store.put_endpoint(endpoint_from_dict("old", {"url": "http://old:1"}))
    new = endpoint_from_dict("new", {"url": "http://new:1"})
    _, added, _, removed = await store.replace_registry({"new": new})
    assert (added, removed) == (["new"], ["old"])
    assert set((await store.read_registry()).endpoints) == {"new", "src/e:1"}


# --- resolving against dnsmasq -----------------------------------------------------------


async def test_resolve_maps_answers_and_errors(dns_server: DnsProcess) -> None:
    dns_server.set(
        srv=[(SRV, "e1.test", 8001), (SRV, "e2.test", 8002)],
        a=[("a.test", "127.0.0.1"), ("a.test", "::1"), ("_m._tcp.nodata.test", "127.0.0.9")],
    ).start()
    ns = dns_server.nameserver
    # Answers come in milliseconds; the lifetime only has to outlast a loaded machine.
    srv = await resolve(parse_discovery_uri(f"dns+srv://{SRV}?nameserver={ns}"), 10.0)
    assert srv == Answer((Target("e1.test", 8001), Target("e2.test", 8002)))
    a = await resolve(parse_discovery_uri(f"dns+a://a.test:9000?nameserver={ns}"), 10.0)
    assert a == Answer((Target("127.0.0.1", 9000), Target("::1", 9000)))
    nx = await resolve(parse_discovery_uri(f"dns+srv://_m._tcp.gone.test?nameserver={ns}"), 10)
    assert (nx.targets, nx.failure) == ((), "nxdomain")
    empty = await resolve(parse_discovery_uri(f"dns+srv://_m._tcp.nodata.test?nameserver={ns}"), 10)
    assert (empty.targets, empty.failure) == ((), "empty")
    refused = await resolve(parse_discovery_uri(f"dns+srv://x.example?nameserver={ns}"), 10)
    assert (refused.targets, refused.failure) == (None, "servfail")
    dns_server.stop()
    down = await resolve(parse_discovery_uri(f"dns+srv://{SRV}?nameserver={ns}"), 0.5)
    assert down.targets is None and down.failure in ("timeout", "servfail", "error")


# --- runners: dnsmasq + real redis-server ------------------------------------------------


async def test_add_at_once_remove_after_two_answers_and_publish(
    dns_server: DnsProcess, rstore: RedisStore
) -> None:
    dns_server.set(srv=[(SRV, "e1.test", 8001), (SRV, "e2.test", 8002)]).start()
    s = settings("p1", srv_uri(dns_server))
    runner = DiscoveryRunner(s, rstore, members=lambda: _members("p1"))
    name = s.discovery[0].name
    async with rstore.subscribe() as pubsub:
        await runner.step(now_s=0)
        assert sorted(await owned(rstore, name)) == [f"{name}/e1.test:8001", f"{name}/e2.test:8002"]
        message = await _next_message(pubsub)
        assert message == f"endpoints {await rstore.registry_rev()}"
    dns_server.set(srv=[(SRV, "e1.test", 8001), (SRV, "e3.test", 8003)]).restart()
    await runner.step(now_s=1)
    assert sorted(await owned(rstore, name)) == [
        f"{name}/e1.test:8001",
        f"{name}/e2.test:8002",  # missing once: kept
        f"{name}/e3.test:8003",  # new: at once
    ]
    await runner.step(now_s=1.5)  # not due: no query
    assert dns_server.queries(SRV) == 2
    await runner.step(now_s=2)
    assert sorted(await owned(rstore, name)) == [f"{name}/e1.test:8001", f"{name}/e3.test:8003"]
    [status] = await read_sources(rstore.client, rstore.keys)
    assert (status["holder"], status["targets"], status["failure"]) == ("p1", 2, "")
    assert status["resolved_at_ms"] and not status["stale"]
    await runner.stop()


async def test_dns_down_empty_and_nxdomain_keep_entries_and_report(
    dns_server: DnsProcess, rstore: RedisStore
) -> None:
    dns_server.set(srv=[(SRV, "e1.test", 8001)]).start()
    metrics = PollerMetrics()
    s = settings("p1", srv_uri(dns_server))
    runner = DiscoveryRunner(s, rstore, metrics, members=lambda: _members("p1"))
    name = s.discovery[0].name
    await runner.step(now_s=0)
    rev = await rstore.registry_rev()
    dns_server.stop()
    for now in (1, 2, 3):
        await runner.step(now_s=now)
    [status] = await read_sources(rstore.client, rstore.keys)
    assert status["failure"] in ("timeout", "servfail", "error") and status["targets"] == 1
    assert status["failure_since_ms"] and status["resolved_at_ms"]
    assert list(await owned(rstore, name)) == [f"{name}/e1.test:8001"]
    dns_server.set(a=[(SRV, "127.0.0.9")]).start()  # the name exists, without SRV records
    for now in (4, 5, 6):
        await runner.step(now_s=now)
    dns_server.set().restart()  # NXDOMAIN
    for now in (7, 8, 9):
        await runner.step(now_s=now)
    [status] = await read_sources(rstore.client, rstore.keys)
    assert status["failure"] == "nxdomain"
    assert list(await owned(rstore, name)) == [f"{name}/e1.test:8001"]
    assert await rstore.registry_rev() == rev  # nothing was written
    sample = metrics.registry.get_sample_value
    assert sample("poller_discovery_resolutions_total", {"source": name}) == 10
    assert sample("poller_discovery_failures_total", {"source": name, "reason": "empty"}) == 3
    assert sample("poller_discovery_failures_total", {"source": name, "reason": "nxdomain"}) == 3
    assert sample("poller_discovery_targets", {"source": name}) == 1
    await runner.stop()


async def test_allow_empty_lets_an_empty_answer_remove(
    dns_server: DnsProcess, rstore: RedisStore
) -> None:
    dns_server.set(srv=[(SRV, "e1.test", 8001)]).start()
    s = settings("p1", srv_uri(dns_server, "&allow_empty=true"))
    runner = DiscoveryRunner(s, rstore, members=lambda: _members("p1"))
    name = s.discovery[0].name
    await runner.step(now_s=0)
    dns_server.set().restart()
    await runner.step(now_s=1)
    assert len(await owned(rstore, name)) == 1  # one empty answer: kept
    await runner.step(now_s=2)
    assert await owned(rstore, name) == {}
    [status] = await read_sources(rstore.client, rstore.keys)
    assert (status["failure"], status["targets"]) == ("", 0)


async def test_two_sources_side_by_side_and_hand_written_entries_left_alone(
    dns_server: DnsProcess, rstore: RedisStore
) -> None:
    dns_server.set(
        srv=[(SRV, "e1.test", 8001)],
        a=[("pool.test", "127.0.0.2"), ("pool.test", "127.0.0.3")],
    ).start()
    ns = dns_server.nameserver
    hand = endpoint_from_dict("hand", {"url": "http://hand.test:1"})
    squat = endpoint_from_dict("pool/127.0.0.3:9000", {"url": "http://squat.test:1"})
    await rstore.put_endpoint(hand)
    await rstore.put_endpoint(squat)
    s = settings(
        "p1",
        srv_uri(dns_server, "&name=srv"),
        f"dns+a://pool.test:9000?engine=sglang&refresh=1&name=pool&nameserver={ns}",
    )
    runner = DiscoveryRunner(s, rstore, members=lambda: _members("p1"))
    await runner.step(now_s=0)
    registry = (await rstore.read_registry()).endpoints
    assert sorted(registry) == [
        "hand",
        "pool/127.0.0.2:9000",
        "pool/127.0.0.3:9000",
        "srv/e1.test:8001",
    ]
    assert registry["pool/127.0.0.2:9000"].engine == "sglang"
    assert registry["pool/127.0.0.3:9000"] == squat  # someone else's id: untouched
    dns_server.set(srv=[]).restart()  # both sources now answer NXDOMAIN / nothing
    for now in (1, 2, 3):
        await runner.step(now_s=now)
    assert (await rstore.read_registry()).endpoints == registry
    sources = await read_sources(rstore.client, rstore.keys)
    assert [(x["source"], x["failure"]) for x in sources] == [
        ("pool", "nxdomain"),
        ("srv", "nxdomain"),
    ]


async def test_one_resolver_per_source_and_takeover(
    dns_server: DnsProcess, rstore: RedisStore
) -> None:
    dns_server.set(srv=[(SRV, "e1.test", 8001)]).start()
    uri = srv_uri(dns_server)
    members = ["p1", "p2", "p3"]
    runners = {m: DiscoveryRunner(settings(m, uri), rstore, members=lambda: _list(members))
               for m in members}  # fmt: skip
    for now in (0, 1, 2):
        for r in runners.values():
            await r.step(now_s=now)
    holders = [m for m, r in runners.items() if r.held]
    assert len(holders) == 1
    assert dns_server.queries(SRV) == 3  # one query per refresh for the whole fleet
    # the holder dies: it leaves the members and its lease lapses (here: deleted)
    dead = holders[0]
    members.remove(dead)
    source = settings(dead, uri).discovery[0].name
    await rstore.client.delete(rstore.keys.discovery_lease(source))
    for now in (3, 4):
        for m in members:
            await runners[m].step(now_s=now)
    assert len([m for m in members if runners[m].held]) == 1
    [status] = await read_sources(rstore.client, rstore.keys)
    assert status["holder"] in members and status["holder"] != dead
    # a poller that joins and is preferred gets the source handed over, not fought for
    members.append(dead)
    runners[dead] = DiscoveryRunner(settings(dead, uri), rstore, members=lambda: _list(members))
    for now in (5, 6, 7):
        for m in members:
            await runners[m].step(now_s=now)
    assert len([m for m in members if runners[m].held]) == 1
    for r in runners.values():
        await r.stop()


async def _members(*ids: str) -> list[str]:
    return list(ids)


async def _list(ids: list[str]) -> list[str]:
    return sorted(ids)


async def _next_message(pubsub: aioredis.client.PubSub) -> str:
    async with asyncio.timeout(30):  # immediate when idle; a loaded machine: seconds
        while True:
            message = await pubsub.get_message(timeout=1)
            if message is not None and message["type"] == "message":
                return str(message["data"])


# --- real `poller run` processes ---------------------------------------------------------


@pytest.mark.slow
async def test_pollers_follow_dns_and_take_over_when_the_resolver_dies(
    dns_server: DnsProcess, own_redis: RedisProcess, tmp_path: Path
) -> None:
    async with Simulator([EndpointSpec(f"vllm-{i}", "vllm", "port") for i in range(3)]) as sim:
        ports = [int(sim.base_url(e).rsplit(":", 1)[1]) for e in sim.ids]
        dns_server.set(srv=[(SRV, "localhost", p) for p in ports[:2]]).start()
        uri = srv_uri(dns_server, "&name=vllm")
        client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
        store = RedisStore(client, "disc")
        try:
            with pollers(3, own_redis.url, "disc", tmp_path, extra_args=("--discover", uri)) as ps:

                async def ids() -> list[str]:
                    return sorted((await store.read_registry()).endpoints)

                want = sorted(f"vllm/localhost:{p}" for p in ports[:2])
                await until(lambda: _eq(ids(), want), 60, "the first two engines")

                async def fresh() -> bool:
                    _, text = ps[0].get("/v1/view")
                    view = json.loads(text or "{}")
                    states = [e["state"] for e in view.get("endpoints", [])]
                    return bool(view.get("sources")) and states == ["fresh", "fresh"]

                await until(fresh, 30, "both discovered engines scraped")
                # One resolver fleet-wide: its refreshes are >= 1 s apart (the cadence itself
                # is pinned on a given clock above), so 4 queries span >= 3 s; three pollers
                # each resolving would send them within ~1 s. A slow machine only slows them.
                before, t0 = dns_server.queries(SRV), time.monotonic()
                await until(lambda: dns_server.queries(SRV) - before >= 4, 60, "4 SRV queries")
                assert time.monotonic() - t0 > 2.5, "more than one poller resolves the source"
                [status] = await read_sources(client, store.keys)
                holder = next(p for p in ps if p.id == status["holder"])
                holder.signal(signal.SIGKILL)
                holder.wait()

                async def taken_over() -> bool:
                    [s] = await read_sources(client, store.keys)
                    return s["holder"] not in (None, holder.id) and not s["stale"]

                await until(taken_over, 40, "another poller resolving the source")
                dns_server.set(srv=[(SRV, "localhost", p) for p in ports[1:]]).restart()
                want = sorted(f"vllm/localhost:{p}" for p in ports[1:])
                await until(lambda: _eq(ids(), want), 40, "the registry following DNS")
                out = await asyncio.to_thread(
                    subprocess.run,
                    [sys.executable, "-m", "poller", "status", "--json", "--redis-url",
                     own_redis.url, "--namespace", "disc"],
                    capture_output=True, text=True, timeout=60, check=True,
                )  # fmt: skip
                [shown] = json.loads(out.stdout)["sources"]
                assert shown["source"] == "vllm" and shown["targets"] == 2
                table = await asyncio.to_thread(
                    subprocess.run,
                    [sys.executable, "-m", "poller", "status", "--redis-url", own_redis.url,
                     "--namespace", "disc"],
                    capture_output=True, text=True, timeout=60, check=True,
                )  # fmt: skip
                assert "discovery sources" in table.stdout and shown["holder"] in table.stdout
        finally:
            await client.aclose()


async def _eq(value: object, want: object) -> bool:
    return await value == want  # type: ignore[misc]


def test_the_example_overlay_discovers_its_headless_service() -> None:
    import yaml

    overlay = REPO / "deploy" / "k8s" / "overlays" / "example"
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    assert "engines-service.yaml" in kustomization["resources"]
    assert {"path": "discovery-patch.yaml"} in kustomization["patches"]
    service = yaml.safe_load((overlay / "engines-service.yaml").read_text())
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert [p["name"] for p in service["spec"]["ports"]] == ["metrics"]
    patch = yaml.safe_load((overlay / "discovery-patch.yaml").read_text())
    [container] = patch["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    [source] = load_settings(None, {"discovery": env["POLLER_DISCOVER"]}, environ={}).discovery
    name, namespace = service["metadata"]["name"], kustomization["namespace"]
    assert source.query == f"_metrics._tcp.{name}.{namespace}.svc.cluster.local."
    assert (source.kind, source.engine) == ("srv", "vllm")


async def test_an_orphaned_source_is_taken_and_kept(
    dns_server: DnsProcess, rstore: RedisStore
) -> None:
    """The preferred poller does not run the source (say, older settings): after three
    passes with the lease free, another poller takes it, and keeps it without flapping."""
    from poller.service.coordinator import owner_of

    dns_server.set(srv=[(SRV, "e1.test", 8001)]).start()
    s = settings("p1", srv_uri(dns_server, "&name=orphan"))
    other = next(
        m for m in (f"q{i}" for i in range(100)) if owner_of("discovery/orphan", ["p1", m]) == m
    )
    runner = DiscoveryRunner(s, rstore, members=lambda: _members("p1", other))
    for now in (0, 0.25):
        await runner.step(now_s=now)
        assert runner.held == []
    await runner.step(now_s=0.5)  # the third pass that finds the lease free
    assert runner.held == ["orphan"] and len(await owned(rstore, "orphan")) == 1
    for now in (0.75, 1.0, 1.25, 1.5, 1.75, 2.0):
        await runner.step(now_s=now)
    assert runner.held == ["orphan"]
    assert dns_server.queries(SRV) == 2  # at 0.5 and 1.5: once per 1 s refresh
    await runner.stop()
    assert await rstore.client.get(rstore.keys.discovery_lease("orphan")) is None


def _warned(caplog: pytest.LogCaptureFixture) -> bool:
    return any(
        r.name == "poller.service.discovery.runner" and r.levelno >= logging.WARNING
        for r in caplog.records
    )


async def test_the_runner_loop_survives_an_empty_redis_restart(
    dns_server: DnsProcess, own_redis: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis goes away and comes back empty: the loop backs off, re-acquires the source
    (the old lease is gone with everything else) and writes the entries again."""
    dns_server.set(srv=[(SRV, "e1.test", 8001)]).start()
    client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    store = RedisStore(client, "test")
    runner = DiscoveryRunner(
        settings("p1", srv_uri(dns_server, "&name=loop")), store, members=lambda: _members("p1")
    )
    try:
        await runner.start()
        await until(lambda: owned(store, "loop"), 30, "the first entry")
        own_redis.stop()
        caplog.clear()
        await until(lambda: _warned(caplog), 30, "a pass failing against a stopped Redis")
        own_redis.restart()

        async def written_again() -> bool:
            try:
                return bool(await owned(store, "loop"))
            except StoreError:  # this test's own client reconnects too
                return False

        await until(written_again, 30, "the entry written again")
        assert runner.held == ["loop"]
    finally:
        await runner.stop()
        await client.aclose()


async def test_endpoints_sync_and_its_dry_run_leave_discovered_entries(
    rstore: RedisStore, redis_server: RedisProcess, tmp_path: Path
) -> None:
    await rstore.put_endpoint(endpoint_from_dict("src/e:1", {"url": "http://e:1", "source": "src"}))
    await rstore.put_endpoint(endpoint_from_dict("old", {"url": "http://old:1"}))
    file = tmp_path / "endpoints.yaml"
    file.write_text("endpoints:\n  - {id: new, url: 'http://new:1'}\n")
    args = ["endpoints", "sync", str(file), "--redis-url", redis_server.url, "--namespace", "test"]

    def sync(*extra: str) -> str:
        result = CliRunner().invoke(cli_main, [*args, *extra], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.output

    dry = await asyncio.to_thread(sync, "--dry-run")
    real = await asyncio.to_thread(sync)
    for output in (dry, real):
        assert "+ new" in output and "- old" in output and "src/e:1" not in output
    assert set((await rstore.read_registry()).endpoints) == {"new", "src/e:1"}
