"""What a new user types, and the exact lines and exit status they get back.

Each test drives ``python -m poller`` in a subprocess, as an operator would, against a
real redis-server where Redis is involved: duplicate URLs in the registry, URL mistakes
(a metrics path or ``/v1`` at the end), the engine ``check`` detects and the hint a
running poller gives, settings problems in plain words and all at once, plurals,
``--replace``, shell completion and the demo's install.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from poller.integrations.litellm import normalize_url as litellm_normalize_url
from poller.integrations.litellm.deployments import UrlIndex
from poller.schema.endpoint import normalize_url
from poller.schema.keys import Keys
from tests.support.httpserver import Request, answer, threaded
from tests.support.paths import DATA, REPO
from tests.support.procs import PollerProc
from tests.support.procs import poller_cli as poller
from tests.support.redisproc import RedisProcess

NS = "words"
UNREACHABLE = "redis://127.0.0.1:1/0"
#: A bound on events a poller makes happen within a few scrapes: ample on a loaded machine.
EVENT_TIMEOUT_S = 60.0
SGLANG_PAGE = (DATA / "sglang-0.5.23-priority-tp-dp-handwritten.txt").read_bytes()


@pytest.fixture
def redis_env(redis_server: RedisProcess) -> dict[str, str]:
    redis.Redis.from_url(redis_server.url).flushall()
    return {"POLLER_REDIS_URL": redis_server.url, "POLLER_NAMESPACE": NS}


@pytest.fixture
def sglang_engine() -> Iterator[str]:
    """An SGLang engine's /metrics on a loopback port (every other path: 404)."""

    def script(request: Request) -> bytes:
        if request.path == "/metrics":
            return answer(200, SGLANG_PAGE)
        return answer(404, "not found\n")

    with threaded(script) as url:
        yield url


def contract_failures(proc: PollerProc) -> float:
    """The poller's contract failures of vLLM-mapped endpoints (its /metrics)."""
    _, text = proc.get("/metrics")
    wanted = ("poller_scrapes_total{", 'engine="vllm"', 'result="contract"')
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(wanted[0]) and all(w in line for w in wanted[1:])
    )


def wait_for(cond, what: str):  # type: ignore[no-untyped-def]
    """``cond()`` once it is truthy; fails after EVENT_TIMEOUT_S."""
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# --- 1. one engine, one entry: duplicate URLs --------------------------------------------


def test_one_url_rule_for_the_registry_and_litellm() -> None:
    assert litellm_normalize_url is normalize_url
    for url in (
        "http://GW.internal/vllm-3",
        "http://gw.internal:80/vllm-3/",
        "http://gw.internal/vllm-3/v1?x=1",
    ):
        assert normalize_url(url) == "http://gw.internal:80/vllm-3"


def test_endpoints_add_refuses_a_second_entry_with_the_same_url(redis_env: dict[str, str]) -> None:
    first = poller("endpoints", "add", "vllm-3", "http://gw.internal/vllm-3", env=redis_env)
    assert first.returncode == 0, first.stderr
    second = poller(
        "endpoints", "add", "trailing-slash", "http://GW.internal:80/vllm-3/", env=redis_env
    )
    assert second.returncode == 2
    assert second.stderr.splitlines() == [
        "Error: endpoint 'trailing-slash' has the URL of endpoint 'vllm-3' "
        "(http://gw.internal:80/vllm-3): one engine, one entry (a gateway matching "
        "deployments by URL could not tell them apart); remove one, or give each its own URL"
    ]
    # --replace of the entry itself is no conflict
    same = poller(
        "endpoints", "add", "vllm-3", "http://gw.internal/vllm-3/", "--replace", env=redis_env
    )
    assert same.returncode == 0, same.stderr
    listed = poller("endpoints", "ls", env=redis_env)
    assert listed.stdout.splitlines()[1] == "registry rev 2: 1 endpoint"  # under the Redis


