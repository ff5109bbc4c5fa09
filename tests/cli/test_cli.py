from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from poller.cli import cli
from tests.support.httpserver import Request, answer, threaded
from tests.support.paths import DATA
from tests.support.redisproc import RedisProcess

NS = "cli"


@pytest.fixture
def run(redis_server: RedisProcess):  # type: ignore[no-untyped-def]
    import redis

    redis.Redis.from_url(redis_server.url).flushall()

    def invoke(*args: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
        env = {"POLLER_REDIS_URL": redis_server.url, "POLLER_NAMESPACE": NS, **(env or {})}
        return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)

    invoke.url = redis_server.url  # type: ignore[attr-defined]
    return invoke


def test_version() -> None:
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0 and "poller, version" in result.output


def test_check_example_page_for_every_engine() -> None:
    for engine in ("vllm", "sglang", "llamacpp", "trtllm", "triton", "tgi", "lmdeploy"):
        result = CliRunner().invoke(cli, ["check", "--example", "--engine", engine, "--json"])
        assert result.exit_code == 0, result.output
        report = json.loads(result.output)
        assert report["ok"] and report["engine"] == engine and report["missing"] == []
        assert isinstance(report["signals"]["running"], int)
        assert isinstance(report["signals"]["waiting"], int)
        assert report["signals"]["models"], engine  # from the page, else /v1/models


def test_check_json_speaks_json() -> None:
    result = CliRunner().invoke(cli, ["check", "--example", "--json"])
    signals = json.loads(result.output)["signals"]
    assert signals["running"] == 17 and signals["waiting"] == 3
    assert signals["kv_cache_usage"] == 0.4237
    assert isinstance(signals["prefix_cache_hit_rate"], float)
    assert signals["lora"] == {"running": ["sql-lora", "chat-lora"], "waiting": [], "max": 4}
    assert signals["models"] == ["meta-llama/Llama-3.1-8B-Instruct"]
    # the text report is unchanged
    text = CliRunner().invoke(cli, ["check", "--example"]).output
    assert "lora                   running=[sql-lora,chat-lora] waiting=[] max=4" in text
    assert "models                 meta-llama/Llama-3.1-8B-Instruct" in text


def test_check_human_output_names_sources() -> None:
    result = CliRunner().invoke(cli, ["check", "--example"])
    assert result.exit_code == 0
    assert "kv_cache_usage         0.4237" in result.output
    assert "vllm:kv_cache_usage_perc" in result.output
    assert "OK: the page satisfies the vllm contract" in result.output


def test_check_failures_exit_1_and_bad_arguments_exit_2() -> None:
    from tests.support.redisproc import free_port

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
        f"would add 1, change 1, remove 1 (registry rev 2 of {run.url} namespace {NS})",
    ]
    assert len(json.loads(run("endpoints", "ls", "--json").output)["endpoints"]) == 2
    done = run("endpoints", "sync", str(yaml_file))
    assert done.exit_code == 0 and "added 1, changed 1, removed 1" in done.output
    ids = [e["id"] for e in json.loads(run("endpoints", "ls", "--json").output)["endpoints"]]
    assert sorted(ids) == ["keep", "new"]
    again = run("endpoints", "sync", str(yaml_file))
    assert "added 0, changed 0, removed 0" in again.output

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
        ("endpoints:\n  - {url: 'http://x:1'}\n", "entry 1 has no id"),
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
    assert table.output.splitlines()[0] == f"{run.url} namespace {NS}"  # what it read
    assert table.output.splitlines()[2].split()[:3] == ["ID", "ENGINE", "STATE"]
    snapshot = json.loads(run("status", "--json").output)
    assert set(snapshot) == {
        "redis", "namespace", "schema_missing",
        "schema", "now_ms", "rev", "pollers", "counts", "endpoints", "sources", "members"
    }  # fmt: skip
    assert snapshot["members"] == []  # the live pollers with their state (none here)
    assert snapshot["sources"] == []  # DNS discovery sources (none here)
    [entry] = snapshot["endpoints"]
    assert set(entry) == {
        *("id", "state", "engine", "age_ms", "owner", "token", "stats", "failure"),
        *("url", "labels", "registry_engine"),  # the registry entry's
    }
    assert (entry["url"], entry["labels"], entry["registry_engine"]) == (
        "http://10.0.0.1:8000",
        {},
        None,
    )
    assert entry["state"] == "unknown"


def test_redis_unreachable_is_exit_1() -> None:
    from tests.support.redisproc import free_port

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
        ([], {"POLLER_SCRAPE__NOPE": "1"}, "unknown environment variable POLLER_SCRAPE__NOPE"),
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
    assert result.exit_code == 2
    assert "unknown key `scrape.interval` (did you mean `scrape.interval_s`?)" in result.output


# --- poller check against a real HTTP server, one page per new engine case ------------------

LLAMA_501 = (
    '{"error":{"code":501,"message":"This server does not support metrics endpoint. '
    'Start it with `--metrics`","type":"not_supported_error"}}'
)


