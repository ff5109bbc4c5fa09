"""Several real `poller run` processes against real Redis and the engine simulator.

Each test is bounded in time; pollers are stopped by pid at the end whatever happens.
Figures (takeover time, gaps) are asserted with slack for noisy machines; the benchmark
prints the real numbers.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from poller.reader import StatsReader
from poller.reader.view import View
from poller.schema.endpoint import endpoint_from_dict
from poller.store.store import RedisStore
from poller_lab.sim import EndpointSpec, Simulator, fleet
from tests.support.procs import pollers, until
from tests.support.redisproc import RedisProcess

pytestmark = pytest.mark.slow
NS = "it"


@pytest.fixture
async def env(own_redis: RedisProcess) -> AsyncIterator[tuple[RedisStore, StatsReader]]:
    client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    yield RedisStore(client, NS), StatsReader(client, NS)
    await client.aclose()


async def register(store: RedisStore, sim: Simulator) -> None:
    entries = {e["id"]: endpoint_from_dict(None, e) for e in sim.registry()}
    await store.replace_registry(entries)


async def all_fresh(reader: StatsReader, n: int) -> View | None:
    view = await reader.snapshot()
    ok = len(view.endpoints) == n and all(e.state == "fresh" for e in view.endpoints.values())
    return view if ok else None


async def fresh_and_shared(reader: StatsReader, n: int, ids: set[str]) -> View | None:
    """All ``n`` endpoints fresh and every poller of ``ids`` owning some: on a loaded
    machine one poller may start seconds after the others, which scrape everything."""
    view = await all_fresh(reader, n)
    return view if view and set(owners(view).values()) == ids else None


def owners(view: View) -> dict[str, str]:
    return {e.id: e.stats.poller for e in view.endpoints.values() if e.stats is not None}


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


async def test_one_scrape_per_interval_balance_and_sigkill_takeover(
    own_redis: RedisProcess, env: tuple[RedisStore, StatsReader], tmp_path: Path
) -> None:
    store, reader = env
    async with Simulator(fleet(30), seed=1) as sim:
        await register(store, sim)
        with pollers(3, own_redis.url, NS, tmp_path) as procs:
            # Process start on a loaded machine takes seconds: the start-up waits are ample.
            view = await until(
                lambda: fresh_and_shared(reader, 30, {"p0", "p1", "p2"}),
                60,
                "every endpoint fresh, every poller owning some",
            )
            assert isinstance(view, View) and sorted(view.pollers) == ["p0", "p1", "p2"]
            await asyncio.sleep(1.0)
            sim.reset_hits()
            await asyncio.sleep(5.0)
            for endpoint_id in sim.ids:
                times = sim.hit_times(endpoint_id)
                assert 4 <= len(times) <= 6, (endpoint_id, len(times))
                assert min(gaps(times)) > 0.6, (endpoint_id, gaps(times))  # no duplicates

            view = await reader.snapshot()
            owned = owners(view)
            assert set(Counter(owned.values())) == {"p0", "p1", "p2"}
            victims = [e for e, o in owned.items() if o == "p0"]
            t0 = time.time()
            procs[0].signal(signal.SIGKILL)
            taken: dict[str, float] = {}

            async def all_taken() -> bool:
                snap = await reader.snapshot()
                for e in victims:
                    s = snap[e].stats
                    if e not in taken and s and s.poller != "p0" and s.scraped_at_ms > t0 * 1000:
                        taken[e] = s.scraped_at_ms / 1000 - t0
                return len(taken) == len(victims)

            await until(all_taken, 30, "takeover of p0's endpoints")  # bound asserted below
            assert max(taken.values()) < 3.5, sorted(taken.values())


async def test_sigterm_hands_over_without_missing_an_interval(
    own_redis: RedisProcess, env: tuple[RedisStore, StatsReader], tmp_path: Path
) -> None:
    store, reader = env
    async with Simulator(fleet(15, engines=("vllm",)), seed=2) as sim:
        await register(store, sim)
        with pollers(3, own_redis.url, NS, tmp_path) as procs:
            await until(
                lambda: fresh_and_shared(reader, 15, {"p0", "p1", "p2"}),
                60,
                "every endpoint fresh, every poller owning some",
            )
            await asyncio.sleep(1.5)
            mine = [e for e, o in owners(await reader.snapshot()).items() if o == "p1"]
            assert mine
            sim.reset_hits()
            # p1 has scraped each of its endpoints since, so the handover's gap is seen
            await until(lambda: all(sim.hit_times(e) for e in mine), 30, "p1's scrapes")
            procs[1].signal(signal.SIGTERM)
            assert await asyncio.to_thread(procs[1].wait, 30) == 0
            assert "left the members: released" in procs[1].log()
            stopped = time.time()

            def scraped_thrice_since() -> bool:
                return all(len([t for t in sim.hit_times(e) if t > stopped]) >= 3 for e in mine)

            await until(scraped_thrice_since, 30, "three scrapes of each after the handover")
            for e in mine:
                g = gaps(sim.hit_times(e))
                assert len(g) >= 3 and max(g) < 1.6, (e, g)  # nothing skipped
                assert min(g) > 0.5, (e, g)  # nothing doubled
            view = await reader.snapshot()
            assert set(owners(view).values()) == {"p0", "p2"}


async def test_paused_poller_never_writes_with_its_old_token(
    own_redis: RedisProcess, env: tuple[RedisStore, StatsReader], tmp_path: Path
) -> None:
    store, reader = env
    async with Simulator(fleet(8, engines=("vllm",)), seed=3) as sim:
        await register(store, sim)
        with pollers(2, own_redis.url, NS, tmp_path) as procs:
            mark = len(procs[0].log())
            before = await until(
                lambda: fresh_and_shared(reader, 8, {"p0", "p1"}),
                60,
                "every endpoint fresh, every poller owning some",
            )
            assert isinstance(before, View)
            old = {e.id: e.token for e in before.endpoints.values() if e.owner == "p0"}
            assert old
            procs[0].signal(signal.SIGSTOP)

            async def taken_over() -> bool:
                snap = await reader.snapshot()
                return all(snap[e].stats and snap[e].stats.poller == "p1" for e in old)  # type: ignore[union-attr]

            await until(taken_over, 30, "p1 taking over")
            procs[0].signal(signal.SIGCONT)

            async def no_stale_write_and_old_jobs_gone() -> bool:
                snap = await reader.snapshot()
                for e, token in old.items():
                    s = snap[e].stats
                    if s is not None and s.poller == "p0":
                        assert token is not None and s.token > token, "stale token accepted"
                # Watch until p0 has ended every job it ran under an old token (it logs
                # each drop): a stale write, if any, would come before that.
                log = procs[0].log()[mark:]
                return all(f"dropped endpoint={e} " in log for e in old)

            await until(no_stale_write_and_old_jobs_gone, 45, "p0 dropping its old-token jobs")
            await until(lambda: all_fresh(reader, 8), 30, "fresh again after resume")
            await no_stale_write_and_old_jobs_gone()


async def test_registry_changes_are_followed_within_a_second(
    own_redis: RedisProcess, env: tuple[RedisStore, StatsReader], tmp_path: Path
) -> None:
    store, reader = env
    async with Simulator(fleet(4, engines=("vllm",)), seed=4) as sim:
        await register(store, sim)
        with pollers(2, own_redis.url, NS, tmp_path) as procs:
            await until(lambda: all_fresh(reader, 4), 60, "all endpoints fresh")
            await sim.add(EndpointSpec("late", "sglang"))
            t0 = time.monotonic()
            await store.put_endpoint(
                endpoint_from_dict(
                    None, {"id": "late", "url": sim.base_url("late"), "engine": "sglang"}
                )
            )
            await until(lambda: store.lease_holder("late"), 10, "lease on the new endpoint")
            assert time.monotonic() - t0 < 1.5  # bound of the behaviour: events, not polling
            await until(lambda: all_fresh(reader, 5), 30, "new endpoint fresh")

            gone = sim.ids[0]
            marks = [len(p.log()) for p in procs]
            await store.remove_endpoint(gone)

            def job_dropped() -> bool:  # its holder logs the drop of the job
                logs = [p.log()[m:] for p, m in zip(procs, marks, strict=True)]
                return any(f"dropped endpoint={gone} " in log for log in logs)

            await until(job_dropped, 30, f"the job of {gone} dropped")
            sim.reset_hits(gone)
            await asyncio.sleep(2.0)
            assert sim.hits(gone) == 0
            assert await store.lease_holder(gone) is None


FAULTS = {
    "down": ("down", {}, "unreachable"),
    "slow": ("slow", {"delay_s": 3.0}, "timeout"),
    "hang": ("hang", {}, "timeout"),
    "e500": ("http500", {}, "http_status"),
    "e401": ("http401", {}, "auth"),
    "junk": ("garbage", {}, "parse"),
    "huge": ("oversized", {"mb": 10.0}, "too_large"),
    "miss": ("missing", {}, "contract"),
    "json": ("json", {}, "parse"),
}


async def test_engine_faults_are_written_with_their_reason(
    own_redis: RedisProcess, env: tuple[RedisStore, StatsReader], tmp_path: Path
) -> None:
    store, reader = env
    specs = [EndpointSpec(e, "vllm", "port") for e in FAULTS]
    async with Simulator(specs, seed=5) as sim:
        await register(store, sim)
        with pollers(1, own_redis.url, NS, tmp_path, extra_args=("--timeout", "0.5")) as procs:
            await until(lambda: all_fresh(reader, len(FAULTS)), 60, "all endpoints fresh")
            for endpoint_id, (mode, params, _) in FAULTS.items():
                await sim.set_fault(endpoint_id, mode, **params)
            seen: dict[str, tuple[str, bool]] = {}

            async def all_failing() -> bool:
                snap = await reader.snapshot()
                for e in FAULTS:
                    failure = snap[e].failure
                    if failure is not None and e not in seen:
                        seen[e] = (failure.reason, snap[e].stats is not None)
                return len(seen) == len(FAULTS)

            await until(all_failing, 30, "every fault recorded")
            assert {e: r for e, (r, _) in seen.items()} == {e: f[2] for e, f in FAULTS.items()}
            assert all(kept for _, kept in seen.values()), seen  # last good stats kept
            assert "reason=contract" in procs[0].log() and "WARNING" in procs[0].log()
            for endpoint_id in FAULTS:
                await sim.set_fault(endpoint_id, "ok")
            await until(lambda: all_fresh(reader, len(FAULTS)), 30, "recovery")
