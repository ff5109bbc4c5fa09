"""Time a Router's pick with a prompt (prefix affinity) on a cached view of N endpoints,
no Redis.

Usage: python tests/bench/bench_prefix_pick.py [--endpoints 1000] [--picks 20000]
       [--chars 4000] [--json]

The fleet of tests/bench/bench_pick.py (8 models, mixed engines), the fleet's shared
counts of 7 other gateway replicas present and a ``LocalLoad`` with requests in flight,
as a gateway runs by default; the placement table already holding 2,000 conversations
and ~500,000 blocks. It times one call at a time (wall clock and this thread's CPU,
garbage collector off) and prints p50/p99/max in us:

- ``router.pick(model)`` without a prompt (the reference); every pick's ticket is
  ended before the next pick, untimed;
- with a new ``--chars`` prompt each time (nothing matches; its blocks are recorded);
- with a conversation's next turn (its previous turn placed: the prefix matches);
- ``block_ids`` alone on such a prompt;
- one exchange's placement work: 7 peers' entries (200 ids each) absorbed and ours
  taken to write;
- constant work calibrated to the new prompt's CPU p50, timed the same way: its p99 is
  the machine's own tail at that duration, the floor under the pick's p99.

Timings come from whatever machine runs it, often shared and noisy: compare runs on one
machine, not single numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from itertools import repeat, starmap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

from poller.reader import Router, ViewCache  # noqa: E402
from poller.reader.load.fleet import FleetLoad, pages_of  # noqa: E402
from poller.reader.load.local import LocalLoad  # noqa: E402
from poller.reader.prefix.blocks import block_ids  # noqa: E402
from poller.reader.prefix.outbox import pack  # noqa: E402
from poller.reader.prefix.placements import Placements  # noqa: E402
from tests.bench.bench_pick import MODELS, Picks, fleet, peer_totals, steady, timed  # noqa: E402

CONVERSATIONS = 2000
FILL_BLOCKS = 500_000


def text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz      ,.") for _ in range(n))


def new_prompt_text(base: str, k: int) -> str:
    """The ``k``-th new prompt: ``base`` under a head of its own, so no block matches."""
    return f"new {k:08d} " + base[13:]


def gateway(n: int, rng: random.Random, fill: int = FILL_BLOCKS) -> tuple[ViewCache, Router]:
    """The cache of ``n`` endpoints and a Router on it with 7 peers' shared counts,
    requests in flight on a third of the endpoints, and the placement table filled as a
    busy fleet's."""
    cache = fleet(n, int(time.time() * 1000))
    local = LocalLoad()
    for i in range(0, n, 3):
        local.started(f"ep-{i}")
    fleet_load = FleetLoad("bench", clock=repeat(0.0).__next__)  # answered as of every pick
    pages = pages_of((i, cache.base(i)) for i in cache.ids())
    fleet_load.read(
        1, 7, peer_totals(n, cache, rng), pages, cache.offset_ms, cache.now_ms(), full=True
    )
    assert fleet_load.peers == 7
    table = Placements()
    table.sharing = True
    table.exchanged_at = math.inf  # shared: an exchange answered as of every pick
    for i in range(fill // 100):  # blocks of other prompts on every endpoint
        table.record(f"ep-{i % n}", [rng.getrandbits(64) for _ in range(100)])
    while table.take_outbox():
        pass
    router = Router(cache, local=local, fleet=fleet_load, placements=table, rng=random.Random(2))
    assert router.load_shared and router.placements_shared
    return cache, router


def report(results: dict[str, dict[str, float]], title: str) -> None:
    print(f"{title}; times per call in us ({time.strftime('%Y-%m-%d %H:%M')})")
    print(f"{'':34} {'p50':>8} {'p99':>8} {'max':>8} {'cpu p50':>8} {'cpu p99':>8} {'calls':>6}")
    for name, r in results.items():
        print(
            f"{name:34} {r['p50_us']:8.1f} {r['p99_us']:8.1f} {r['max_us']:8.1f}"
            f" {r['cpu_p50_us']:8.1f} {r['cpu_p99_us']:8.1f} {r['count']:6}"
        )


def picks_only(row: str, count: int, router: Router, new: list[str], turns: list[str]) -> None:
    """``count`` picks of one row (``none``, ``new`` or ``turn``), after 200 more to warm,
    in one ``itertools.starmap`` (``valgrind --tool=callgrind --collect-atstart=no
    --toggle-collect=starmap_next`` counts exactly them: each pick with its ticket's
    start and the prompt's placement, not the tickets' ends, made after it)."""
    total = count + 200
    if row == "none":
        calls = [(MODELS[k % len(MODELS)], None) for k in range(total)]
    elif row == "new":
        calls = [(MODELS[k % len(MODELS)], new[k]) for k in range(total)]
    else:
        c = len(turns)
        calls = [(MODELS[k % c % len(MODELS)], turns[k % c]) for k in range(total)]

    def one(model: str, prompt: str | None) -> object:
        return router.pick(model, prompt=prompt)

    for model, prompt in calls[:200]:
        one(model, prompt).done()  # type: ignore[attr-defined]
    for ticket in list(starmap(one, calls[200:])):
        ticket.done()  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--endpoints", type=int, default=1000)
    parser.add_argument("--picks", type=int, default=20000)
    parser.add_argument("--chars", type=int, default=4000)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--fill", type=int, default=FILL_BLOCKS, help="blocks placed first")
    parser.add_argument(
        "--only",
        choices=("none", "new", "turn"),
        help="make only this row's picks (no prompt, new prompts, next turns), untimed, in "
        "one itertools.starmap: for an instruction count (docs/performance.md)",
    )
    args = parser.parse_args()
    n, count, chars = args.endpoints, args.picks, args.chars
    rng = random.Random(1)
    cache, router = gateway(n, rng, args.fill)
    table = router.placements
    base = text(rng, chars)
    turns = [f"{c:06d}" + base[6 : chars - 200] for c in range(CONVERSATIONS)]
    for c, prompt in enumerate(turns):
        router.pick(MODELS[c % len(MODELS)], prompt=prompt).done()  # type: ignore[union-attr]
    while table.take_outbox():
        pass
    tail = text(rng, 200)
    if args.only:
        new_prompts = [new_prompt_text(base, k) for k in range(count + 200)]
        picks_only(args.only, count, router, new_prompts, [t + tail for t in turns])
        return
    picks = Picks(router)
    results: dict[str, dict[str, float]] = {}
    results["router.pick(model)"] = timed(
        lambda k: picks.pick(MODELS[k % len(MODELS)]), count, before=picks.end
    )
    current = [""]

    def new_prompt(k: int) -> None:
        picks.end()
        current[0] = new_prompt_text(base, k)
        if k % 100 == 0:  # what the exchange takes meanwhile
            table.take_outbox()

    new = f"pick, new {chars}-char prompt"
    results[new] = timed(
        lambda k: picks.pick(MODELS[k % len(MODELS)], current[0]), count, before=new_prompt
    )

    def next_turn(k: int) -> None:
        picks.end()
        current[0] = turns[k % CONVERSATIONS] + tail

    def pick_turn(k: int) -> object:
        c = k % CONVERSATIONS
        return picks.pick(MODELS[c % len(MODELS)], current[0])

    results[f"pick, next turn ({chars} chars)"] = timed(pick_turn, count, before=next_turn)
    picks.end()
    hits = 0
    for c in range(CONVERSATIONS):
        ids = block_ids(turns[c] + tail, MODELS[c % len(MODELS)])
        matched = table.matches(ids, limit=1)
        hits += bool(matched) and matched[0][1] == len(ids)
    results[f"block_ids, {chars} chars"] = timed(lambda k: block_ids(current[0], "m"), count)
    bodies: list[str] = []  # 7 peers' entries: 200 new ids each, on some endpoint
    for i in range(7):
        ids = [rng.getrandbits(64) for _ in range(200)]
        bodies += [f"1-{i}", f"ep-{rng.randrange(n)} {pack(ids)}"]

    def exchange(k: int) -> object:
        table.take_entries([f"{k}-9", *bodies])
        return table.take_outbox()

    results["placements: one exchange"] = timed(exchange, max(20, count // 100))
    results["constant work, same cpu p50"] = steady(results[new]["cpu_p50_us"], count)
    if args.json:
        print(json.dumps({"endpoints": n, "chars": chars, "results": results}))
        return
    report(results, f"{n} endpoints, {len(table)} blocks placed, {chars}-char prompts")
    print(f"next turns whose whole prompt is placed after the run: {hits}/{CONVERSATIONS}")


if __name__ == "__main__":
    main()
