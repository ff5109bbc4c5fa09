"""The block table (poller/reader/prefix/table.py) when it changes between a pick's lookup and
its use, when it starts over, and given more than it may hold; and an engine whose page
shows no capacity, judged alike by every replica."""

from __future__ import annotations

import random

from poller.reader.exchange.carrier import Carrier
from poller.reader.legacy import Picker
from poller.reader.prefix.blocks import block_ids
from poller.reader.prefix.outbox import pack
from poller.reader.prefix.placements import Placements
from poller.reader.prefix.table import DEFAULT_CAPACITY_TOKENS, MAX_ENDPOINTS, TOKENS_PER_BLOCK
from tests.reader.test_pick import timed, view_of

PROMPT = "x" * 4000


def _full(table: Placements) -> None:
    """As many endpoints seen as the table keeps track of, but one."""
    for i in range(MAX_ENDPOINTS - 1):
        table.capacity(f"old-{i}", 65536)


def test_a_placement_absorbed_between_a_lookup_and_its_record_is_kept() -> None:
    ids = [7, 8, 9]
    table = Placements()
    table.record("a", ids, 65536)
    held = table.lookup(ids)  # a pick's lookup (no lock) ...
    table.take_entries(["1-0", "1-0", "b " + pack(ids)])  # ... the exchange's absorb meanwhile
    table.record("c", ids, 65536, held)  # the pick's record with its lookup
    assert dict(table.matches(ids)) == {"a": 3, "b": 3, "c": 3}


def test_a_pick_that_takes_the_table_past_its_endpoints_starts_it_over() -> None:
    picker = Picker(rng=random.Random(2))
    _full(picker.placements)
    picker.placements.record("a", block_ids(PROMPT, "m"))  # the last endpoint it keeps
    view = view_of(timed("a", running="5", models="m"), timed("b", running="0", models="m"))
    chosen = picker.pick(view, "m", prompt=PROMPT)  # "b" is one endpoint too many
    assert chosen in ("a", "b")
    assert picker.placements.matches(block_ids(PROMPT, "m")) == [(chosen, 7)]


def test_a_lookup_made_before_the_table_started_over_is_read_again() -> None:
    table = Placements()
    _full(table)
    ids = block_ids(PROMPT, "m")
    table.record("a", ids)
    held = table.lookup(ids)
    table.take_entries(["1-0", "1-0", "peer-new " + pack([99])])  # one endpoint too many
    assert table.matches(ids, found=held) == []  # forgotten, as the start-over says


def test_a_reader_never_meets_a_half_known_endpoint() -> None:
    """Another thread may read the table while an endpoint is being added or the table
    starts over: what it finds is either unknown or whole."""
    table = Placements()

    class StartsOverWhenRead(dict[str, int]):
        def get(self, key: str, default: object = None) -> object:  # type: ignore[override]
            found = super().get(key, default)
            table._clear()  # another thread starts the table over right after this read
            return found

    for call in (lambda: table.observe("e", 10.0, 5.0), lambda: table.capacity("e", 65536)):
        table.observe("e", 9.0, 4.0)
        table._codes = StartsOverWhenRead(table._codes)
        call()  # no IndexError: found unknown, so the locked path
        assert "e" in table._codes and type(table._codes) is dict


def test_one_entry_never_takes_the_table_past_its_blocks() -> None:
    table = Placements(max_blocks=1000)
    rng = random.Random(1)
    for name in ("e", "f", "g"):
        table.take_entries(
            ["1-0", "1-0", f"{name} " + pack([rng.getrandbits(63) for _ in range(700)])]
        )
        assert len(table) <= 1000
    table.record("h", [rng.getrandbits(63) for _ in range(900)])
    assert len(table) <= 1000


def test_an_engine_without_a_capacity_is_judged_alike_by_the_replica_that_sent() -> None:
    """Its page shows no KV capacity: the replica that picked it and one that only reads
    the placements judge them by the same default."""
    view = view_of(
        timed("a", models="m", kv_capacity_tokens="16384"),
        timed("u", models="m"),  # no capacity on its page
    )
    picker = Picker(rng=random.Random(1))
    picker.placements.sharing = True
    reader = Placements()
    carrier = Carrier(reader, "k")
    for endpoint_id in ("a", "u"):
        carrier.take_page(endpoint_id, view.get(endpoint_id))
    blocks = DEFAULT_CAPACITY_TOKENS // TOKENS_PER_BLOCK
    prompts = [f"{i} " + "y" * 5200 for i in range(blocks // 10 + 2)]  # 10 blocks each
    for prompt in prompts:
        assert picker.pick(view, "m", prompt=prompt, candidates=["u"]) == "u"
        reader.take_entries(["1-0", "1-0", picker.placements.take_outbox()])
    for prompt in (prompts[0], prompts[1], prompts[-1]):
        ids = block_ids(prompt, "m")
        assert picker.placements.matches(ids) == reader.matches(ids)
    assert reader.matches(block_ids(prompts[0], "m")) == []  # evicted by the default
    assert reader.matches(block_ids(prompts[-1], "m")) == [("u", 10)]
