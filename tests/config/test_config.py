from __future__ import annotations

from pathlib import Path

import pytest

from poller.config import (
    DEFAULT_KEY_DIR,
    ScrapeSettings,
    Settings,
    effective_timeout_s,
    key_directory,
    load_settings,
)
from poller.config.registry_file import endpoints_from_file
from poller.errors import ConfigError
from tests.support.redisproc import RedisProcess


def test_defaults_keep_the_takeover_promise() -> None:
    s = Settings()
    c = s.coordination
    # SIGKILLed poller: lease and membership lapse, survivors notice at a heartbeat
    assert max(c.lease_ttl_ms, c.member_ttl_ms) + c.heartbeat_interval_ms <= 2500
    assert s.scrape.timeout_s < s.scrape.interval_s
    # Reconcile renews every held lease, so the 2 s scrape interval may equal the lease TTL.
    assert c.reconcile_interval_ms * 2 <= c.lease_ttl_ms
    assert s.redis.namespace == "llmgw" and s.scrape.default_engine == "vllm"


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    config = tmp_path / "p.toml"
    config.write_text('id = "from-file"\n[scrape]\ninterval_s = 5\n[redis]\nnamespace = "f"\n')
    env = {"POLLER_SCRAPE__INTERVAL_S": "3", "POLLER_REDIS__NAMESPACE": "e"}
    s = load_settings(config, {"redis.namespace": "flag", "scrape.interval_s": None}, env)
    assert (s.id, s.scrape.interval_s, s.redis.namespace) == ("from-file", 3.0, "flag")
    assert s.scrape.timeout_s == 1.0  # the Go poller's 1 s, below the 3 s interval


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        ({"scrape.timeout_s": 2}, "scrape", "must be below interval_s"),
        ({"scrape.default_engine": "nope"}, "scrape", "accepted: vllm, sglang"),
        ({"coordination.heartbeat_interval_ms": 1000}, "coordination", "at most a third"),
        ({"coordination.reconcile_interval_ms": 1500}, "coordination", "at most half"),
        ({"redis.namespace": "has space"}, "redis.namespace", "1-64 of A-Z a-z 0-9 . _ : -"),
        ({"log_level": "LOUD"}, "log_level", "'DEBUG', 'INFO', 'WARNING' or 'ERROR'"),
        ({"id": "a b"}, "id", "no spaces"),
    ],
)
def test_invalid_values_name_the_field(
    overrides: dict[str, object], field: str, words: str
) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(None, overrides, {})
    assert str(err.value).startswith(f"{field}: ") and words in str(err.value)


