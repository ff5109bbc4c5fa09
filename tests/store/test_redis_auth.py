"""Credentials and ACLs Redis refuses are named as such, never as "unreachable": one line
and exit 2 from every command, an ERROR in the poller's log, the reason in /readyz."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import redis.asyncio as aioredis
import redis.exceptions as rexc

from poller.config import Settings
from poller.errors import StoreAuthError, StoreError, StoreUnreachable
from poller.redis.errors import reply_error, store_error
from poller.service.worker import Worker
from poller.store.store import RedisStore
from poller.util.logs import text_of
from tests.support.procs import PollerProc, until
from tests.support.redisproc import RedisProcess

PASSWORD = "s3cret-pw"
NS = "auth"


@pytest.fixture(scope="module")
def locked() -> Iterator[RedisProcess]:
    """A redis-server with a password for ``default``, a poller user and a user whose
    ACL allows no key of our namespace."""
    server = RedisProcess(extra_args=["--requirepass", PASSWORD]).start()
    admin = redis.Redis(port=server.port, password=PASSWORD)
    admin.acl_setuser("ops", enabled=True, passwords=["+ops-pw"], commands=["+@all"], keys=["*"])
    admin.acl_setuser(
        "elsewhere",
        enabled=True,
        passwords=["+else-pw"],
        commands=["+@all"],
        keys=["other:*"],
        channels=["*"],
    )
    admin.close()
    yield server
    server.cleanup()


def url(server: RedisProcess, userinfo: str = "") -> str:
    at = f"{userinfo}@" if userinfo else ""
    return f"redis://{at}127.0.0.1:{server.port}/0"


def poller(*args: str, redis_url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "poller", *args, "--redis-url", redis_url, "--namespace", NS],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("command", [["status"], ["endpoints", "ls"], ["status", "--json"]])
@pytest.mark.parametrize(
    "userinfo", [":wrong-password", "", "ops:wrong-password", "nobody:whatever"]
)
def test_commands_name_a_refused_login_in_one_line_and_exit_2(
    locked: RedisProcess, command: list[str], userinfo: str
) -> None:
    result = poller(*command, redis_url=url(locked, userinfo))
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("Error: Redis refused authentication: "), line
    assert "unreachable" not in line


def test_an_acl_that_forbids_our_keys_is_named_a_refused_permission(locked: RedisProcess) -> None:
    result = poller("endpoints", "ls", redis_url=url(locked, "elsewhere:else-pw"))
    assert result.returncode == 2, result
    [line] = result.stderr.splitlines()
    assert line.startswith("Error: Redis refused permission (ACL)"), line


def test_the_right_password_works(locked: RedisProcess) -> None:
    result = poller("endpoints", "ls", redis_url=url(locked, f":{PASSWORD}"))
    assert result.returncode == 0, result


def test_run_with_a_wrong_password_stops_with_one_line_and_exit_2(
    locked: RedisProcess, tmp_path: Path
) -> None:
    proc = PollerProc("p0", url(locked, ":wrong-password"), NS, tmp_path).start()
    try:
        assert proc.wait(60) == 2
    finally:
        proc.cleanup()
    log = proc.log()
    assert "Traceback" not in log
    refused = [
        ln for ln in log.splitlines() if "refused authentication" in ln and "DEBUG" not in ln
    ]
    assert len(refused) == 1 and "level=ERROR" in refused[0], log
    assert "unreachable" not in log


def _past_start(proc: PollerProc) -> bool:
    """Ready, with a lease held through two reconciles: renewed once, so a refusal from
    now on is not one at start (which stops the poller)."""
    return (
        proc.get("/readyz")[0] == 200
        and proc.metric("poller_leases_held") == 1
        and proc.metric("poller_reconcile_duration_seconds_count") >= 3
    )


async def _register_one(admin: aioredis.Redis) -> None:
    await admin.hset(f"{{{NS}}}:endpoints", "e1", '{"url": "http://127.0.0.1:9"}')
    await admin.incr(f"{{{NS}}}:endpoints:rev")


def _acl_user(name: str, *, allowed: bool) -> dict[str, object]:
    """A user with every right but PEXPIRE (the lease scripts' renewal) unless ``allowed``."""
    commands = ["+@all"] if allowed else ["+@all", "-pexpire"]
    return dict(
        enabled=True,
        passwords=[f"+{name}-pw"],
        commands=commands,
        keys=["*"],
        channels=["*"],
        reset_channels=True,
        reset_keys=True,
    )


@pytest.mark.redis_server
async def test_a_password_changed_under_a_running_poller_is_an_error_and_readyz_says_so(
    tmp_path: Path,
) -> None:
    server = RedisProcess(extra_args=["--requirepass", PASSWORD]).start()
    admin = aioredis.Redis(port=server.port, password=PASSWORD, decode_responses=True)
    await _register_one(admin)
    proc = PollerProc("p0", url(server, f":{PASSWORD}"), NS, tmp_path).start()
    try:
        await until(lambda: _past_start(proc), 30, "ready, a lease renewed")
        await admin.config_set("requirepass", "rotated")
        await admin.client_kill_filter(_type="normal", skipme=True)  # force a new login

        def refused() -> bool:
            status, body = proc.get("/readyz")
            return status == 503 and "Redis refused authentication" in body

        await until(refused, 60, "/readyz naming the refused login")
        assert proc.running()  # it keeps retrying: the password may be put back
        await until(lambda: "refused authentication" in proc.log(), 30, "the log line")
        await admin.config_set("requirepass", PASSWORD)
        await until(lambda: proc.get("/readyz")[0] == 200, 60, "ready again")
        logged = [
            ln
            for ln in proc.log().splitlines()
            if "refused authentication" in ln and "logger=poller.service.redis_state" in ln
        ]
        assert len(logged) == 1 and "level=ERROR" in logged[0], logged  # once, not per retry
    finally:
        proc.cleanup()
        await admin.aclose()
        server.cleanup()


@pytest.mark.redis_server
async def test_a_password_changed_before_a_renewal_holds_readyz_until_the_next_one() -> None:
    """One rule for "refused after a successful start": Redis took our login, so a refusal
    of it is Redis's change (hold 503 and retry), however soon after start; a pass that
    renews the lease, not three lease TTLs (here 30 min), ends it."""
    server = RedisProcess(extra_args=["--requirepass", PASSWORD]).start()
    admin = aioredis.Redis(port=server.port, password=PASSWORD, decode_responses=True)
    await _register_one(admin)
    settings = Settings(
        id="p1",
        redis={"url": url(server, f":{PASSWORD}"), "namespace": NS},
        coordination={"lease_ttl_ms": 600_000},
    )
    worker = Worker(settings)
    try:
        await worker.step()  # heartbeat, registry, e1 acquired: ready, nothing renewed yet
        assert worker.ready and "e1" in worker.owned
        await admin.config_set("requirepass", "rotated")
        await admin.client_kill_filter(_type="normal", skipme=True)  # force a new login
        assert await worker.attempt()  # failed...
        assert worker.fatal is None  # ...and goes on: `poller run` would not exit
        assert not worker.ready
        assert worker.unready_reason().startswith("Redis refused authentication")
        await admin.config_set("requirepass", PASSWORD)
        assert not await worker.attempt()  # heartbeat, registry, e1 renewed
        assert worker.ready, worker.unready_reason()
    finally:
        await worker.stop()
        await admin.aclose()
        server.cleanup()


# --- the mapping itself ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (rexc.AuthenticationError("invalid username-password pair or user is disabled."), "auth"),
        (rexc.AuthenticationError("NOAUTH Authentication required."), "auth"),
        (rexc.NoPermissionError("this user has no permissions to run the 'set' command"), "perm"),
        (
            rexc.ResponseError("The user executing the script can't access at least one key"),
            "perm",
        ),
        (rexc.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused."), "down"),
        (rexc.TimeoutError("Timeout reading from socket"), "down"),
        (ConnectionResetError(104, "Connection reset by peer"), "down"),
        (rexc.ResponseError("WRONGTYPE Operation against a key"), "rejected"),
        (
            rexc.RedisClusterException(
                "Redis Cluster cannot be connected. Please provide at least one reachable "
                "node: Cluster mode is not enabled on this node"
            ),
            "rejected",
        ),
        (
            rexc.RedisClusterException(
                "Redis Cluster cannot be connected. Please provide at least one reachable "
                "node: Error 111 connecting to 127.0.0.1:1. Connect call failed"
            ),
            "down",
        ),
        (rexc.DataError("Invalid input"), "error"),
    ],
)
def test_redis_py_errors_map_to_our_tree(exc: Exception, kind: str) -> None:
    mapped = store_error(exc, "GET x")
    expected = {
        "auth": StoreAuthError,
        "perm": StoreAuthError,
        "down": StoreUnreachable,
        "rejected": StoreError,
        "error": StoreError,
    }[kind]
    assert type(mapped) is expected, mapped
    assert "GET x" in str(mapped)
    if kind in ("auth", "perm"):
        assert isinstance(mapped, StoreAuthError)
        assert mapped.kind == ("authentication" if kind == "auth" else "permission")


