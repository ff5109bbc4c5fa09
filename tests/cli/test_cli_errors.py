"""Every mistake on the command line is one ``Error:`` line on stderr and exit 2, never a
traceback: driven as an operator would, through ``python -m poller`` in a subprocess."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.procs import poller_cli as poller

BAD_REDIS_URLS = {
    "redis//127.0.0.1:55235": "did you mean 'redis://127.0.0.1:55235'?",
    "redis://127.0.0.1:notaport": "port 'notaport'",
    ":notaport": "has no scheme",
    "127.0.0.1:6379": "has no scheme",
    "redis://127.0.0.1:6379/abc": "database 'abc'",
    "http://127.0.0.1:6379": "scheme 'http'",
}
COMMANDS = [
    ["run"],
    ["status"],
    ["endpoints", "ls"],
    ["endpoints", "add", "a", "http://10.0.0.1:8000"],
    ["endpoints", "rm", "a"],
]


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


# Each URL in one command, each command with one URL (a subprocess costs ~0.5 s).
@pytest.mark.parametrize(
    ("url", "command"), list(zip(sorted(BAD_REDIS_URLS), [*COMMANDS, COMMANDS[1]], strict=True))
)
def test_a_malformed_redis_url_is_one_line_in_every_command(url: str, command: list[str]) -> None:
    line = one_error_line(poller(*command, "--redis-url", url))
    assert "redis.url" in line and BAD_REDIS_URLS[url] in line, (command, line)


def test_a_malformed_redis_url_from_the_environment_is_one_line() -> None:
    line = one_error_line(poller("endpoints", "ls", env={"POLLER_REDIS_URL": "redis//h:1"}))
    assert line == "Error: redis.url: 'redis//h:1' is not a URL: did you mean 'redis://h:1'?"


@pytest.mark.parametrize("command", [["demo"], ["bench", "--quick"]])
def test_the_lab_commands_check_their_redis_url_too(command: list[str]) -> None:
    line = one_error_line(poller(*command, "--redis-url", "redis//127.0.0.1:6379"))
    assert "did you mean 'redis://127.0.0.1:6379'?" in line and "--redis-url" in line


def test_a_password_in_a_bad_redis_url_is_not_printed() -> None:
    line = one_error_line(poller("status", "--redis-url", "redis://u:s3cret@h:x/0"))
    assert "s3cret" not in line and "u:***@h" in line


@pytest.mark.parametrize(
    ("name", "suggestion", "command"),
    [
        ("POLLER_REDISURL", "POLLER_REDIS_URL", ["run"]),
        ("POLLER_SCRAPE__INTERVALL_S", "POLLER_SCRAPE__INTERVAL_S", ["run"]),
        ("POLLER_REDIS__NAMESPCE", "POLLER_REDIS__NAMESPACE", ["status"]),
        ("POLLER_HEALT_PORT", "POLLER_HEALTH_PORT", ["endpoints", "ls"]),
    ],
)
def test_unknown_poller_variables_are_refused_alike(
    name: str, suggestion: str, command: list[str]
) -> None:
    line = one_error_line(poller(*command, env={name: "redis://127.0.0.1:1/0"}))
    assert line == f"Error: unknown environment variable {name} (did you mean {suggestion}?)"


def test_config_file_errors_come_all_at_once(tmp_path: Path) -> None:
    config = tmp_path / "poller.toml"
    config.write_text(
        '[scrape]\nintervall_s = 2\ntimeout_s = "soon"\n[helth]\nport = 1\n[redis]\nurl = "x"\n'
    )
    result = poller(
        "run", "--config", str(config), "--health-port", "70000",
        env={"POLLER_SCRAPE__JITTER_S": "abc"},
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    # each line says where the value came from: the file, a variable or a flag
    assert sorted(result.stderr.splitlines()) == sorted(
        [
            f"Error: {config}: unknown key `scrape.intervall_s` (did you mean "
            "`scrape.interval_s`?)",
            f"Error: {config}: scrape.timeout_s: should be a valid number, unable to parse "
            "string as a number, got 'soon'",
            f"Error: {config}: unknown key `helth` (did you mean `health`?)",
            f"Error: {config}: redis.url: 'x' has no scheme: use redis://HOST:PORT/DB, "
            "rediss://HOST:PORT/DB, unix:///PATH?db=DB or "
            "redis+sentinel://HOST:PORT[,HOST:PORT]/MASTER[/DB]",
            "Error: scrape.jitter_s: should be a valid number, unable to parse string as a "
            "number, got 'abc' (from POLLER_SCRAPE__JITTER_S)",
            "Error: health.port: should be at most 65535, got 70000 (from --health-port)",
        ]
    )


@pytest.mark.parametrize("command", [["status"], ["endpoints", "ls"], ["run", "--check"]])
def test_a_namespace_copied_with_its_braces_says_to_drop_them(command: list[str]) -> None:
    result = poller(*command, "--namespace", "{llmgw}", "--redis-url", "redis://127.0.0.1:1/0")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith(
        "Error: redis.namespace: write the namespace without the braces: llmgw (every key "
        "starts with {llmgw}: the braces are added)"
    ), line


def test_a_type_error_does_not_hide_a_range_error_beside_it() -> None:
    # click stopped at the first option it could not convert
    result = poller("run", env={"POLLER_INTERVAL": "-1", "POLLER_TIMEOUT": "abc"})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        "Error: scrape.interval_s: should be at least 0.05, got -1 (from POLLER_INTERVAL)",
        "Error: scrape.timeout_s: should be a valid number, unable to parse string as a "
        "number, got 'abc' (from POLLER_TIMEOUT)",
    ]


def test_endpoints_file_errors_come_all_at_once(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    path.write_text(
        "endpoints:\n"
        "  - {id: a, url: 'http://10.0.0.1:8000', metric_path: /m}\n"
        "  - {id: ok, url: 'http://10.0.0.2:8000'}\n"
        "  - {id: b, url: 'ftp://10.0.0.3:8000'}\n"
        "  - {id: c, url: 'http://10.0.0.4:8000', engine: vlm}\n"
    )
    # the file is read before Redis is: no server needed to see every mistake
    for command in (["endpoints", "sync", str(path)], ["run", "--endpoints-file", str(path)]):
        result = poller(*command, "--redis-url", "redis://127.0.0.1:1/0")
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert result.stderr.splitlines() == [
            f"Error: {path}: endpoint 'a' (entry 1): unknown key `metric_path` "
            "(did you mean `metrics_path`?)",
            f"Error: {path}: endpoint 'b' (entry 3): url: scheme must be http or https, got 'ftp'",
            f"Error: {path}: endpoint 'c' (entry 4): engine: unknown engine 'vlm' "
            "(did you mean 'vllm'?); "
            "accepted: vllm, sglang, llamacpp, trtllm, triton, tgi, lmdeploy, external",
        ], command


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["run", "--log-format", "xml"], "Invalid value for '--log-format'"),
        (["endpoints", "add", "a"], "Missing argument 'URL'"),
        (["status", "--nope"], "No such option '--nope'"),
        (["endpoints", "add", "a", "http://10.0.0.1:8000", "--label", "x"], "is not k=v"),
    ],
)
def test_click_usage_errors_are_one_line_too(args: list[str], words: str) -> None:
    line = one_error_line(poller(*args))
    assert words in line and "--help" in line


# --- at registration: what the pollers would fail on at every scrape ------------------------

UNREACHABLE = "redis://127.0.0.1:1/0"  # the checks come before Redis


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["x", "http://h:8000/metrics"],
            "url http://h:8000/metrics ends in the metrics path /metrics, while the pollers "
            "append /metrics: register the base URL http://h:8000",
        ),
        (
            ["x", "http://h:8000/v1/prometheus/metrics/", "--engine", "trtllm"],
            "ends in the metrics path /prometheus/metrics, while the pollers append "
            "/prometheus/metrics: register the base URL http://h:8000/v1",
        ),
        (
            ["x", "http://h:8000/metrics", "--engine", "trtllm"],
            "ends in the metrics path /metrics, while the pollers append /prometheus/metrics: "
            "register the base URL http://h:8000",
        ),
        (
            ["x", "http://h:8000", "--api-key-env", "HOME"],
            "api_key_env HOME does not start with LLMGW_KEY_: the pollers read keys only from "
            "such variables (scrape.key_env_prefix), e.g. LLMGW_KEY_HOME",
        ),
        (
            ["x", "http://h:8000", "--api-key-file", "/etc/passwd"],
            "api_key_file /etc/passwd is not inside the key directory /etc/llmgw-poller/keys",
        ),
        (
            ["x", "http://h:8000", "--api-key-file", "../../passwd"],
            "api_key_file ../../passwd is not inside the key directory",
        ),
    ],
)
def test_endpoints_add_refuses_what_the_pollers_would_fail_on(
    args: list[str], expected: str
) -> None:
    line = one_error_line(poller("endpoints", "add", *args, "--redis-url", UNREACHABLE))
    assert line.startswith("Error: endpoint 'x': ") and expected in line, line


def test_the_key_rules_are_the_pollers_settings(tmp_path: Path) -> None:
    config = tmp_path / "poller.toml"
    config.write_text('[scrape]\nkey_env_prefix = "MY_"\nkey_dir = "/srv/keys"\n')
    passes = [
        ("--api-key-env", "MY_KEY", {"POLLER_CONFIG": str(config)}),
        ("--api-key-file", "/srv/keys/a", {"POLLER_SCRAPE__KEY_DIR": "/srv/keys"}),
        ("--api-key-file", "a", {"CREDENTIALS_DIRECTORY": "/run/credentials/x"}),
    ]
    for option, value, env in passes:
        result = poller(
            "endpoints", "add", "x", "http://h:8000", option, value, "--redis-url", UNREACHABLE,
            env=env,
        )  # fmt: skip
        # past the checks: it fails only at Redis (exit 1)
        assert result.returncode == 1 and "unreachable" in result.stderr, result.stderr
    line = one_error_line(
        poller("endpoints", "add", "x", "http://h:8000", "--api-key-env", "LLMGW_KEY_A",
               "--config", str(config), "--redis-url", UNREACHABLE)
    )  # fmt: skip
    assert "does not start with MY_" in line


def test_endpoints_sync_reports_every_registration_problem(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    path.write_text(
        "endpoints:\n"
        "  - {id: a, url: 'http://10.0.0.1:8000/metrics'}\n"
        "  - {id: ok, url: 'http://10.0.0.2:8000', api_key_env: LLMGW_KEY_OK}\n"
        "  - {id: b, url: 'http://10.0.0.3:8000', api_key_env: AWS_SECRET_ACCESS_KEY}\n"
    )
    result = poller("endpoints", "sync", str(path), "--redis-url", UNREACHABLE)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(
        f"Error: {path}: endpoint 'a' (entry 1): url http://10.0.0.1:8000/metrics"
    )
    assert lines[1].startswith(
        f"Error: {path}: endpoint 'b' (entry 3): api_key_env AWS_SECRET_ACCESS_KEY"
    )


def test_file_syntax_errors_are_one_line(tmp_path: Path) -> None:
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text("endpoints:\n  - {id: a, url: 'http://x:1'\n  - b\n")
    line = one_error_line(poller("endpoints", "sync", str(endpoints), "--redis-url", UNREACHABLE))
    assert line == (
        f"Error: {endpoints}: not valid YAML: expected ',' or '}}', but got '-' at line 3, column 3"
    )
    config = tmp_path / "poller.toml"
    config.write_text("[scrape\n")
    line = one_error_line(poller("run", "--config", str(config)))
    assert f"config file '{config}' is not valid TOML" in line and "line 1" in line
