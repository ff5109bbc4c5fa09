"""The prefix bench's workloads: the prefix property, no shared prefix, reproducibility."""

from __future__ import annotations

import pytest

from poller.errors import ConfigError
from poller_lab.prefix.workload import (
    Shape,
    best_hit_rate,
    capacity_per_s,
    conversations,
    render,
    start_times,
)
from poller_lab.sim.openai import chat_text
from poller_lab.sim.prefix import block_ids

SMALL = Shape(system_prompts=2, system_chars=700, document_chars=900, question_chars=120)


def test_each_turn_extends_the_last_one_and_system_prompts_are_shared() -> None:
    convs = conversations("prefix-heavy", 30, seed=3, shape=SMALL)
    systems = {c.turns[0].messages[0]["content"] for c in convs}
    assert len(systems) == 2  # a handful shared by many conversations
    for conv in convs:
        assert SMALL.min_turns <= len(conv.turns) <= SMALL.max_turns
        assert conv.turns[0].think_s == 0 and all(t.think_s > 0 for t in conv.turns[1:])
        for before, after in zip(conv.turns, conv.turns[1:], strict=False):
            prompt, following = render(before.messages), render(after.messages)
            assert following.startswith(prompt + f"assistant: {before.answer}\n")
            assert len(before.answer) == 4 * before.max_tokens
        # The rendering is the engines' (the simulator's chat prompt).
        last = conv.turns[-1].messages
        assert render(last) == chat_text({"messages": [dict(m) for m in last]})
    documents = {c.turns[0].messages[1]["content"][:900] for c in convs}
    assert len(documents) == len(convs)  # a document of its own


def test_no_prefix_prompts_share_not_even_a_first_block() -> None:
    convs = conversations("no-prefix", 30, seed=3, shape=SMALL)
    heavy = conversations("prefix-heavy", 30, seed=3, shape=SMALL)
    firsts: set[int] = set()
    every: set[int] = set()
    requests = 0
    for conv in convs:
        for turn in conv.turns:
            ids = block_ids(render(turn.messages))
            assert ids[0] not in firsts
            assert not every & set(ids)
            firsts.add(ids[0])
            every.update(ids)
            requests += 1
    assert requests == sum(len(c.turns) for c in heavy)  # the same requests otherwise
    assert best_hit_rate(convs) == 0.0
    assert best_hit_rate(heavy) > 0.5


def test_the_same_seed_gives_the_same_workload_and_another_seed_another() -> None:
    assert conversations("prefix-heavy", 5, 7, SMALL) == conversations("prefix-heavy", 5, 7, SMALL)
    assert conversations("prefix-heavy", 5, 7, SMALL) != conversations("prefix-heavy", 5, 8, SMALL)
    assert start_times(10, 2.0, 1) == start_times(10, 2.0, 1)
    times = start_times(200, 2.0, 1)
    assert times == sorted(times) and 60 < times[-1] < 140  # about 100 s at 2 per second


def test_capacity_at_the_best_hit_rate_is_higher_than_without_a_cache() -> None:
    heavy = conversations("prefix-heavy", 40, 1, SMALL)
    none = conversations("no-prefix", 40, 1, SMALL)
    assert capacity_per_s(heavy, 28, 4000, 50) > capacity_per_s(none, 28, 4000, 50)
    # Without a cache: every token prefilled, then decoded.
    turns = [t for c in none for t in c.turns]
    service = sum(len(render(t.messages)) // 4 / 4000 + t.max_tokens / 50 for t in turns)
    assert capacity_per_s(none, 28, 4000, 50) == pytest.approx(28 / (service / len(turns)))


def test_bad_workload_arguments_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="unknown workload"):
        conversations("prefixy", 1, 1)
    with pytest.raises(ConfigError, match="min_turns"):
        Shape(min_turns=5, max_turns=2)
    with pytest.raises(ConfigError, match="rate_per_s"):
        start_times(3, 0.0, 1)
