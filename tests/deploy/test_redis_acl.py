"""users.acl and every Redis config under deploy/redis, loaded by a real redis-server: each
ACL user gets exactly its commands, a poller and a reader run as the ACL users, and
replication and Sentinel authenticate."""

from __future__ import annotations

import asyncio
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis
import yaml
from click.testing import CliRunner

from poller.cli import cli
from poller.config import load_settings
from tests.support.deploy import ACL_FILE, ADMIN, DEPLOY, GATEWAY, POLLER
from tests.support.markers import require
from tests.support.redisproc import free_cluster_port, free_port, redis_server_binary, wait_until

if TYPE_CHECKING:
    from poller.service.worker import Worker

pytestmark = pytest.mark.redis_server


class _Redis:
    """A redis-server started with extra arguments; its clients log in as ACL users."""

    def __init__(
        self, args: list[str], cwd: Path, *, sentinel: bool = False, cluster: bool = False
    ) -> None:
        # A cluster node also binds port + 10000 for its bus.
        self.port = free_cluster_port() if cluster else free_port()
        self.cwd = cwd
        self._clients: dict[tuple[str, str] | None, redis.Redis] = {}
        cwd.mkdir(parents=True, exist_ok=True)
        command = [redis_server_binary(), *args, "--port", str(self.port), "--bind", "127.0.0.1"]
        if sentinel:
            require("sentinel", "a redis-server in Sentinel mode")
            command.append("--sentinel")
        command += ["--logfile", str(cwd / "redis.log")]
        self.proc = subprocess.Popen(
            command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

        def up() -> bool:
            if self.proc.poll() is not None:
                return True
            try:  # any answer will do: with the ACL file, PING wants a user first
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    return conn.recv(64).startswith((b"+PONG", b"-NOAUTH"))
            except OSError:
                return False

        wait_until(up, 60, what=f"redis-server {args[:1]}")  # seconds on a loaded machine
        if self.proc.poll() is not None:
            log = (cwd / "redis.log").read_text(errors="replace")[-2000:]
            raise AssertionError(f"redis-server {args} exited at start:\n{log}")

    def client(self, user: tuple[str, str] | None = ADMIN) -> redis.Redis:
        """One client per user, closed by stop()."""
        if user not in self._clients:
            username, password = user if user else (None, None)
            self._clients[user] = redis.Redis(
                port=self.port,
                username=username,
                password=password,
                decode_responses=True,
                socket_timeout=5,
            )
        return self._clients[user]

    def url(self, user: tuple[str, str]) -> str:
        return f"redis://{user[0]}:{user[1]}@127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        for client in self._clients.values():
            client.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[_Redis]:
    server = _Redis(
        ["--save", "", "--appendonly", "no", "--aclfile", str(ACL_FILE)], tmp_path / "acl"
    )
    try:
        yield server
    finally:
        server.stop()


def _dryrun(client: redis.Redis, user: str, *command: str) -> bool:
    return bool(client.execute_command("ACL", "DRYRUN", user, *command) == "OK")


def test_acl_file_loads_and_each_user_gets_exactly_its_commands(acl_redis: _Redis) -> None:
    admin = acl_redis.client()
    listed = {line.split()[1]: line for line in admin.execute_command("ACL", "LIST")}
    assert set(listed) == {
        "default",
        "admin",
        "poller",
        "gateway",
        "replica",
        "sentinel",
        "monitor",
    }
    assert " off " in listed["default"] + " "
    key = "{llmgw}:x"
    ev, up, sha = "{llmgw}:events", "{llmgw}:updates", "0" * 40
    poller_may = [
        ("GET", key), ("SET", key, "1"), ("INCR", key), ("DEL", key), ("MGET", key),
        ("HSET", key, "f", "v"), ("HGET", key, "f"), ("HGETALL", key), ("HDEL", key, "f"),
        ("HEXISTS", key, "f"), ("PEXPIRE", key, "1"), ("PTTL", key), ("ZADD", key, "1", "m"),
        ("ZREM", key, "m"), ("ZRANGEBYSCORE", key, "0", "1"), ("ZRANGE", key, "0", "-1"),
        ("ZREMRANGEBYSCORE", key, "0", "1"), ("TIME",), ("PUBLISH", ev, "x"), ("SUBSCRIBE", ev),
        ("EVALSHA", sha, "1", key), ("EVAL", "return 1", "1", key), ("SCRIPT", "LOAD", "return 1"),
        ("PING",), ("MULTI",), ("EXEC",), ("SPUBLISH", up, "x"),
    ]  # fmt: skip
    for command in poller_may:
        assert _dryrun(admin, "poller", *command), f"poller may not {command}"
    gateway_may = [
        ("GET", key), ("MGET", key), ("HGET", key, "f"), ("HGETALL", key), ("HEXISTS", key, "f"),
        ("ZRANGE", key, "0", "-1"), ("ZRANGEBYSCORE", key, "0", "1"), ("TIME",), ("PING",),
        ("SUBSCRIBE", ev), ("EVALSHA", sha, "1", key), ("EVALSHA_RO", sha, "1", key),
        ("SCRIPT", "LOAD", "return 1"), ("MULTI",), ("EXEC",), ("SSUBSCRIBE", up),
    ]  # fmt: skip
    shared = "{llmgw}:gateways:inflight"  # the gateways' shared in-flight, their one write
    gateway_may += [("HSET", shared, "g", "v"), ("HDEL", shared, "g"), ("PEXPIRE", shared, "1")]
    placed = "{llmgw}:gateways:placements"  # their shared prefix placements, a stream
    gateway_may += [
        ("XADD", placed, "MAXLEN", "~", "10", "*", "@", "g", "p", ""),
        ("XTRIM", placed, "MINID", "~", "1"), ("XRANGE", placed, "-", "+"),
        ("XREVRANGE", placed, "+", "-"), ("PEXPIRE", placed, "1"),
    ]  # fmt: skip
    for command in gateway_may:
        assert _dryrun(admin, "gateway", *command), f"gateway may not {command}"
    for user, command in [
        ("poller", ("SET", "other", "1")),
        ("poller", ("FLUSHALL",)),
        ("poller", ("KEYS", "*")),
        ("poller", ("CONFIG", "GET", "*")),
        ("poller", ("PUBLISH", "other", "x")),
        ("gateway", ("SET", key, "1")),
        ("gateway", ("HSET", key, "f", "v")),
        ("gateway", ("DEL", key)),
        ("gateway", ("PUBLISH", "{llmgw}:events", "x")),
        ("gateway", ("SPUBLISH", "{llmgw}:updates", "x")),
        ("poller", ("SPUBLISH", "other", "x")),
        ("gateway", ("EVAL", "return 1", "0")),
        ("gateway", ("GET", "other")),
        ("gateway", ("SET", "{llmgw}:gateways:inflight", "1")),
        ("gateway", ("DEL", "{llmgw}:gateways:inflight")),
        ("gateway", ("PEXPIRE", key, "1")),
        ("gateway", ("XADD", key, "*", "f", "v")),
        ("gateway", ("DEL", "{llmgw}:gateways:placements")),
        ("gateway", ("HSET", "{llmgw}:gateways:placements", "f", "v")),
        ("gateway", ("XADD", "{llmgw}:gateways:inflight", "*", "f", "v")),
    ]:
        assert not _dryrun(admin, user, *command), f"{user} may {command}"


async def _poller_on(server: _Redis, base: str, tmp_path: Path) -> Worker:
    """The example engine at ``base`` registered through `endpoints sync`, and a Worker
    for it (not started), both as the `poller` ACL user."""
    from poller.service.worker import Worker

    registry = tmp_path / "endpoints.yaml"
    registry.write_text(
        yaml.safe_dump({"endpoints": [{"id": "acl-vllm", "url": base, "engine": "vllm"}]})
    )
    sync = await asyncio.to_thread(
        CliRunner().invoke,
        cli,
        ["endpoints", "sync", str(registry), "--redis-url", server.url(POLLER)],
    )
    assert sync.exit_code == 0, sync.output
    settings = load_settings(
        None,
        {"redis.url": server.url(POLLER), "id": "acl-poller", "health.port": 0},
        environ={},
    )
    return Worker(settings)


def test_a_poller_and_a_reader_run_as_the_acl_users(acl_redis: _Redis, tmp_path: Path) -> None:
    """The real code paths, not a list: registry sync, poller run, gateway reads."""
    from poller.reader import StatsReader, SyncStatsReader
    from poller.scrape.check import serve_example

    async def scenario() -> None:
        async with serve_example("vllm") as base:
            worker = await _poller_on(acl_redis, base, tmp_path)
            reader = StatsReader.from_url(acl_redis.url(GATEWAY))
            await worker.start()
            try:
                deadline = time.monotonic() + 30  # start-up: ample for a loaded machine
                while True:
                    view = (await reader.snapshot()).to_dict()
                    states = {e["id"]: e["state"] for e in view["endpoints"]}
                    if states.get("acl-vllm") == "fresh":
                        break
                    assert time.monotonic() < deadline, f"never fresh: {view}"
                    await asyncio.sleep(0.1)
                async with reader.router() as router:  # SSUBSCRIBE P:updates, probes
                    cache = router.cache
                    seq = cache.get("acl-vllm").stats.seq  # type: ignore[union-attr]
                    while (e := cache.get("acl-vllm")) is None or e.stats.seq <= seq + 1:  # type: ignore[union-attr]
                        assert time.monotonic() < deadline + 10, "no update reached the cache"
                        await asyncio.sleep(0.05)
                    assert cache.healthy
                # Drain as the poller user: the CLI's request and wait, the undo, and the
                # poller writing its own request (SIGUSR1).
                drain = ["drain", "acl-poller", "--redis-url", acl_redis.url(POLLER)]
                invoke = CliRunner().invoke
                drained = await asyncio.to_thread(invoke, cli, [*drain, "--force", "--wait", "60"])
                assert drained.exit_code == 0 and "holds no lease" in drained.output, drained.output
                undone = await asyncio.to_thread(invoke, cli, [*drain, "--undo"])
                assert undone.exit_code == 0, undone.output
                worker.drain.request()
                while not worker.draining:
                    assert time.monotonic() < deadline + 30, "the poller's own drain request"
                    await asyncio.sleep(0.05)
            finally:
                await worker.stop()
                await reader.aclose()

    asyncio.run(scenario())
    sync_reader = SyncStatsReader.from_url(acl_redis.url(GATEWAY))
    try:
        assert sync_reader.get("acl-vllm") is not None
        sync_reader.live_pollers()
    finally:
        sync_reader.close()
    status = CliRunner().invoke(cli, ["status", "--json", "--redis-url", acl_redis.url(GATEWAY)])
    assert status.exit_code == 0, status.output

    admin = acl_redis.client()
    denied = admin.execute_command("ACL", "LOG")
    assert not denied, f"commands refused to the ACL users: {denied}"
    # The gateways share their requests in flight with the share script, as that user.
    from poller.schema.lua import lua

    share = acl_redis.client(GATEWAY).register_script(lua("share"))
    record = '{"acl-vllm":[1,0,0]}'  # one request in flight, as the exchange writes it
    from poller.schema.keys import Keys

    shared = Keys("llmgw").share(placements=True)
    reply = share(keys=shared, args=["acl-gw", 800, record, 1, "", 10, "", "", 64, 600_000, 64])
    assert reply[2] == 0 and reply[8:] == ["acl-vllm", "1"]  # no other replica; the total
    reply = share(
        keys=shared, args=["acl-gw-2", 800, "", 1, "", 10, "e AAAAAAAAAAE=", "", 64, 600_000, 64]
    )
    assert reply[2] == 1 and reply[8:] == ["acl-vllm", "1"]
    assert admin.hexists("{llmgw}:gateways:inflight", "acl-gw")
    # The gateway cannot write, not even through a script it loads itself.
    gateway = acl_redis.client(GATEWAY)
    script = gateway.register_script("return redis.call('SET', KEYS[1], 'x')")
    with pytest.raises(redis.ResponseError, match="can't run this command"):
        script(keys=["{llmgw}:schema"])


@pytest.mark.sentinel
def test_every_redis_config_starts_and_replication_and_sentinel_authenticate(
    tmp_path: Path,
) -> None:
    configs = DEPLOY / "redis"
    acl = ["--aclfile", str(ACL_FILE)]
    started: list[_Redis] = []
    try:
        single = _Redis([str(configs / "single" / "redis.conf"), *acl], tmp_path / "single")
        started.append(single)
        assert single.client().config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}

        node = _Redis(
            [str(configs / "cluster" / "redis.conf"), *acl], tmp_path / "cluster", cluster=True
        )
        started.append(node)
        assert node.client().info("cluster")["cluster_enabled"] == 1

        # Sentinel rewrites the files it manages: work on copies.
        conf = tmp_path / "sentinel-redis.conf"
        shutil.copy(configs / "sentinel" / "redis.conf", conf)
        primary = _Redis([str(conf), *acl], tmp_path / "primary")
        started.append(primary)
        shutil.copy(configs / "sentinel" / "redis.conf", tmp_path / "replica.conf")
        replica = _Redis(
            [str(tmp_path / "replica.conf"), *acl, "--replicaof", "127.0.0.1", str(primary.port)],
            tmp_path / "replica",
        )
        started.append(replica)
        wait_until(
            lambda: replica.client().info("replication").get("master_link_status") == "up",
            60,
            what="the replica to sync as the `replica` user",
        )
        text = (configs / "sentinel" / "sentinel.conf").read_text(encoding="utf-8")
        monitor = re.search(r"^sentinel monitor (\S+) (\S+) (\d+) (\d+)$", text, re.M)
        assert monitor is not None
        name = monitor.group(1)
        text = text.replace(monitor.group(0), f"sentinel monitor {name} 127.0.0.1 {primary.port} 1")
        (tmp_path / "sentinel.conf").write_text(text)
        sentinel = _Redis([str(tmp_path / "sentinel.conf")], tmp_path / "sentinel", sentinel=True)
        started.append(sentinel)

        def watched() -> bool:
            state = sentinel.client(None).sentinel_master(name)
            return bool(state["flags"] == "master" and state["num-slaves"] >= 1)

        wait_until(watched, 60, what="Sentinel to see the primary and its replica")
        for server in (primary, replica):
            assert not server.client().execute_command("ACL", "LOG"), "Sentinel or replica refused"
    finally:
        for server in started:
            server.stop()


