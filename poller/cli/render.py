"""``poller status``: the shared view as a table (rich) or JSON, read through the reader."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rich.cells import cell_len
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from poller.reader.view import EndpointView, View
from poller.service.web.format import fmt_age as _age
from poller.service.web.format import labels_text, models_text
from poller.util.logs import count

__all__ = ["SORT_KEYS", "clip", "render"]

_STATE_STYLE = {"fresh": "green", "stale": "yellow", "failing": "red", "unknown": "dim"}


def clip(text: str, limit: int = 60) -> str:
    """``text`` in at most ``limit`` characters: cut after a word, with an ellipsis."""
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    if text[limit - 1] != " " and " " in cut:
        cut = cut.rsplit(" ", 1)[0]
    return cut.rstrip(" ,;:.") + "…"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}"


def _engine(e: EndpointView) -> str:
    """The registry's engine, else the one the stats were read with, else ``default``
    (the entry names none: the pollers' scrape.default_engine); as on the page."""
    entry = e.entry
    if entry is None and e.stats is None:
        return "-"
    return (entry.engine if entry is not None else None) or e.engine or "default"


def _num(e: EndpointView, name: str) -> float:
    stats = e.stats
    value = getattr(stats, name, None) if stats is not None else None
    return -1.0 if value is None else float(value)


SORT_KEYS: dict[str, Callable[[EndpointView], Any]] = {
    "id": lambda e: e.id,
    "engine": lambda e: (_engine(e), e.id),
    "state": lambda e: (["failing", "stale", "unknown", "fresh"].index(e.state), e.id),
    "owner": lambda e: (e.owner or "", e.id),
    "running": lambda e: (-_num(e, "running"), e.id),
    "waiting": lambda e: (-_num(e, "waiting"), e.id),
    "kv": lambda e: (-_num(e, "kv_cache_usage"), e.id),
    "hit": lambda e: (-_num(e, "prefix_cache_hit_rate"), e.id),
    "age": lambda e: (-(e.age_ms if e.age_ms is not None else -1), e.id),
}


def shown_state(e: EndpointView) -> str:
    """The state ``--state`` filters on: the reader's, or ``sleeping`` for fresh stats
    that say the engine sleeps (the page's state filter, ``STATES`` of its render)."""
    if e.state == "fresh" and e.stats is not None and e.stats.sleeping:
        return "sleeping"
    return e.state


def selected(
    view: View, states: Sequence[str] = (), engines: Sequence[str] = ()
) -> list[str] | None:
    """The ids ``poller status --state/--engine`` shows: any of the states (see
    ``shown_state``) and any of the engines as the ENGINE column shows them; None (every
    endpoint) when neither is given."""
    if not states and not engines:
        return None
    return [
        e.id
        for e in view.endpoints.values()
        if (not states or shown_state(e) in states) and (not engines or _engine(e) in engines)
    ]


def header(view: View) -> str:
    counts = view.counts()
    pollers = ", ".join(view.pollers) or "none"
    states = "  ".join(f"{state} {n}" for state, n in counts.items())
    return (
        f"{count(len(view.pollers), 'live poller')} ({pollers})   "
        f"{count(len(view.endpoints), 'endpoint')}: {states}"
    )


_COLUMNS = (
    ("ID", "left"),
    ("ENGINE", "left"),
    ("STATE", "left"),
    ("OWNER", "left"),
    ("RUN", "right"),
    ("WAIT", "right"),
    ("KV%", "right"),
    ("HIT%", "right"),
    ("LORA", "left"),
    ("MODELS", "left"),
    ("AGE", "right"),
    ("URL", "left"),
    ("LABELS", "left"),
    ("FAILURE", "left"),
)
#: What a narrow terminal leaves out, first to last; ID, STATE, OWNER, RUN, WAIT and
#: FAILURE always show (``--json`` or a wider terminal has the rest).
_DROP_ORDER = ("LABELS", "URL", "MODELS", "LORA", "HIT%", "AGE", "ENGINE", "KV%")
#: The failure cell's least width: its reason and how long ("http_status for 9.0s").
_FAILURE_MIN = 20
_GAP = 2  # between two columns (rich's padding of one on each side)


def render(
    view: View,
    sort: str = "id",
    sources: list[dict[str, Any]] | None = None,
    extra: Sequence[RenderableType] = (),
    only: Sequence[str] | None = None,
    width: int | None = None,
) -> Group:
    """The header line and the table (then the sources and ``extra``, e.g. the pollers);
    with ``only``, the table has those ids alone and says how many it shows. rich drops
    the colours when output is piped. ``width``: the terminal's columns; a table wider
    leaves out the columns of ``_DROP_ORDER`` in turn and cuts the failure with an
    ellipsis, never wrapping a cell (a cell wrapped at 80 columns read one word a line)."""
    tail = [*([sources_table(sources, view.now_ms)] if sources else []), *extra]
    if not view.endpoints:
        note = Text(
            "the registry is empty: add endpoints with `poller endpoints add` or "
            "`poller endpoints sync FILE` (or run pollers with --endpoints-file)",
            style="yellow",
        )
        return Group(Text(header(view)), note, *tail)
    rows: Iterable[EndpointView] = view.endpoints.values()
    if only is not None:
        wanted = set(only)
        rows = [e for e in rows if e.id in wanted]
    cells = [_row(e, view.now_ms) for e in sorted(rows, key=SORT_KEYS[sort])]
    table = _table(cells, width)
    lines = [Text(header(view))]
    if only is not None:
        shown = len(set(only) & view.endpoints.keys())
        lines.append(Text(f"showing {shown} of {count(len(view.endpoints), 'endpoint')}"))
    names = {str(c.header) for c in table.columns}
    left_out = [name for name, _ in _COLUMNS if name not in names]
    if left_out:
        lines.append(Text(f"not shown at {width} columns: {', '.join(left_out)}", style="dim"))
    return Group(*lines, table, *tail)


def _table(cells: list[list[str | Text]], width: int | None) -> Table:
    """The table of ``cells`` (a row each, a cell per ``_COLUMNS``) in ``width``
    characters (None: every column, as rich fits them)."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    if width is None:
        for name, justify in _COLUMNS:
            table.add_column(name, justify=justify)  # type: ignore[arg-type]
        for row in cells:
            table.add_row(*row)
        return table
    widths = [
        max([len(name), *(_cell_len(row[i]) for row in cells)])
        for i, (name, _) in enumerate(_COLUMNS)
    ]
    shown = list(range(len(_COLUMNS)))
    failure = len(_COLUMNS) - 1

    def others() -> int:  # the width of every shown column but the failure's, with gaps
        return sum(widths[i] for i in shown if i != failure) + _GAP * (len(shown) - 1)

    for name in _DROP_ORDER:
        if others() + min(widths[failure], _FAILURE_MIN) <= width:
            break
        shown.remove(next(i for i, (n, _) in enumerate(_COLUMNS) if n == name))
    for i in shown:
        name, justify = _COLUMNS[i]
        # The failure takes the rest of the line: a long detail is cut, never wrapped.
        rest = max(_FAILURE_MIN, width - others()) if i == failure else None
        table.add_column(
            name,
            justify=justify,  # type: ignore[arg-type]
            no_wrap=True,
            overflow="ellipsis",
            width=None if rest is None else min(widths[failure], rest),
        )
    for row in cells:
        table.add_row(*(row[i] for i in shown))
    return table


def _cell_len(cell: str | Text) -> int:
    return cell.cell_len if isinstance(cell, Text) else cell_len(cell)


def _row(e: EndpointView, now_ms: int) -> list[str | Text]:
    """One endpoint's cells, in the order of ``_COLUMNS``."""
    stats, failure = e.stats, e.failure
    failing = "-"
    if failure is not None:
        failing = f"{failure.reason} for {_age(max(0, now_ms - failure.since_ms))}"
        if failure.missing:
            failing += f" (missing {', '.join(failure.missing)})"
        elif failure.detail:
            failing += f": {clip(failure.detail)}"
    lora = "-"
    if stats is not None and stats.lora_max is not None:
        lora = ",".join(stats.lora_running) or "none"
    state = Text(e.state, style=_STATE_STYLE[e.state])
    if stats is not None and stats.sleeping:
        state.append(" asleep", style="magenta")  # vLLM sleep mode: never picked
    return [
        e.id,
        _engine(e),
        state,
        e.owner or "-",
        "-" if stats is None else str(stats.running),
        "-" if stats is None else str(stats.waiting),
        _pct(stats.kv_cache_usage if stats else None),
        _pct(stats.prefix_cache_hit_rate if stats else None),
        lora,
        models_text(stats.models if stats is not None else None),
        _age(e.age_ms),
        e.entry.url if e.entry is not None else "-",
        labels_text(e.entry.labels if e.entry is not None else None),
        failing,
    ]


# --- discovery sources --------------------------------------------------------------------


def sources_table(sources: list[dict[str, Any]], now_ms: int) -> Table:
    """One row per DNS discovery source: who resolves it, when it last answered, how many
    registry entries it owns, and its current failure."""
    table = Table(box=None, pad_edge=False, header_style="bold", title_justify="left")
    table.title = "discovery sources"
    for column in ("SOURCE", "QUERY", "OWNER", "RESOLVED", "TARGETS", "FAILURE"):
        table.add_column(column, justify="right" if column == "TARGETS" else "left")
    for s in sources:
        owner = Text(str(s.get("holder") or "-"))
        if s.get("stale"):
            owner = Text(f"{owner} (stale)", style="yellow")
        failure: Text | str = "-"
        if s.get("failure"):
            since = int(s.get("failure_since_ms") or now_ms)
            failure = Text(
                f"{s['failure']} for {_age(max(0, now_ms - since))}: {clip(str(s.get('detail')))}",
                style="red",
            )
        resolved = s.get("resolved_at_ms")
        table.add_row(
            str(s.get("source")),
            str(s.get("query", "-")),
            owner,
            "never" if not resolved else f"{_age(max(0, now_ms - int(resolved)))} ago",
            "-" if s.get("targets") is None else str(s["targets"]),
            failure,
        )
    return table