def test_raw_error_replies_map_like_redis_py_errors() -> None:
    assert isinstance(
        reply_error("WRONGPASS invalid username-password pair", "AUTH"), StoreAuthError
    )
    perm = reply_error("NOPERM User gw has no permissions to access the 'x' channel", "SSUBSCRIBE")
    assert isinstance(perm, StoreAuthError) and perm.kind == "permission"
    assert type(reply_error("ERR unknown command", "X")) is StoreError


async def test_a_worker_pass_raises_the_refusal_and_readyz_explains_each_state(
    locked: RedisProcess,
) -> None:
    worker = Worker(
        Settings(id="p1", redis={"url": url(locked, ":nope"), "namespace": NS}),
    )
    try:
        assert worker.unready_reason() == "Redis not reached yet"
        worker.redis.seen(StoreUnreachable("Redis unreachable during heartbeat: refused"), 0.0)
        assert worker.unready_reason() == "Redis unreachable during heartbeat: refused"
        with pytest.raises(StoreAuthError, match="Redis refused authentication"):
            await worker.step()
    finally:
        await worker.jobs.stop()
        await worker.scraper.aclose()
        await worker.store.close()
    good = RedisStore(
        aioredis.Redis(port=locked.port, password=PASSWORD, decode_responses=True), NS
    )
    worker = Worker(Settings(id="p1", redis={"namespace": NS}), good)
    try:
        await worker.step()
        assert worker.ready and worker.unready_reason() == ""
        worker.last_heartbeat -= 3600  # the clock the worker reads: an hour without a beat
        assert not worker.ready
        assert worker.unready_reason().startswith("heartbeat stale: last written 3600")
    finally:
        await worker.stop()


