"""``poller run --check`` as a subprocess: settings checked, Redis reached, nothing written."""

from __future__ import annotations

import subprocess
import sys

import redis

from tests.support.redisproc import RedisProcess, free_port

NS = "chk"


def run_check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "poller", "run", "--check", "--namespace", NS, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False, env=env)


def test_check_says_what_a_poller_would_find_and_writes_nothing(own_redis: RedisProcess) -> None:
    client = redis.Redis.from_url(own_redis.url, decode_responses=True)
    try:
        port = free_port()  # the check listens on it for a moment: a free one
        empty = run_check(
            "--redis-url",
            own_redis.url,
            "--id",
            "p7",
            "--interval",
            "1",
            "--health-port",
            str(port),
        )
        assert empty.returncode == 0, empty.stderr
        first, second = empty.stdout.splitlines()
        assert first == (
            f"settings ok: poller p7, namespace {NS}, interval 1s (timeout 0.5s, stats live 6s), "
            f"health port {port}"
        )
        assert second == (
            f"redis ok: {own_redis.url}, no schema yet (the first poller claims 1), "
            "0 live pollers, registry rev 0: 0 endpoints"
        )
        assert client.dbsize() == 0  # read only: no schema claimed, no membership

        client.set("{chk}:schema", "1")
        client.hset("{chk}:endpoints", mapping={"a": '{"url": "http://10.0.0.1:8000"}',
                                                "b": "{not json"})  # fmt: skip
        client.set("{chk}:endpoints:rev", "4")
        far = 2**50
        client.zadd("{chk}:members", {"p1": far, "p2": far})
        client.hset("{chk}:members:drain", "p2", '{"since_ms": 1, "by": "cli"}')
        found = run_check("--redis-url", own_redis.url, "--health-port", "0")
        assert found.returncode == 0, found.stderr
        assert found.stdout.splitlines()[1] == (
            f"redis ok: {own_redis.url}, schema 1, 2 live pollers (p1, p2 drain requested), "
            "registry rev 4: 2 endpoints, 1 invalid"
        )

        client.set("{chk}:schema", "2")
        other = run_check("--redis-url", own_redis.url, "--health-port", "0")
        assert other.returncode == 1 and "schema version '2'" in other.stderr
        assert other.stderr.count("\n") == 1 and "Traceback" not in other.stderr
    finally:
        client.close()


def test_a_bad_setting_is_one_line_and_exit_2_before_redis_is_contacted() -> None:
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    bad = run_check("--redis-url", unreachable, "--interval", "0.5", "--timeout", "0.8")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "timeout_s (0.8) must be below" in bad.stderr


def test_unreachable_redis_is_another_exit_status() -> None:
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    down = run_check("--redis-url", unreachable, "--health-port", "0")
    assert down.returncode == 1, (down.stdout, down.stderr)
    assert down.stdout.startswith("settings ok:")
    assert down.stderr.startswith("Error: ") and "unreachable" in down.stderr
    assert down.stderr.count("\n") == 1 and "Traceback" not in down.stderr
