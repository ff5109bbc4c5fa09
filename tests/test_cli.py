from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from redisproc import RedisProcess

from poller.cli import cli

NS = "cli"


@pytest.fixture
def run(redis_server: RedisProcess):  # type: ignore[no-untyped-def]
    import redis

    redis.Redis.from_url(redis_server.url).flushall()

    def invoke(*args: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
        env = {"POLLER_REDIS_URL": redis_server.url, "POLLER_NAMESPACE": NS, **(env or {})}
        return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)

    return invoke


def test_version() -> None:
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0 and "poller, version" in result.output


def test_check_example_page_for_every_engine() -> None:
    for engine in ("vllm", "sglang", "llamacpp", "trtllm", "triton", "tgi"):
        result = CliRunner().invoke(cli, ["check", "--example", "--engine", engine, "--json"])
        assert result.exit_code == 0, result.output
        report = json.loads(result.output)
        assert report["ok"] and report["engine"] == engine and report["missing"] == []
        assert report["signals"]["running"] is not None


def test_check_human_output_names_sources() -> None:
    result = CliRunner().invoke(cli, ["check", "--example"])
    assert result.exit_code == 0
    assert "kv_cache_usage         0.4237" in result.output
    assert "vllm:kv_cache_usage_perc" in result.output
    assert "OK: the page satisfies the vllm contract" in result.output


def test_check_failures_exit_1_and_bad_arguments_exit_2() -> None:
    from redisproc import free_port

    result = CliRunner().invoke(cli, ["check", f"http://127.0.0.1:{free_port()}", "--json"])
    assert result.exit_code == 1
    assert json.loads(result.output)["reason"] == "unreachable"
    for args in (
        ["check"],
        ["check", "ftp://x"],
        ["check", "http://x", "--engine", "nope"],
        ["check", "http://x", "--api-key-env", "1BAD"],
    ):
        assert CliRunner().invoke(cli, args).exit_code == 2, args


def test_endpoints_add_ls_rm(run) -> None:  # type: ignore[no-untyped-def]
    assert (
        run(
            "endpoints",
            "add",
            "a",
            "http://10.0.0.5:8000",
            "--engine",
            "sglang",
            "--label",
            "zone=a",
            "--interval",
            "2",
        ).exit_code
        == 0
    )
    assert run("endpoints", "add", "b", "http://10.0.0.6:8000/prefix/").exit_code == 0
    dup = run("endpoints", "add", "a", "http://10.0.0.5:8000")
    assert dup.exit_code == 1 and "already exists" in dup.output
    assert run("endpoints", "add", "a", "http://10.0.0.7:8000", "--replace").exit_code == 0
    listed = json.loads(run("endpoints", "ls", "--json").output)
    assert listed["rev"] == 3
    assert listed["endpoints"] == [
        {"id": "a", "url": "http://10.0.0.7:8000"},
        {"id": "b", "url": "http://10.0.0.6:8000/prefix"},
    ]
    human = run("endpoints", "ls").output
    assert "registry rev 3: 2 endpoints" in human and "(default)" in human
    assert run("endpoints", "rm", "a").exit_code == 0
    missing = run("endpoints", "rm", "a")
    assert missing.exit_code == 1 and "no endpoint 'a'" in missing.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["http://x:1", "--engine", "nope"], "Invalid value for '--engine'"),
        (["ftp://x:1"], "scheme must be http or https"),
        (["http://user:pw@x:1"], "credentials in the URL"),
        (["http://x:1", "--api-key-env", "A", "--api-key-file", "/k"], "not both"),
        (["http://x:1", "--label", "novalue"], "is not k=v"),
    ],
)
def test_endpoints_add_rejects_bad_entries(run, args: list[str], message: str) -> None:  # type: ignore[no-untyped-def]
    result = run("endpoints", "add", "a", *args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert json.loads(run("endpoints", "ls", "--json").output)["endpoints"] == []


def test_endpoints_sync_is_exact_and_dry_run_changes_nothing(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    run("endpoints", "add", "old", "http://10.0.0.1:8000")
    run("endpoints", "add", "keep", "http://10.0.0.2:8000")
    yaml_file = tmp_path / "endpoints.yaml"
    yaml_file.write_text(
        "endpoints:\n"
        "  - {id: keep, url: 'http://10.0.0.2:8000', engine: vllm}\n"
        "  - {id: new, url: 'http://10.0.0.3:8080', engine: llamacpp, interval_s: 5}\n"
    )
    dry = run("endpoints", "sync", str(yaml_file), "--dry-run")
    assert dry.exit_code == 0
    assert dry.output.splitlines() == [
        "+ new",
        "~ keep",
        "- old",
        "would add 1, change 1, remove 1",
    ]
    assert len(json.loads(run("endpoints", "ls", "--json").output)["endpoints"]) == 2
    done = run("endpoints", "sync", str(yaml_file))
    assert done.exit_code == 0 and "did add 1, change 1, remove 1" in done.output
    ids = [e["id"] for e in json.loads(run("endpoints", "ls", "--json").output)["endpoints"]]
    assert sorted(ids) == ["keep", "new"]
    again = run("endpoints", "sync", str(yaml_file))
    assert "did add 0, change 0, remove 0" in again.output

    toml_file = tmp_path / "endpoints.toml"
    toml_file.write_text('[[endpoints]]\nid = "t"\nurl = "http://10.0.0.9:1"\n')
    assert run("endpoints", "sync", str(toml_file)).exit_code == 0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            "endpoints:\n  - {id: a, url: 'http://x:1'}\n  - {id: a, url: 'http://y:1'}\n",
            "duplicate endpoint id 'a'",
        ),
        ("endpoints:\n  - {id: a, url: 'http://x:1', api_key: 'sk-123'}\n", "inline secret"),
        ("endpoints:\n  - {id: a, url: 'http://x:1', engine: nope}\n", "unknown engine 'nope'"),
        ("endpoints:\n  - {url: 'http://x:1'}\n", "entry 0 has no id"),
        ("endpoints: [\n", "not valid YAML"),
        ("hosts: []\n", "unknown top-level keys"),
    ],
)
def test_sync_rejects_a_bad_file_whole(run, tmp_path: Path, content: str, message: str) -> None:  # type: ignore[no-untyped-def]
    run("endpoints", "add", "existing", "http://10.0.0.1:8000")
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    result = run("endpoints", "sync", str(path))
    assert result.exit_code == 2 and message in result.output, result.output
    ids = [e["id"] for e in json.loads(run("endpoints", "ls", "--json").output)["endpoints"]]
    assert ids == ["existing"]  # nothing half-applied


