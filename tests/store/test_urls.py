"""The one URL redactor, and the Sentinel URL read once for the check and the connection."""

from __future__ import annotations

import re
from typing import Any

import pytest

from poller.errors import ConfigError
from poller.redis import connection
from poller.redis.settings import RedisSettings, SentinelUrl, check_redis_url, parse_sentinel_url
from poller.util.urls import redact_url
from tests.support.paths import REPO


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://u@h:6379/0", "redis://u@h:6379/0"),
        ("redis://u:pw@h:6379/0", "redis://u:***@h:6379/0"),
        ("redis://:pw@h", "redis://:***@h"),
        ("rediss://poller:p%40ss:w@h:6380/2", "rediss://poller:***@h:6380/2"),
        ("redis://u:p@ss@h/0", "redis://u:***@h/0"),
        ("redis://u:pw@[::1]:6379/0", "redis://u:***@[::1]:6379/0"),
        ("rediss://u:pw@[2001:db8::5]/1", "rediss://u:***@[2001:db8::5]/1"),
        ("redis://[::1]:6379/0", "redis://[::1]:6379/0"),
        ("unix:///run/redis.sock?db=1", "unix:///run/redis.sock?db=1"),
        ("unix://:pw@/run/redis.sock?db=1", "unix://:***@/run/redis.sock?db=1"),
        ("unix:///run/redis.sock?db=1&password=pw", "unix:///run/redis.sock?db=1&password=***"),
        (
            "redis+sentinel://u:pw@a:26379,[::1]:26380,c/mymaster/2",
            "redis+sentinel://u:***@a:26379,[::1]:26380,c/mymaster/2",
        ),
        (
            "rediss+sentinel://a:26379,b:26379/m?sentinel_password=sp",
            "rediss+sentinel://a:26379,b:26379/m?sentinel_password=***",
        ),
        ("http://10.0.0.5:8000/metrics", "http://10.0.0.5:8000/metrics"),
        ("https://k:secret@[fd00::7]:8443/m?x=1#top", "https://k:***@[fd00::7]:8443/m?x=1#top"),
        # not URLs (a mistyped scheme): the text before the "@" is still user information
        ("redis:/u:pw@h:1", "redis:/u:***@h:1"),
        ("rediss:u:pw@h", "rediss:u:***@h"),
        ("h:6379", "h:6379"),
    ],
)
def test_redact_url_hides_passwords_and_keeps_everything_else(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert redact_url(shown) == shown  # a redacted URL stays as it is


def test_the_package_has_one_redactor() -> None:
    """Nothing but poller/util/urls.py writes the mask: every other place calls it."""
    others = [
        str(path.relative_to(REPO))
        for path in (REPO / "poller").rglob("*.py")
        if "***" in path.read_text(encoding="utf-8") and path.name != "urls.py"
    ]
    assert others == []


def test_setting_errors_show_the_url_as_the_redactor_does() -> None:
    url = "redis://u:s3cret@[::1]:notaport/0"
    with pytest.raises(ValueError) as info:
        check_redis_url(url)
    assert f"'{redact_url(url)}'" in str(info.value) and "s3cret" not in str(info.value)


def test_a_sentinel_url_is_read_into_one_value() -> None:
    parsed = parse_sentinel_url(
        "rediss+sentinel://poller:p%40ss@a:26380,b,[::1]:26381/mymaster/3?sentinel_password=sp"
    )
    assert parsed == SentinelUrl(
        hosts=(("a", 26380), ("b", 26379), ("::1", 26381)),
        service="mymaster",
        db=3,
        username="poller",
        password="p@ss",
        sentinel_password="sp",
        tls=True,
    )
    plain = parse_sentinel_url("redis+sentinel://h/m")
    assert plain == SentinelUrl(hosts=(("h", 26379),), service="m")


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("redis+sentinel://a:26379,b:x/m", "bad sentinel address 'b:x'"),
        ("redis+sentinel://a:0/m", "bad sentinel address 'a:0'"),
        ("redis+sentinel://[::1]x/m", "bad sentinel address '[::1]x'"),
        ("redis+sentinel://a:26379", "names the service"),
        ("redis+sentinel://a:26379/m/0/1", "names the service"),
        ("redis+sentinel://u:pw@a:26379/m/x", "database 'x'"),
    ],
)
def test_the_check_and_the_connection_refuse_the_same_sentinel_urls(url: str, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)) as checked:
        check_redis_url(url)
    assert "pw@" not in str(checked.value)
    with pytest.raises(ConfigError, match=re.escape(words)) as connecting:
        connection.connect(RedisSettings.model_construct(url=url))
    assert connecting.value.field == "redis.url"


def test_the_connection_uses_the_parsed_sentinel_url(monkeypatch: pytest.MonkeyPatch) -> None:
    made: dict[str, Any] = {}

    class Sentinel:
        def __init__(self, hosts: list[tuple[str, int]], **kwargs: Any) -> None:
            made.update(hosts=hosts, **kwargs)

        def master_for(self, service: str, **kwargs: Any) -> str:
            made.update(service=service, **kwargs)
            return "master"

    monkeypatch.setattr("redis.asyncio.sentinel.Sentinel", Sentinel)
    url = "redis+sentinel://poller:p%40ss@a:26380,[::1]/mymaster/3?sentinel_password=sp"
    assert connection.connect(RedisSettings(url=url)) == "master"  # type: ignore[comparison-overlap]
    assert made["hosts"] == [("a", 26380), ("::1", 26379)]
    assert made["service"] == "mymaster" and made["db"] == 3
    assert (made["username"], made["password"]) == ("poller", "p@ss")
    assert made["sentinel_kwargs"]["password"] == "sp" and made["ssl"] is False
