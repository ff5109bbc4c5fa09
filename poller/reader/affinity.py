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

Replicas that share no placements (``table.shared`` False: sharing off, Redis lost) each
know an eighth of a conversation's turns when there are eight of them. They agree on its
engine without talking. A head of the prompt that prompts went on from differently (a
system prompt many conversations open with; ``Placements.head``) is not this
conversation's own; when no endpoint within the bound is known to hold more of the
prompt than that head, the request goes to the endpoint a rendezvous hash of its first
block past the head ranks first (``rank``, weighted by capacity), within the same bound
(else the second, else the rule above). Every replica that knows the head computes the
same ranking, so a conversation's turns meet on one engine whichever replica receives
them. A replica that knows itself alone (the fleet's shared counts current, no other
replica with a request in flight) has nothing to agree with and keeps the rule above. A
prompt nothing holds is the load-only pick's, as before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Container, Mapping, Sequence
from math import log

from poller.reader.index import Index, ModelIndex, Slot
from poller.reader.placements import Found, Placements
from poller.reader.share import FleetLoad

__all__ = ["AGREE_MAX_ENDPOINTS", "agreeing", "prefer", "rank"]

#: The hash that replicas without shared placements agree by is taken over the model's
#: endpoints when they are at most this many (its cost is per endpoint); above, the
#: rule without it.
AGREE_MAX_ENDPOINTS = 32
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_TWO53 = float(1 << 53)
#: endpoint id -> its 64-bit salt (BLAKE2b of its UTF-8): the same in every process.
_salts: dict[str, int] = {}


def prefer(  # noqa: C901 (the hot loop's checks inline: a helper costs ~3,000 instructions a pick)
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
    agree: bool = False,
) -> str:
    """The endpoint for a request whose prompt has block ids ``ids``, the load-only pick
    having chosen ``chosen_id`` (``by_kv``: saturation is by KV usage only, as on the
    fleet's estimate); ``found``: ``table.lookup(ids)``; ``allowed``: the caller's
    candidates (None: any); ``agree``: by the hash too (``agreeing``, module doc)."""
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
    if agree:
        head = table.head(ids, holders[0][1])  # a head many prompts share, known held
        if best_n <= head < len(ids) and head:  # and no holder of more within the bound
            may_take = _MayTake(chosen, models, judge_ms, allowed, by_kv)  # the checks above
            return _agreed(ids[head], index, models, may_take, score, bound) or best
    return best


def agreeing(table: Placements, fleet: FleetLoad | None) -> bool:
    """Whether a prefix pick agrees with the other replicas by the hash: the placements
    not ``shared``, and this replica not known to be alone (the fleet's shared counts
    current, no other replica with a request in flight: none to agree with)."""
    return not table.shared and not (fleet is not None and fleet.shared and not fleet.peers)


def _agreed(
    key: int,
    index: Index,
    models: ModelIndex,
    may_take: _MayTake,
    score: Callable[[Slot], tuple[float, float]],
    bound: float,
) -> str | None:
    """Of the first two endpoints in the hash's order for the block id ``key`` that may
    take the request, the first within ``bound``; None: neither is, or the model has
    more endpoints than the hash is taken over."""
    if len(models.where) > AGREE_MAX_ENDPOINTS:
        return None
    slots = [s for s in map(index.slots.get, models.where) if s is not None and may_take(s)]
    ranked = rank(key, {s.id: s.weight for s in slots})
    for slot in [index.slots[e] for e in ranked[:2]]:
        if score(slot)[0] <= bound:
            return slot.id
    return None


class _MayTake:
    """Whether an endpoint may take the request as the reference ``chosen`` may: fresh,
    among ``allowed``, in its LoRA tier or a better one, not saturated unless it is."""

    __slots__ = ("adapter", "allowed", "by_kv", "judge_ms", "limit", "model", "saturated")

    def __init__(
        self,
        chosen: Slot,
        models: ModelIndex,
        judge_ms: float,
        allowed: Container[str] | None,
        by_kv: bool,
    ) -> None:
        self.model, self.adapter = models.model, models.adapter
        tier = chosen.tier(self.model, self.adapter)
        self.limit = 4 if tier is None else tier
        self.saturated = chosen.full if by_kv else chosen.saturated
        self.judge_ms, self.allowed, self.by_kv = judge_ms, allowed, by_kv

    def __call__(self, slot: Slot) -> bool:
        if slot.fresh_until_ms < self.judge_ms:
            return False
        if self.allowed is not None and slot.id not in self.allowed:
            return False
        held = slot.tier(self.model, self.adapter)
        if held is None or held > self.limit:
            return False
        return self.saturated or not (slot.full if self.by_kv else slot.saturated)


def rank(key: int, weights: Mapping[str, float]) -> list[str]:
    """The endpoints of ``weights`` (endpoint id -> relative capacity) in weighted
    rendezvous order for the block id ``key``, highest score first: each endpoint gets a
    share of the keys ranked first in proportion to its weight, the order is the same in
    every process, and an endpoint added or removed moves only the keys it ranks first.
    An endpoint's score is ``weight / -ln(u)``, ``u`` the 53 high bits of a 64-bit hash of
    ``key`` and the endpoint's salt, as a fraction in (0, 1) (docs/reader.md)."""
    scores = []
    for endpoint_id, weight in weights.items():
        salt = _salts.get(endpoint_id)
        if salt is None:
            if len(_salts) >= 1 << 16:
                _salts.clear()
            digest = hashlib.blake2b(endpoint_id.encode("utf-8", "surrogatepass"), digest_size=8)
            salt = _salts[endpoint_id] = int.from_bytes(digest.digest(), "big")
        w = ((key ^ salt) * _GOLDEN) & _M64
        u = (((w ^ (w >> 29)) >> 11) + 0.5) / _TWO53
        scores.append((weight / -log(u), endpoint_id))
    scores.sort(reverse=True)
    return [endpoint_id for _, endpoint_id in scores]
