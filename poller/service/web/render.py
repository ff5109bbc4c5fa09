"""The operator's page as HTML: pure functions from ``View.to_dict()`` to markup.

Everything shown comes from the same dict ``poller status --json`` prints, so the page
and the CLI agree on states and numbers (the state rules live in
``poller/reader/view/records.py``; ``format.shown_state`` only tells ``sleeping`` from fresh).
Every value that comes from the registry or an engine page (ids, engines, owners, model
and adapter names, failure details, discovery sources) is untrusted and goes through
``_e``; nothing else writes text into the markup.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, replace
from html import escape
from typing import Any
from urllib.parse import parse_qsl, urlencode

from poller.service.web.format import (
    fmt_age,
    labels_text,
    lora_text,
    models_text,
    pct,
    registry_engine,
    shown_state,
    stat,
    with_entries,
)
from poller.store.members import duplicate_line

__all__ = [
    "COLUMNS",
    "STATES",
    "Fleet",
    "Query",
    "fmt_age",
    "parse_query",
    "render_page",
    "with_entries",
]

#: The reader's states, plus ``sleeping`` (fresh numbers that say the engine sleeps).
STATES = ("fresh", "stale", "failing", "unknown", "sleeping")
COLUMNS = ("id", "engine", "state", "owner", "running", "waiting", "kv", "hit", "lora", "age")
_COLUMN_TITLES = {
    "id": "endpoint, URL, labels",
    "kv": "KV %",
    "hit": "prefix hit %",
    "lora": "LoRA adapters",
    "age": "age",
}
_NUMERIC = frozenset(("running", "waiting", "kv", "hit", "lora", "age"))
_STATE_ORDER = {"failing": 0, "stale": 1, "unknown": 2, "sleeping": 3, "fresh": 4}
_ENGINE_RE = re.compile(r"[A-Za-z0-9._-]{1,40}")


def _e(value: object) -> str:
    """Escape for text and double-quoted attributes alike."""
    return escape(str(value), quote=True)


@dataclass(frozen=True, slots=True)
class Query:
    """Filters and sort from the query string: the page's shareable state."""

    state: str = ""
    engine: str = ""
    sort: str = "id"
    order: str = "asc"

    def link(self, **changes: str) -> str:
        """``?...`` for this query with ``changes``, defaults left out."""
        q = replace(self, **changes)
        pairs = [(k, getattr(q, k)) for k in ("state", "engine", "sort", "order")]
        defaults = Query()
        kept = [(k, v) for k, v in pairs if v and v != getattr(defaults, k)]
        return "?" + urlencode(kept) if kept else "?"


def parse_query(query: str) -> Query:
    """The query string -> Query; raises ValueError with a one-line message."""
    values: dict[str, str] = {}
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=False, max_num_fields=8)
    except ValueError:
        raise ValueError("too many query parameters") from None
    for name, value in pairs:
        if name not in ("state", "engine", "sort", "order"):
            raise ValueError(f"unknown query parameter {name!r}: use state, engine, sort, order")
        values[name] = value
    q = Query(**values)
    if q.state and q.state not in STATES:
        raise ValueError(f"unknown state {q.state!r}: one of {', '.join(STATES)}")
    if q.engine and not _ENGINE_RE.fullmatch(q.engine):
        raise ValueError(f"invalid engine {q.engine[:40]!r}: letters, digits, '.', '_', '-'")
    if q.sort not in COLUMNS:
        raise ValueError(f"unknown sort column {q.sort!r}: one of {', '.join(COLUMNS)}")
    if q.order not in ("asc", "desc"):
        raise ValueError(f"unknown order {q.order!r}: asc or desc")
    return q


