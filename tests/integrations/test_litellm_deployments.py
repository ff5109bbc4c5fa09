"""Deployment -> endpoint: the model_info name first, else api_base against registry URLs
under normalize_url's rule; and import isolation of the integration."""

from __future__ import annotations

import subprocess
import sys

import pytest

from poller.integrations.litellm.deployments import UrlIndex, normalize_url


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("http://h:8000/v1", "http://h:8000"),
        ("http://h:8000/v1/", "http://h:8000/"),
        ("HTTP://H.Example:8000/v1", "http://h.example:8000"),
        ("http://h/v1", "http://h:80"),
        ("https://h/v1", "https://h:443/"),
        ("http://h:8000/e/a/v1", "http://h:8000/e/a"),
        ("http://h:8000/v1?x=1", "http://h:8000"),
        ("http://[::1]:8000/v1", "http://[::1]:8000"),
    ],
)
def test_the_same_endpoint_normalizes_the_same(a: str, b: str) -> None:
    assert normalize_url(a) == normalize_url(b) is not None


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("http://h:8000", "https://h:8000"),  # scheme
        ("http://h:8000", "http://h:8001"),  # port
        ("http://localhost:8000", "http://127.0.0.1:8000"),  # no name is resolved
        ("http://h:8000/e/a", "http://h:8000/e/b"),  # path
        ("http://h:8000/v1/x", "http://h:8000/x"),  # /v1 only at the end
        ("http://h:8000/V1", "http://h:8000"),  # paths are case-sensitive
    ],
)
def test_different_endpoints_stay_different(a: str, b: str) -> None:
    assert normalize_url(a) != normalize_url(b)


@pytest.mark.parametrize("url", ["", "ftp://h/", "h:8000", "http://h:99999", "http:///v1"])
def test_what_is_no_http_url_normalizes_to_none(url: str) -> None:
    assert normalize_url(url) is None


def test_model_info_names_the_endpoint_before_api_base_is_matched() -> None:
    index = UrlIndex([("a", "http://h:1"), ("b", "http://h:2/")])
    by_url = {"litellm_params": {"api_base": "http://h:2/v1"}}
    assert index.endpoint_for(by_url) == "b"
    named = {**by_url, "model_info": {"llmgw_endpoint": "a"}}
    assert index.endpoint_for(named) == "a"
    assert index.endpoint_for({"litellm_params": {"api_base": "http://h:3/v1"}}) is None
    assert index.endpoint_for({"litellm_params": {"model": "openai/gpt-4o"}}) is None


def test_a_url_two_entries_share_matches_neither(caplog: pytest.LogCaptureFixture) -> None:
    index = UrlIndex([("a", "http://h:1"), ("b", "http://h:1/v1"), ("c", "http://h:2")])
    assert index.endpoint_for({"litellm_params": {"api_base": "http://h:1"}}) is None
    assert index.endpoint_for({"litellm_params": {"api_base": "http://h:2"}}) == "c"
    assert "share the URL" in caplog.text and "llmgw_endpoint" in caplog.text


def test_importing_poller_or_its_reader_never_imports_litellm() -> None:
    code = (
        "import sys, poller, poller.reader, poller.integrations; "
        "from poller import Router, RoutingOptions, StatsReader; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'litellm'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stdout