@pytest.fixture
def engine_server() -> Iterator[str]:
    """A loopback HTTP server in its own thread: /<page>/metrics serves tests/data/<page>,
    /nometrics/metrics answers as llama-server without --metrics, and /router/metrics
    as llama-server in router mode (400 unless ?model=qwen3-8b)."""

    def page(request: Request) -> bytes:
        name = request.path.removeprefix("/").removesuffix("/metrics")
        if name == "nometrics":
            return answer(501, LLAMA_501, content_type="application/json")
        if name == "router":
            if "model=qwen3-8b" not in request.query.split("&"):
                body = '{"error":{"code":400,"message":"model name is missing from the request"}}'
                return answer(400, body, content_type="application/json")
            name = "llamacpp-b11434-busy-handwritten.txt"
        if name == "plain500":
            return answer(500, "\n  upstream exploded\nsecond line\n")
        path = DATA / name
        return answer(200, path.read_bytes()) if path.is_file() else answer(404)

    with threaded(page) as url:
        yield url


def check_json(*args: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    result = CliRunner().invoke(cli, ["check", *args, "--json", "--timeout", "10"])
    return result.exit_code, json.loads(result.output)


# page -> (engine, signals expected in the JSON report)
CHECKED_PAGES = {
    "sglang-0.5.23-priority-tp-dp-handwritten.txt": (
        "sglang",
        {"running": 7, "waiting": 4, "kv_cache_usage": 0.41, "prefix_cache_hit_rate": 0.275},
    ),
    "lmdeploy-0.18-dp2-handwritten.txt": (
        "lmdeploy",
        {"running": 8, "waiting": 5, "api_waiting": 2, "kv_cache_usage": 0.62},
    ),
    "vllm-0.33-sleeping-dp2-handwritten.txt": (
        "vllm",
        {"running": 0, "waiting": 0, "sleeping": True, "prefix_cache_hit_rate": 0.25},
    ),
    "vllm-0.33-waiting-reasons-dp2-handwritten.txt": (
        "vllm",
        {
            "waiting": 6,
            "waiting_by_reason": {"capacity": 4, "deferred": 2},
            "kv_capacity_tokens": 633600,
        },
    ),
    "llamacpp-b11434-busy-handwritten.txt": (
        "llamacpp",
        {"running": 3, "waiting": 2, "kv_cache_usage": None, "prefix_cache_hit_rate": 0.75},
    ),
    "llamacpp-b11434-real-idle.txt": (
        "llamacpp",
        {"running": 0, "waiting": 0, "prefix_cache_hit_rate": None, "lora": None, "models": None},
    ),
}


@pytest.mark.parametrize("page", sorted(CHECKED_PAGES))
def test_check_reads_each_new_page_over_http(engine_server: str, page: str) -> None:
    engine, expected = CHECKED_PAGES[page]
    code, report = check_json(f"{engine_server}/{page}", "--engine", engine)
    assert code == 0, report
    assert report["status"] == 200
    for name, value in expected.items():
        assert report["signals"][name] == value, name


def test_check_reads_v1_models_where_the_page_names_no_model_as_run_does() -> None:
    """llama-server's page names no model: check asks /v1/models as `poller run` does,
    and says where the names came from, or why none were read."""
    page = (DATA / "llamacpp-b11434-busy-handwritten.txt").read_bytes()
    listed = json.dumps({"object": "list", "data": [{"id": "qwen3-8b", "aliases": ["q8"]}]})

    def server(request: Request) -> bytes:
        if request.path == "/metrics":
            return answer(200, page)
        if request.path == "/v1/models":
            return answer(200, listed, content_type="application/json")
        return answer(404)

    with threaded(server) as url:
        code, report = check_json(url, "--engine", "llamacpp")
        text = CliRunner().invoke(cli, ["check", url, "--engine", "llamacpp"]).output
    assert code == 0, report
    assert report["signals"]["models"] == ["qwen3-8b", "q8"]
    assert report["sources"]["models"] == "/v1/models"
    assert "  models                 qwen3-8b, q8" in text and text.rstrip().endswith("contract")

    def no_models(request: Request) -> bytes:
        return answer(200, page) if request.path == "/metrics" else answer(404)

    with threaded(no_models) as url:
        code, report = check_json(url, "--engine", "llamacpp")
    assert code == 0, report  # the page is fine: the names are what a registry entry adds
    assert report["signals"]["models"] is None
    assert report["sources"]["models"].startswith("/v1/models not read: http_status: ")


@pytest.mark.parametrize(
    ("page", "engine", "words"),
    [
        ("trtllm-unprefixed-handwritten.txt", "trtllm", "return_perf_metrics"),
        ("triton-llmapi-handwritten.txt", "triton", "registers no load metrics"),
    ],
)
def test_check_contract_failures_say_what_to_run(
    engine_server: str, page: str, engine: str, words: str
) -> None:
    # trtllm's default path is /prometheus/metrics; the test server serves /<page>/metrics
    code, report = check_json(
        f"{engine_server}/{page}", "--engine", engine, "--metrics-path", "/metrics"
    )
    assert code == 1 and report["reason"] == "contract"
    assert words in report["detail"] and report["missing"]
    text = (
        CliRunner()
        .invoke(
            cli,
            ["check", f"{engine_server}/{page}", "--engine", engine, "--metrics-path", "/metrics"],
        )
        .output
    )
    assert words in text


def test_check_failure_carries_status_and_the_engine_message(engine_server: str) -> None:
    code, report = check_json(f"{engine_server}/nometrics", "--engine", "llamacpp")
    assert code == 1 and report["reason"] == "http_status" and report["status"] == 501
    message = "This server does not support metrics endpoint. Start it with `--metrics`"
    assert report["body"] == message
    assert report["detail"] == f"HTTP 501: {message}"
    text = (
        CliRunner()
        .invoke(cli, ["check", f"{engine_server}/nometrics", "--engine", "llamacpp"])
        .output
    )
    assert "status=501" in text and f"FAILED: http_status: HTTP 501: {message}" in text
    # a plain-text body: its first non-blank line, stripped
    code, report = check_json(f"{engine_server}/plain500")
    assert (report["status"], report["body"]) == (500, "upstream exploded")


def test_check_llamacpp_router_mode_needs_a_model_query(engine_server: str) -> None:
    code, report = check_json(f"{engine_server}/router", "--engine", "llamacpp")
    assert code == 1 and report["status"] == 400
    assert report["body"] == "model name is missing from the request"
    code, report = check_json(
        f"{engine_server}/router",
        "--engine",
        "llamacpp",
        "--metrics-path",
        "/metrics?model=qwen3-8b",
    )
    assert code == 0 and report["url"].endswith("/router/metrics?model=qwen3-8b")
    assert report["signals"]["prefix_cache_hit_rate"] == 0.75


def test_check_applies_the_settings_engine_defaults(engine_server: str, tmp_path: Path) -> None:
    config = tmp_path / "poller.toml"
    config.write_text(
        '[scrape.engines.llamacpp]\nmetrics_path = "/metrics?model=qwen3-8b"\n'
        '[scrape.engines.llamacpp.overrides]\nwaiting = ["llamacpp:requests_processing"]\n'
    )
    code, report = check_json(
        f"{engine_server}/router", "--engine", "llamacpp", "--config", str(config)
    )
    assert code == 0, report
    assert report["signals"]["waiting"] == 3  # the override read requests_processing
    assert report["sources"]["waiting"] == "llamacpp:requests_processing"
    bad = tmp_path / "bad.toml"
    bad.write_text('[scrape.engines.nope]\nmetrics_path = "/m"\n')
    result = CliRunner().invoke(cli, ["check", "http://x", "--config", str(bad)])
    assert result.exit_code == 2 and "unknown engine 'nope'" in result.output


def test_check_reads_the_settings_file_named_by_poller_config(
    engine_server: str, tmp_path: Path
) -> None:
    """`poller check` honours POLLER_CONFIG as `run` and `endpoints` do."""
    config = tmp_path / "poller.toml"
    config.write_text('[scrape.engines.llamacpp]\nmetrics_path = "/metrics?model=qwen3-8b"\n')
    args = ["check", f"{engine_server}/router", "--engine", "llamacpp", "--json"]
    result = CliRunner().invoke(cli, args, env={"POLLER_CONFIG": str(config)})
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["url"].endswith("/router/metrics?model=qwen3-8b")
    bad = tmp_path / "bad.toml"
    bad.write_text('[scrape.engines.nope]\nmetrics_path = "/m"\n')
    result = CliRunner().invoke(cli, ["check", "http://x"], env={"POLLER_CONFIG": str(bad)})
    assert result.exit_code == 2 and "unknown engine 'nope'" in result.output


def test_every_command_defines_config_alike() -> None:
    """One --config: the same variable, metavar and type wherever a command takes it."""
    from tests.cli.test_cli_help import commands

    found = []
    for where, command, _ in commands(cli):  # type: ignore[arg-type]
        for param in command.params:
            if isinstance(param, click.Option) and "--config" in param.opts:
                found.append(where)
                assert param.envvar == "POLLER_CONFIG", where
                assert param.metavar == "FILE" and param.name == "config_file", where
                assert isinstance(param.type, click.Path) and not param.type.dir_okay, where
    assert {"poller check", "poller run", "poller endpoints add"} <= set(found)


def test_check_with_the_wrong_engine_names_the_one_the_page_looks_like(
    engine_server: str,
) -> None:
    url = f"{engine_server}/sglang-0.5.23-priority-tp-dp-handwritten.txt"
    code, report = check_json(url, "--engine", "vllm")
    assert code == 1 and report["reason"] == "contract" and report["looks_like"] == ["sglang"]
    text = CliRunner().invoke(cli, ["check", url, "--engine", "vllm"]).output
    assert "the page looks like sglang's: try --engine sglang" in text
    # a page no engine's contract accepts says so
    code, report = check_json(
        f"{engine_server}/trtllm-unprefixed-handwritten.txt", "--engine", "trtllm",
        "--metrics-path", "/metrics",
    )  # fmt: skip
    assert code == 1 and report["looks_like"] == []