async def test_writes_an_acl_refuses_are_one_error_in_the_log(
    locked: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """An ACL that lets the heartbeat and the leases through but not the update channel:
    every fenced write fails the same way, logged once at ERROR, not per scrape."""
    admin = aioredis.Redis(port=locked.port, password=PASSWORD, decode_responses=True)
    await admin.acl_setuser(
        "nopub",
        enabled=True,
        passwords=["+nopub-pw"],
        commands=["+@all"],
        keys=["*"],
        channels=[f"{{{NS}}}:events"],
        reset_channels=True,
    )
    await admin.hset(f"{{{NS}}}:endpoints", "e1", '{"url": "http://e1.test"}')
    await admin.incr(f"{{{NS}}}:endpoints:rev")
    client = aioredis.Redis(
        port=locked.port, username="nopub", password="nopub-pw", decode_responses=True
    )
    page = (
        b"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.5\n"
    )
    worker = Worker(
        Settings(id="p1", redis={"namespace": NS}),
        RedisStore(client, NS),
        transport_factory=lambda _: httpx.MockTransport(
            lambda r: httpx.Response(200, content=page)
        ),
    )
    try:
        await worker.step()
        assert "e1" in worker.owned
        with caplog.at_level(logging.DEBUG, logger="poller.service.jobs"):
            for _ in range(3):
                await worker.scrape_once("e1")
        errors = [text_of(r) for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "Redis refused permission (ACL) during write stats" in errors[0]
        assert worker.metrics.redis_errors.labels("write_stats")._value.get() == 3
    finally:
        await worker.stop()
        await admin.delete(f"{{{NS}}}:endpoints", f"{{{NS}}}:endpoints:rev")
        await admin.aclose()


@pytest.mark.redis_server
async def test_run_without_a_command_the_leases_need_stops_with_one_line_and_exit_2(
    locked: RedisProcess, tmp_path: Path
) -> None:
    # The heartbeat passes; renewing a lease is refused: a settings problem, found at start.
    admin = aioredis.Redis(port=locked.port, password=PASSWORD, decode_responses=True)
    try:
        await admin.acl_setuser("nopexpire", **_acl_user("nopexpire", allowed=False))
        await _register_one(admin)
        proc = PollerProc("p0", url(locked, "nopexpire:nopexpire-pw"), NS, tmp_path).start()
        try:
            assert proc.wait(60) == 2
        finally:
            proc.cleanup()
    finally:
        await admin.delete(f"{{{NS}}}:endpoints", f"{{{NS}}}:endpoints:rev")
        await admin.aclose()
    log = proc.log()
    refused = [ln for ln in log.splitlines() if "refused permission" in ln and "DEBUG" not in ln]
    assert len(refused) == 1 and "level=ERROR" in refused[0], log
    assert "Traceback" not in log


@pytest.mark.redis_server
async def test_a_right_taken_away_under_a_running_poller_keeps_it_unready_until_restored(
    tmp_path: Path,
) -> None:
    # Each heartbeat still succeeds: it must not say "redis reachable" (and ready) between
    # two refused passes.
    server = RedisProcess().start()
    admin = aioredis.Redis(port=server.port, decode_responses=True)
    await admin.acl_setuser("ops", **_acl_user("ops", allowed=True))
    await _register_one(admin)
    proc = PollerProc("p0", url(server, "ops:ops-pw"), NS, tmp_path).start()
    try:
        await until(lambda: _past_start(proc), 30, "ready, a lease renewed")
        await admin.acl_setuser("ops", **_acl_user("ops", allowed=False))
        await until(lambda: "refused permission" in proc.log(), 60, "the refusal logged")
        errors = proc.metric("poller_redis_errors_total")
        await until(
            lambda: proc.metric("poller_redis_errors_total") >= errors + 3,
            60,
            "three more refused passes",
        )
        status, body = proc.get("/readyz")
        assert status == 503 and "refused permission" in body, body
        after = proc.log().split("refused permission", 1)[1]
        assert "redis reachable" not in after, after
        await admin.acl_setuser("ops", **_acl_user("ops", allowed=True))
        await until(lambda: proc.get("/readyz")[0] == 200, 60, "ready again")
        assert proc.running()
        logged = [
            ln
            for ln in proc.log().splitlines()
            if "refused permission" in ln and "logger=poller.service.redis_state" in ln
        ]
        assert len(logged) == 1 and "level=ERROR" in logged[0], logged
    finally:
        proc.cleanup()
        await admin.aclose()
        server.cleanup()