def test_bad_config_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(tmp_path / "missing.toml", environ={})
    bad = tmp_path / "bad.toml"
    bad.write_text("[scrape\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(bad, environ={})


@pytest.mark.parametrize("name", ["endpoints.yaml", "endpoints.json", "config.toml"])
def test_a_file_that_is_not_utf8_is_named_so(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_bytes("[scrape]\n".encode("utf-16"))  # what PowerShell's `>` writes
    read = endpoints_from_file if name.startswith("endpoints") else load_settings
    with pytest.raises(ConfigError) as raised:
        read(path)
    message = str(raised.value)
    assert f"{str(path)!r} is not UTF-8 text (byte 0xff at offset 0)" in message, message
    assert "UTF-16" in message


def test_scrape_defaults_are_the_go_pollers() -> None:
    # llmgw's DefaultConfig: Interval 2 s, Timeout 1 s.
    s = ScrapeSettings()
    assert (s.interval_s, s.timeout_s) == (2.0, 1.0)
    # Only an interval named: 1 s while it fits, else half the interval (normalize()).
    assert ScrapeSettings(interval_s=5).timeout_s == 1.0
    assert ScrapeSettings(interval_s=1).timeout_s == 0.5
    assert ScrapeSettings(interval_s=0.4).timeout_s == 0.2
    # An explicit pair at the settings level is still an error, with both numbers.
    with pytest.raises(ConfigError, match=r"timeout_s \(3\) must be below interval_s \(2\)"):
        load_settings(overrides={"scrape.timeout_s": 3}, environ={})


@pytest.mark.parametrize(
    ("entry_timeout", "entry_interval", "expected"),
    [
        (None, None, (1.0, False)),  # the settings' own pair
        (0.3, None, (0.3, False)),
        (2.0, None, (1.0, True)),  # at the 2 s default interval: half of it
        (5.0, None, (1.0, True)),
        (None, 0.5, (0.25, True)),  # the 1 s default timeout does not fit a 0.5 s interval
        (3.0, 3.0, (1.5, True)),  # equal is not below
        (2.9, 3.0, (2.9, False)),
        (None, 10.0, (1.0, False)),
    ],
)
def test_effective_timeout_lowers_to_half_the_interval(
    entry_timeout: float | None, entry_interval: float | None, expected: tuple[float, bool]
) -> None:
    assert effective_timeout_s(entry_timeout, entry_interval, ScrapeSettings()) == expected


def test_entry_timeout_at_the_interval_is_accepted() -> None:
    from poller.schema.endpoint import endpoint_from_dict

    e = endpoint_from_dict("a", {"url": "http://x:1", "interval_s": 1, "timeout_s": 2})
    assert effective_timeout_s(e.timeout_s, e.interval_s, ScrapeSettings()) == (0.5, True)


def test_key_settings_and_directory(tmp_path: Path) -> None:
    s = ScrapeSettings()
    assert s.key_env_prefix == "LLMGW_KEY_" and s.key_dir is None
    assert key_directory(s, {}) == DEFAULT_KEY_DIR == "/etc/llmgw-poller/keys"
    # systemd's LoadCredential= sets $CREDENTIALS_DIRECTORY; an explicit key_dir wins.
    assert key_directory(s, {"CREDENTIALS_DIRECTORY": str(tmp_path)}) == str(tmp_path)
    assert key_directory(s, {"CREDENTIALS_DIRECTORY": "relative"}) == DEFAULT_KEY_DIR
    own = ScrapeSettings(key_dir="/srv/keys")
    assert key_directory(own, {"CREDENTIALS_DIRECTORY": str(tmp_path)}) == "/srv/keys"
    env = {"POLLER_SCRAPE__KEY_ENV_PREFIX": "ENGINE_KEY_", "POLLER_SCRAPE__KEY_DIR": "/k"}
    loaded = load_settings(environ=env).scrape
    assert (loaded.key_env_prefix, loaded.key_dir) == ("ENGINE_KEY_", "/k")


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        ({"scrape.key_dir": "keys"}, "scrape.key_dir", "must be an absolute path"),
        ({"scrape.key_env_prefix": ""}, "scrape.key_env_prefix", "pattern"),
        ({"scrape.key_env_prefix": "A-B"}, "scrape.key_env_prefix", "pattern"),
    ],
)
def test_bad_key_settings_name_the_field(
    overrides: dict[str, object], field: str, words: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(overrides=overrides, environ={})
    assert info.value.field == field and words in str(info.value)


def test_endpoints_add_and_sync_say_when_a_timeout_is_lowered(
    redis_server: RedisProcess, tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from poller.cli import cli

    env = {"POLLER_REDIS_URL": redis_server.url, "POLLER_NAMESPACE": "cfg-notes"}

    def run(*args: str) -> str:
        result = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.output

    out = run(
        "endpoints", "add", "slow", "http://10.0.0.1:8000", "--interval", "1", "--timeout", "1"
    )
    assert "note: slow: timeout 1s is not below its interval 1s: the pollers use 0.5s" in out
    out = run("endpoints", "add", "fine", "http://10.0.0.2:8000", "--timeout", "0.5")
    assert "note:" not in out
    # Against the pollers' interval (2 s by default, POLLER_SCRAPE__INTERVAL_S if set).
    out = run("endpoints", "add", "long", "http://10.0.0.3:8000", "--timeout", "4")
    assert "note: long: timeout 4s is not below its interval 2s (scrape.interval_s)" in out

    path = tmp_path / "endpoints.yaml"
    path.write_text(
        "endpoints:\n"
        "  - {id: a, url: 'http://10.0.0.1:8000', interval_s: 0.5}\n"
        "  - {id: b, url: 'http://10.0.0.2:8000', interval_s: 4, timeout_s: 3}\n"
        "  - {id: c, url: 'http://10.0.0.3:8000', timeout_s: 2}\n"
    )
    out = run("endpoints", "sync", str(path))
    notes = [line for line in out.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: a: timeout 1s is not below its interval 0.5s: the pollers use 0.25s, "
        "half the interval",
        "note: c: timeout 2s is not below its interval 2s (scrape.interval_s): the pollers "
        "use 1s, half the interval",
    ]


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("redis//127.0.0.1:55235", "did you mean 'redis://127.0.0.1:55235'?"),
        ("rediss:/h:6380/0", "did you mean 'rediss://h:6380/0'?"),
        ("127.0.0.1:6379", "has no scheme"),
        ("http://h:6379", "scheme 'http'"),
        ("redis://h:notaport/0", "port 'notaport'"),
        ("redis://h:0/0", "port '0'"),
        ("redis://h:6379/abc", "database 'abc'"),
        ("redis://h:6379/0/1", "only the database number"),
        ("redis:///0", "has no host"),
        ("unix:///tmp/r.sock?db=x", "database 'x'"),
        ("unix://", "names no socket"),
        ("redis+sentinel://a:26379,b:x/m", "bad sentinel address 'b:x'"),
        ("redis+sentinel://a:26379", "names the service"),
        ("redis+sentinel://a:26379/m/x", "database 'x'"),
        ("redis://u:pw@h:x/0", "'redis://u:***@h:x/0'"),
        ("redis://h:6379/0?foo=bar", "unknown parameter 'foo' in the Redis URL"),
        ("redis://h:6379/0?socket_timout=1", "(did you mean 'socket_timeout'?)"),
        ("redis://h:6379/0?socket_timeout=abc", "socket_timeout='abc' in the Redis URL"),
        ("redis://h:6379/0?ssl_cert_reqs=none", "TLS is set by redis.tls_ca_file"),
        ("redis+sentinel://a:26379/m?db=1", "unknown parameter 'db'"),
        ("redis://h:6379/0?retry_on_error=TimeoutError", "unknown parameter 'retry_on_error'"),
    ],
)
def test_malformed_redis_urls_are_refused_at_load(url: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(overrides={"redis.url": url}, environ={})
    assert info.value.field == "redis.url" and words in str(info.value)
    assert "pw@" not in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "redis://h",
        "rediss://user:pw@h:6380/2",
        "redis://[::1]:6379/3",
        "unix:///run/redis.sock?db=1",
        "redis+sentinel://a,b:26380/mymaster/2",
        "rediss+sentinel://a:26379/m",
    ],
)
def test_good_redis_urls_pass(url: str) -> None:
    assert load_settings(overrides={"redis.url": url}, environ={}).redis.url == url


