"""What the commands say about the Redis and the namespace they read, as an operator runs
them: ``python -m poller`` in a subprocess against a real redis-server of the test's own,
each answer checked as the exact line and exit status.

- which Redis and namespace a command read (password redacted), and ``--json`` too;
- a namespace nothing wrote: the reader and ``status`` say so;
- read-only commands write nothing, and run as the ``gateway`` ACL user;
- Redis mistakes named by their cause: no password, TLS at a plain port, a Sentinel
  URL at a plain Redis, Cluster mode at a plain Redis, a web server's port, a trailing
  space in the URL;
- ``run --check`` notices a health port in use.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry

from poller.reader import RedisSettings, StatsReader
from poller.service.web.health import HealthServer
from poller.store.store import RedisStore
from tests.support.paths import REPO
from tests.support.procs import poller_cli as poller
from tests.support.procs import until
from tests.support.redisproc import RedisProcess, free_port

ACL_FILE = REPO / "deploy" / "redis" / "users.acl"
ADMIN = "admin:admin-example-password"
POLLER = "poller:poller-example-password"
GATEWAY = "gateway:gateway-example-password"
PASSWORD = "answers-pw"


def error_line(result: subprocess.CompletedProcess[str], status: int) -> str:
    """The one ``Error:`` line of a command that failed with ``status``."""
    assert result.returncode == status, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    return line


def at(server: RedisProcess, userinfo: str = "") -> str:
    return f"redis://{userinfo + '@' if userinfo else ''}127.0.0.1:{server.port}/0"


@pytest.fixture
def acl_redis() -> Iterator[RedisProcess]:
    """A redis-server with deploy/redis/users.acl: the default user is off."""
    server = RedisProcess(extra_args=["--aclfile", str(ACL_FILE)]).start()
    yield server
    server.cleanup()


@pytest.fixture
def locked() -> Iterator[RedisProcess]:
    server = RedisProcess(extra_args=["--requirepass", PASSWORD]).start()
    yield server
    server.cleanup()


# --- which Redis and namespace ---------------------------------------------------------------


def test_status_and_ls_say_which_redis_and_namespace_they_read(locked: RedisProcess) -> None:
    url = at(locked, f":{PASSWORD}")
    shown = f"redis://:***@127.0.0.1:{locked.port}/0"
    env = {"POLLER_REDIS_URL": url, "POLLER_NAMESPACE": "answers"}
    assert poller("endpoints", "add", "a", "http://10.0.0.1:8000", env=env).returncode == 0

    table = poller("status", env=env)
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0] == f"{shown} namespace answers"
    assert PASSWORD not in table.stdout
    as_json = json.loads(poller("status", "--json", env=env).stdout)
    assert (as_json["redis"], as_json["namespace"]) == (shown, "answers")
    assert as_json["schema_missing"] is False and "namespaces" not in as_json

    listed = poller("endpoints", "ls", env=env)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[:2] == [
        f"{shown} namespace answers",
        "registry rev 1: 1 endpoint",
    ]
    ls_json = json.loads(poller("endpoints", "ls", "--json", env=env).stdout)
    assert (ls_json["redis"], ls_json["namespace"]) == (shown, "answers")

    exported = poller("endpoints", "export", env=env)
    assert exported.returncode == 0, exported.stderr
    assert exported.stdout.splitlines()[0] == (
        f"# poller endpoints export (registry rev 1 of {shown} namespace answers): "
        "`poller endpoints sync FILE` reads it back"
    )
    assert exported.stderr.splitlines() == [
        f"note: 1 entry of registry rev 1 of {shown} namespace answers"
    ]


# --- a namespace nothing wrote ---------------------------------------------------------------


def test_status_of_a_namespace_without_a_schema_key_says_so_and_names_the_others(
    own_redis: RedisProcess,
) -> None:
    env = {"POLLER_REDIS_URL": own_redis.url}
    alone = poller("status", "--namespace", "llmgwx", env=env)
    assert alone.returncode == 0, alone.stderr
    assert alone.stdout.splitlines()[:3] == [
        f"{own_redis.url} namespace llmgwx",
        "namespace llmgwx has no schema key ({llmgwx}:schema): nothing ever wrote it: "
        "wrong namespace?",
        "no namespace on this Redis has a schema key: no poller has run here",
    ]
    for namespace in ("llmgw", "other"):
        added = poller("endpoints", "add", "a", "http://10.0.0.1:8000", "--namespace", namespace,
                       env=env)  # fmt: skip
        assert added.returncode == 0, added.stderr

    typo = poller("status", "--namespace", "llmgwx", env=env)
    assert typo.returncode == 0, typo.stderr
    assert typo.stdout.splitlines()[1:3] == [
        "namespace llmgwx has no schema key ({llmgwx}:schema): nothing ever wrote it: "
        "wrong namespace?",
        "namespaces on this Redis: llmgw, other (--namespace NS)",
    ]
    as_json = json.loads(poller("status", "--namespace", "llmgwx", "--json", env=env).stdout)
    assert as_json["schema_missing"] is True and as_json["namespaces"] == ["llmgw", "other"]
    checked = poller("run", "--check", "--health-port", "0", "--namespace", "llmgwx", env=env)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.splitlines()[-1] == (
        "note: nothing ever wrote namespace llmgwx; namespaces on this Redis: llmgw, other "
        "(wrong --namespace?)"
    )
    right = poller("status", env=env)
    assert "schema key" not in right.stdout and "a  " in right.stdout


async def test_a_cached_reader_of_a_namespace_without_schema_says_so_once(
    own_redis: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="poller")
    reader = StatsReader.from_url(own_redis.url, namespace="llmgw-prod", resync_s=0.05)
    await _follow_a_namespace_without_schema(reader, own_redis, caplog)
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


async def _follow_a_namespace_without_schema(
    reader: StatsReader, own_redis: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    try:
        view = await reader.snapshot()
        assert view.schema_missing and view.healthy and not view.endpoints
        async with reader.router() as router:
            cache = router.cache
            assert cache.schema_missing and not cache.healthy
            assert cache.ids() == [] and router.pick("any-model") is None
            assert router.explain("any-model").reason == "not_ready"
            assert cache.view().schema_missing and not cache.view().healthy
            start = cache.version
            # five resyncs, each reading no schema key
            await until(lambda: cache.version >= start + 5, 60, "five resyncs", 0.01)
            said = [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert [r.getMessage() for r in said] == [
                "namespace llmgw-prod has no schema key ({llmgw-prod}:schema): nothing ever "
                "wrote it: wrong namespace? The view stays empty and the cache unhealthy "
                "until a poller writes there"
            ]
            store = RedisStore.from_settings(
                RedisSettings(url=own_redis.url, namespace="llmgw-prod")
            )
            try:
                await store.heartbeat("p1", 60_000)  # a poller arrives: it claims the schema
            finally:
                await store.close()
            await until(lambda: cache.healthy, 60, "the cache to see the schema key", 0.01)
            assert cache.pollers == ["p1"] and not cache.view().schema_missing
    finally:
        await reader.aclose()


# --- read-only commands write nothing ---------------------------------------------------------


def test_read_only_commands_run_as_the_gateway_acl_user_and_write_nothing(
    acl_redis: RedisProcess, tmp_path: Path
) -> None:
    admin = redis.Redis.from_url(at(acl_redis, ADMIN), decode_responses=True)
    gateway = {"POLLER_REDIS_URL": at(acl_redis, GATEWAY)}
    wanted = tmp_path / "endpoints.yaml"
    wanted.write_text("endpoints:\n  - {id: b, url: 'http://10.0.0.2:8000'}\n")
    read_only = [
        ["endpoints", "sync", str(wanted), "--dry-run"],
        ["status"],
        ["status", "--json"],
        ["endpoints", "ls"],
        ["endpoints", "ls", "--json"],
        ["endpoints", "export"],
        ["run", "--check", "--health-port", "0"],
    ]
    try:
        for command in read_only:
            result = poller(*command, env=gateway)
            assert result.returncode == 0, (command, result.stderr)
            assert admin.dbsize() == 0, (command, admin.keys("*"))  # not even {llmgw}:schema
        status = poller("status", env=gateway).stdout.splitlines()
        # the gateway user may not SCAN: no list of namespaces, and no error either
        assert status[1:3] == [
            "namespace llmgw has no schema key ({llmgw}:schema): nothing ever wrote it: "
            "wrong namespace?",
            "0 live pollers (none)   0 endpoints: fresh 0  stale 0  failing 0  unknown 0",
        ]

        added = poller("endpoints", "add", "a", "http://10.0.0.1:8000",
                       env={"POLLER_REDIS_URL": at(acl_redis, POLLER)})  # fmt: skip
        assert added.returncode == 0, added.stderr
        before = {key: admin.dump(key) for key in admin.keys("*")}
        for command in read_only:
            result = poller(*command, env=gateway)
            assert result.returncode == 0, (command, result.stderr)
        assert {key: admin.dump(key) for key in admin.keys("*")} == before
        listed = poller("endpoints", "ls", env=gateway).stdout.splitlines()
        assert listed[1] == "registry rev 1: 1 endpoint"

        refused = poller("endpoints", "add", "b", "http://10.0.0.2:8000", env=gateway)
        assert error_line(refused, 2).startswith("Error: Redis refused permission (ACL)")
    finally:
        admin.close()


def test_refused_changes_leave_a_namespace_nothing_wrote_as_it_was(
    acl_redis: RedisProcess,
) -> None:
    # A claimed schema key would hide status's "wrong namespace?" warning.
    admin = redis.Redis.from_url(at(acl_redis, ADMIN), decode_responses=True)
    env = {"POLLER_REDIS_URL": at(acl_redis, POLLER)}
    try:
        for command, status in (
            (["endpoints", "rm", "nope"], 1),
            (["drain", "ghost"], 2),
            (["drain", "ghost", "--undo"], 0),
        ):
            result = poller(*command, env=env)
            assert result.returncode == status, (command, result.stderr)
            assert admin.dbsize() == 0, (command, admin.keys("*"))
    finally:
        admin.close()


# --- Redis mistakes named by their cause -------------------------------------------------------


@pytest.mark.parametrize("command", [["status"], ["run", "--check", "--health-port", "0"]])
def test_no_password_says_to_put_one_in_the_url(locked: RedisProcess, command: list[str]) -> None:
    result = poller(*command, env={"POLLER_REDIS_URL": at(locked)})
    what = "snapshot" if command == ["status"] else "GET schema"
    assert error_line(result, 2) == (
        f"Error: Redis refused authentication: it wants a password and the Redis URL has "
        f"none (during {what}): put the user and password in it, "
        "redis://USER:PASSWORD@HOST:PORT/DB (redis://:PASSWORD@HOST:PORT/DB for requirepass)"
    )


@pytest.mark.parametrize("command", [["status"], ["run", "--check", "--health-port", "0"]])
def test_tls_at_a_plain_port_says_the_server_does_not_speak_tls(
    own_redis: RedisProcess, command: list[str]
) -> None:
    url = f"rediss://127.0.0.1:{own_redis.port}/0"
    result = poller(*command, env={"POLLER_REDIS_URL": url})
    what = "snapshot" if command == ["status"] else "GET schema"
    assert error_line(result, 1) == (
        f"Error: the server at 127.0.0.1:{own_redis.port} does not speak TLS: use redis:// "
        f"or the TLS port (during {what})"
    )


def test_a_sentinel_url_at_a_plain_redis_says_it_is_not_a_sentinel(
    own_redis: RedisProcess,
) -> None:
    url = f"redis+sentinel://127.0.0.1:{own_redis.port}/mymaster"
    result = poller("status", env={"POLLER_REDIS_URL": url})
    assert error_line(result, 1) == (
        "Error: the server a redis+sentinel:// URL names is not a Sentinel (it does not know "
        "SENTINEL; during snapshot): use redis://HOST:PORT/DB for a plain Redis, or the "
        "Sentinels' port (26379) with the master's name"
    )


@pytest.mark.parametrize(
    "command", [["status"], ["endpoints", "ls"], ["run", "--check", "--health-port", "0"]]
)
def test_cluster_mode_at_a_plain_redis_says_it_is_not_a_cluster(
    own_redis: RedisProcess, command: list[str]
) -> None:
    env = {"POLLER_REDIS_URL": at(own_redis), "POLLER_REDIS__CLUSTER": "true"}
    line = error_line(poller(*command, env=env), 1)
    assert line.startswith("Error: the Redis at the URL is not a Cluster (during "), line
    assert line.endswith(
        "unset redis.cluster (POLLER_REDIS__CLUSTER) for a single Redis or Sentinel"
    )


@pytest.fixture
def web_port() -> Iterator[int]:
    """A loopback port whose server answers whatever it is sent as a web server would."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed: the test is over
            with conn:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone does not)
    listener.close()
    thread.join(timeout=10)


