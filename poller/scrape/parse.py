"""Prometheus text exposition (0.0.4) -> the wanted samples only; pure, fast and lax.

Also reads OpenMetrics text: ``# EOF`` is a comment, ``_created`` lines are samples, and
an exemplar after `` # `` is skipped. ``parse`` never walks the page line by line: one
regex per set of names (a ``Selector``, cached) jumps from one wanted line start to the
next. On the 61 KB vLLM page with 11 names that is ~70 us against ~10 ms for
prometheus_client's full parse (``tests/bench/bench_parse.py``).

Rules shared by ``parse`` and ``parse_all``, so that ``parse`` equals a filtered
``parse_all`` on every page:
- a sample line starts in column 0 (every exporter writes it so); ``parse`` never sees an
  indented line and ``parse_all`` rejects one rather than guess;
- a line is split at ``\\n`` only; a trailing ``\\r`` (CRLF) or other whitespace is dropped;
- names are matched as written (counters keep ``_total``); series are never aggregated.

Malformed wanted lines raise ``ParseError`` with the 1-based line number and an excerpt;
unwanted lines are never looked at. Every pattern below is possessive or anchored, so the
work is linear in the input.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from functools import lru_cache
from typing import NamedTuple, NoReturn

from poller.errors import ParseError, ScrapeError

__all__ = [
    "Sample",
    "Selector",
    "decode_body",
    "looks_like_exposition",
    "parse",
    "parse_all",
]

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*+")
# One `name="value"` pair and its optional comma. A value is any run of non-quote,
# non-backslash text and `\x` escape pairs, so an escaped quote never ends it.
_LABEL = re.compile(
    r'[ \t]*+([a-zA-Z_][a-zA-Z0-9_]*+)[ \t]*+=[ \t]*+"([^"\\]*+(?:\\.[^"\\]*+)*+)"[ \t]*+(,?)',
    re.DOTALL,
)
_CLOSE = re.compile(r"[ \t]*+\}")
_OPEN = re.compile(r"[ \t]*+\{")
# value [timestamp] [# exemplar], then only whitespace (the \r of CRLF) to the line end.
_TAIL = re.compile(r"[ \t]*+([^\s#]\S*+)(?:[ \t]++([^\s#]\S*+))?+(?:[ \t]++#.*+)?+\s*+\Z")
_BLANK_OR_COMMENT = re.compile(r"\s*+(?:#|\Z)")
# The start of a line holding something other than blanks or a comment.
_CONTENT_LINE = re.compile(r"^[ \t\r\f\v]*+[^#\s]", re.MULTILINE)
_ESCAPE = re.compile(r'\\[\\"n]')
# Exactly the escapes prometheus_client undoes; any other `\x` is kept as written.
_UNESCAPED = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_BOM = "\ufeff"


class Sample(NamedTuple):
    """One sample line: its name as written, unescaped labels and value."""

    name: str
    labels: dict[str, str]
    value: float


class Selector:
    """A precompiled matcher for a fixed set of metric names; build one per engine."""

    __slots__ = ("_first", "_next", "names")

    def __init__(self, names: Iterable[str]) -> None:
        if isinstance(names, str):
            raise TypeError("Selector takes a collection of names, not one string")
        self.names = frozenset(names)
        for name in self.names:
            if not _NAME.fullmatch(name):
                raise ValueError(f"not a metric name: {name!r}")
        alt = "|".join(re.escape(name) for name in sorted(self.names))
        # re factors the names' common prefix (e.g. "\nvllm:") into a fast literal scan.
        # The name must end at `{`, space or tab, so `foo` never matches `foo_bucket`.
        self._first = re.compile(f"({alt})[{{ \\t]")
        self._next = re.compile(f"\\n({alt})[{{ \\t]")

    def __repr__(self) -> str:
        return f"Selector({sorted(self.names)!r})"


@lru_cache(maxsize=128)
def _selector(names: frozenset[str]) -> Selector:
    return Selector(names)


def decode_body(body: bytes) -> str:
    """Decode a /metrics body as UTF-8 and drop a leading BOM; do not parse it."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        start = body.rfind(b"\n", 0, exc.start) + 1
        end = body.find(b"\n", exc.start)
        line = body[start : end if end >= 0 else len(body)]
        raise ParseError(
            f"invalid UTF-8 at byte offset {exc.start}",
            line=body.count(b"\n", 0, exc.start) + 1,
            excerpt=line[:80].decode("utf-8", "replace"),
        ) from None
    return text[1:] if text.startswith(_BOM) else text


def parse(
    text: str, wanted: Selector | Collection[str], max_samples: int | None = None
) -> list[Sample]:
    """Return the samples whose name is in ``wanted``, in page order.

    More than ``max_samples`` of them is a ``too_large`` ScrapeError: it bounds the work
    (and the time the GIL is held) that one hostile or runaway page can cost.
    """
    selector = wanted if isinstance(wanted, Selector) else _selector(_names(wanted))
    if not selector.names:
        return []
    start = 1 if text.startswith(_BOM) else 0
    samples: list[Sample] = []
    first = selector._first.match(text, start)
    if first is not None:
        samples.append(_sample(text, first[1], start))
    limit = max_samples if max_samples is not None else -1
    for match in selector._next.finditer(text, start):
        samples.append(_sample(text, match[1], match.start() + 1))
        if len(samples) > limit >= 0:
            raise ScrapeError(
                f"more than {limit} samples of the mapped metrics on one page (scrape.max_samples)",
                reason="too_large",
            )
    return samples