def test_a_gateway_with_the_rights_of_before_the_sharing_routes_on_its_own_counts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """users.acl as it was before the gateways shared their requests in flight (the
    gateway user without the share script's writes on P:gateways:inflight and the
    totals' keys, nor the channel P:gateways:updates): a gateway keeps routing, on its
    own counts and the pages, and says once what right it lacks and how to give it."""
    import logging

    from poller.reader import StatsReader
    from poller.scrape.check import serve_example

    text = ACL_FILE.read_text()
    assert INFLIGHT_SELECTOR in text and PLACEMENTS_SELECTOR in text and CHANNEL in text
    old_acl = tmp_path / "users-before.acl"
    before = text.replace(INFLIGHT_SELECTOR, "").replace(PLACEMENTS_SELECTOR, "")
    old_acl.write_text(before.replace(CHANNEL, ""))
    server = _Redis(["--save", "", "--appendonly", "no", "--aclfile", str(old_acl)], tmp_path / "r")

    def refusals() -> int:
        """Times Redis refused the gateway the share script's HSET (ACL LOG's count)."""
        entries = server.client().execute_command("ACL", "LOG")
        return sum(
            int(e["count"])
            for e in entries
            if e.get("username") == "gateway" and e.get("object") == "hset"
        )

    async def scenario() -> None:
        async with serve_example("vllm") as base:
            worker = await _poller_on(server, base, tmp_path)
            reader = StatsReader.from_url(server.url(GATEWAY))
            await worker.start()
            try:
                async with reader.router() as router:
                    deadline = time.monotonic() + 60  # ample for a loaded machine
                    while (e := router.get("acl-vllm")) is None or e.state != "fresh":
                        assert time.monotonic() < deadline, "acl-vllm never fresh"
                        await asyncio.sleep(0.05)
                    held = router.pick()  # a request in flight: a record to write
                    assert held is not None and held.id == "acl-vllm"
                    # Refused once, then again after the retry: one WARNING for both.
                    while refusals() < 2:
                        assert time.monotonic() < deadline + 30, "no second refusal"
                        await asyncio.sleep(0.05)
                    assert not router.load_shared  # said in the Router's health
                    assert router.healthy  # the view itself is read as before
                    with router.pick() as ticket:  # type: ignore[union-attr]
                        assert ticket.id == "acl-vllm"  # routing goes on
                    assert router.fleet is not None and router.fleet.peers == 0
                    held.done()
            finally:
                await worker.stop()
                await reader.aclose()

    try:
        with caplog.at_level(logging.WARNING, logger="poller.reader.exchange"):
            asyncio.run(scenario())
    finally:
        server.stop()
    said = [r.getMessage() for r in caplog.records if r.name.startswith("poller.reader.exchange")]
    load = [m for m in said if m.startswith("gateway load sharing refused")]
    assert len(load) == 1, said
    assert "writes on {llmgw}:gateways:inflight, {llmgw}:gateways:load" in load[0], load[0]
    assert INFLIGHT_SELECTOR.strip() in load[0], load[0]
    # The channel and the placements' stream were refused too, each said once.
    heard = [m for m in said if m.startswith("Redis refused the gateway's user the channel")]
    assert len(heard) == 1 and CHANNEL.strip() in heard[0], said
    others = [m for m in said if m not in load and m not in heard]
    assert len(others) <= 1 and all(PLACEMENTS_SELECTOR.strip() in m for m in others), said