def test_status_json_and_plain_table(run) -> None:  # type: ignore[no-untyped-def]
    empty = run("status")
    assert empty.exit_code == 0 and "the registry is empty" in empty.output
    run("endpoints", "add", "a", "http://10.0.0.1:8000")
    table = run("status")
    assert "\x1b[" not in table.output  # piped: no colours
    assert "0 live pollers" in table.output and "unknown 1" in table.output
    assert table.output.splitlines()[1].split()[:3] == ["ID", "ENGINE", "STATE"]
    snapshot = json.loads(run("status", "--json").output)
    assert set(snapshot) == {"schema", "now_ms", "rev", "pollers", "counts", "endpoints"}
    [entry] = snapshot["endpoints"]
    assert set(entry) == {"id", "state", "engine", "age_ms", "owner", "token", "stats", "failure"}
    assert entry["state"] == "unknown"


def test_redis_unreachable_is_exit_1() -> None:
    from redisproc import free_port

    env = {"POLLER_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    for args in (["endpoints", "ls"], ["status"]):
        result = CliRunner().invoke(cli, args, env=env)
        assert result.exit_code == 1 and "unreachable" in result.output, args


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--interval", "0.5", "--timeout", "0.8"], {}, "scrape: timeout_s (0.8) must be below"),
        (["--health-port", "70000"], {}, "health.port"),
        ([], {"POLLER_SCRAPE__JITTER_S": "abc"}, "scrape.jitter_s"),
        ([], {"POLLER_SCRAPE__NOPE": "1"}, "scrape.nope: Extra inputs are not permitted"),
        (["--log-format", "xml"], {}, "Invalid value for '--log-format'"),
        (["--endpoints-file", "/nonexistent.yaml"], {}, "cannot read endpoints file"),
    ],
)
def test_run_rejects_bad_settings_with_exit_2(
    args: list[str], env: dict[str, str], message: str
) -> None:
    result = CliRunner().invoke(cli, ["run", *args], env=env)
    assert result.exit_code == 2 and message in result.output, result.output


def test_run_rejects_unknown_keys_in_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "poller.toml"
    config.write_text("[scrape]\ninterval_s = 2\ninterval = 3\n")
    result = CliRunner().invoke(cli, ["run", "--config", str(config)])
    assert (
        result.exit_code == 2 and "scrape.interval: Extra inputs are not permitted" in result.output
    )
