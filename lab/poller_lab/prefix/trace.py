"""A diagnostic trace of prefix picks (lab only, off unless ``LAB_PREFIX_TRACE``
names a folder): per request, what the engines held of its prompt in truth (the
simulator's ``POST /admin/prefix`` just before the pick), what the picker's placements
said (``matches``, and the placements on every engine valid or not) and what ``prefer``
did with each holder (chosen, over the load bound, stale, saturated, ...), and the time
from its forward to the engine's first chunk. One JSON line per request, in
``<folder>/gw-<pid>.jsonl``; ``python -m poller_lab.prefix.trace <folder>`` sums them up
per cell.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from poller.reader.prefix.table import TOKENS_PER_BLOCK
from poller_lab.prefix.fleet import ENGINES, PREFILL_TPS

__all__ = ["ENV", "Trace", "folder"]

ENV = "LAB_PREFIX_TRACE"


def folder() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value else None


class Trace:
    """Installed in one gateway process: wraps the Router's ``prefer``
    (poller/reader/routing/affinity.py)."""

    def __init__(self, out: Path, group: str) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.file = (out / f"gw-{os.getpid()}.jsonl").open("a", encoding="utf-8")
        self.group = group
        self.truth: Mapping[str, Any] | None = None
        self.pending: dict[str, Any] | None = None
        import poller.reader.router as router_module

        real = router_module.prefer  # type: ignore[attr-defined]

        def traced(pick: Any, table: Any, ids: Any, found: Any, chosen_id: str,
                   score: Any, **kw: Any) -> str:  # fmt: skip
            best = real(pick, table, ids, found, chosen_id, score, **kw)
            try:
                self.pending = _explain(pick, table, ids, found, chosen_id, score, best, kw)
            except Exception as exc:  # a diagnostic never breaks the pick
                self.pending = {"error": repr(exc)}
            return best

        router_module.prefer = traced  # type: ignore[attr-defined,assignment]

    def take(self, chosen: str | None) -> dict[str, Any]:
        """The record of the pick just made (``write`` it once the request is answered)."""
        record = {
            "t": time.monotonic(),
            "group": self.group,
            "chosen": chosen,
            "pick": self.pending,
            "truth": None
            if self.truth is None
            else {
                i: [e["cached_tokens"], e["running"] + e["waiting"]]
                for i, e in self.truth["endpoints"].items()
            },
            "tokens": None if self.truth is None else self.truth["prompt_tokens"],
        }
        self.pending = self.truth = None
        return record

    def write(self, record: dict[str, Any], first_s: float | None) -> None:
        """``record`` (``take``) with ``first_s``: seconds from the request's forward to
        the engine's first chunk (None: none came)."""
        record["first_s"] = first_s
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


def _explain(  # noqa: C901 (a diagnostic: prefer's loop, annotated)
    pick: Any, table: Any, ids: Any, found: Any, chosen_id: str, score: Any, best: str,
    kw: Mapping[str, Any],
) -> dict[str, Any]:  # fmt: skip
    from poller.reader.prefix.table import _MASK, CODE_BITS

    index, models, judge_ms = pick.index, pick.models, pick.judge_ms
    saturated_by = pick.load.saturated
    chosen = index.slots.get(chosen_id)
    out: dict[str, Any] = {"ref": chosen_id, "best": best, "blocks": len(ids)}
    if chosen is None or not ids:
        return out
    holders = table.matches(ids, found=found)
    bound = score(chosen)[0] * kw["factor"] + kw["slack"]
    out["ref_load"] = score(chosen)[0]
    out["bound"] = bound
    tier = chosen.tier(models.model, models.adapter)
    limit = 4 if tier is None else tier
    saturated = saturated_by(chosen)
    rows = []
    best_n, best_load = 0, bound
    for endpoint_id, n in holders:
        slot = chosen if endpoint_id == chosen_id else index.slots.get(endpoint_id)
        reason = "ok"
        load = None if slot is None else score(slot)[0]
        if n < best_n:
            reason = "shorter"
        elif slot is None or slot.fresh_until_ms < judge_ms:
            reason = "stale"
        else:
            held = slot.tier(models.model, models.adapter)
            if held is None or held > limit:
                reason = "tier"
            elif saturated_by(slot) and not saturated:
                reason = "saturated"
            elif load is not None and load <= best_load and (n > best_n or load < best_load):
                best_n, best_load = n, load
            elif load is not None and load > bound:
                reason = "over-bound"
            else:
                reason = "beaten"
        rows.append([endpoint_id, n, reason, load])
    for row in rows:
        if row[2] == "ok":
            row[2] = "chosen" if row[0] == best else "beaten"
    out["holders"] = rows
    # Every engine's placements of the prompt, valid or not: the longest prefix with a
    # placement there at all, and the longest still counted.
    values = found[0]
    codes = table._codes
    low, used, cap = table._low, table._used, table._cap
    placed: dict[str, list[int]] = {}
    for name, code in codes.items():
        anyk = validk = 0
        for k, value in enumerate(values):
            if value is None:
                break
            vs = (value,) if type(value) is int else value
            mine = [v for v in vs if v & _MASK == code]
            if not mine:
                break
            pos = mine[0] >> CODE_BITS
            anyk = k + 1
            if pos >= low[code] and used[code] - pos < cap[code]:
                validk = k + 1
        placed[name] = [anyk, validk, used[code], cap[code]]
    out["placed"] = placed
    out["loads"] = {i: score(s)[0] for i, s in index.slots.items()}
    out["parts"] = _parts(score, index)
    return out