def test_unknown_variables_and_keys_are_all_reported_with_suggestions(tmp_path: Path) -> None:
    config = tmp_path / "p.toml"
    config.write_text("[scrape]\nintervall_s = 2\n[scrape.engines.vllm]\nmetric_path = '/m'\n")
    env = {"POLLER_REDISURL": "x", "POLLER_SCRAPE__TIMEOUT": "1", "POLLER_ZZZZZZ": "1"}
    with pytest.raises(ConfigError) as info:
        load_settings(config, environ=env)
    assert str(info.value).splitlines() == [
        "unknown environment variable POLLER_REDISURL (did you mean POLLER_REDIS_URL?)",
        "unknown environment variable POLLER_SCRAPE__TIMEOUT (did you mean "
        "POLLER_SCRAPE__TIMEOUT_S?)",
        "unknown environment variable POLLER_ZZZZZZ (see docs/operations.md)",
        f"{config}: unknown key `scrape.engines.vllm.metric_path` (did you mean "
        "`scrape.engines.vllm.metrics_path`?)",
        f"{config}: unknown key `scrape.intervall_s` (did you mean `scrape.interval_s`?)",
    ]
    # known flat names (the command line's) and real nested ones pass
    ok = {"POLLER_REDIS_URL": "x", "POLLER_SCRAPE__ENGINES__SGLANG__METRICS_PATH": "/m"}
    assert load_settings(environ=ok).scrape.engines["sglang"].metrics_path == "/m"
