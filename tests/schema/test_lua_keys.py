"""Every Lua script touches only the keys and channels it is given in KEYS (Redis
Cluster's rule), and says what it takes and returns in its header.

Each script runs on a real redis-server as an ACL user that may touch exactly the keys
(and publish on exactly the channels) named in that call's KEYS: a command on anything
else inside the script is refused by Redis itself. Every script of ``schema/scripts`` must
run at least once, on its write and its rejection paths, so a new script is covered too.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import pytest
import redis.asyncio as aioredis

from poller.errors import IdentityConflict
from poller.reader.reader import StatsReader
from poller.schema.endpoint import Endpoint
from poller.schema.lua import lua
from poller.store.discovery import DiscoveryStore
from poller.store.members import Instance, request_drain
from poller.store.store import RedisStore
from tests.support.redisproc import RedisProcess

NS = "keys"


class _AnyValue:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, str)


ANY_VALUE = _AnyValue()
PROBE = "declared-keys-only"


def _scripts() -> dict[str, str]:
    """sha1 -> script name, for every script the package ships."""
    folder = resources.files("poller.schema") / "scripts"
    names = [p.name.removesuffix(".lua") for p in folder.iterdir() if p.name.endswith(".lua")]
    return {hashlib.sha1(lua(n).encode()).hexdigest(): n for n in names}


def _glob_escape(key: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", key)


class DeclaredKeysOnly(aioredis.Redis):
    """Runs every EVALSHA as ``PROBE``, an ACL user allowed exactly the declared KEYS
    (as keys and as channels) and nothing else; the rest goes as the default user."""

    admin: aioredis.Redis
    probe: aioredis.Redis
    ran: set[str]

    async def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any:  # type: ignore[override]
        keys = [str(k) for k in keys_and_args[:numkeys]]
        patterns = [f"~{_glob_escape(k)}" for k in keys] + [f"&{_glob_escape(k)}" for k in keys]
        await self.admin.execute_command(
            "ACL", "SETUSER", PROBE, "reset", "on", "nopass", "+@all", *patterns
        )
        self.ran.add(sha)
        return await self.probe.evalsha(sha, numkeys, *keys_and_args)


@pytest.fixture
async def client(redis_server: RedisProcess) -> AsyncIterator[DeclaredKeysOnly]:
    c = DeclaredKeysOnly(port=redis_server.port, decode_responses=True)
    c.admin = aioredis.Redis(port=redis_server.port, decode_responses=True)
    await c.admin.flushall()
    await c.admin.execute_command("ACL", "SETUSER", PROBE, "reset", "on", "nopass", "+@all")
    c.probe = aioredis.Redis(
        port=redis_server.port, username=PROBE, password="x", decode_responses=True
    )
    c.ran = set()
    yield c
    await c.admin.execute_command("ACL", "DELUSER", PROBE)
    for each in (c, c.admin, c.probe):
        await each.aclose()


async def test_the_probe_refuses_an_undeclared_key(client: DeclaredKeysOnly) -> None:
    """The harness itself: a script that writes a key it was not given fails."""
    sneaky = client.register_script("redis.call('SET', KEYS[1], 1); redis.call('SET', 'x', 1)")
    with pytest.raises(Exception, match="can't access"):
        await sneaky(keys=["declared"])
    channel = client.register_script("redis.call('SPUBLISH', KEYS[1] .. 'x', 1)")
    with pytest.raises(Exception, match="can't publish"):
        await channel(keys=["declared"])


async def test_every_script_touches_only_what_its_keys_declare(client: DeclaredKeysOnly) -> None:
    store = RedisStore(client, NS)
    await store.ensure_schema()
    await store.heartbeat("p1", 5000)
    await store.live_members()  # the heartbeat script in its read-only form
    assert await request_drain(client, store.keys, "p1", "cli") == "requested"
    assert await request_drain(client, store.keys, "p1", "cli") == "already"
    assert await request_drain(client, store.keys, "nobody", "cli") == "not live"
    assert (await store.heartbeat("p1", 5000)).draining == ("p1",)  # info says draining
    with pytest.raises(IdentityConflict):  # the refusal: another process under the id
        await store.heartbeat("p1", 5000, Instance("other", "elsewhere", 1))
    e1 = Endpoint(id="e1", url="http://e1.test")
    await store.put_endpoint(e1)
    await store.put_endpoint(Endpoint(id="e2", url="http://e2.test"))
    await store.replace_registry({"e1": e1, "e2": Endpoint(id="e2", url="http://e2b.test")})
    assert (await store.read_registry()).ids == ["e1", "e2"]

    [first, second] = await store.acquire_leases("p1", ["e1", "e2"], 5000)
    assert first.token is not None and second.token is not None
    assert (await store.acquire_leases("p1", ["e1"], 5000))[0].renewed
    assert (await store.acquire_leases("p2", ["e1"], 5000))[0].holder
    assert await store.renew_leases("p1", {"e1": first.token, "e2": second.token}, 5000)
    ttl = {"lease_ttl_ms": 5000}
    ok = await store.write_stats("e1", "p1", first.token, {"running": "1"}, **ttl, stats_ttl_ms=9)
    assert ok.accepted
    failed = await store.write_failure(
        "e2", "p1", second.token, reason="timeout", detail="slow", **ttl, failure_ttl_ms=9000
    )
    assert failed.accepted
    again = await store.write_failure(
        "e2", "p1", second.token, reason="timeout", detail="slow", **ttl, failure_ttl_ms=9000
    )
    assert again.accepted and again.value == 2
    wrong = await store.write_stats("e1", "p1", 999, {"running": "1"}, **ttl, stats_ttl_ms=9)
    assert not wrong.accepted
    assert not (await store.write_failure("e1", "p1", 999, reason="x", detail="", **ttl,
                                          failure_ttl_ms=9)).accepted  # fmt: skip

    reader = StatsReader(client, NS)
    view = await reader.snapshot()
    assert set(view.endpoints) == {"e1", "e2"}
    await reader.snapshot()  # with the registry held: the script's other path
    assert (await reader.get("e1")) is not None
    keys, args = reader._records_call("e1")
    await reader._get_records(keys=keys, args=args)
    assert await reader.live_pollers() == ["p1"]
    share = client.register_script(lua("share"))
    shared = reader.keys.share()
    written = await share(keys=shared, args=["g1", 800, '{"e1":[1,0,0]}', 1, "", 10])
    number = int(written[3])
    assert written[2:] == [0, number, 0, 1, 0, "e1", "1"]
    read = await share(keys=shared, args=["g2", 800, "", 1, number, 10])
    assert read[2:] == [1, number, 1, 0, 0]  # nothing moved since; g2 never wrote
    left = await share(keys=shared, args=["g1", 800, ".", 1, number, 10])
    assert left[2:5] == [1, number + 1, 0] and left[7:] == ["e1", "0"]

    assert await store.release_leases("p1", {"e1": first.token}) == 1
    assert await store.remove_endpoint("e2") is not None

    discovery = DiscoveryStore(client, store.keys)
    lease = await discovery.acquire("dns", "p1", 5000)
    assert lease.token is not None
    assert await discovery.renew("dns", "p1", lease.token, 5000)
    status = {"targets": [], "answer": ""}
    assert await discovery.write_status(
        "dns", "p1", lease.token, answered=True, failure="", record=status,
        lease_ttl_ms=5000, status_ttl_ms=5000,
    )  # fmt: skip
    assert not await discovery.write_status(
        "dns", "p1", 999, answered=True, failure="", record=status,
        lease_ttl_ms=5000, status_ttl_ms=5000,
    )  # fmt: skip
    assert await discovery.release("dns", "p1", lease.token)

    scripts = _scripts()
    assert {scripts[sha] for sha in client.ran if sha in scripts} == set(scripts.values())


@pytest.mark.parametrize("name", sorted(_scripts().values()))
def test_each_script_header_names_keys_argv_and_return(name: str) -> None:
    lines = lua(name).splitlines()
    header = "\n".join(line for line in lines if line.startswith("--"))
    body = "\n".join(line for line in lines if not line.startswith("--"))
    assert "KEYS:" in header, name
    assert "ARGV" in header or "ARGV" not in body, name
    assert "return" in header.lower(), name