def _parts(score: Any, index: Any) -> dict[str, list[float]] | None:
    """Per endpoint, the fleet estimate's parts (FleetLoadModel.scorer's closure): [the
    others' and outside requests, ours in flight, weight, speed factor's share of the
    slowness, slowness, failing]; None for another score."""
    names = score.__code__.co_freevars
    if "extra" not in names or score.__closure__ is None:
        return None
    env = dict(zip(names, (c.cell_contents for c in score.__closure__), strict=True))
    now = env["now"]
    out = {}
    for i, slot in index.slots.items():
        base = env["extra"].get(i)
        out[i] = [
            slot.requests if base is None else base,
            env["in_flight"](i),
            slot.weight,
            env["share"],
            env["slower"](i, now),
            env["failing"](i, now),
        ]
    return out


# --- the summary ----------------------------------------------------------------------


def classify(r: Mapping[str, Any]) -> tuple[str, int]:
    """(category, tokens lost against the true longest holder) of one request."""
    truth = r["truth"]
    pick = r["pick"] or {}
    chosen = r["chosen"]
    if truth is None or chosen not in truth:
        return "untraced", 0
    top = max(t[0] for t in truth.values())
    got = truth[chosen][0]
    if top == 0:
        return "nothing cached anywhere", 0
    tops = {i for i, t in truth.items() if t[0] >= top - TOKENS_PER_BLOCK}
    holders = pick.get("holders") or []
    if chosen in tops:
        moved = chosen != pick.get("ref", chosen)
        return ("chosen = true holder (affinity moved it)" if moved
                else "chosen = true holder (load-only choice)"), 0  # fmt: skip
    lost = top - got
    claim = {h[0]: h for h in holders}
    if chosen in claim and claim[chosen][1] * TOKENS_PER_BLOCK > got + TOKENS_PER_BLOCK:
        return "table's holder evicted in truth", lost
    if not holders:
        placed = pick.get("placed") or {}
        if any(placed.get(i, [0, 0])[0] > 0 for i in tops):
            return "no holder known: true holder taken for evicted", lost
        return "no holder known: never placed/learned", lost
    known = [claim[i] for i in tops if i in claim]
    if known:
        reasons = {h[2] for h in known}
        for reason in ("over-bound", "saturated", "stale", "tier", "beaten", "shorter", "chosen"):
            if reason in reasons:
                return f"true holder known: {reason}", lost
    placed = pick.get("placed") or {}
    if any(placed.get(i, [0, 0])[0] > 0 for i in tops):
        if any(placed.get(i, [0, 0])[1] > 0 for i in tops):
            return "true holder valid but not in matches (limit)", lost
        return "true holder taken for evicted (others known)", lost
    return "true holder never placed/learned (others known)", lost


