"""The server markers hold together (tests/support/markers.py): pyproject.toml registers
each one, `make test-fast` leaves out every one, tests are marked from their fixtures,
and each helper that starts a server refuses to in a test without its marker."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import markers
from tests.support.cdp import chromium_binary
from tests.support.deploy import promtool_binary
from tests.support.dnsproc import dnsmasq_binary
from tests.support.envoyproc import envoy_binary
from tests.support.litellm_fleet import litellm_proxy
from tests.support.paths import REPO
from tests.support.procs import PollerProc
from tests.support.redisproc import RedisCluster, RedisProcess, redis_server_binary


def test_every_marker_is_registered_and_strict() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    ini = pyproject["tool"]["pytest"]["ini_options"]
    registered = {line.partition(":")[0] for line in ini["markers"]}
    assert registered == {*markers.SERVERS, "slow"}
    assert "--strict-markers" in ini["addopts"].split()


def test_make_test_fast_leaves_out_every_server_and_slow() -> None:
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    assert f"FAST_MARKERS := {markers.FAST}\n" in makefile
    assert re.search(
        r'^test-fast: install\n\t\$\(BIN\)/pytest -q -n auto -m "\$\(FAST_MARKERS\)"$',
        makefile,
        re.M,
    )
    # `make test` runs everything (no marker left out), after the lint and the installs,
    # which it then requires, on TEST_WORKERS pytest-xdist workers.
    assert re.search(
        r"^test: install redis-server dnsmasq promtool chromium lint\n"
        r"\tLLMGW_TOOLS_REQUIRED=1 \$\(BIN\)/pytest -q -n \$\(TEST_WORKERS\)$",
        makefile,
        re.M,
    )


@pytest.mark.parametrize(
    ("fixtures", "store_param", "expected"),
    [
        (["tmp_path"], None, set()),
        (["real_client", "redis_server"], None, {"redis_server"}),
        (["own_redis"], None, {"redis_server"}),
        (["store"], "fake", set()),
        (["store"], "real-batched", {"redis_server"}),
        (["store"], "cluster", {"redis_cluster", "redis_server"}),
        (["dns_server"], None, {"dnsmasq"}),
    ],
)
def test_fixtures_say_which_markers_a_test_needs(
    fixtures: list[str], store_param: str | None, expected: set[str]
) -> None:
    assert markers.markers_for(fixtures, store_param) == expected


def test_every_collected_test_carries_what_its_fixtures_need(
    request: pytest.FixtureRequest,
) -> None:
    """Over the tests of this run: conftest marked each from its fixtures."""
    unmarked = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        param = callspec.params.get("store") if callspec is not None else None
        for name in markers.markers_for(getattr(item, "fixturenames", []), param):
            if item.get_closest_marker(name) is None:
                unmarked.append(f"{item.nodeid}: {name}")
    assert request.session.items and not unmarked, unmarked


def _starters(tmp_path: Path) -> dict[str, list[Callable[[], object]]]:
    sentinel = RedisProcess(extra_args=["--sentinel"])
    sentinel.dir.rmdir()  # made by the constructor; nothing is started
    return {
        "redis_server": [
            redis_server_binary,
            lambda: PollerProc("p0", "redis://127.0.0.1:1/0", "ns", tmp_path).start(),
        ],
        "redis_cluster": [lambda: RedisCluster.start(RedisCluster.__new__(RedisCluster))],
        "sentinel": [sentinel.start],
        "dnsmasq": [dnsmasq_binary],
        "chromium": [chromium_binary],
        "promtool": [promtool_binary],
        "litellm_proxy": [lambda: litellm_proxy(tmp_path / "c", 1, tmp_path / "log", {})],
        "envoy": [envoy_binary],
    }


def test_each_starter_refuses_without_its_marker(tmp_path: Path) -> None:
    starters = _starters(tmp_path)
    assert set(starters) == set(markers.SERVERS)
    for marker, calls in starters.items():
        for call in calls:
            with pytest.raises(pytest.fail.Exception, match=rf"not marked `{marker}`: add "):
                call()
    assert not list(tmp_path.iterdir()), "a refused starter wrote something"


def test_the_marker_lets_a_test_through(request: pytest.FixtureRequest) -> None:
    with pytest.raises(pytest.fail.Exception):
        markers.require("promtool", "promtool")
    request.node.add_marker("promtool")
    markers.require("promtool", "promtool")  # marked now: nothing to refuse
