"""Logging set-up for the ``poller`` processes: text (key=value) or JSON lines on stderr.

Library modules only call ``logging.getLogger(__name__)``; this is the one place that
configures handlers and levels. A message is a short constant phrase, and what varies is
passed as fields with ``extra=``::

    log.warning("scrape failed", extra={"endpoint": "dead", "reason": "timeout"})

Text lines put the fields after the message (``scrape failed endpoint=dead
reason=timeout``, values with spaces or quotes JSON-quoted, so no value can forge a line);
JSON lines make each field a key of its own beside ``time`` (RFC 3339, UTC), ``level``,
``logger``, ``poller`` and ``msg``. ``tag_poller`` puts the poller id on every line.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Iterable
from typing import Any

__all__ = [
    "Tally",
    "count",
    "few",
    "fields_of",
    "quote",
    "rfc3339",
    "setup_logging",
    "tag_poller",
    "text_of",
]

# Every attribute a plain record has; anything else on a record came from ``extra=``.
_RECORD_ATTRS = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys()
    | {"message", "asctime", "taskName", "poller"}
)
_BARE = re.compile(r"[^\s\"=\\\x00-\x1f\x7f]+")


def setup_logging(level: str = "INFO", fmt: str = "text", poller_id: str | None = None) -> None:
    """One handler on stderr; with ``poller_id``, every line carries it from the first."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # APScheduler logs every job run at INFO: far too chatty at 1,000 jobs a second.
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if poller_id is not None:
        tag_poller(poller_id)


def tag_poller(poller_id: str) -> None:
    """Put ``poller=<id>`` on every line the root handlers write from now on (a filter
    on the handlers: a filter on a logger would see only that logger's own records)."""
    for handler in logging.getLogger().handlers:
        for old in [f for f in handler.filters if isinstance(f, _PollerTag)]:
            handler.removeFilter(old)
        handler.addFilter(_PollerTag(poller_id))


class _PollerTag(logging.Filter):
    def __init__(self, poller_id: str) -> None:
        super().__init__()
        self.poller_id = poller_id

    def filter(self, record: logging.LogRecord) -> bool:
        record.poller = self.poller_id
        return True


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a call passed with ``extra=``, in the order it gave them."""
    return {k: v for k, v in vars(record).items() if k not in _RECORD_ATTRS}


def quote(value: Any) -> str:
    """A field's value on a text line: as is, or JSON-quoted when it holds spaces, quotes,
    ``=``, backslashes or control characters (a newline cannot start a forged line)."""
    text = value if isinstance(value, str) else _json(value)
    return text if _BARE.fullmatch(text) else json.dumps(text)


def text_of(record: logging.LogRecord) -> str:
    """The message followed by its fields as ``key=value``: what a text line says after
    its level and logger (tests compare it)."""
    parts = [record.getMessage()]
    parts.extend(f"{key}={quote(value)}" for key, value in fields_of(record).items())
    return " ".join(parts)


def count(n: int, noun: str) -> str:
    """``1 endpoint``, ``3 endpoints``: counts that agree in number."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def few(ids: Iterable[str], limit: int = 5) -> str:
    """Up to ``limit`` ids, comma-separated, and how many more: a field for a log line."""
    items = sorted(ids)
    more = f",(+{len(items) - limit} more)" if len(items) > limit else ""
    return ",".join(items[:limit]) + more


class Tally:
    """Endpoints one kind of event happened to, said in one line by ``say()``.

    A Redis that hangs for seconds makes the same thing happen to every endpoint at once
    (each job's run overlaps its next, each lease goes unconfirmed, each fenced write
    fails): a line per endpoint is a thousand lines a second at 1,000 endpoints, hiding
    the one that matters. The worker says every tally once per coordination pass, so the
    lines grow with passes, not with endpoints or seconds. ``message`` is a %-format
    with ``%(endpoints)s`` ("3 endpoints") and may use ``%(events)s`` ("7 runs").
    """

    def __init__(
        self,
        logger: logging.Logger,
        level: int,
        message: str,
        *,
        event: str = "event",
        detail: str | None = None,
    ) -> None:
        self._log = logger
        self._level = level
        self._message = message
        self._event = event
        self._detail = detail  # the field that lists what ``add``'s details were
        self._ids: dict[str, int] = {}
        self._details: set[str] = set()

    def add(self, endpoint_id: str, detail: str = "") -> None:
        self._ids[endpoint_id] = self._ids.get(endpoint_id, 0) + 1
        if detail:
            self._details.add(detail)

    def say(self) -> None:
        """One line for what was added since the last ``say()`` (nothing if nothing)."""
        if not self._ids:
            return
        ids, details = self._ids, self._details
        self._ids, self._details = {}, set()
        numbers = {
            "endpoints": count(len(ids), "endpoint"),
            "events": count(sum(ids.values()), self._event),
        }
        fields = {"endpoints": few(ids)}
        if self._detail is not None:
            fields[self._detail] = few(details) or "(none)"
        self._log.log(self._level, self._message, numbers, extra=fields)


def rfc3339(created_s: float) -> str:
    """``2026-12-01T12:00:00.123Z``: UTC, milliseconds."""
    whole = int(created_s)
    millis = int((created_s - whole) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{millis:03d}Z"


def _json(value: Any) -> str:
    return json.dumps(value, default=str, ensure_ascii=False)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        poller = getattr(record, "poller", None)
        head = f"{rfc3339(record.created)} level={record.levelname} logger={record.name}"
        if poller is not None:
            head += f" poller={quote(poller)}"
        line = f"{head} {text_of(record)}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": rfc3339(record.created),
            "level": record.levelname,
            "logger": record.name,
        }
        poller = getattr(record, "poller", None)
        if poller is not None:
            entry["poller"] = poller
        entry["msg"] = record.getMessage()
        for key, value in fields_of(record).items():
            entry.setdefault(key, value)  # a field never hides the line's own keys
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return _json(entry)