def at_pick(r: Mapping[str, Any]) -> tuple[int, int, bool, bool] | None:
    """In truth, when the request was sent: (the prompt's tokens the chosen engine did
    not hold, the fewest any engine did not hold, whether every slot of the chosen one
    was taken, whether another engine had one free); None: not traced."""
    truth, tokens = r["truth"], r.get("tokens")
    if truth is None or tokens is None or r["chosen"] not in truth:
        return None
    slots = dict(ENGINES)
    cached, queue = truth[r["chosen"]]
    most = max(held for held, _ in truth.values())
    free = any(q < slots.get(i, 1) for i, (_, q) in truth.items() if i != r["chosen"])
    return max(0, tokens - cached), max(0, tokens - most), queue >= slots.get(r["chosen"], 1), free


def _quantile(values: list[Any], q: float) -> Any:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0


def summarise(path: Path) -> str:
    cells: dict[str, dict[str, Any]] = {}
    for line in (path / "cells.jsonl").read_text().splitlines():
        c = json.loads(line)
        cells[c["group"]] = c
    per: dict[str, dict[str, list[int]]] = {}
    totals: dict[str, list[float]] = {}
    # Per cell: the chosen engine's uncached tokens; the requests that lacked more than
    # 1,000 tokens on every engine; those sent to an engine with no slot free (and of
    # them, while another had one); the first chunk's time, and its time past the prefill.
    uncached: dict[str, list[int]] = {}
    counts: dict[str, list[int]] = {}
    firsts: dict[str, list[float]] = {}
    waits: dict[str, list[float]] = {}
    for f in sorted(path.glob("gw-*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            cell = cells.get(r["group"])
            if cell is None or r["t"] < cell["t0"] + cell["warmup_s"]:
                continue
            key = f"{cell['label']}"
            cat, lost = classify(r)
            row = per.setdefault(key, {}).setdefault(cat, [0, 0])
            row[0] += 1
            row[1] += lost
            tot = totals.setdefault(key, [0, 0, 0])
            tot[0] += 1
            seen = at_pick(r)
            if seen is not None:
                lacked, fewest, full, other = seen
                uncached.setdefault(key, []).append(lacked)
                tally = counts.setdefault(key, [0, 0, 0])
                tally[0] += fewest > 1000
                tally[1] += full
                tally[2] += full and other
                if r.get("first_s") is not None:
                    firsts.setdefault(key, []).append(r["first_s"])
                    waits.setdefault(key, []).append(r["first_s"] - lacked / PREFILL_TPS)
            if r["truth"] and r["chosen"] in r["truth"]:
                tot[1] += max(t[0] for t in r["truth"].values())
                tot[2] += r["truth"][r["chosen"]][0]
    lines = []
    for key in sorted(per):
        n, top, got = totals[key]
        lines.append(f"== {key}: {n} requests, true best cached tokens {top}, "
                     f"chosen's cached {got} ({got / max(1, top):.3f})")  # fmt: skip
        missing = uncached.get(key, [])
        if missing:
            p50, p90 = _quantile(missing, 0.5), _quantile(missing, 0.9)
            none, busy, freed = counts[key]
            lines.append(
                f"  prompt tokens the chosen engine lacked: p50 {p50} ({p50 / PREFILL_TPS:.3f} s"
                f" of prefill), p90 {p90} ({p90 / PREFILL_TPS:.3f} s); more than 1,000 on"
                f" every engine: {none} of {len(missing)}"
            )
            lines.append(
                f"  sent to an engine with every slot taken: {busy} of {len(missing)}"
                f" ({freed} while another had one free)"
            )
        first, rest = firsts.get(key, []), waits.get(key, [])
        if first:
            lines.append(
                f"  the engine's first chunk after the forward: p50 {_quantile(first, 0.5):.3f} s;"
                f" past the prefill (a wait for a slot, the transport): p50"
                f" {_quantile(rest, 0.5):.3f} s, p90 {_quantile(rest, 0.9):.3f} s"
            )
        for cat, (count, lost) in sorted(per[key].items(), key=lambda kv: -kv[1][1]):
            lines.append(f"  {cat:52s} {count:5d}  lost {lost:8d}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(summarise(Path(sys.argv[1])) + "\n")