def test_a_registry_file_with_two_entries_of_one_url_is_refused_everywhere(
    redis_env: dict[str, str], tmp_path: Path
) -> None:
    path = tmp_path / "endpoints.yaml"
    path.write_text(
        "endpoints:\n"
        "  - {id: vllm-3, url: 'http://gw.internal/vllm-3'}\n"
        "  - {id: trailing-slash, url: 'http://gw.internal/vllm-3/'}\n"
        "  - {id: other, url: 'http://gw.internal/vllm-4'}\n"
    )
    expected = [
        f"Error: {path}: endpoint 'trailing-slash' has the URL of endpoint 'vllm-3' "
        "(http://gw.internal:80/vllm-3): one engine, one entry (a gateway matching "
        "deployments by URL could not tell them apart); remove one, or give each its own URL"
    ]
    for command in (
        ["endpoints", "sync", str(path)],
        ["run", "--check", "--endpoints-file", str(path)],
    ):
        result = poller(*command, env=redis_env)
        assert result.returncode == 2, command
        assert result.stderr.splitlines() == expected, command
    listed = poller("endpoints", "ls", env=redis_env).stdout.splitlines()
    assert listed[1] == "registry rev 0: 0 endpoints"  # under the Redis it read


def test_the_litellm_warning_names_every_id_sharing_a_url(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Entries a foreign writer made: the registry refuses them, the gateway warns.
    with caplog.at_level(logging.WARNING):
        UrlIndex(
            [
                ("a", "http://gw/vllm-3"),
                ("trailing-slash", "http://gw/vllm-3/"),
                ("v1", "http://gw/vllm-3/v1"),
            ]
        )
    assert [r.getMessage() for r in caplog.records] == [
        "endpoints a, trailing-slash and v1 share the URL http://gw:80/vllm-3: deployments "
        "must name theirs in model_info.llmgw_endpoint"
    ]


# --- 2. URL mistakes, the engine check detects, the hint a poller gives -------------------


def test_a_url_ending_in_the_metrics_path_or_v1_is_refused_everywhere(
    redis_env: dict[str, str], tmp_path: Path
) -> None:
    metrics = (
        "url http://127.0.0.1:9/metrics ends in the metrics path /metrics, while the "
        "pollers append /metrics: register the base URL http://127.0.0.1:9"
    )
    v1 = (
        "url http://127.0.0.1:9/v1 ends in /v1, the OpenAI API's path, while the pollers "
        "append /metrics to the engine's base URL: register http://127.0.0.1:9 (an engine "
        "serving its metrics under /v1 takes --metrics-path /v1/metrics)"
    )
    for url, line in (("http://127.0.0.1:9/metrics", metrics), ("http://127.0.0.1:9/v1", v1)):
        checked = poller("check", url)
        assert (checked.returncode, checked.stderr.splitlines()) == (2, [f"Error: {line}"])
        added = poller("endpoints", "add", "e", url, env=redis_env)
        assert (added.returncode, added.stderr.splitlines()) == (
            2,
            [f"Error: endpoint 'e': {line}"],
        )
    path = tmp_path / "endpoints.yaml"
    path.write_text("endpoints:\n  - {id: e, url: 'http://127.0.0.1:9/v1'}\n")
    synced = poller("endpoints", "sync", str(path), env=redis_env)
    assert (synced.returncode, synced.stderr.splitlines()) == (
        2,
        [f"Error: {path}: endpoint 'e' (entry 1): {v1}"],
    )


def test_check_without_engine_detects_it_from_the_page(sglang_engine: str) -> None:
    result = poller("check", sglang_engine)
    assert result.returncode == 0, result.stdout
    lines = result.stdout.splitlines()
    assert lines[1] == "engine: sglang (detected from the page)"
    assert lines[-1] == "OK: the page satisfies the sglang contract"
    # named, it is the one read: the wrong one fails with the hint
    wrong = poller("check", sglang_engine, "--engine", "vllm")
    assert wrong.returncode == 1
    assert wrong.stdout.splitlines()[-1] == "the page looks like sglang's: try --engine sglang"
    assert wrong.stdout.count("looks like") == 1, wrong.stdout  # the advice once
    assert wrong.stdout.splitlines()[-2] == (
        "FAILED: contract: vllm page lacks required metrics: vllm:num_requests_running, "
        "vllm:num_requests_waiting, vllm:kv_cache_usage_perc|vllm:gpu_cache_usage_perc"
    )


def test_check_without_engine_says_why_it_fell_back_to_the_default() -> None:
    """A vLLM page lacking a metric satisfies no engine: the report is the default's and
    says what it lacks; with no page at all, it says there was none to tell from."""
    page = (DATA / "vllm-v1-dp-lora-handwritten.txt").read_text()
    lacking = "".join(x for x in page.splitlines(True) if "kv_cache_usage" not in x)

    def script(request: Request) -> bytes:
        return answer(200, lacking.encode()) if request.path == "/metrics" else answer(404, "")

    with threaded(script) as url:
        text = poller("check", url)
        as_json = poller("check", url, "--json")
    assert text.returncode == 1, text.stdout
    lines = text.stdout.splitlines()
    assert lines[1] == "engine: vllm (the default: the page satisfies no engine's contract)"
    assert lines[-3].startswith("missing: ") and "kv_cache_usage" in lines[-3], lines
    assert lines[-1] == "no other engine's contract fits either: the page lacks what vllm needs"
    assert json.loads(as_json.stdout)["detected"] is False

    gone = poller("check", "http://127.0.0.1:9", "--timeout", "5")  # nothing listens
    assert gone.returncode == 1, gone.stdout
    assert gone.stdout.splitlines()[1] == (
        "engine: vllm (the default: no page was read to tell it from)"
    )
    assert gone.stdout.splitlines()[-1].startswith("FAILED: unreachable: ")


def test_a_running_poller_gives_the_hint_in_the_failure_and_once_in_the_log(
    redis_server: RedisProcess, redis_env: dict[str, str], sglang_engine: str, tmp_path: Path
) -> None:
    added = poller("endpoints", "add", "sg", sglang_engine, "--engine", "vllm", env=redis_env)
    assert added.returncode == 0, added.stderr
    hint = (
        "the page looks like sglang's: register the endpoint with engine sglang "
        "(poller check --engine sglang shows what it reads)"
    )
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    proc = PollerProc("p0", redis_server.url, NS, tmp_path, interval_s=0.2).start()
    try:
        # a few failed scrapes: the warning is logged once, not once per scrape
        wait_for(lambda: contract_failures(proc) >= 3, "three failed scrapes")
        detail = client.hget(Keys(NS).failure("sg"), "detail")
        assert detail is not None and detail.endswith(f"; {hint}"), detail
        warnings = [line for line in proc.log().splitlines() if "does not serve" in line]
        assert len(warnings) == 1 and f"hint={json.dumps(hint)}" in warnings[0], warnings
        status = poller("status", env=redis_env)
        assert status.returncode == 0
        assert any(
            line.startswith("1 live poller (p0)   1 endpoint: ")
            for line in status.stdout.splitlines()
        ), status.stdout
    finally:
        proc.cleanup()
        client.close()


# --- 3. settings messages in the user's terms, all at once --------------------------------


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["run", "--check", "--interval", "0"],
            "scrape.interval_s: should be at least 0.05, got 0 (from --interval)",
        ),
        (
            ["run", "--check", "--interval", "nan"],
            "scrape.interval_s: should be a finite number, got nan (from --interval)",
        ),
        (
            ["endpoints", "add", "a", "http://10.0.0.1:8000", "--interval", "inf"],
            "endpoint 'a' interval_s: should be a finite number, got inf",
        ),
        (
            ["run", "--check", "--id", "has space"],
            "id: poller id 'has space' must be 1-200 characters from A-Z a-z 0-9 . _ : @ / - "
            "(no spaces), e.g. the pod name",
        ),
        (
            ["endpoints", "add", "a", "10.0.0.1:8000"],
            "endpoint 'a' url: '10.0.0.1:8000' has no scheme: write http://10.0.0.1:8000 "
            "(or https://)",
        ),
        (
            ["run", "--check", "--interval", "1", "--timeout", "1"],
            "scrape: timeout_s (1) must be below interval_s (1)",
        ),
    ],
)
def test_settings_mistakes_are_said_in_the_users_terms(args: list[str], line: str) -> None:
    result = poller(*args, "--redis-url", UNREACHABLE)
    assert (result.returncode, result.stderr.splitlines()) == (2, [f"Error: {line}"])