def parse_all(text: str) -> list[Sample]:
    """Return every sample on the page (slower: it visits every line)."""
    samples: list[Sample] = []
    pos = 1 if text.startswith(_BOM) else 0
    size = len(text)
    while pos <= size:
        end = _line_end(text, pos)
        match = _NAME.match(text, pos, end)
        if match is not None and match.end() < end and text[match.end()] in "{ \t":
            samples.append(_sample(text, match[0], pos))
        elif not _BLANK_OR_COMMENT.match(text, pos, end):
            _fail(_bad_line_reason(text, pos, end), text, pos)
        pos = end + 1
    return samples


def looks_like_exposition(text: str, lines: int = 3) -> bool:
    """Whether the first ``lines`` sample lines parse; tells HTML/JSON from a page.

    A page that is empty or holds only comments counts as exposition text.
    """
    pos = 1 if text.startswith(_BOM) else 0
    while lines > 0:
        # Jump over blank and comment lines in C: a page of megabytes of newlines must
        # not cost a Python iteration per line.
        found = _CONTENT_LINE.search(text, pos)
        if found is None:
            return True
        pos = found.start()
        end = _line_end(text, pos)
        match = _NAME.match(text, pos, end)
        if match is None or match.end() == end or text[match.end()] not in "{ \t":
            return False
        try:
            _sample(text, match[0], pos)
        except ParseError:
            return False
        lines -= 1
        pos = end + 1
    return True


def _names(wanted: Collection[str]) -> frozenset[str]:
    if isinstance(wanted, str):
        raise TypeError("wanted must be a collection of names, not one string")
    return frozenset(wanted)


def _line_end(text: str, pos: int) -> int:
    end = text.find("\n", pos)
    return len(text) if end < 0 else end


def _sample(text: str, name: str, start: int) -> Sample:
    """Parse the line at ``start``, known to begin with ``name`` then `{`, space or tab."""
    end = _line_end(text, start)
    pos = start + len(name)
    labels: dict[str, str] = {}
    if text[pos] == "{":
        pos = _known_labels(text, pos, end, labels, start)
    elif (brace := _OPEN.match(text, pos, end)) is not None:
        pos = _labels(text, brace.end(), end, labels, start)
    tail = _TAIL.match(text, pos, end)
    if tail is None:
        reason = "missing value" if not text[pos:end].strip() else "malformed value"
        _fail(reason, text, start)
    try:
        value = _number(tail[1])
        if tail[2] is not None:
            _number(tail[2])
    except ValueError:
        _fail("value or timestamp is not a number", text, start)
    return Sample(name, labels, value)


#: Label sets already parsed, by their exact text (``{`` to ``}``). Most lines repeat their
#: label set from one scrape to the next (and across the endpoints of one engine version):
#: an info metric such as vLLM's ``cache_config_info`` carries twenty labels, and reading
#: them again on every scrape was a fifth of the page's cost. Bounded: cleared when full.
_LABEL_SETS: dict[str, dict[str, str]] = {}
_LABEL_SETS_MAX = 4096


def _known_labels(text: str, pos: int, end: int, labels: dict[str, str], start: int) -> int:
    """``_labels`` for a label set at ``pos`` (its `{`), reusing the parse of an identical
    label set. Only lines without `#` take the cache: then the set's `}` is the line's last
    one (values and timestamps hold none; an exemplar or a `#` in a value would), and an
    entry is stored only where the parser itself ends the set there."""
    close = text.rfind("}", pos, end)
    if close < 0 or text.find("#", pos, end) >= 0:
        return _labels(text, pos + 1, end, labels, start)
    key = text[pos : close + 1]
    known = _LABEL_SETS.get(key)
    if known is not None:
        labels.update(known)
        return close + 1
    after = _labels(text, pos + 1, end, labels, start)
    if after == close + 1:
        if len(_LABEL_SETS) >= _LABEL_SETS_MAX:
            _LABEL_SETS.clear()
        _LABEL_SETS[key] = dict(labels)
    return after


def _labels(text: str, pos: int, end: int, labels: dict[str, str], start: int) -> int:
    """Fill ``labels`` from the label set after `{`; return the index after `}`."""
    while (match := _LABEL.match(text, pos, end)) is not None:
        key, value, comma = match.groups()
        if key in labels:
            _fail(f"duplicate label {key!r}", text, start)
        labels[key] = _ESCAPE.sub(_unescape, value) if "\\" in value else value
        pos = match.end()
        if not comma:
            break
    if text.startswith("}", pos, end):
        return pos + 1
    close = _CLOSE.match(text, pos, end)
    if close is None:
        _fail("malformed label set", text, start)
    return close.end()


def _unescape(match: re.Match[str]) -> str:
    return _UNESCAPED[match[0]]


def _number(token: str) -> float:
    # float() also takes "1_000", which no exposition format allows.
    if "_" in token:
        raise ValueError(token)
    return float(token)


def _bad_line_reason(text: str, pos: int, end: int) -> str:
    if text[pos] in " \t":
        return "indented sample line (samples must start in column 0)"
    match = _NAME.match(text, pos, end)
    if match is None:
        return "not a sample, comment or blank line"
    if not text[match.end() : end].strip():
        return "missing value"
    return "metric name must be followed by '{', space or tab"


def _fail(reason: str, text: str, start: int) -> NoReturn:
    """Raise ParseError for the line at ``start``; counting lines only on this path."""
    end = _line_end(text, start)
    raise ParseError(
        reason,
        line=text.count("\n", 0, start) + 1,
        excerpt=text[start : min(end, start + 80)].rstrip("\r"),
    )
