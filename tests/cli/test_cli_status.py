"""``poller status`` as an operator reads it: each endpoint's URL, labels and registry
engine, one age format, and ``--watch`` through a pipe."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import redis
from click.testing import CliRunner

from poller.cli import cli
from tests.support.redisproc import RedisProcess

NS = "status"


def env_for(server: RedisProcess) -> dict[str, str]:
    return {"POLLER_REDIS_URL": server.url, "POLLER_NAMESPACE": NS}


def test_status_shows_url_labels_and_the_registry_engine(redis_server: RedisProcess) -> None:
    redis.Redis.from_url(redis_server.url).flushall()
    runner = CliRunner()
    env = env_for(redis_server)
    for args in (
        ["a", "http://10.0.0.1:8000", "--engine", "sglang", "--label", "zone=b"],
        ["b", "http://10.0.0.2:8000"],
    ):
        assert runner.invoke(cli, ["endpoints", "add", *args], env=env).exit_code == 0
    out = runner.invoke(cli, ["status"], env=env).output
    header, *rows = out.splitlines()[2:5]  # after the Redis line and the counts
    assert header.split() == [
        *("ID", "ENGINE", "STATE", "OWNER", "RUN", "WAIT", "KV%", "HIT%", "LORA", "MODELS"),
        "AGE",
        *("URL", "LABELS", "FAILURE"),
    ]
    # never read: the engine is the registry's (or the pollers' default), not '-'
    assert rows[0].split() == ["a", "sglang", "unknown", *["-"] * 8, "http://10.0.0.1:8000"] + [
        "zone=b",
        "-",
    ]
    assert rows[1].split()[:2] == ["b", "default"]


def test_status_watch_prints_plain_frames_through_a_pipe(redis_server: RedisProcess) -> None:
    redis.Redis.from_url(redis_server.url).flushall()
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLLER_")}
    env |= env_for(redis_server)
    CliRunner().invoke(cli, ["endpoints", "add", "a", "http://10.0.0.1:8000"], env=env)
    with subprocess.Popen(
        [sys.executable, "-m", "poller", "status", "--watch"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    ) as proc:
        assert proc.stdout is not None
        seen = b""
        frames = 0
        deadline = time.monotonic() + 60  # generous: a frame is due every second
        try:
            while frames < 3 and time.monotonic() < deadline:
                line = proc.stdout.readline()
                if not line:
                    break
                seen += line
                frames += line.startswith(b"0 live pollers")
        finally:
            proc.terminate()  # our own child, by its handle
            proc.wait(30)
    assert frames == 3, seen
    assert b"\x1b" not in seen  # no colour, no cursor movement
    assert seen.count(b"http://10.0.0.1:8000") >= 2  # the rows of the first two frames
