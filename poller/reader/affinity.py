"""Prefix affinity: the endpoint likely to hold the longest prefix of the prompt, within
a bound on its load (docs/reader.md, "Prefix affinity").

The load-only pick runs first and gives the reference: its choice and its load. An
endpoint holding a longer prefix of the prompt (``Placements``) takes the request instead
when it may take it as the reference may (fresh, serving the model in the same LoRA tier
or a better one, not saturated unless the reference is) and its load, by the same
measure, is at most ``factor`` x the reference's + ``slack``. Among endpoints holding
equally long prefixes the least loaded wins. A hot system prompt thus goes to its engine
until that engine is loaded past the bound; the next request goes to the reference,
which then holds the prompt too, and the prompt spreads over as many engines as its
traffic needs.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

from poller.reader.index import Index, ModelIndex, Slot
from poller.reader.placements import Found, Placements

__all__ = ["prefer"]


def prefer(
    table: Placements,
    ids: Sequence[int],
    found: Found,
    index: Index,
    models: ModelIndex,
    chosen_id: str,
    score: Callable[[Slot], tuple[float, float]],
    judge_ms: float,
    *,
    by_kv: bool,
    factor: float,
    slack: float,
    allowed: Container[str] | None,
) -> str:
    """The endpoint for a request whose prompt has block ids ``ids``, the load-only pick
    having chosen ``chosen_id`` (``by_kv``: saturation is by KV usage only, as on the
    fleet's estimate); ``found``: ``table.lookup(ids)``; ``allowed``: the caller's
    candidates (None: any)."""
    chosen = index.slots.get(chosen_id)
    if chosen is None or not ids:
        return chosen_id
    slots = index.slots

    def usable(endpoint_id: str) -> bool:
        slot = slots.get(endpoint_id)
        return (
            slot is not None
            and slot.fresh_until_ms >= judge_ms
            and (allowed is None or endpoint_id in allowed)
        )

    holders = table.matches(ids, found=found, keep=usable)
    if not holders:  # a new prompt: nothing to weigh against the load-only choice
        return chosen_id
    bound = score(chosen)[0] * factor + slack
    model, adapter = models.model, models.adapter
    tier = chosen.tier(model, adapter)
    limit = 4 if tier is None else tier
    saturated = chosen.full if by_kv else chosen.saturated
    best, best_n, best_load = chosen_id, 0, bound
    for endpoint_id, n in holders:
        if n < best_n:
            break  # a shorter prefix than one already within the bound
        slot = chosen if endpoint_id == chosen_id else index.slots.get(endpoint_id)
        if slot is None or slot.fresh_until_ms < judge_ms:
            continue
        if allowed is not None and endpoint_id not in allowed:
            continue
        held = slot.tier(model, adapter)
        if held is None or held > limit:
            continue
        if (slot.full if by_kv else slot.saturated) and not saturated:
            continue
        if table.observe(endpoint_id, slot.prefix_queries, slot.prefix_hits, slot.scraped_at_ms):
            continue  # its cache was reset since: what it held is gone
        load = score(slot)[0]
        if load <= best_load and (n > best_n or load < best_load):
            best, best_n, best_load = endpoint_id, n, load
    return best