@pytest.mark.parametrize("command", [["status"], ["run", "--check", "--health-port", "0"]])
def test_a_url_at_a_web_server_says_it_does_not_speak_redis(
    web_port: int, command: list[str]
) -> None:
    result = poller(*command, env={"POLLER_REDIS_URL": f"redis://127.0.0.1:{web_port}/0"})
    line = error_line(result, 1)
    assert line.startswith("Error: the server at the Redis URL does not speak Redis's protocol"), (
        line
    )
    assert line.endswith(": it answers HTTP; check the URL's port"), line


async def test_a_url_at_a_pollers_health_port_says_it_answers_http_at_once() -> None:
    """The poller's own health server answers a RESP command with a 400 (it waited for a
    head RESP never ends, and the command for its Redis timeout)."""
    health = HealthServer("127.0.0.1", 0, ready=lambda: True, registry=CollectorRegistry())
    port = await health.start()
    try:
        env = {"POLLER_REDIS_URL": f"redis://127.0.0.1:{port}/0"}
        result = await asyncio.to_thread(poller, "status", env=env)
    finally:
        await health.stop()
    line = error_line(result, 1)
    assert line.startswith("Error: the server at the Redis URL does not speak Redis's protocol"), (
        line
    )
    assert line.endswith(": it answers HTTP; check the URL's port"), line


