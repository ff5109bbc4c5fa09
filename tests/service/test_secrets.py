"""Secrets never leave the poller: API keys from a variable or a key file are used for
scraping and appear in none of its outputs (its log at DEBUG, /metrics, /v1/view, the
CLI's JSON, every key and value in Redis, the events), not even when a key is wrong."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from poller.reader import StatsReader
from poller.reader.view import View
from poller.schema.endpoint import endpoint_from_dict
from poller.store.store import RedisStore
from poller_lab.sim import EndpointSpec, Simulator
from tests.support.hostile import NS, collect_events, dump_redis
from tests.support.paths import REPO
from tests.support.procs import PollerProc, until
from tests.support.redisproc import RedisProcess


async def _cli(*args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "poller",
        *args,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, out.decode()
    return out.decode()


@pytest.mark.slow
async def test_api_keys_appear_nowhere_outside_the_poller(
    own_redis: RedisProcess, tmp_path: Path
) -> None:
    keys = {
        name: f"sk-{name}-{secrets.token_hex(12)}"
        for name in ("env", "file", "wrong", "right", "unset")
    }
    key_file = tmp_path / "llama.key"
    key_file.write_text(keys["file"] + "\n")
    key_file.chmod(0o600)
    specs = [
        EndpointSpec("llama-env", "llamacpp", api_key=keys["env"]),
        EndpointSpec("llama-file", "llamacpp", api_key=keys["file"]),
        EndpointSpec("llama-wrong", "llamacpp", api_key=keys["right"]),
        EndpointSpec("llama-unset", "llamacpp", api_key=keys["unset"]),
        EndpointSpec("llama-nofile", "llamacpp", api_key=keys["right"]),
    ]
    # The keys live only in the poller's environment and the key file: never in this
    # process's environment, the registry, or the command line.
    poller_env = {"LLMGW_KEY_HOSTILE_ENV": keys["env"], "LLMGW_KEY_HOSTILE_WRONG": keys["wrong"]}
    poller_env["CREDENTIALS_DIRECTORY"] = str(tmp_path)  # the key directory, as systemd sets it
    assert not set(poller_env) & set(os.environ)
    client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    reader = StatsReader(client, NS)
    async with Simulator(specs, seed=5) as sim:
        store = RedisStore(client, NS)
        where = {
            "llama-env": {"api_key_env": "LLMGW_KEY_HOSTILE_ENV"},
            "llama-file": {"api_key_file": str(key_file)},
            "llama-wrong": {"api_key_env": "LLMGW_KEY_HOSTILE_WRONG"},
            "llama-unset": {"api_key_env": "LLMGW_KEY_HOSTILE_UNSET"},
            "llama-nofile": {"api_key_file": str(tmp_path / "absent.key")},
        }
        for endpoint_id, source in where.items():
            entry = {"url": sim.base_url(endpoint_id), "engine": "llamacpp", **source}
            await store.put_endpoint(endpoint_from_dict(endpoint_id, entry))
        events: list[str] = []
        ready = asyncio.Event()
        collector = asyncio.create_task(collect_events(client, NS, events, ready))
        await asyncio.wait_for(ready.wait(), 30)
        poller = PollerProc("p0", own_redis.url, NS, tmp_path, env=poller_env).start()
        try:
            expected = {
                "llama-env": ("fresh", None),
                "llama-file": ("fresh", None),
                "llama-wrong": ("failing", "auth"),
                "llama-unset": ("failing", "config"),
                "llama-nofile": ("failing", "config"),
            }

            async def settled() -> View | None:
                view = await reader.snapshot()
                got = {
                    e: (view[e].state, view[e].failure.reason if view[e].failure else None)
                    for e in expected
                }
                return view if got == expected else None

            view = await until(settled, 20, "keys used, wrong key refused, missing key failed")
            assert isinstance(view, View)
            assert "LLMGW_KEY_HOSTILE_UNSET" in view["llama-unset"].failure.detail  # type: ignore[union-attr]
            assert "absent.key" in view["llama-nofile"].failure.detail  # type: ignore[union-attr]
            assert "HTTP 401" in view["llama-wrong"].failure.detail  # type: ignore[union-attr]
            failing = [e for e, (state, _) in expected.items() if state == "failing"]

            def repeats_logged() -> bool:
                repeats = [
                    line
                    for line in poller.log().splitlines()
                    if "level=DEBUG" in line and "scrape failed" in line
                ]
                return all(
                    any(f"endpoint={e}" in line.split() for line in repeats) for e in failing
                )

            # The DEBUG-level repeat of every failure reached the log: the greps below see it.
            await until(repeats_logged, 30, "a DEBUG repeat of every failure in the log")
            outputs = {
                "/metrics": poller.get("/metrics")[1],
                "/v1/view": poller.get("/v1/view")[1],
                "status --json": await _cli(
                    "status", "--json", "--redis-url", own_redis.url, "--namespace", NS
                ),
                "endpoints ls --json": await _cli(
                    "endpoints", "ls", "--json", "--redis-url", own_redis.url, "--namespace", NS
                ),
            }
            redis_keys, redis_values = await dump_redis(client)
        finally:
            poller.cleanup()
            collector.cancel()
            await asyncio.gather(collector, return_exceptions=True)
            await client.aclose()
    outputs["redis"] = "\n".join(redis_keys) + redis_values.decode("utf-8", "replace")
    outputs["events"] = "\n".join(events)
    outputs["log (DEBUG)"] = await asyncio.to_thread(poller.log)
    # The greps must be able to find something: each output does mention the endpoints.
    for name, text in outputs.items():
        if name != "/metrics":
            assert "llama-wrong" in text, name
    assert "level=DEBUG" in outputs["log (DEBUG)"]
    for name, text in outputs.items():
        for which, key in keys.items():
            # The whole key, and its random part alone (a truncated or re-quoted copy).
            assert key not in text and key[-24:] not in text, f"{which} key found in {name}"
