"""One record per held lease: the token compared in one place, scrapes cancelled with it."""

from __future__ import annotations

import asyncio

from poller.service.owned import Holdings


def test_a_late_answer_about_an_old_token_leaves_the_current_record() -> None:
    holdings = Holdings()
    old = holdings.hold("e1", 7, confirmed_at=1.0)
    new = holdings.hold("e1", 9, confirmed_at=2.0)  # lost and re-acquired
    assert holdings.current("e1", 7) is None and holdings.current("e1", 9) is new
    assert holdings.discard("e1", 7) is None  # the old job's rejected write
    assert holdings.tokens() == {"e1": 9} and old is not new
    assert holdings.discard("e1", 9) is new and "e1" not in holdings and not holdings.tokens()


async def test_discarding_a_record_cancels_its_other_scrapes_but_not_the_caller() -> None:
    holdings = Holdings()
    record = holdings.hold("e1", 1, confirmed_at=0.0)
    never = asyncio.Event()
    other = asyncio.create_task(never.wait())
    record.tasks.add(other)

    async def rejected_write() -> bool:
        me = asyncio.current_task()
        assert me is not None
        record.tasks.add(me)
        holdings.discard("e1", 1)
        await asyncio.sleep(0)  # the caller goes on: it was not cancelled
        return me.cancelling() == 0

    assert await rejected_write()
    await asyncio.wait({other}, timeout=5)
    assert other.cancelled()


async def test_a_replaced_record_cancels_the_scrapes_of_the_old_one() -> None:
    holdings = Holdings()
    first = holdings.hold("e1", 1, confirmed_at=0.0)
    never = asyncio.Event()
    task = asyncio.create_task(never.wait())
    first.tasks.add(task)
    holdings.hold("e1", 2, confirmed_at=1.0)
    await asyncio.wait({task}, timeout=5)
    assert task.cancelled() and holdings.tokens() == {"e1": 2}
