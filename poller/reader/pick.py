"""A reference routing choice over the shared view; a gateway may well replace it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from poller.reader.view import EndpointView, View
from poller.stats import EndpointStats

__all__ = ["pick"]


def pick(
    view: View | Mapping[str, EndpointView],
    candidates: Iterable[str] | None = None,
    model: str | None = None,
    *,
    max_waiting: int = 5,
    max_kv_cache_usage: float = 0.8,
) -> str | None:
    """An example routing choice; a gateway may well replace it.

    Skips endpoints that are not fresh, sleeping ones (vLLM sleep mode: ``sleeping``),
    and saturated ones (``waiting >= max_waiting`` or ``kv_cache_usage >=
    max_kv_cache_usage``, the Gateway API Inference Extension's defaults). Among the
    rest, prefers those that serve ``model`` or already have it
    loaded as a LoRA adapter, then the least loaded (fewest waiting, then lowest KV
    usage, then fewest running). Returns None when nothing qualifies.
    """
    entries = view.endpoints if isinstance(view, View) else view
    ids = entries.keys() if candidates is None else [c for c in candidates if c in entries]
    usable: list[tuple[EndpointView, EndpointStats]] = []
    for endpoint_id in ids:
        e = entries[endpoint_id]
        stats = e.stats
        if e.state != "fresh" or stats is None or stats.sleeping:
            continue
        kv = stats.kv_cache_usage
        if stats.waiting >= max_waiting or (kv is not None and kv >= max_kv_cache_usage):
            continue
        usable.append((e, stats))
    if not usable:
        return None
    if model is not None:
        serving = [
            (e, s)
            for e, s in usable
            if model in s.models or model in s.lora_running or model in s.lora_waiting
        ]
        usable = serving or usable
    best = min(
        usable,
        key=lambda es: (es[1].waiting, es[1].kv_cache_usage or 0.0, es[1].running, es[0].id),
    )
    return best[0].id
