"""Failures are logged once per failure (what failed), not once per scrape or per reason."""

from __future__ import annotations

import logging

import pytest

from poller.errors import ContractError, FetchError
from poller.service.reporting import FailureLog
from poller.util.logs import text_of


def messages(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, text_of(r)) for r in caplog.records]


def test_another_set_of_missing_metrics_is_reported_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failures = FailureLog()
    with caplog.at_level(logging.INFO, logger="poller.service.reporting"):
        for _ in range(3):
            failures.failed("e1", ContractError(["a"], engine="vllm"))
        failures.failed("e1", ContractError(["a", "b"], engine="vllm"))
        failures.failed("e1", ContractError(["a", "b"], engine="vllm"))
    logged = messages(caplog)
    assert [level for level, _ in logged] == ["WARNING", "WARNING"]
    assert logged[0][1].endswith("missing=a") and logged[1][1].endswith("missing=a,b")
    assert all("routing to it is uninformed" in m for _, m in logged)


def test_another_status_code_is_reported_again_but_not_the_same_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failures = FailureLog()
    with caplog.at_level(logging.INFO, logger="poller.service.reporting"):
        for status in (500, 500, 503, 503, 500):
            failures.failed("e1", FetchError("http_status", f"HTTP {status}", status=status))
    details = [m.rsplit("detail=", 1)[1] for _, m in messages(caplog)]
    assert details == ['"HTTP 500"', '"HTTP 503"', '"HTTP 500"']


def test_transient_failures_with_varying_details_are_one_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failures = FailureLog()
    with caplog.at_level(logging.INFO, logger="poller.service.reporting"):
        for detail in ("ConnectError: refused", "ConnectError: reset by peer", "timed out"):
            failures.failed("e1", FetchError("unreachable", detail))
        failures.recovered("e1")
        failures.recovered("e1")
        failures.failed("e1", FetchError("unreachable", "again"))
    assert [m.split(" detail=")[0] for _, m in messages(caplog)] == [
        "scrape failed endpoint=e1 reason=unreachable",
        "endpoint recovered endpoint=e1 after=unreachable",
        "scrape failed endpoint=e1 reason=unreachable",
    ]
