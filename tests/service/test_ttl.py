"""Stats outlive a takeover: the TTL rule, and a SIGKILL at a 1 s interval read throughout."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from poller.config import CoordinationSettings, Settings
from poller.errors import StoreError
from poller.reader import StatsReader
from poller.schema.endpoint import endpoint_from_dict
from poller.service.ttl import TAKEOVER_MARGIN_MS, stats_ttl_ms, takeover_ms
from poller.store.store import RedisStore
from poller_lab.sim import Simulator, fleet
from tests.support.procs import pollers, until
from tests.support.redisproc import RedisProcess

DEFAULTS = CoordinationSettings()


def test_takeover_bound_adds_up_the_steps_of_a_takeover() -> None:
    # interval 1 s, timeout 0.5 s: last write up to 1.5 s old, lapse 2 s, heartbeat 0.5 s
    # plus one reconcile pass 1 s, the new owner's scrape 0.5 s, the margin.
    assert takeover_ms(1.0, 0.5, DEFAULTS) == 1500 + 2000 + 1500 + 500 + TAKEOVER_MARGIN_MS
    slow = CoordinationSettings(lease_ttl_ms=10_000, member_ttl_ms=4000)
    assert takeover_ms(1.0, 0.5, slow) - takeover_ms(1.0, 0.5, DEFAULTS) == 8000


def test_stats_ttl_is_the_longer_of_the_intervals_and_the_takeover() -> None:
    # At 1 s, three intervals (3 s) are shorter than a takeover: the takeover decides.
    assert stats_ttl_ms(1.0, 0.5, DEFAULTS, 3.0) == takeover_ms(1.0, 0.5, DEFAULTS) == 6000
    # At the 2 s default too (a kill just before a write leaves a 3 s old record).
    assert stats_ttl_ms(2.0, 1.0, DEFAULTS, 3.0) == 8000
    # Long intervals keep their multiple.
    assert stats_ttl_ms(30.0, 1.0, DEFAULTS, 3.0) == 90_000
    assert stats_ttl_ms(1.0, 0.5, DEFAULTS, 20.0) == 20_000


@pytest.mark.parametrize("interval_s", [0.25, 0.5, 1.0, 2.0, 5.0, 60.0])
def test_every_accepted_setting_gets_a_ttl_above_its_takeover(interval_s: float) -> None:
    s = Settings.model_validate({"scrape": {"interval_s": interval_s}})
    c, sc = s.coordination, s.scrape
    ttl = stats_ttl_ms(sc.interval_s, sc.timeout_s, c, sc.stats_ttl_intervals)
    lapse_ms = max(c.lease_ttl_ms, c.member_ttl_ms)
    assert ttl >= (sc.interval_s + 2 * sc.timeout_s) * 1000 + lapse_ms + c.heartbeat_interval_ms


NS = "ttl"


@pytest.mark.slow
@pytest.mark.parametrize("lapse_ms", [None, 3000], ids=["default-ttls", "3s-ttls"])
async def test_sigkill_at_interval_1_never_shows_unknown(
    own_redis: RedisProcess, tmp_path: Path, lapse_ms: int | None
) -> None:
    """Two pollers at --interval 1; one is killed just before a write (its record is
    oldest then); the view is read every 50 ms until its endpoints are written by the
    survivor: they read fresh or stale, never unknown. With 3 s lease and member TTLs,
    records living 3 intervals would expire before any takeover could write them."""
    env = {}
    if lapse_ms is not None:
        env = {
            "POLLER_COORDINATION__LEASE_TTL_MS": str(lapse_ms),
            "POLLER_COORDINATION__MEMBER_TTL_MS": str(lapse_ms),
        }
    client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    store, reader = RedisStore(client, NS), StatsReader(client, NS)
    try:
        async with Simulator(fleet(8, engines=("vllm",)), seed=23) as sim:
            entries = {e["id"]: endpoint_from_dict(None, e) for e in sim.registry()}
            await store.replace_registry(entries)
            with pollers(2, own_redis.url, NS, tmp_path, interval_s=1.0, env=env) as procs:

                async def owners() -> dict[str, str] | None:
                    view = await reader.snapshot()
                    if len(view.endpoints) != 8 or any(
                        e.state != "fresh" or e.stats is None for e in view.endpoints.values()
                    ):
                        return None
                    found = {e.id: e.stats.poller for e in view.endpoints.values() if e.stats}
                    return found if set(found.values()) == {"p0", "p1"} else None

                owned = await until(owners, 30, "both pollers writing, every endpoint fresh")
                assert isinstance(owned, dict)
                victims = sorted(e for e, p in owned.items() if p == "p0")
                seen: dict[str, set[str]] = {e: set() for e in entries}

                async def a_victim_is_due() -> bool:
                    view = await reader.snapshot()
                    return any((view[e].age_ms or 0) >= 700 for e in victims)

                await until(a_victim_is_due, 30, "a record of p0 close to its next write", 0.02)
                killed_at_ms = time.time() * 1000
                procs[0].signal(signal.SIGKILL)

                async def taken_over() -> bool:
                    try:
                        view = await reader.snapshot()
                    except StoreError:
                        return False
                    for e in view.endpoints.values():
                        seen[e.id].add(e.state)
                    return all(
                        (s := view[e].stats) is not None
                        and s.poller == "p1"
                        and s.scraped_at_ms > killed_at_ms
                        for e in victims
                    )

                # Generous: the takeover takes ~3 s; the records live 6 s (service/ttl.py).
                await until(taken_over, 30, "p1 writing p0's endpoints", interval_s=0.05)
                for _ in range(10):  # and a little after it
                    await taken_over()
                    await asyncio.sleep(0.05)
                assert all("unknown" not in states for states in seen.values()), seen
                assert all(seen[e] <= {"fresh", "stale"} for e in victims), seen
    finally:
        await client.aclose()
