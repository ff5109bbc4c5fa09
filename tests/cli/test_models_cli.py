"""``endpoints add --model`` and the MODELS column of ``poller status`` (table and JSON)."""

from __future__ import annotations

import json

import pytest
import redis
from click.testing import CliRunner

from poller.cli import cli
from poller.schema.endpoint import endpoint_from_json
from poller.schema.keys import Keys
from tests.support.redisproc import RedisProcess

NS = "models-cli"
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"


@pytest.fixture
def env(redis_server: RedisProcess) -> dict[str, str]:
    redis.Redis.from_url(redis_server.url).flushall()
    return {"POLLER_REDIS_URL": redis_server.url, "POLLER_NAMESPACE": NS}


def entry(redis_server: RedisProcess, endpoint_id: str) -> object:
    raw = redis.Redis.from_url(redis_server.url).hget(Keys(NS).endpoints, endpoint_id)
    assert raw is not None
    return endpoint_from_json(endpoint_id, raw)


def test_add_takes_repeated_models(redis_server: RedisProcess, env: dict[str, str]) -> None:
    args = ["endpoints", "add", "l", "http://10.0.0.1:8080", "--engine", "llamacpp"]
    result = CliRunner().invoke(cli, [*args, "--model", LLAMA, "--model", "llama3"], env=env)
    assert result.exit_code == 0, result.output
    assert entry(redis_server, "l").models == (LLAMA, "llama3")  # type: ignore[attr-defined]
    plain = CliRunner().invoke(cli, ["endpoints", "add", "v", "http://10.0.0.2:8000"], env=env)
    assert plain.exit_code == 0
    assert entry(redis_server, "v").models == ()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("models", "says"),
    [(["a,b"], "comma"), (["a", "a"], "listed twice"), ([""], "empty")],
)
def test_add_refuses_bad_models_in_one_line(
    redis_server: RedisProcess, env: dict[str, str], models: list[str], says: str
) -> None:
    flags = [f for m in models for f in ("--model", m)]
    result = CliRunner().invoke(
        cli, ["endpoints", "add", "l", "http://10.0.0.1:8080", *flags], env=env
    )
    assert result.exit_code == 2
    assert says in result.output and "models" in result.output
    assert redis.Redis.from_url(redis_server.url).hlen(Keys(NS).endpoints) == 0


def test_status_shows_the_models_of_the_stats(
    redis_server: RedisProcess, env: dict[str, str]
) -> None:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    runner = CliRunner()
    assert (
        runner.invoke(cli, ["endpoints", "add", "l", "http://10.0.0.1:8080"], env=env).exit_code
        == 0
    )
    # what a poller wrote for it: the stats' models are what a pick for a model matches
    now_ms = int(client.time()[0]) * 1000
    fields = {
        "engine": "llamacpp",
        "running": "0",
        "waiting": "0",
        "interval_ms": "1000",
        "scraped_at_ms": str(now_ms),
        "poller": "p0",
        "token": "1",
        "seq": "1",
        "models": f"{LLAMA},a,b,c",
    }
    client.hset(Keys(NS).stats("l"), mapping=fields)
    record = f"{now_ms} 1000 {now_ms + 60_000} p0 1|{json.dumps(fields)}"
    client.hset(Keys(NS).view_stats, "l", record)

    out = runner.invoke(cli, ["status"], env=env).output
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if "MODELS" in line.split())
    header, row = lines[at : at + 2]
    assert "ID" in header.split()
    assert f"{LLAMA}, a, b (+1 more)" in row

    shown = json.loads(runner.invoke(cli, ["status", "--json"], env=env).output)
    [endpoint] = shown["endpoints"]
    assert endpoint["stats"]["models"] == [LLAMA, "a", "b", "c"]