SHARE_KEYS = (
    "~{llmgw}:gateways:inflight ~{llmgw}:gateways:load ~{llmgw}:gateways:changed"
    " ~{llmgw}:gateways:alive"
)
SHARE_COMMANDS = (
    "+hset +hdel +hincrby +hmget +hkeys +zadd +zrem +zrevrange +zcard +pexpire +spublish"
)
INFLIGHT_SELECTOR = f" ({SHARE_KEYS} &{{llmgw}}:gateways:updates {SHARE_COMMANDS})"
PLACEMENTS_SELECTOR = " (~{llmgw}:gateways:placements +xadd +xtrim +xrange +xrevrange +pexpire)"
CHANNEL = " &{llmgw}:gateways:updates"


def test_a_gateway_with_the_rights_of_before_the_pushed_counts_still_shares_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """users.acl without the channel (the keys' selector without it, the user without
    it, as before the replicas pushed their counts): the view is followed as before,
    the counts are shared by reading the totals on each call, and one WARNING says how
    to grant the channel."""
    import logging

    from poller.reader import StatsReader, SyncStatsReader
    from tests.support.procs import until

    text = ACL_FILE.read_text()
    assert INFLIGHT_SELECTOR in text and CHANNEL in text
    acl = tmp_path / "users-before-push.acl"
    old_selector = f" ({SHARE_KEYS} {SHARE_COMMANDS})"
    acl.write_text(text.replace(INFLIGHT_SELECTOR, old_selector).replace(CHANNEL, ""))
    server = _Redis(["--save", "", "--appendonly", "no", "--aclfile", str(acl)], tmp_path / "r")

    def warned() -> list[str]:
        return [
            r.getMessage() for r in caplog.records if r.name.startswith("poller.reader.exchange")
        ]

    async def scenario() -> None:
        a = StatsReader.from_url(server.url(GATEWAY))
        b = SyncStatsReader.from_url(server.url(GATEWAY))
        try:
            async with a.router(replica_id="gw-a") as router_a:
                with b.router(replica_id="gw-b") as router_b:
                    fleet_a, fleet_b = router_a.fleet, router_b.fleet
                    assert fleet_a is not None and fleet_b is not None
                    router_a.track("e1")
                    router_b.track("e2")
                    await until(lambda: fleet_b.peer_in_flight("e1") == 1, 60, "a's in b")
                    await until(lambda: fleet_a.peer_in_flight("e2") == 1, 60, "b's in a")
                    assert router_a.load_shared and router_b.load_shared
                    assert router_a.cache.loaded and router_b.cache.loaded  # followed
                    await until(lambda: len(warned()) >= 2, 60, "both warnings")
        finally:
            await a.aclose()
            b.close()

    try:
        with caplog.at_level(logging.WARNING, logger="poller.reader.exchange"):
            asyncio.run(scenario())
    finally:
        server.stop()
    said = warned()
    assert len(said) == 2, said  # one per replica, no more
    assert all("the channel {llmgw}:gateways:updates" in m for m in said), said
    assert all(INFLIGHT_SELECTOR.strip() in m for m in said), said  # the grant as users.acl


