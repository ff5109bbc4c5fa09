"""Prefix affinity without Redis: the block ids, ``prompt_of``, the placement table's
bounds and invalidation, and the pick rule (the prefix wins, bounded load overrides,
``prompt=None`` unchanged). Every random choice is seeded: the verdicts are exact."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import subprocess
import sys
import zlib
from collections import Counter
from typing import Any, TypeVar

import pytest

from poller import prompt_of
from poller.errors import ConfigError
from poller.reader.legacy import Picker
from poller.reader.load.fleet import FleetLoad
from poller.reader.load.local import LocalLoad
from poller.reader.prefix.blocks import BLOCK_BYTES, MAX_PROMPT_BLOCKS, block_ids
from poller.reader.prefix.outbox import ENTRY_MAX, OUT_MAX, entry_placements
from poller.reader.prefix.placements import Placements
from poller.reader.prefix.table import MAX_HOLDERS, TOKENS_PER_BLOCK
from poller.reader.routing.affinity import rank
from tests.reader.test_pick import picks, timed, view_of
from tests.support.routers import lasting, read_others, router_on


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def text(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))


# --- block ids -----------------------------------------------------------------------------


def test_block_ids_are_the_running_crc32_and_adler32_of_the_prefix() -> None:
    """The documented rule (docs/schema.md), computed here from zlib directly."""
    size = BLOCK_BYTES
    assert size == 512
    prompt = text(size * 3 + 40)
    data = prompt.encode()
    ends = (size, size * 2, size * 3)
    expected = [zlib.crc32(data[:end]) << 32 | zlib.adler32(data[:end]) for end in ends]
    assert block_ids(prompt) == expected  # the part block (40 bytes) has no id
    seeded = b"org/m\0"
    assert block_ids(prompt, "org/m")[0] == (
        zlib.crc32(seeded + data[:size]) << 32 | zlib.adler32(seeded + data[:size])
    )
    assert block_ids(prompt[: size - 1]) == []


def test_two_prompts_share_ids_exactly_as_far_as_they_share_a_prefix() -> None:
    base = text(BLOCK_BYTES * 10)
    longer = base + text(BLOCK_BYTES * 3, seed=1)
    assert block_ids(longer)[:10] == block_ids(base)
    at = BLOCK_BYTES * 2 + 3
    changed = base[:at] + ("x" if base[at] != "x" else "y") + base[at + 1 :]
    a, b = block_ids(base), block_ids(changed)
    assert a[:2] == b[:2] and all(x != y for x, y in zip(a[2:], b[2:], strict=True))
    assert block_ids(base, "m1") != block_ids(base, "m2")  # a cache is per model
    assert len(block_ids("é" * BLOCK_BYTES)) == 2  # UTF-8 bytes, not characters
    assert len(block_ids("a" * BLOCK_BYTES * (MAX_PROMPT_BLOCKS + 5))) == MAX_PROMPT_BLOCKS
    # past the limit in characters of several bytes: the same ids as the whole text's
    huge = "é€" * (BLOCK_BYTES * MAX_PROMPT_BLOCKS // 2 + 7)
    data = huge.encode()
    ends = range(BLOCK_BYTES, BLOCK_BYTES * MAX_PROMPT_BLOCKS + 1, BLOCK_BYTES)
    spec = [zlib.crc32(data[:e]) << 32 | zlib.adler32(data[:e]) for e in ends[-3:]]
    assert len(block_ids(huge)) == MAX_PROMPT_BLOCKS and block_ids(huge)[-3:] == spec


def test_block_ids_are_the_same_in_another_process() -> None:
    """Python's ``hash`` is salted per process; the ids must not be."""
    prompt = text(1000, seed=3)
    code = (
        "import sys; from poller.reader.prefix.blocks import block_ids; "
        "print(block_ids(sys.stdin.read(), 'org/model'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=prompt,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    )
    assert out.stdout.strip() == str(block_ids(prompt, "org/model"))


def test_block_ids_want_text() -> None:
    with pytest.raises(TypeError, match="prompt must be a str"):
        block_ids(b"bytes")  # type: ignore[arg-type]


# --- prompt_of ------------------------------------------------------------------------------


def test_a_turns_messages_render_to_a_prefix_of_the_next_turns() -> None:
    turn = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image_url"}]},
    ]
    first = prompt_of(turn)
    assert first == "<|system|>\nYou answer briefly.\n<|user|>\nLook:\n"
    turn += [{"role": "assistant", "content": None}, {"role": "user", "content": "And?"}]
    second = prompt_of(turn)
    assert second.startswith(first) and second.endswith("<|assistant|>\n\n<|user|>\nAnd?\n")
    assert prompt_of([]) == ""
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert prompt_of([{"role": "user", "content": parts}]) == "<|user|>\na\nb\n"


