"""Log lines: fields as JSON keys (or key=value on text lines), RFC 3339 time, poller id."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Callable, Iterator

import pytest

from poller.util.logs import quote, rfc3339, setup_logging, tag_poller

RFC3339_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
Capture = Callable[[str], io.StringIO]


@pytest.fixture
def capture() -> Iterator[Capture]:
    """Set logging up as ``poller run`` does, writing into a buffer; restore afterwards."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level

    def start(fmt: str) -> io.StringIO:
        setup_logging("DEBUG", fmt)
        buffer = io.StringIO()
        handler = root.handlers[0]
        assert isinstance(handler, logging.StreamHandler)
        handler.setStream(buffer)
        return buffer

    yield start
    root.handlers[:], level = saved
    root.setLevel(level)


def test_json_lines_carry_each_field_as_a_key_the_time_and_the_poller(capture: Capture) -> None:
    out = capture("json")
    tag_poller("p-7")
    log = logging.getLogger("poller.service.reporting")
    log.info("scrape failed", extra={"endpoint": "dead", "reason": "unreachable", "count": 3})
    logging.getLogger("elsewhere.lib").warning("plain %s", "message")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("route failed", extra={"path": "/x"})
    lines = [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]
    first, second, third = lines
    assert list(first) == [
        "time",
        "level",
        "logger",
        "poller",
        "msg",
        "endpoint",
        "reason",
        "count",
    ]
    assert first["msg"] == "scrape failed" and first["endpoint"] == "dead"
    assert first["reason"] == "unreachable" and first["count"] == 3
    assert first["level"] == "INFO" and first["logger"] == "poller.service.reporting"
    assert RFC3339_MS.match(first["time"]), first["time"]
    # the poller id is on every line, whichever logger wrote it
    assert [line["poller"] for line in lines] == ["p-7", "p-7", "p-7"]
    assert second["msg"] == "plain message"
    assert third["path"] == "/x" and "ValueError: boom" in third["exc"]


def test_a_field_named_like_a_line_key_never_replaces_it(capture: Capture) -> None:
    out = capture("json")
    tag_poller("p0")
    logging.getLogger("poller.x").info("m", extra={"time": "forged", "level": "ERROR"})
    line = json.loads(out.getvalue())
    assert line["level"] == "INFO" and RFC3339_MS.match(line["time"])


def test_text_lines_put_fields_after_the_message_quoted_when_needed(capture: Capture) -> None:
    out = capture("text")
    tag_poller("p0")
    tag_poller("p1")  # set again at a restart: replaces, not stacks
    logging.getLogger("poller.service.reporting").warning(
        "scrape failed",
        extra={"endpoint": "dead", "reason": "unreachable", "detail": "connect refused"},
    )
    logging.getLogger("poller.service.follow").error(
        "registry id unusable", extra={"endpoint": "forged\n2030-01-01 level=ERROR x"}
    )
    first, second = out.getvalue().splitlines()
    time, rest = first.split(" ", 1)
    assert RFC3339_MS.match(time)
    assert rest == (
        "level=WARNING logger=poller.service.reporting poller=p1 scrape failed "
        'endpoint=dead reason=unreachable detail="connect refused"'
    )
    assert second.endswith('endpoint="forged\\n2030-01-01 level=ERROR x"')


def test_quote_and_rfc3339() -> None:
    assert quote("a-b.c:1") == "a-b.c:1"
    assert quote("") == '""' and quote("a=b") == '"a=b"' and quote('say "hi"') == '"say \\"hi\\""'
    assert quote("\x1b[31mred") == '"\\u001b[31mred"'
    assert quote(3) == "3" and quote(None) == "null" and quote(["a", 1]) == '"[\\"a\\", 1]"'
    assert rfc3339(1_796_126_400.123_9) == "2026-12-01T12:00:00.123Z"
    assert rfc3339(0) == "1970-01-01T00:00:00.000Z"