def test_a_gateway_without_the_placements_right_shares_its_load_and_keeps_its_placements(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """users.acl without the placements' selector: the replica's load is shared as
    before, its prefix placements stay its own (``placements_shared`` False), and one
    WARNING names the rights and the selector to add."""
    import logging

    from poller.reader import StatsReader

    text = ACL_FILE.read_text()
    assert PLACEMENTS_SELECTOR in text
    acl = tmp_path / "users-no-placements.acl"
    acl.write_text(text.replace(PLACEMENTS_SELECTOR, ""))
    server = _Redis(["--save", "", "--appendonly", "no", "--aclfile", str(acl)], tmp_path / "r")

    def warned() -> list[str]:
        return [
            r.getMessage() for r in caplog.records if r.name.startswith("poller.reader.exchange")
        ]

    async def scenario() -> None:
        reader = StatsReader.from_url(server.url(GATEWAY))
        try:
            async with reader.router() as router:
                deadline = time.monotonic() + 60  # ample for a loaded machine
                while not warned() or not router.load_shared:
                    assert time.monotonic() < deadline, "never refused, or never shared"
                    await asyncio.sleep(0.05)
                assert not router.placements_shared and router.placements.sharing
                router.placements.record("e1", [1, 2, 3])
                assert router.placements.matches([1, 2, 3]) == [("e1", 3)]  # its own, used
        finally:
            await reader.aclose()

    try:
        with caplog.at_level(logging.WARNING, logger="poller.reader.exchange"):
            asyncio.run(scenario())
    finally:
        server.stop()
    said = warned()
    assert len(said) == 1, said
    assert "prefix placement sharing refused" in said[0], said[0]
    assert PLACEMENTS_SELECTOR.strip() in said[0], said[0]
