from __future__ import annotations

import random
from collections import Counter

import fakeredis
import pytest

from poller.config import CoordinationSettings
from poller.service.coordinator import Coordinator, assign, owner_of, weight
from poller.store.store import RedisStore

IDS = [f"endpoint-{i}" for i in range(1000)]


def test_weight_is_stable_across_processes() -> None:
    # fixed values: a salted hash() would differ from run to run
    assert weight("poller-a", "e1") == weight("poller-a", "e1")
    assert owner_of("e1", ["b", "a"]) == owner_of("e1", ["a", "b"])
    assert owner_of("e1", []) is None
    assert assign([], IDS) == {}


def test_pinned_weight_value() -> None:
    # Every poller and every language must agree: blake2b-64 of b"member\\0endpoint".
    import hashlib

    expected = int.from_bytes(hashlib.blake2b(b"m\x00e", digest_size=8).digest(), "big")
    assert weight("m", "e") == expected


def test_balance_with_three_members() -> None:
    owners = assign(["p0", "p1", "p2"], IDS)
    counts = Counter(owners.values())
    mean = len(IDS) / 3
    assert max(counts.values()) / mean <= 1.15, counts


def test_adding_a_member_moves_few_and_only_to_it() -> None:
    before = assign(["p0", "p1", "p2"], IDS)
    after = assign(["p0", "p1", "p2", "p3"], IDS)
    moved = [e for e in IDS if before[e] != after[e]]
    assert all(after[e] == "p3" for e in moved)
    assert len(moved) <= 1.3 * len(IDS) / 4, len(moved)
    assert len(moved) >= 0.7 * len(IDS) / 4


def test_removing_a_member_moves_only_its_endpoints() -> None:
    before = assign(["p0", "p1", "p2"], IDS)
    after = assign(["p0", "p2"], IDS)
    assert [e for e in IDS if before[e] != after[e]] == [e for e in IDS if before[e] == "p1"]


def coordinators(n: int, server: fakeredis.FakeServer) -> list[Coordinator]:
    settings = CoordinationSettings()
    return [
        Coordinator(
            RedisStore(fakeredis.FakeAsyncRedis(server=server, decode_responses=True), "t"),
            f"p{i}",
            settings,
        )
        for i in range(n)
    ]


async def assert_single_owners(coords: list[Coordinator]) -> None:
    holders: Counter[str] = Counter()
    for c in coords:
        holders.update(c.held.keys())
        for e, token in c.held.items():
            assert await c.store.lease_holder(e) == (c.poller_id, token)
    assert all(n == 1 for n in holders.values()), holders.most_common(3)


async def test_reconcile_converges_without_double_ownership() -> None:
    server = fakeredis.FakeServer()
    coords = coordinators(4, server)
    ids = IDS[:200]
    rng = random.Random(7)
    active = coords[:3]
    for c in active:
        await c.heartbeat()
    for _ in range(3):
        for c in rng.sample(active, len(active)):
            await c.heartbeat()
            await c.reconcile(ids)
            await assert_single_owners(coords)
    assert sum(len(c.held) for c in active) == len(ids)
    want = assign([c.poller_id for c in active], ids)
    for c in active:
        assert set(c.held) == {e for e, o in want.items() if o == c.poller_id}

    # a fourth joins: the others release what it now wins, it takes them over
    active.append(coords[3])
    for _ in range(3):
        for c in rng.sample(active, len(active)):
            await c.heartbeat()
            result = await c.reconcile(ids)
            await assert_single_owners(coords)
            assert not (set(result.gained) & set(result.lost))
    want = assign([c.poller_id for c in active], ids)
    for c in active:
        assert set(c.held) == {e for e, o in want.items() if o == c.poller_id}

    # one leaves gracefully: its endpoints are free at once, survivors take them
    leaving = active.pop(1)
    assert await leaving.leave() > 0
    for c in active:
        await c.heartbeat()
        await c.reconcile(ids)
    await assert_single_owners(coords)
    assert sum(len(c.held) for c in active) == len(ids)


async def test_reconcile_gives_up_removed_and_stolen_endpoints() -> None:
    server = fakeredis.FakeServer()
    [c] = coordinators(1, server)
    await c.heartbeat()
    result = await c.reconcile(["a", "b", "c"])
    assert sorted(result.gained) == ["a", "b", "c"]
    await c.store.client.set("{t}:lease:b", "other 99")
    result = await c.reconcile(["a", "b"])  # c removed from the registry, b stolen
    assert sorted(result.lost) == ["b", "c"]
    assert sorted(c.held) == ["a"]
    assert await c.store.lease_holder("b") == ("other", 99)  # never released someone else's
    result = await c.reconcile(["a", "b"])
    assert result.contested == ["b"] and not result.gained


async def test_non_member_owns_nothing() -> None:
    server = fakeredis.FakeServer()
    [c] = coordinators(1, server)
    result = await c.reconcile(["a"])  # no heartbeat yet
    assert not result.gained and not c.held


@pytest.mark.parametrize(
    "bad",
    [
        {"heartbeat_interval_ms": 1000, "member_ttl_ms": 2000},
        {"reconcile_interval_ms": 1500, "lease_ttl_ms": 2000},
    ],
)
def test_coordination_settings_are_validated(bad: dict[str, int]) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        CoordinationSettings(**bad)


async def test_leases_of_a_dead_holder_are_reported_as_orphaned() -> None:
    server = fakeredis.FakeServer()
    [c] = coordinators(1, server)
    await c.heartbeat()
    await c.store.client.set("{t}:lease:a", "ghost 5")  # held by a poller that is gone
    result = await c.reconcile(["a", "c"])
    assert result.contested == ["a"] and result.orphaned == ["a"]
    assert sorted(result.gained) == ["c"]
