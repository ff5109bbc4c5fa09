"""An engine's size and its queue's breakdown: KV capacity in tokens, waiting by reason.

Both are folded like ``running``: summed over separate engines (data-parallel ranks each
hold their own KV cache), the max over ranks that repeat one batch. The engine mapping
passes its own series filter and fold in, so the label rules of ``specs.py`` apply here
exactly as they do to the load signals.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from poller.scrape.parse import Sample
from poller.scrape.specs import Capacity, InfoTokens, Metric, Product
from poller.util.text import digits

__all__ = ["MAX_REASONS", "capacity_tokens", "info_tokens", "waiting_by_reason", "wanted"]

Series = Callable[[Metric], list[Sample]]
Fold = Callable[[Sequence[Sample]], float]

# Past 2**53 a float is no longer an exact integer (readers in other languages rely on it).
_MAX_TOKENS = 2**53
# A reason becomes part of a hash field ("reason:count,..."): a short plain word only,
# and only a few of them, so a hostile page cannot grow the stats record.
_REASON = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_REASONS = 16


def _count(text: str | None) -> int | None:
    """A label value that is a plain non-negative integer (vLLM writes ``"None"`` for a
    block count not yet known)."""
    if text is None or not digits(text) or len(text) > 16:
        return None
    return int(text)


def info_tokens(series: Sequence[Sample], rule: InfoTokens) -> list[Sample]:
    """Each info series as a sample valued at its capacity in tokens; a series whose
    labels give no number is dropped."""
    found = []
    for sample in series:
        tokens = _count(sample.labels.get(rule.tokens))
        if tokens is None:
            blocks = _count(sample.labels.get(rule.blocks))
            size = _count(sample.labels.get(rule.block_size))
            tokens = None if blocks is None or size is None else blocks * size
        if tokens is not None and tokens < _MAX_TOKENS:
            found.append(Sample(sample.name, sample.labels, float(tokens)))
    return found


def _one(source: Capacity, series: Series, fold: Fold) -> float | None:
    if isinstance(source, InfoTokens):
        samples = info_tokens(series(source.metric), source)
        return fold(samples) if samples else None
    if isinstance(source, Product):
        blocks, per_block = series(source.blocks), series(source.per_block)
        if not blocks or not per_block:
            return None
        # Tokens per block is a setting of the engine, the same on every series.
        return fold(blocks) * max(s.value for s in per_block)
    samples = series(source)
    return fold(samples) if samples else None


def capacity_tokens(
    candidates: Sequence[Capacity], series: Series, fold: Fold, sources: dict[str, str]
) -> int | None:
    """The first candidate that gives a positive capacity. Zero is absent too: no engine
    serves with an empty KV cache, so it can only mean "not known yet"."""
    for source in candidates:
        value = _one(source, series, fold)
        if value is not None and 0 < value < _MAX_TOKENS:
            sources["kv_capacity_tokens"] = str(source)
            return round(value)
    return None


def waiting_by_reason(
    spec: tuple[Metric, str] | None, series: Series, fold: Fold, sources: dict[str, str]
) -> dict[str, int]:
    """Waiting requests per reason label value, in name order; empty when unpublished."""
    if spec is None:
        return {}
    metric, label = spec
    groups: dict[str, list[Sample]] = {}
    for sample in series(metric):
        reason = sample.labels.get(label, "")
        if _REASON.fullmatch(reason):
            groups.setdefault(reason, []).append(sample)
    if not groups:
        return {}
    sources["waiting_by_reason"] = f"{metric} by {label}"
    return {reason: round(fold(groups[reason])) for reason in sorted(groups)[:MAX_REASONS]}


def wanted(capacity: Sequence[Capacity], by_reason: tuple[Metric, str] | None) -> set[str]:
    """The sample names these signals read."""
    names: set[str] = set()
    for source in capacity:
        if isinstance(source, InfoTokens):
            names.add(source.metric.name)
        elif isinstance(source, Product):
            names.update((source.blocks.name, source.per_block.name))
        else:
            names.add(source.name)
    if by_reason is not None:
        names.add(by_reason[0].name)
    return names