@pytest.mark.parametrize(
    ("messages", "said"),
    [
        ("hello", "messages must be a list"),
        ({"role": "user"}, "messages must be a list"),
        (["hi"], r"messages\[0\] must be a mapping"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\['content'\] must be"),
    ],
)
def test_prompt_of_names_what_is_wrong(messages: object, said: str) -> None:
    with pytest.raises(TypeError, match=said):
        prompt_of(messages)  # type: ignore[arg-type]


# --- the placement table ---------------------------------------------------------------------


def test_matches_are_the_longest_prefix_per_endpoint_longest_first() -> None:
    table = Placements()
    system = text(BLOCK_BYTES * 4)
    conversation = system + text(BLOCK_BYTES * 6, seed=1)
    table.record("a", block_ids(system))
    table.record("b", block_ids(conversation))
    asked = block_ids(conversation + text(BLOCK_BYTES * 2, seed=2))
    assert table.matches(asked) == [("b", 10), ("a", 4)]
    assert table.matches(asked, limit=1) == [("b", 10)]
    assert table.matches(block_ids(text(BLOCK_BYTES * 5, seed=9))) == []
    assert table.placed == 4 + 10


def test_a_placement_counts_while_the_engine_could_still_hold_the_block() -> None:
    """An engine of 10 blocks: a prompt's blocks count until 10 new blocks were placed
    there after its last use; a prompt placed again is moved up, as an LRU moves it to
    the front."""
    table = Placements()
    capacity = 10 * TOKENS_PER_BLOCK

    def prompt(blocks: int, seed: int) -> list[int]:
        return block_ids(text(BLOCK_BYTES * blocks, seed=seed))

    first, second = prompt(4, 0), prompt(6, 1)
    table.record("e", first, capacity)
    table.record("e", second, capacity)
    table.record("e", prompt(3, 2), capacity)
    assert table.matches(first) == [("e", 4)]  # 9 placed since: still held
    table.record("e", first, capacity)  # used again: moved up, nothing new placed
    assert table.placed == 13
    table.record("e", prompt(7, 3), capacity)
    assert table.matches(second) == []  # 10 placed since its last use: evicted
    assert table.matches(first) == [("e", 4)]  # 7 since its last use
    table.record("e", prompt(3, 4), capacity)
    assert table.matches(first) == []


def test_a_placement_stops_counting_past_the_age_cap() -> None:
    clock = Clock()
    table = Placements(age_s=60.0, clock=clock)
    ids = block_ids(text(BLOCK_BYTES * 3))
    table.record("e", ids)
    clock.t += 30
    table.record("other", block_ids(text(BLOCK_BYTES, seed=1)))
    assert table.matches(ids) == [("e", 3)]
    clock.t += 40  # 70 s since it was placed
    table.record("other", block_ids(text(BLOCK_BYTES, seed=2)))  # any record sweeps
    assert table.matches(ids) == []


def test_placements_past_the_age_cap_stop_counting_with_nothing_placed_since() -> None:
    """A quiet spell: the first lookup after it already finds nothing, with no record
    in between; blocks placed within one mark's step age with that mark."""
    clock = Clock()
    table = Placements(age_s=60.0, clock=clock)
    ids = block_ids(text(BLOCK_BYTES * 3))
    table.record("e", ids)
    clock.t += 5  # within the mark's step (MARK_S)
    later = block_ids(text(BLOCK_BYTES * 2, seed=3))
    table.record("e", later)
    clock.t += 30
    assert table.matches(ids) == [("e", 3)] and table.matches(later) == [("e", 2)]
    clock.t += 1000  # nothing placed anywhere since
    assert table.matches(ids) == [] and table.matches(later) == []


def test_a_block_in_use_never_ages_out_here_or_in_the_others_tables() -> None:
    """A hot prompt used every 30 s on a big engine (never a quarter of its capacity
    placed between uses): it is moved up and written again before its age runs out
    (``REWRITE_AGE``), so neither this table nor one that reads what it writes ever
    takes it for evicted; unused for ``age_s`` it goes."""
    clock = Clock()
    a, b = Placements(age_s=120.0, clock=clock), Placements(age_s=120.0, clock=clock)
    a.sharing = True
    hot = block_ids(text(BLOCK_BYTES * 8, seed=9))
    start = clock.t
    for k in range(0, 1500, 5):  # 25 minutes
        clock.t = start + k
        if k % 30 == 0 and k <= 1200:
            a.record("e", hot, 8192 * TOKENS_PER_BLOCK)
            b.take_entries(["1-0", "1-0", a.take_outbox()])
        b.record("x", block_ids(text(BLOCK_BYTES, seed=10_000 + k)))  # b's own traffic
        held = (a.matches(hot), b.matches(hot))
        if k <= 1200:
            assert held == ([("e", 8)], [("e", 8)]), k
    assert held == ([], [])  # unused for 295 s, past age_s


def test_the_others_entries_age_from_when_they_were_written() -> None:
    """An entry read late (a new replica's first read, a backlog) counts for what is
    left of its age by its stream id's time; one older than ``age_s`` not at all."""
    clock = Clock()
    writer, reader = Placements(), Placements(age_s=600.0, clock=clock)
    writer.sharing = True
    old, recent = (
        block_ids(text(BLOCK_BYTES * 3, seed=20)),
        block_ids(text(BLOCK_BYTES * 3, seed=21)),
    )
    writer.record("e", old)
    old_body = writer.take_outbox()
    writer.record("e", recent)
    recent_body = writer.take_outbox()
    now_ms = 5_000_000
    reply = ["x", f"{now_ms - 700_000}-0", old_body, f"{now_ms - 590_000}-0", recent_body]
    reader.take_entries(reply, now_ms)
    assert reader.matches(old) == [] and reader.matches(recent) == [("e", 3)]
    clock.t += 11  # past the 600 s since it was written
    assert reader.matches(recent) == []


def test_a_record_whose_clock_passes_an_expiry_midway_does_not_lock_itself() -> None:
    """A clock that moves 11 s per reading: the lookup inside a record finds an expiry
    due while the record holds the table's lock, and expires under it (no deadlock; a
    deadlock never ends, so the generous join below only tells one)."""
    import itertools
    import threading

    ticks = itertools.count(1000.0, 11.0)
    table = Placements(clock=lambda: next(ticks))
    ids = block_ids(text(BLOCK_BYTES * 3))
    worker = threading.Thread(target=lambda: [table.record("e", ids) for _ in range(3)])
    worker.daemon = True
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive()


def test_a_page_older_than_one_seen_says_nothing_of_a_reset() -> None:
    """A pick on an index a page behind the exchange's shows lower counters than the
    exchange saw: not a reset. A newer page with lower counters is one."""
    table = Placements()
    ids = block_ids(text(BLOCK_BYTES * 3))
    table.record("e", ids)
    assert not table.observe("e", 110.0, 55.0, 2000)  # the exchange: the newer page
    assert not table.observe("e", 100.0, 50.0, 1000)  # a pick: the page before
    assert table.matches(ids) == [("e", 3)] and table.invalidated == 0
    assert table.observe("e", 3.0, 1.0, 3000)  # restarted
    assert table.matches(ids) == [] and table.invalidated == 1


def test_a_page_dated_ahead_does_not_hide_the_next_reset() -> None:
    """A page dated far ahead (a failover to a Redis whose clock is behind, a poller's
    bad clock) is not the reference for ever: a page more than an hour older than it
    becomes the reference, voiding nothing, and the restart after it is seen."""
    table = Placements()
    ids = block_ids(text(BLOCK_BYTES * 3))
    table.record("e", ids)
    assert not table.observe("e", 100.0, 50.0, 1_000_000)
    assert not table.observe("e", 101.0, 51.0, 10**15)  # dated ahead
    assert not table.observe("e", 102.0, 52.0, 2_000_000)  # the next real page
    assert table.matches(ids) == [("e", 3)] and table.invalidated == 0
    assert table.observe("e", 0.0, 0.0, 3_000_000)  # restarted
    assert table.matches(ids) == [] and table.invalidated == 1


def test_the_others_placements_are_judged_by_the_engine_s_capacity() -> None:
    """A replica that never sent to an endpoint judges the placements it reads there by
    the capacity the endpoint's page shows (``capacity``, from the exchange), as the
    replica that wrote them does."""
    a, b = Placements(), Placements()
    a.sharing = True
    b.capacity("e", 128 * TOKENS_PER_BLOCK)  # 128 blocks, as e's page says
    prompts = [block_ids(text(BLOCK_BYTES * 10, seed=100 + i)) for i in range(31)]
    for ids in prompts:  # one prompt an exchange: 310 blocks, the first ones evicted
        a.record("e", ids, 128 * TOKENS_PER_BLOCK)
        b.take_entries(["1-0", "1-0", a.take_outbox()])
    assert a.matches(prompts[0]) == [] and b.matches(prompts[0]) == []
    assert a.matches(prompts[-1]) == b.matches(prompts[-1]) == [("e", 10)]


def test_counters_that_go_back_void_the_endpoints_placements_at_once() -> None:
    table = Placements()
    ids = block_ids(text(BLOCK_BYTES * 3))
    table.record("e", ids)
    table.record("f", ids)
    assert not table.observe("e", 100.0, 40.0)
    assert not table.observe("e", 150.0, 70.0)  # grew: nothing happens
    assert table.observe("e", 3.0, 1.0)  # restarted
    assert table.matches(ids) == [("f", 3)] and table.invalidated == 1
    assert not table.observe("e", 4.0, 1.0)  # the new counters are the reference now
    table.record("e", ids)
    assert dict(table.matches(ids)) == {"e": 3, "f": 3}
    assert not table.observe("g", None, None)  # no counters: nothing to tell


def test_the_table_holds_at_most_max_blocks() -> None:
    table = Placements(max_blocks=1000)
    recent = []
    for i in range(300):
        recent = block_ids(text(BLOCK_BYTES * 10, seed=i))
        table.record(f"e{i % 7}", recent)
        assert len(table) <= 1000
    assert table.matches(recent) == [(f"e{299 % 7}", 10)]  # the newest stay


def test_a_block_is_remembered_on_a_bounded_number_of_endpoints() -> None:
    table = Placements()
    ids = block_ids(text(BLOCK_BYTES))
    for i in range(20):
        table.record(f"e{i}", ids)
    held = table.matches(ids, limit=100)
    assert len(held) == MAX_HOLDERS and {e for e, _ in held} == {f"e{i}" for i in range(16, 20)}


def test_a_prompt_on_several_endpoints_keeps_the_valid_holders_of_every_block() -> None:
    table = Placements()
    ids = block_ids(text(BLOCK_BYTES * 5))
    table.record("e1", ids)
    table.record("e2", ids[:3])  # a shorter prefix of it
    table.observe("e1", 10.0, 5.0)
    table.observe("e1", 1.0, 0.0)  # e1 restarted: its placements are void
    table.record("e3", ids)
    assert table.matches(ids) == [("e3", 5), ("e2", 3)]
    assert table.matches(ids[:4]) == [("e3", 4), ("e2", 3)]
    table.record("e1", ids)  # placed there again: new there, with the others kept
    assert table.matches(ids) == [("e3", 5), ("e1", 5), ("e2", 3)]
    assert table.placed == 5 + 3 + 5 + 5


def test_what_one_table_sends_another_absorbs() -> None:
    a, b = Placements(), Placements()
    a.sharing = True
    ids = block_ids(text(BLOCK_BYTES * 5))
    a.record("e", ids)
    a.record("e", ids)  # held there already: nothing more to send
    body = a.take_outbox()
    assert body.startswith("e ") and a.take_outbox() == ""
    assert a.ids_written == 5 and a.bytes_written == len(body)
    b.take_entries(["1-0", "1-0", body])
    assert b.matches(ids) == [("e", 5)] and b.last_id == "1-0" and b.ids_read == 5
    a.put_back(body)  # the call that carried it failed: sent again next time
    assert a.take_outbox() == body


def test_a_block_in_use_is_written_again_before_the_others_take_it_for_evicted() -> None:
    """Replica A keeps using a prompt on an engine of 40 blocks while other prompts are
    placed there. B sees only what A writes: without a rewrite, B would count the
    prompt evicted after 40 new blocks, where the engine's LRU keeps it. A writes it
    again once a quarter of the capacity (10 blocks) was placed since it last wrote it,
    not at every use."""
    a, b = Placements(), Placements()
    a.sharing = True
    capacity = 40 * TOKENS_PER_BLOCK
    hot = block_ids(text(BLOCK_BYTES * 2, seed=99))

    def send() -> None:
        body = a.take_outbox()
        if body:
            b.take_entries(["1-0", "1-0", body])

    b.record("e", [], capacity)  # B knows the engine's size from its own picks
    a.record("e", hot, capacity)
    send()
    written = a.ids_written
    for seed in range(16):  # 3 new blocks each: 48 in all, past B's 40
        a.record("e", block_ids(text(BLOCK_BYTES * 3, seed=seed)), capacity)
        a.record("e", hot, capacity)  # used again
        send()
        assert b.matches(hot) == [("e", 2)], seed
    assert a.ids_written - written == 16 * 3 + 4 * 2  # rewritten after 12, 24, 36, 48


def test_the_queue_to_send_is_bounded_and_one_entry_carries_at_most_entry_max() -> None:
    table = Placements()
    table.sharing = True
    for i in range(OUT_MAX // 100 + 5):
        table.record(f"e{i % 3}", block_ids(text(BLOCK_BYTES * 100, seed=i)))
    assert table.dropped == (OUT_MAX // 100 + 5) * 100 - OUT_MAX
    sent = 0
    while body := table.take_outbox():
        n = sum(len(ids) for _, ids in entry_placements(body))
        assert n <= ENTRY_MAX
        sent += n
    assert sent == OUT_MAX


def test_placements_not_written_within_the_hold_are_dropped_not_sent_late() -> None:
    """Redis away: what waits is written within 300 s of its queueing (half the table's
    age, when a block in use is written again anyway) or dropped, counted; never
    written an hour late as new, which the others would count for another 600 s."""
    now = [0.0]
    a = Placements(clock=lambda: now[0])
    a.sharing = True
    old, recent = block_ids(text(BLOCK_BYTES * 3, seed=1)), block_ids(text(BLOCK_BYTES * 2))
    a.record("e", old)
    now[0] = 100.0
    a.put_back(a.take_outbox())  # the call failed: back in the queue
    now[0] = 120.0  # the next call: written
    body = a.take_outbox()
    assert [(e, ids) for e, ids in entry_placements(body)] == [("e", old)] and a.dropped == 0
    a.put_back(body)
    for t in range(200, 3600, 100):  # an hour of outage: the exchange tries on
        now[0] = float(t)
        a.put_back(a.take_outbox())
    now[0] = 3600.0
    a.record("e", recent)  # placed just now: written
    assert [(e, ids) for e, ids in entry_placements(a.take_outbox())] == [("e", recent)]
    assert a.dropped == 3 and a.take_outbox() == ""
    b = Placements(clock=lambda: now[0])
    b.take_entries(["9-0", "3600000-0", body], now_ms=3_600_000)  # had it been sent late
    assert b.matches(old) == [("e", 3)]  # it would have counted as new


# --- the pick rule ---------------------------------------------------------------------------

P = TypeVar("P", bound=Any)
PROMPT = text(4000, seed=7)


def fleet(**loads: int) -> object:
    return view_of(*(timed(e, running=str(n), models="m") for e, n in loads.items()))


def test_the_endpoint_holding_the_prefix_takes_the_conversations_next_turn() -> None:
    picker = Picker(rng=random.Random(1))
    view = fleet(a=2, b=2, c=2, d=2)
    first = picker.pick(view, "m", prompt=PROMPT)
    assert first is not None
    follow_up = PROMPT + text(300, seed=8)
    assert picks(picker, view, 50, model="m", prompt=follow_up) == {first: 50}
    # A load-only pick spreads (and records nothing).
    assert len(picks(picker, view, 50, model="m")) > 1
    assert len(picker.placements) == len(block_ids(follow_up, "m"))


def test_bounded_load_sends_the_request_elsewhere_when_the_holder_is_too_busy() -> None:
    """Holder at (r + 1) loads against the least loaded's 1: within 1.5 x 1 + 2 it wins,
    past it the load-only choice does."""
    for running, expected in ((2, "a"), (3, "b")):
        picker = Picker(rng=random.Random(2))
        picker.placements.record("a", block_ids(PROMPT, "m"))
        view = fleet(a=running, b=0)
        assert picker.pick(view, "m", prompt=PROMPT) == expected, running
    picker = Picker(rng=random.Random(2), prefix_load_factor=4.0, prefix_load_slack=0.0)
    picker.placements.record("a", block_ids(PROMPT, "m"))
    assert picker.pick(fleet(a=3, b=0), "m", prompt=PROMPT) == "a"


def shared(picker: Picker) -> Picker:
    """``picker``'s placements as a cache's that the exchange keeps current (an exchange
    that answered "now" for as long as the test runs: no clock in the verdict)."""
    picker.placements.sharing = True
    picker.placements.exchanged_at = math.inf
    return picker


def test_among_equal_prefixes_the_least_loaded_holder_wins_and_a_longer_one_first() -> None:
    picker = shared(Picker(rng=random.Random(3)))
    system = PROMPT[:2000]
    for holder in ("a", "b", "c"):
        picker.placements.record(holder, block_ids(system, "m"))
    view = fleet(a=3, b=1, c=2, d=0)
    assert picker.pick(view, "m", prompt=system + "a new conversation " * 20) == "b"
    picker.placements.record("c", block_ids(PROMPT, "m"))
    assert picker.pick(view, "m", prompt=PROMPT + "next turn") == "c"


# --- replicas without shared placements agree by a hash -----------------------------------

SIX = {e: 1 for e in "abcdef"}


def conversation(k: int) -> str:
    """A conversation's first turn: the system prompt, then a document of its own."""
    return PROMPT[:2000] + text(1500, seed=100 + k)


def knows_head(picker: P, holders: str) -> P:
    """``picker``'s (or a Router's) placements after three other conversations went to
    ``holders`` in turn: the system prompt is a head two of them went on from
    differently (a fork)."""
    for k in (1, 2, 3):
        picker.placements.record(holders[k % len(holders)], block_ids(conversation(-k), "m"))
    return picker


def test_replicas_without_shared_placements_send_a_conversation_to_one_engine() -> None:
    """Two replicas that each know the system prompt on other engines (one engine only,
    for the second), and nothing of each other's picks, choose the same engine for each
    new conversation (the hash of its first block past the head), and spread the
    conversations over the fleet."""
    one = knows_head(Picker(rng=random.Random(1)), "ab")
    two = knows_head(Picker(rng=random.Random(2)), "c")
    view = fleet(**SIX)
    chosen = []
    for k in range(40):
        a = one.pick(view, "m", prompt=conversation(k))
        assert a == two.pick(view, "m", prompt=conversation(k)), k
        # the next turn, at either replica: still there (its own placement or the hash)
        follow_up = conversation(k) + text(600, seed=900 + k)
        assert one.pick(view, "m", prompt=follow_up) == a, k
        assert two.pick(view, "m", prompt=follow_up) == a, k
        chosen.append(a)
    assert len(set(chosen)) == 6  # every engine gets conversations
    assert max(Counter(chosen).values()) <= 14  # of 40: no engine takes them all


def test_the_hash_is_shared_the_bound_and_a_longer_holder_still_rule() -> None:
    head = len(block_ids(PROMPT[:2000], "m"))
    prompt = conversation(0)
    ids = block_ids(prompt, "m")
    order = rank(ids[head], dict.fromkeys("abcdef", 1.0))
    assert order == rank(ids[head], dict.fromkeys("fedcba", 1.0))  # any listing order
    # The head is known once two prompts went on from it differently, not before.
    picker = Picker(rng=random.Random(5))
    assert picker.placements.head(ids, len(ids)) == 0
    knows_head(picker, "ab")
    assert picker.placements.head(ids, len(ids)) == head
    assert picker.placements.head(ids, head - 1) == 0  # only as far as it is held
    # Unshared: the first in the hash's order, that order within the bound, then the rule.
    for loads, expected in (
        (SIX, order[0]),
        ({**SIX, order[0]: 9}, order[1]),  # past 1.5 x 2 + 2: the second
        ({**SIX, order[0]: 9, order[1]: 9}, None),  # both past: the rule without the hash
    ):
        picker = knows_head(Picker(rng=random.Random(5)), "ab")
        got = picker.pick(fleet(**loads), "m", prompt=prompt)
        if expected is None:
            assert got in "ab" and got not in order[:2], loads
        else:
            assert got == expected, loads
    # A holder of this prompt's own blocks (past the head) keeps it.
    picker = knows_head(Picker(rng=random.Random(5)), "ab")
    own = next(e for e in "cdef" if e != order[0])
    picker.placements.record(own, ids[:-1])
    assert picker.pick(fleet(**SIX), "m", prompt=prompt) == own
    # Shared placements: no hash; the least loaded holder of the head.
    picker = knows_head(shared(Picker(rng=random.Random(5))), "ab")
    assert picker.pick(fleet(**{**SIX, "a": 2}), "m", prompt=prompt) == "b"


def test_a_replica_that_knows_itself_alone_keeps_the_rule_until_it_hears_another() -> None:
    """On the fleet's shared counts with no other replica sending (one gateway), there
    is nothing to agree with: the head's least loaded holder, as with shared placements.
    Once another replica has requests in flight, the hash."""
    head = len(block_ids(PROMPT[:2000], "m"))
    tops = {k: rank(block_ids(conversation(k), "m")[head], SIX)[0] for k in range(50)}
    k1, k2 = [k for k, top in tops.items() if top not in "ab"][:2]
    clock = Clock()
    local = LocalLoad(clock=clock)
    fleet = FleetLoad("g1", clock=clock)  # a frozen clock: the counts stay current
    fleet.attach(local)
    pages = dict.fromkeys("abcdef", (0, 999_500))
    read_others(fleet, pages, {}, live=0)
    assert fleet.answered_within(1.0) and fleet.peers == 0
    view = view_of(*(timed(e, models="m") for e in "abcdef"))
    router = knows_head(router_on(view, local=local, fleet=fleet, seed=6), "ab")
    with router.pick("m", prompt=conversation(k1)) as ticket:
        assert ticket.id in ("a", "b")
    read_others(fleet, pages, {"c": 1}, now_ms=999_500)
    assert fleet.peers == 1
    with router.pick("m", prompt=conversation(k2)) as ticket:
        assert ticket.id == tops[k2]


def test_the_hash_order_is_the_documented_one_weighted_by_capacity() -> None:
    """docs/reader.md gives the rule, for gateways in other languages: an endpoint's
    salt is the BLAKE2b-64 of its id; for block id k, w = (k ^ salt) x
    0x9E3779B97F4A7C15 mod 2^64, h = w ^ (w >> 29), u = ((h >> 11) + 0.5) / 2^53, and
    its score weight / -ln(u), highest first."""
    weights = {"a": 1.0, "b": 2.0, "c": 0.5}
    scores = {}
    for e, weight in weights.items():
        salt = int.from_bytes(hashlib.blake2b(e.encode(), digest_size=8).digest(), "big")
        w = ((7 ^ salt) * 0x9E3779B97F4A7C15) & (2**64 - 1)
        scores[e] = weight / -math.log((((w ^ (w >> 29)) >> 11) + 0.5) / 2**53)
    assert rank(7, weights) == sorted(scores, key=scores.__getitem__, reverse=True)
    # pinned: the same in every process
    assert rank(7, dict.fromkeys("abc", 1.0)) == ["c", "a", "b"]
    assert rank(2**63 + 12345, dict.fromkeys("abcdef", 1.0)) == ["e", "b", "f", "d", "c", "a"]
    # Each endpoint is ranked first for a share of the keys in proportion to its weight.
    firsts = Counter(rank(k * 0x9E3779B1, {"big": 4.0, "small": 1.0})[0] for k in range(4000))
    assert 0.76 < firsts["big"] / 4000 < 0.84


def test_a_holder_that_may_not_take_the_request_is_passed_over() -> None:
    ids = block_ids(PROMPT, "m")
    cases = [
        (view_of(timed("a", kv_cache_usage="0.95", models="m"), timed("b", models="m")), None),
        (view_of(timed("a", age_ms=5000, models="m"), timed("b", models="m")), None),
        (view_of(timed("a", models="other"), timed("b", models="m")), None),
        (fleet(a=0, b=0), ["b"]),  # not among the caller's candidates
    ]
    for view, candidates in cases:
        picker = Picker(rng=random.Random(4))
        picker.placements.record("a", ids)
        assert picker.pick(view, "m", prompt=PROMPT, candidates=candidates) == "b"


def test_holders_a_pick_may_not_use_leave_room_for_one_it_may() -> None:
    """More holders of a longer prefix than ``MAX_HOLDERS``, none of them usable (not
    among the candidates, or gone from the view): the usable holder of a shorter prefix
    still takes the request."""
    system = text(BLOCK_BYTES * 4, seed=7)
    prompt = system + text(BLOCK_BYTES * 2, seed=8)
    for view_ids, candidates in (("abcdef", ["e", "f"]), ("ef", None)):
        for seed in range(20):
            picker = Picker(rng=random.Random(seed))
            for e in "abcd"[:MAX_HOLDERS]:
                picker.placements.record(e, block_ids(prompt, "m"))
            picker.placements.record("e", block_ids(system, "m"))
            view = view_of(*(timed(x, running="0", models="m") for x in view_ids))
            chosen = picker.pick(view, "m", prompt=prompt + " next", candidates=candidates)
            assert chosen == "e", (view_ids, seed)


def test_a_holder_whose_counters_went_back_is_no_holder() -> None:
    picker = Picker(rng=random.Random(5))
    ids = block_ids(PROMPT, "m")
    picker.placements.record("a", ids)
    picker.placements.observe("a", 500.0, 200.0)
    reset = view_of(
        timed("a", models="m", prefix_cache_queries_total="10", prefix_cache_hits_total="0"),
        timed("b", models="m", running="1"),
    )
    assert picker.pick(reset, "m", prompt=PROMPT) == "a"  # the least loaded, then recorded
    assert picker.placements.invalidated == 1
    assert picker.placements.matches(ids) == [("a", len(ids))]  # placed after the reset


def test_no_prompt_is_todays_pick_bit_for_bit() -> None:
    view = view_of(*(timed(f"e{i}", running=str(i % 4), models="m") for i in range(40)))
    local = LocalLoad()
    one, two = Picker(rng=random.Random(9)), Picker(rng=random.Random(9))
    a = [one.pick(view, "m", local=local) for _ in range(200)]
    b = [two.pick(view, "m", prompt=None, local=local) for _ in range(200)]
    assert a == b and len(two.placements) == 0


def test_the_router_keeps_the_placements_of_its_picks() -> None:
    router = router_on([timed(e, running="1", models="m") for e in "abc"], seed=6)
    with router.pick("m", prompt=PROMPT) as ticket:
        chosen = ticket.id
    assert router.placements.matches(block_ids(PROMPT, "m")) == [(chosen, 4000 // BLOCK_BYTES)]
    assert not router.placements_shared


@pytest.mark.parametrize(
    ("kw", "said"),
    [
        ({"prefix_load_factor": 0.5}, "prefix_load_factor must be a number >= 1"),
        ({"prefix_load_factor": float("inf")}, "prefix_load_factor"),
        ({"prefix_load_slack": -1}, "prefix_load_slack must be a number >= 0"),
        ({"prefix_load_slack": "2"}, "prefix_load_slack"),
    ],
)
def test_bad_prefix_settings_are_config_errors(kw: dict[str, object], said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        Picker(**kw)  # type: ignore[arg-type]


def test_a_prompt_that_is_not_text_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="prompt must be a str or None"):
        Picker().pick(fleet(a=0), "m", prompt=["hi"])  # type: ignore[arg-type]


def test_prompts_that_match_nothing_choose_what_the_load_only_pick_chooses() -> None:
    """The same seed, the same requests in flight, the same changes to the cache: a prefix
    picker given prompts no placement holds chooses exactly the load-only picker's
    endpoints (the prefix rule only ever moves a request to a holder)."""
    from tests.reader.test_pick import Clock, cache_of, raw_stats

    def run(prompted: bool) -> list[str | None]:
        rng = random.Random(21)
        cache = cache_of(*(lasting(timed(f"e{i}", models="m")) for i in range(12)))

        def update(endpoint_id: str, running: int) -> None:
            scraped = cache.now_ms()
            fields = raw_stats(scraped_at_ms=str(scraped), running=str(running), models="m")
            record = f"{scraped} 60000 {scraped + 60_000} p 1|" + json.dumps(fields)
            cache.set_stats(endpoint_id, record)

        for i in range(12):
            update(f"e{i}", i % 5)
        clock = Clock(100.0)
        router = router_on(cache, local=LocalLoad(clock), seed=22)
        chosen: list[str | None] = []
        for k in range(300):
            if k % 7 == 0:  # a stats update between picks: the index follows it
                update(f"e{rng.randrange(12)}", rng.randrange(6))
            prompt = f"conversation {k:05d} " + PROMPT if prompted else None
            ticket = router.pick("m", prompt=prompt)
            chosen.append(None if ticket is None else ticket.id)
            clock.t += 0.01
            if ticket is not None and not k % 2:
                ticket.done()  # every other one stays in flight
        if prompted:
            assert len(router.placements) == 300 * (len(PROMPT) // BLOCK_BYTES)
        return chosen

    load_only = run(prompted=False)
    assert None not in load_only and len(set(load_only)) > 3
    assert run(prompted=True) == load_only