@pytest.mark.parametrize("command", [["status"], ["endpoints", "ls"]])
def test_a_url_where_nothing_listens_says_to_check_its_host_and_port(command: list[str]) -> None:
    port = free_port()
    result = poller(*command, env={"POLLER_REDIS_URL": f"redis://127.0.0.1:{port}/0"})
    line = error_line(result, 1)
    assert line.startswith("Error: Redis unreachable during "), line
    assert f"127.0.0.1:{port}" in line
    assert line.endswith(": nothing listens there; check the Redis URL's host and port"), line


@pytest.mark.parametrize("command", [["status"], ["run", "--check"]])
def test_a_trailing_space_in_the_url_is_named(command: list[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0 "
    result = poller(*command, env={"POLLER_REDIS_URL": url})
    assert error_line(result, 2) == (
        f"Error: redis.url: trailing space in the Redis URL {url!r}: remove it"
    )
    assert result.stdout == ""


# --- run --check and the health port ----------------------------------------------------------


def test_run_check_fails_when_the_health_port_is_in_use(own_redis: RedisProcess) -> None:
    env = {"POLLER_REDIS_URL": own_redis.url, "POLLER_HEALTH__HOST": "127.0.0.1"}
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        held = poller("run", "--check", "--health-port", str(port), env=env)
        assert error_line(held, 1) == (
            f"Error: health port {port} on 127.0.0.1 is in use: stop what holds it, or set "
            "another (--health-port, POLLER_HEALTH_PORT; 0 turns the health server off)"
        )
        assert held.stdout.startswith("settings ok: ") and "redis ok" not in held.stdout
    free = poller("run", "--check", "--health-port", str(port), env=env)
    assert free.returncode == 0, free.stderr
    assert free.stdout.splitlines()[1].startswith(f"redis ok: {own_redis.url}, ")