def test_the_documented_minimum_interval_runs(redis_env: dict[str, str]) -> None:
    result = poller("run", "--check", "--interval", "0.05", "--id", "p0", env=redis_env)
    assert result.returncode == 0, result.stderr
    assert "interval 0.05s (timeout 0.025s," in result.stdout.splitlines()[0]


def test_a_registry_file_is_read_in_the_format_its_suffix_names(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.json"
    path.write_text('[\n {"id": "a", "url": "http://x:1"}\n {"id": "b"}]')
    result = poller("endpoints", "sync", str(path), "--redis-url", UNREACHABLE)
    assert (result.returncode, result.stderr.splitlines()) == (
        2,
        [f"Error: {path}: not valid JSON: Expecting ',' delimiter: line 3 column 2 (char 37)"],
    )


def test_flags_variables_the_file_and_the_registry_file_are_checked_in_one_pass(
    tmp_path: Path,
) -> None:
    config = tmp_path / "poller.toml"
    config.write_text("[scrape]\nintervall_s = 2\n")
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text(
        "endpoints:\n"
        "  - {id: a, url: 'http://10.0.0.1:8000/metrics'}\n"
        "  - {id: b, url: 'http://10.0.0.2:8000', engine: vlm}\n"
    )
    result = poller(
        "run", "--check", "--config", str(config), "--id", "a b",
        env={"POLLER_FOO": "1", "POLLER_ENDPOINTS_FILE": str(endpoints)},
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "Error: unknown environment variable POLLER_FOO (see docs/operations.md)",
        "Error: id: poller id 'a b' must be 1-200 characters from A-Z a-z 0-9 . _ : @ / - "
        "(no spaces), e.g. the pod name",
        f"Error: {config}: unknown key `scrape.intervall_s` (did you mean `scrape.interval_s`?)",
        f"Error: {endpoints}: endpoint 'a' (entry 1): url http://10.0.0.1:8000/metrics ends in "
        "the metrics path /metrics, while the pollers append /metrics: register the base URL "
        "http://10.0.0.1:8000",
        f"Error: {endpoints}: endpoint 'b' (entry 2): engine: unknown engine 'vlm' (did you "
        "mean 'vllm'?); accepted: vllm, sglang, llamacpp, trtllm, triton, tgi, lmdeploy, external",
    ]


def test_a_flag_of_the_wrong_type_does_not_hide_unknown_variables() -> None:
    result = poller("run", "--interval", "abc", env={"POLLER_FOO": "1"})
    assert (result.returncode, result.stderr.splitlines()) == (
        2,
        [
            "Error: unknown environment variable POLLER_FOO (see docs/operations.md)",
            "Error: scrape.interval_s: should be a valid number, unable to parse string as a "
            "number, got 'abc' (from --interval)",
        ],
    )


# --- 4. papercuts ---------------------------------------------------------------------------


def test_sync_and_add_say_what_they_did_in_words(redis_env: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    path.write_text("endpoints:\n  - {id: a, url: 'http://10.0.0.1:8000'}\n")
    dry = poller("endpoints", "sync", str(path), "--dry-run", env=redis_env)
    # Which Redis and namespace it changed, as status says which it read.
    where = f"{redis_env['POLLER_REDIS_URL']} namespace {NS}"
    assert dry.stdout.splitlines() == [
        "+ a",
        f"would add 1, change 0, remove 0 (registry rev 0 of {where})",
    ]
    done = poller("endpoints", "sync", str(path), env=redis_env)
    assert done.stdout.splitlines() == [
        "+ a",
        f"added 1, changed 0, removed 0 (registry rev 1 of {where})",
    ]
    again = poller("endpoints", "add", "a", "http://10.0.0.1:8000", env=redis_env)
    assert (again.returncode, again.stderr.splitlines()) == (
        1,
        ["Error: endpoint 'a' already exists: add --replace to overwrite it"],
    )
    assert poller("endpoints", "ls", env=redis_env).stdout.splitlines()[1] == (
        "registry rev 1: 1 endpoint"
    )


def test_the_failure_column_is_cut_after_a_word_with_an_ellipsis(
    redis_server: RedisProcess, redis_env: dict[str, str], tmp_path: Path
) -> None:
    from poller.cli.render import clip

    said = "the upstream engine went away while its scheduler was being restarted by the operator"

    def script(request: Request) -> bytes:
        return answer(500, said + "\n")

    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    with threaded(script) as url:
        assert poller("endpoints", "add", "broken", url, env=redis_env).returncode == 0
        proc = PollerProc("p0", redis_server.url, NS, tmp_path, interval_s=0.2).start()
        try:
            detail = wait_for(
                lambda: client.hget(Keys(NS).failure("broken"), "detail"), "the failure"
            )
            status = poller("status", env=redis_env)
        finally:
            proc.cleanup()
            client.close()
    assert len(detail) > 60 and said in detail
    shown = clip(detail)
    assert shown.endswith("…") and len(shown) <= 60
    cut = shown.removesuffix("…")
    assert detail.startswith(cut) and detail[len(cut)] in " ,;:."  # after a whole word
    rows = [line for line in status.stdout.splitlines() if line.startswith("broken ")]
    assert len(rows) == 1 and rows[0].endswith(f": {shown}"), status.stdout


def test_shell_completion_completes_commands() -> None:
    env = {
        "_POLLER_COMPLETE": "bash_complete",
        "COMP_WORDS": "poller endpoints a",
        "COMP_CWORD": "2",
    }
    result = poller(env=env)
    assert (result.returncode, result.stdout.splitlines()) == (0, ["plain,add"])
    source = poller(env={"_POLLER_COMPLETE": "bash_source"})
    assert source.returncode == 0 and "complete -o nosort -F _poller_completion" in source.stdout


def test_make_demo_installs_only_what_the_demo_needs_beside_the_dev_set(tmp_path: Path) -> None:
    """``make demo`` and ``make install`` share .venv, each with its own stamp."""
    for name in (
        "Makefile",
        "pyproject.toml",
        "lab/pyproject.toml",
        "constraints/litellm.txt",
        "constraints/epp.txt",
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)

    def planned(target: str) -> list[str]:
        done = subprocess.run(
            ["make", "-n", target], cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return [line for line in done.stdout.splitlines() if "pip install" in line]

    demo = planned("demo")
    assert demo[-1] == (
        ".venv/bin/python -m pip install --progress-bar on -e '.[service]' -e ./lab"
    )
    assert not any("--quiet" in line or "dev" in line for line in demo)
    # a demo install does not pass for the development set ...
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / ".installed-demo").touch()
    assert planned("demo") == []
    assert any("'.[dev,litellm,epp]'" in line for line in planned("install"))
    # ... and the development set holds the demo's
    (tmp_path / ".venv" / ".installed-dev").touch()
    assert planned("install") == [] and planned("demo") == []
