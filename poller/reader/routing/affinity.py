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

Replicas that share no placements (not current: sharing off, Redis lost) each
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
from collections.abc import Mapping, Sequence
from math import log

from poller.reader.prefix.placements import Found, Placements
from poller.reader.routing.index import Slot
from poller.reader.routing.models import Score
from poller.reader.routing.pick import Pick

__all__ = ["AGREE_MAX_ENDPOINTS", "prefer", "rank"]

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
    pick: Pick,
    table: Placements,
    ids: Sequence[int],
    found: Found,
    chosen_id: str,
    bound_score: Score,
    *,
    factor: float,
    slack: float,
    agree: bool = False,
) -> str:
    """The endpoint for a request whose prompt has block ids ``ids``, ``pick`` having
    chosen ``chosen_id`` on load alone; ``found``: ``table.lookup(ids)``;
    ``bound_score``: the load the bound compares (the load model's, ``bound=True``);
    ``agree``: by the hash too, the placements not shared (module doc)."""
    index = pick.index
    chosen = index.slots.get(chosen_id)
    if chosen is None or not ids:
        return chosen_id
    slots, judge_ms, allowed = index.slots, pick.judge_ms, pick.allowed

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
    bound = bound_score(chosen)[0] * factor + slack
    model, adapter = pick.models.model, pick.models.adapter
    tier = chosen.tier(model, adapter)
    limit = 4 if tier is None else tier
    saturated_by = pick.vetoed
    saturated = saturated_by(chosen)
    best, best_n, best_load = chosen_id, 0, bound
    for endpoint_id, n in holders:
        if n < best_n:
            break  # a shorter prefix than one already within the bound
        slot = chosen if endpoint_id == chosen_id else slots.get(endpoint_id)
        if slot is None or slot.fresh_until_ms < judge_ms:
            continue
        if allowed is not None and endpoint_id not in allowed:
            continue
        held = slot.tier(model, adapter)
        if held is None or held > limit:
            continue
        if not saturated and saturated_by(slot):
            continue
        if table.observe(endpoint_id, slot.prefix_queries, slot.prefix_hits, slot.scraped_at_ms):
            continue  # its cache was reset since: what it held is gone
        load = bound_score(slot)[0]
        if load <= best_load and (n > best_n or load < best_load):
            best, best_n, best_load = endpoint_id, n, load
    if agree:
        head = table.head(ids, holders[0][1])  # a head many prompts share, known held
        if best_n <= head < len(ids) and head:  # and no holder of more within the bound
            may_take = _MayTake(pick, chosen, saturated)  # the checks above
            return _agreed(ids[head], pick, may_take, bound_score, bound) or best
    return best


def _agreed(
    key: int, pick: Pick, may_take: _MayTake, bound_score: Score, bound: float
) -> str | None:
    """Of the first two endpoints in the hash's order for the block id ``key`` that may
    take the request, the first within ``bound``; None: neither is, or the model has
    more endpoints than the hash is taken over."""
    models, slots_of = pick.models, pick.index.slots
    if len(models.where) > AGREE_MAX_ENDPOINTS:
        return None
    slots = [s for s in map(slots_of.get, models.where) if s is not None and may_take(s)]
    ranked = rank(key, {s.id: s.weight for s in slots})
    for slot in [slots_of[e] for e in ranked[:2]]:
        if bound_score(slot)[0] <= bound:
            return slot.id
    return None


class _MayTake:
    """Whether an endpoint may take the request as the reference ``chosen`` may: fresh,
    among the candidates, in its LoRA tier or a better one, not saturated unless it is."""

    __slots__ = ("adapter", "allowed", "judge_ms", "limit", "model", "saturated", "saturated_by")

    def __init__(self, pick: Pick, chosen: Slot, saturated: bool) -> None:
        self.model, self.adapter = pick.models.model, pick.models.adapter
        tier = chosen.tier(self.model, self.adapter)
        self.limit = 4 if tier is None else tier
        self.saturated, self.saturated_by = saturated, pick.vetoed
        self.judge_ms, self.allowed = pick.judge_ms, pick.allowed

    def __call__(self, slot: Slot) -> bool:
        if slot.fresh_until_ms < self.judge_ms:
            return False
        if self.allowed is not None and slot.id not in self.allowed:
            return False
        held = slot.tier(self.model, self.adapter)
        if held is None or held > self.limit:
            return False
        return self.saturated or not self.saturated_by(slot)


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