@dataclass(frozen=True, slots=True)
class Fleet:
    """What the page knows beside the view: this poller, the Redis it sees."""

    self_id: str
    version: str
    #: This poller's member TTL: heartbeat age = TTL - time left, if the fleet shares it.
    member_ttl_ms: int
    reachable: bool = True
    error: str = ""
    schema: str = ""
    #: Live members' heartbeat expiry (Redis clock, ms).
    expiries: Mapping[str, float] | None = None
    #: Live members' own word (``P:members:info``): version and member TTL.
    infos: Mapping[str, Mapping[str, Any]] | None = None
    #: Live members a drain is requested for (``P:members:drain``).
    drains: Set[str] = frozenset()
    #: Live members seen from two processes: id -> the other's duplicate record
    #: (``P:members:duplicates``, in force).
    duplicates: Mapping[str, Mapping[str, Any]] | None = None


_SORT_KEYS: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "id": lambda e: e["id"],
    "engine": lambda e: e.get("engine"),
    "state": lambda e: _STATE_ORDER.get(shown_state(e), 9),
    "owner": lambda e: e.get("owner"),
    "running": lambda e: stat(e, "running"),
    "waiting": lambda e: stat(e, "waiting"),
    "kv": lambda e: stat(e, "kv_cache_usage"),
    "hit": lambda e: stat(e, "prefix_cache_hit_rate"),
    "lora": lambda e: len(stat(e, "lora_running") or ()) if e.get("stats") else None,
    "age": lambda e: e.get("age_ms"),
}


def select(endpoints: Sequence[Mapping[str, Any]], q: Query) -> list[Mapping[str, Any]]:
    """Filter and sort; rows without the sorted value go last either way, ties by id."""
    rows = [
        e
        for e in endpoints
        if (not q.state or shown_state(e) == q.state)
        and (not q.engine or e.get("engine") == q.engine)
    ]
    key = _SORT_KEYS[q.sort]
    known = [e for e in rows if key(e) is not None]
    known.sort(key=lambda e: e["id"])
    known.sort(key=key, reverse=q.order == "desc")
    unknown = sorted((e for e in rows if key(e) is None), key=lambda e: e["id"])
    return known + unknown


# --- markup -------------------------------------------------------------------------------


