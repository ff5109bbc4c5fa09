"""Precompiled page templates: static bytes with value slots, filled by one ``%``.

A page source is exposition text with two markers:

- ``<<R>>`` in a sample line: the line is repeated once per data-parallel rank, with the
  marker replaced by that rank's label text (vLLM ``engine="1",``, SGLang ``dp_rank="1",``).
- ``<<key>>`` as a value: a live slot, filled from ``RankState.key`` of the line's rank
  (rank 0 on lines without ``<<R>>``); ``<<start>>`` is the process start time and a line
  holding only ``<<lora>>`` becomes the vLLM LoRA series block.

Compiling turns the text into static byte chunks between the slots, so serving a 60 KB
page is formatting a few dozen short values and one ``bytes.join``: no registry, no
per-line work. Templates are cached per page shape (engine, model, ranks, dropped names).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from poller_lab.sim.model import EndpointLoad, RankState

__all__ = [
    "Slot",
    "Template",
    "compile_page",
    "families",
    "family_name",
    "fmt_go",
    "fmt_plain",
    "histogram",
    "render",
]

Formatter = Callable[[float], bytes]

_SLOT = re.compile(r"<<([a-z_]+)>>")
_RANK = "<<R>>"


class Slot(NamedTuple):
    key: str
    rank: int


class Template(NamedTuple):
    #: Static text around the slots: ``len(parts) == len(slots) + 1``.
    parts: tuple[bytes, ...]
    slots: tuple[Slot, ...]
    formatter: Formatter


def fmt_go(value: float) -> bytes:
    """prometheus_client's floatToGoString: what Python engines print (``5.314951e+06``)."""
    value = float(value)
    if math.isnan(value):
        return b"NaN"
    if math.isinf(value):
        return b"+Inf" if value > 0 else b"-Inf"
    text = repr(value)
    dot = text.find(".")
    if value > 0 and dot > 6:  # Go switches to exponents sooner than Python
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}".encode()
    return text.encode()


def fmt_plain(value: float) -> bytes:
    """Integers bare, fractions to 6 significant digits, NaN as C's ``-nan`` (llama.cpp)."""
    if isinstance(value, int) or (math.isfinite(value) and value == int(value)):
        return b"%d" % value
    if math.isnan(value):
        return b"-nan"
    return b"%.6g" % value


def family_name(line: str) -> str | None:
    """The metric name of a HELP/TYPE line or a sample line; None for other lines."""
    if line.startswith(("# HELP ", "# TYPE ")):
        return line[7:].split(" ", 1)[0]
    if line and not line.startswith("#"):
        return re.split(r"[{ ]", line, maxsplit=1)[0]
    return None


def families(lines: Iterable[str]) -> list[list[str]]:
    """Split a page into families: a HELP starts one, a TYPE not right after a HELP too."""
    blocks: list[list[str]] = [[]]
    previous = ""
    for line in lines:
        starts = line.startswith("# HELP ") or (
            line.startswith("# TYPE ") and not previous.startswith("# HELP ")
        )
        if starts and blocks[-1]:
            blocks.append([])
        blocks[-1].append(line)
        previous = line
    return blocks


def compile_page(
    source: str,
    *,
    ranks: int,
    rank_label: Callable[[int], str],
    formatter: Formatter,
    drop: frozenset[str] = frozenset(),
) -> Template:
    """Compile a page source for ``ranks`` ranks, leaving out the metric names in ``drop``."""
    parts: list[str] = []
    slots: list[Slot] = []
    text: list[str] = []  # static text since the last slot

    def slot(key: str, rank: int) -> None:
        parts.append("".join(text))
        text.clear()
        slots.append(Slot(key, rank))

    def emit(line: str, rank: int) -> None:
        if line == "<<lora>>":
            slot("lora", -1)
            return
        for i, piece in enumerate(_SLOT.split(line)):
            if i % 2:
                slot(piece, -1 if piece == "start" else max(rank, 0))
            else:
                text.append(piece)
        text.append("\n")

    for family in families(source.splitlines()):
        kept = [line for line in family if family_name(line) not in drop]
        # Ranks are grouped per family, as prometheus_client writes a labelled family.
        for line in kept:
            if _RANK not in line:
                emit(line, -1)
        for rank in range(ranks):
            for line in kept:
                if _RANK in line:
                    emit(line.replace(_RANK, rank_label(rank)), rank)
    parts.append("".join(text))
    return Template(tuple(part.encode() for part in parts), tuple(slots), formatter)


def _lora_block(load: EndpointLoad, wall_offset: float) -> bytes:
    max_lora = len(load.lora)
    lines = [
        b'vllm:lora_requests_info{max_lora="%d",running_lora_adapters="%s",'
        b'waiting_lora_adapters="%s"} %s\n'
        % (max_lora, running.encode(), waiting.encode(), fmt_go(seen + wall_offset))
        for (running, waiting), seen in load.lora_seen.items()
    ]
    return b"".join(lines)


def render(
    template: Template,
    load: EndpointLoad,
    wall_offset: float,
    states: Sequence[RankState] | None = None,
) -> bytes:
    """Fill the template's slots from ``states`` (default: the load's current state)."""
    if states is None:
        states = load.states
    fmt = template.formatter
    start = fmt_go(load.started_at + wall_offset)
    pieces: list[bytes] = [template.parts[0]]
    for (key, rank), part in zip(template.slots, template.parts[1:], strict=True):
        if key == "start":
            pieces.append(start)
        elif key == "lora":
            pieces.append(_lora_block(load, wall_offset))
        else:
            pieces.append(fmt(getattr(states[rank], key)))
        pieces.append(part)
    return b"".join(pieces)


def histogram(
    name: str,
    labels: str,
    buckets: Sequence[float],
    count: int,
    typical: float,
    *,
    bound: Callable[[float], str] = repr,
    value: Callable[[float], str] = lambda v: repr(float(v)),
    sum_value: Callable[[float], str] | None = None,
) -> list[str]:
    """Static sample lines of a plausible histogram (log-normal around ``typical``).

    ``labels`` is the label text before ``le`` (with its trailing comma, or empty); the
    counts never change: only the gauges and counters the poller reads are live.
    """
    lines = []
    for le in buckets:
        share = 0.5 * (1 + math.erf((math.log(le) - math.log(typical)) / (0.9 * math.sqrt(2))))
        lines.append(f'{name}_bucket{{{labels}le="{bound(le)}"}} {value(round(count * share))}')
    lines.append(f'{name}_bucket{{{labels}le="+Inf"}} {value(count)}')
    plain = "{" + labels.rstrip(",") + "}" if labels else ""
    total = round(count * typical * 1.1, 3)
    lines.append(f"{name}_sum{plain} {(sum_value or value)(total)}")
    lines.append(f"{name}_count{plain} {value(count)}")
    return lines
