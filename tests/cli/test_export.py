"""``poller endpoints export`` writes what ``endpoints sync`` reads: the round trip through
a real redis-server, driven as subprocesses."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import yaml

from poller.config import RedisSettings
from poller.schema.endpoint import endpoint_from_dict
from poller.store.store import RedisStore
from tests.support.procs import poller_cli
from tests.support.redisproc import RedisProcess

NS = "export"
ENTRIES = """\
endpoints:
  - id: gpu-a
    url: http://10.0.0.1:8000
    engine: vllm
    labels: {zone: a, pool: "blue green"}
    interval_s: 1.5
    timeout_s: 0.5
  - id: gpu-b
    url: https://10.0.0.2:30000
    engine: sglang
    api_key_env: LLMGW_KEY_B
    tls_insecure: true
    accept_gzip: true
  - id: llama
    url: http://10.0.0.3:8080
    engine: llamacpp
    metrics_path: /metrics?model=qwen3-8b
    overrides: {running: [llamacpp:requests_processing, other_running]}
  - id: hosted
    url: https://api.example.com
    engine: external
"""


def poller(server: RedisProcess, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLLER_")}
    env |= {"POLLER_REDIS_URL": server.url, "POLLER_NAMESPACE": NS}
    return subprocess.run(
        [sys.executable, "-m", "poller", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def raw_registry(server: RedisProcess) -> dict[bytes, bytes]:
    client = redis.Redis.from_url(server.url)
    return {k: v for k, v in client.hgetall(f"{{{NS}}}:endpoints").items()}


def add_discovered(server: RedisProcess) -> None:
    async def go() -> None:
        store = RedisStore.from_settings(RedisSettings(url=server.url, namespace=NS))
        entry = endpoint_from_dict("dns-1", {"url": "http://10.0.1.1:8000", "source": "srv1"})
        await store.put_endpoint(entry)
        await store.close()

    asyncio.run(go())


def test_export_then_sync_is_the_same_registry(redis_server: RedisProcess, tmp_path: Path) -> None:
    redis.Redis.from_url(redis_server.url).flushall()
    source = tmp_path / "in.yaml"
    source.write_text(ENTRIES)
    assert poller(redis_server, "endpoints", "sync", str(source)).returncode == 0
    add_discovered(redis_server)
    before = raw_registry(redis_server)
    assert len(before) == 5

    exported = tmp_path / "out.yaml"
    result = poller(redis_server, "endpoints", "export", "-o", str(exported))
    assert result.returncode == 0, result.stderr
    assert "1 discovered entry left out" in result.stderr
    document = yaml.safe_load(exported.read_text())
    assert [e["id"] for e in document["endpoints"]] == ["gpu-a", "gpu-b", "hosted", "llama"]

    # against the same registry: nothing to do (the discovered entry is sync's to keep)
    dry = poller(redis_server, "endpoints", "sync", str(exported), "--dry-run")
    assert dry.returncode == 0 and dry.stdout.splitlines() == [
        f"would add 0, change 0, remove 0 (registry rev 2 of {redis_server.url} namespace {NS})"
    ]

    # on an empty registry: the same hand-written entries, byte for byte
    redis.Redis.from_url(redis_server.url).flushall()
    assert poller(redis_server, "endpoints", "sync", str(exported)).returncode == 0
    after = raw_registry(redis_server)
    assert after == {k: v for k, v in before.items() if k != b"dns-1"}

    # JSON (by suffix or --format), with the discovered entries when asked
    add_discovered(redis_server)
    as_json = tmp_path / "all.json"
    assert (
        poller(
            redis_server, "endpoints", "export", "--include-discovered", "-o", str(as_json)
        ).returncode
        == 0
    )
    rows = json.loads(as_json.read_text())["endpoints"]
    assert rows[0] == {"id": "dns-1", "url": "http://10.0.1.1:8000", "source": "srv1"}
    redis.Redis.from_url(redis_server.url).flushall()
    assert poller(redis_server, "endpoints", "sync", str(as_json)).returncode == 0
    assert raw_registry(redis_server) == before
    stdout = poller(redis_server, "endpoints", "export", "--format", "json")
    assert json.loads(stdout.stdout)["endpoints"][0]["id"] == "gpu-a"


def test_sync_given_ls_json_output_points_at_export(
    redis_server: RedisProcess, tmp_path: Path
) -> None:
    redis.Redis.from_url(redis_server.url).flushall()
    source = tmp_path / "in.yaml"
    source.write_text(ENTRIES)
    assert poller(redis_server, "endpoints", "sync", str(source)).returncode == 0
    listed = tmp_path / "ls.json"
    listed.write_text(poller(redis_server, "endpoints", "ls", "--json").stdout)
    result = poller(redis_server, "endpoints", "sync", str(listed))
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"Error: {listed}: this looks like `poller endpoints ls --json` output; write a file "
        "sync reads with `poller endpoints export`"
    ]


@pytest.mark.parametrize(
    ("name", "fmt", "words"),
    [
        ("out.toml", None, "out.toml: export writes YAML or JSON (sync reads both)"),
        ("out.json", "yaml", "out.json: --format yaml into a file `sync` reads as JSON"),
    ],
)
def test_export_refuses_a_file_sync_could_not_read_back(
    tmp_path: Path, name: str, fmt: str | None, words: str
) -> None:
    # Refused before Redis is asked: no server is needed, and nothing is written.
    output = tmp_path / name
    args = ["endpoints", "export", "-o", str(output), *(["--format", fmt] if fmt else [])]
    result = poller_cli(*args, env={"POLLER_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert result.returncode == 2 and words in result.stderr, result.stderr
    assert not output.exists()