def _number(value: Any) -> float | None:
    """A positive number from a member's info JSON (untrusted), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def _fleet(view: Mapping[str, Any] | None, fleet: Fleet) -> str:
    if view is None:
        return ""
    now = int(view["now_ms"])
    held: dict[str, int] = {}
    for e in view["endpoints"]:
        if e.get("owner"):
            held[e["owner"]] = held.get(e["owner"], 0) + 1
    rows = []
    lines: list[str] = []  # one per id seen from two processes, under the table
    for poller in view["pollers"]:
        expiry = (fleet.expiries or {}).get(poller)
        info = (fleet.infos or {}).get(poller, {})
        ttl = _number(info.get("member_ttl_ms")) or fleet.member_ttl_ms
        left = None if expiry is None else max(0.0, expiry - now)
        beat = None if left is None else max(0.0, ttl - left)
        me = poller == fleet.self_id
        version = fleet.version if me else str(info.get("version") or "-")
        state = "serving"
        if poller in fleet.drains:  # acknowledged in its own info, or not (yet)
            state = "draining" if info.get("draining") is True else "drain requested"
        classes = "poller" + (" self" if me else "") + (" draining" if state != "serving" else "")
        duplicate = (fleet.duplicates or {}).get(poller)
        flag = ""
        if duplicate is not None:
            classes += " duplicate"
            flag = ' <span class="bad">DUPLICATE</span>'
            lines.append(duplicate_line(poller, info, duplicate, now))
        rows.append(
            f'<tr class="{classes}" data-id="{_e(poller)}">'
            f'<td class="id">{_e(poller)}{" (this page)" if me else ""}{flag}</td>'
            f'<td class="state">{state}</td>'
            f'<td class="num leases">{held.get(poller, 0)}</td>'
            f'<td class="num beat">{_e(fmt_age(beat))}</td>'
            f'<td class="num expires">{_e(fmt_age(left))}</td>'
            f'<td class="version">{_e(version)}</td></tr>'
        )
    body = "".join(rows) or '<tr><td colspan="6" class="empty">no live poller</td></tr>'
    return (
        '<section id="fleet"><h2>Fleet</h2><table class="fleet"><thead><tr>'
        "<th>poller</th><th>state</th><th>leases held</th>"
        "<th>last heartbeat</th><th>heartbeat expires in</th><th>version</th>"
        f"</tr></thead><tbody>{body}</tbody></table>"
        + "".join(f'<p class="duplicate bad">{_e(line)}</p>' for line in lines)
        + "</section>"
    )


def _sources(view: Mapping[str, Any] | None) -> str:
    """Discovery sources, when the view carries them; any shape of plain records."""
    sources = None if view is None else view.get("sources")
    if not sources:
        return ""
    items: list[Mapping[Any, Any]]
    if isinstance(sources, Mapping):
        items = [
            {"source": k, **(v if isinstance(v, Mapping) else {"value": v})}
            for k, v in sources.items()
        ]
    else:
        items = [s if isinstance(s, Mapping) else {"source": s} for s in sources]
    columns: list[str] = []
    for item in items:
        columns += [str(k) for k in item if str(k) not in columns]
    head = "".join(f"<th>{_e(c)}</th>" for c in columns)
    rows = "".join(
        '<tr class="source">'
        + "".join(f"<td>{_e(_plain(item.get(c)))}</td>" for c in columns)
        + "</tr>"
        for item in items
    )
    return (
        '<section id="sources"><h2>Discovery sources</h2><table class="sources">'
        f"<thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></section>"
    )


def _plain(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, list | tuple):
        return ", ".join(_plain(v) for v in value)
    if isinstance(value, Mapping):
        return ", ".join(f"{k}: {_plain(v)}" for k, v in value.items())
    return str(value)


def _failure(e: Mapping[str, Any], now_ms: int) -> str:
    failure = e.get("failure")
    if not failure:
        return '<td class="failure">-</td>'
    since = failure.get("since_ms") or 0
    detail = failure.get("detail") or ""
    if failure.get("missing"):
        detail = "missing " + ", ".join(str(m) for m in failure["missing"])
    return (
        f'<td class="failure"><span class="reason">{_e(failure.get("reason", ""))}</span>'
        f' <span class="since" data-since-ms="{_e(since)}">'
        f"for {_e(fmt_age(max(0, now_ms - since)))}</span>"
        f'<div class="detail">{_e(detail)}</div></td>'
    )


def _row(e: Mapping[str, Any], now_ms: int) -> str:
    state = shown_state(e)
    labels = e.get("labels")
    classes = f"endpoint state-{state}"
    cells = [
        f'<td class="id">{_e(e["id"])}<div class="url">{_e(e.get("url") or "-")}</div>'
        + (f'<div class="labels">{_e(labels_text(labels))}</div>' if labels else "")
        + "</td>",
        f'<td class="engine">{_e(registry_engine(e))}</td>',
        f'<td class="state"><span class="badge">{_e(state)}</span></td>',
        f'<td class="owner">{_e(e.get("owner") or "-")}</td>',
        f'<td class="num running">{_e(_plain(stat(e, "running")))}</td>',
        f'<td class="num waiting">{_e(_plain(stat(e, "waiting")))}</td>',
        f'<td class="num kv">{pct(stat(e, "kv_cache_usage"))}</td>',
        f'<td class="num hit">{pct(stat(e, "prefix_cache_hit_rate"))}</td>',
        f'<td class="lora">{_e(lora_text(e))}</td>',
        f'<td class="models" title="{_e(", ".join(stat(e, "models") or ()))}">'
        f"{_e(models_text(stat(e, 'models')))}</td>",
        f'<td class="num age">{_e(fmt_age(e.get("age_ms")))}</td>',
        _failure(e, now_ms),
        f'<td class="load" data-id="{_e(e["id"])}"></td>',
    ]
    return (
        f'<tr class="{classes}" data-id="{_e(e["id"])}" data-state="{state}">{"".join(cells)}</tr>'
    )


def _filters(view: Mapping[str, Any], q: Query) -> str:
    engines = sorted(
        {str(e["engine"]) for e in view["endpoints"] if e.get("engine")} | ({q.engine} - {""})
    )

    def options(values: Sequence[str], chosen: str, every: str) -> str:
        out = [f'<option value=""{" selected" if not chosen else ""}>{every}</option>']
        out += [
            f'<option value="{_e(v)}"{" selected" if v == chosen else ""}>{_e(v)}</option>'
            for v in values
        ]
        return "".join(out)

    hidden = "".join(
        f'<input type="hidden" name="{k}" value="{_e(v)}">'
        for k, v in (("sort", q.sort), ("order", q.order))
        if v != getattr(Query(), k)
    )
    return (
        '<form id="filters" method="get" action="/">'
        f'<label>state <select name="state">{options(STATES, q.state, "any")}</select></label> '
        f'<label>engine <select name="engine">{options(engines, q.engine, "any")}</select></label> '
        f'{hidden}<button type="submit">filter</button> <a href="/">reset</a></form>'
    )


def _head(q: Query) -> str:
    cells = []
    for column in COLUMNS:
        title = _COLUMN_TITLES.get(column, column)
        # Loads and ages read best largest first; names alphabetically.
        order = "desc" if column in _NUMERIC else "asc"
        mark = ""
        if q.sort == column:
            order = "desc" if q.order == "asc" else "asc"
            mark = " ▲" if q.order == "asc" else " ▼"
        link = _e(q.link(sort=column, order=order))
        cells.append(f'<th class="{column}"><a class="sort" href="{link}">{title}{mark}</a></th>')
        if column == "lora":
            # the names a pick for a model matches; not a sort key
            cells.append('<th class="models">models</th>')
    cells.append('<th class="failure">failure (reason, since, detail)</th>')
    cells.append(
        '<th class="load" title="running (solid) and waiting (dashed), last 5 min">load</th>'
    )
    return f"<thead><tr>{''.join(cells)}</tr></thead>"


def render_main(view: Mapping[str, Any] | None, fleet: Fleet, q: Query) -> str:
    """The ``<main>`` element: what the script swaps in on every refresh."""
    if view is None:
        redis = f'<span class="bad">unreachable</span>: {_e(fleet.error)}'
        return f'<main id="page"><p class="summary">Redis {redis}</p></main>'
    counts = "  ".join(f"{_e(k)} {_e(v)}" for k, v in view["counts"].items())
    summary = (
        f'<p class="summary">Redis <span class="good">reachable</span> · schema '
        f"{_e(fleet.schema or '-')} · registry rev {_e(view['rev'])} · "
        f"{len(view['endpoints'])} endpoints: {counts}</p>"
    )
    rows = select(view["endpoints"], q)
    body = "".join(_row(e, int(view["now_ms"])) for e in rows)
    if not body:
        what = "no endpoint matches" if view["endpoints"] else "the registry is empty"
        body = f'<tr><td colspan="13" class="empty">{what}</td></tr>'
    return (
        f'<main id="page" data-now-ms="{_e(view["now_ms"])}">{summary}{_fleet(view, fleet)}'
        f"{_sources(view)}"
        f'<section id="endpoints"><h2>Endpoints</h2>{_filters(view, q)}'
        f'<table id="endpoint-table">{_head(q)}<tbody>{body}</tbody></table></section></main>'
    )


def render_page(view: Mapping[str, Any] | None, fleet: Fleet, q: Query) -> str:
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>llmgw-poller · {_e(fleet.self_id)}</title>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<link rel="stylesheet" href="/static/page.css">'
        # Scripts off: the same page, reloaded whole every 5 s.
        '<noscript><meta http-equiv="refresh" content="5"></noscript>'
        '<script src="/static/page.js" defer></script></head><body>'
        f'<header><h1>llmgw-poller</h1><p class="served">served by {_e(fleet.self_id)} '
        f'(version {_e(fleet.version)}) · <span id="live">scripts off: reloading every 5 s'
        "</span></p></header>"
        f"{render_main(view, fleet, q)}</body></html>"
    )
