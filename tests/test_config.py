from __future__ import annotations

from pathlib import Path

import pytest

from poller.config import Settings, load_settings
from poller.errors import ConfigError


def test_defaults_keep_the_takeover_promise() -> None:
    s = Settings()
    c = s.coordination
    # SIGKILLed poller: lease and membership lapse, survivors notice at a heartbeat
    assert max(c.lease_ttl_ms, c.member_ttl_ms) + c.heartbeat_interval_ms <= 2500
    assert s.scrape.timeout_s < s.scrape.interval_s * 1000 < c.lease_ttl_ms
    assert s.redis.namespace == "llmgw" and s.scrape.default_engine == "vllm"


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    config = tmp_path / "p.toml"
    config.write_text('id = "from-file"\n[scrape]\ninterval_s = 5\n[redis]\nnamespace = "f"\n')
    env = {"POLLER_SCRAPE__INTERVAL_S": "3", "POLLER_REDIS__NAMESPACE": "e"}
    s = load_settings(config, {"redis.namespace": "flag", "scrape.interval_s": None}, env)
    assert (s.id, s.scrape.interval_s, s.redis.namespace) == ("from-file", 3.0, "flag")
    assert s.scrape.timeout_s == 2.4  # 80% of the interval unless set


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        ({"scrape.timeout_s": 2}, "scrape", "must be below interval_s"),
        ({"scrape.default_engine": "nope"}, "scrape", "accepted: vllm, sglang"),
        ({"coordination.heartbeat_interval_ms": 1000}, "coordination", "at most a third"),
        ({"coordination.reconcile_interval_ms": 1500}, "coordination", "at most half"),
        ({"redis.namespace": "has space"}, "redis.namespace", "pattern"),
        ({"log_level": "LOUD"}, "log_level", "'DEBUG', 'INFO', 'WARNING' or 'ERROR'"),
        ({"id": "a b"}, "id", "pattern"),
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
