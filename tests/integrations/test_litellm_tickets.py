"""Tickets: every routed request ends exactly once in the Router's count, however it ends."""

from __future__ import annotations

import asyncio
from typing import Any

import litellm

from poller.integrations.litellm.tickets import Tickets
from poller.reader.load.local import LocalLoad
from poller.reader.router import Router
from poller.reader.view.cache import ViewCache


def counting(clock: Any = None) -> tuple[Router, LocalLoad]:
    """A Router (on an empty view: ``track`` needs none) and its count."""
    local = LocalLoad() if clock is None else LocalLoad(clock)
    return Router(ViewCache(), local=local), local


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_callback_closes_the_oldest_ticket_of_its_key_once() -> None:
    router, local = counting()
    tickets = Tickets()
    first = tickets.open(router.track("e1"), ("t", "d1"), stream=False)
    tickets.open(router.track("e1"), ("t", "d1"), stream=False)  # a retry to the same deployment
    assert local.in_flight("e1") == 2
    assert tickets.close_key(("t", "d1"))
    assert not first.open and local.in_flight("e1") == 1
    tickets.close(first)  # a second end of the same attempt: nothing
    assert local.in_flight("e1") == 1
    assert tickets.close_key(("t", "d1"))
    assert not tickets.close_key(("t", "d1"))  # a late duplicate callback
    assert local.in_flight("e1") == 0 and tickets.in_flight() == 0


def test_a_failure_callback_counts_the_attempt_as_failed() -> None:
    router, local = counting()
    tickets = Tickets()
    tickets.open(router.track("e1"), ("t", "d1"), stream=False)
    assert tickets.close_key(("t", "d1"), ok=False)
    assert local.in_flight("e1") == 0 and local.failing("e1") > 0.2
    tickets.open(router.track("e2"), ("t", "d2"), stream=False)
    assert tickets.close_key(("t", "d2"))
    assert local.failing("e2") == 0.0


async def test_a_task_ends_what_it_picked_except_the_stream_it_handed_on() -> None:
    router, local = counting()
    tickets = Tickets()

    async def request(stream_last: bool) -> None:
        tickets.open(
            router.track("e1"), ("t1", "d1"), stream=False
        )  # an attempt that failed unlogged
        tickets.open(router.track("e2"), ("t1", "d2"), stream=stream_last)

    await asyncio.create_task(request(stream_last=True))
    await asyncio.sleep(0)  # a task's done callbacks run one loop turn after its awaiter's
    assert (local.in_flight("e1"), local.in_flight("e2")) == (0, 1)  # the stream goes on
    assert tickets.close_key(("t1", "d2"))  # its success callback, at the stream's end
    await asyncio.create_task(request(stream_last=False))
    await asyncio.sleep(0)
    assert tickets.in_flight() == 0 and local.in_flight("e2") == 0


async def test_a_cancelled_task_ends_its_stream_too() -> None:
    router, local = counting()
    tickets = Tickets()
    opened = asyncio.Event()

    async def request() -> None:
        tickets.open(router.track("e1"), ("t1", "d1"), stream=True)
        opened.set()
        await asyncio.Event().wait()  # the client goes away here

    task = asyncio.create_task(request())
    await opened.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)
    assert local.in_flight("e1") == 0 and tickets.in_flight() == 0


def test_a_ticket_nobody_ends_expires_after_max_open_s() -> None:
    clock = Clock()
    router, local = counting(clock)
    tickets = Tickets(max_open_s=60.0, clock=clock)
    tickets.open(router.track("e1"), ("t1", "d1"), stream=True)
    clock.now += 59.0
    tickets.open(router.track("e2"), ("t2", "d2"), stream=False)
    assert local.in_flight("e1") == 1 and tickets.abandoned_total == 0
    clock.now += 2.0
    tickets.open(router.track("e3"), ("t3", "d3"), stream=False)  # expiry runs at each open
    assert local.in_flight("e1") == 0 and local.in_flight("e2") == 1
    assert tickets.abandoned_total == 1


def test_only_the_engines_faults_count_as_failures() -> None:
    """A failure callback for a request the engine rightly refused (400, a context
    window exceeded, 422) is no sign of a failing engine; a 404 for a model it does not
    serve, a 429, a timeout or a 5xx are."""
    from poller.integrations.litellm.strategy import _request_at_fault

    args = {"message": "m", "model": "x", "llm_provider": "openai"}
    blamed_request = [
        litellm.BadRequestError(**args),
        litellm.ContextWindowExceededError(**args),
        litellm.UnprocessableEntityError(
            message="m", model="x", llm_provider="openai", response=_response(422)
        ),
    ]
    blamed_engine = [
        litellm.NotFoundError(**args),
        litellm.RateLimitError(**args),
        litellm.Timeout(**args),
        litellm.InternalServerError(**args),
        litellm.ServiceUnavailableError(**args),
        litellm.APIConnectionError(**args),
        None,
    ]
    for exc in blamed_request:
        assert _request_at_fault({"exception": exc}), exc
    for exc in blamed_engine:
        assert not _request_at_fault({"exception": exc}), exc


def _response(status: int) -> Any:
    import httpx

    return httpx.Response(status, request=httpx.Request("POST", "http://engine/v1"))


async def test_a_task_that_routes_request_after_request_keeps_no_closed_tickets() -> None:
    # An SDK worker loop: one task, many requests, each ended by its callback.
    router, local = counting()
    tickets = Tickets()
    task = asyncio.current_task()
    assert task is not None
    for i in range(1000):
        ticket = tickets.open(router.track("e1"), (f"t{i}", "d1"), stream=False)
        assert tickets.close_key((f"t{i}", "d1"))
        assert ticket.task is None  # closed: keeps no task (and its result) alive
    assert len(tickets._by_task[task]) == 1  # its last pick only, which the task's end reads
    assert local.in_flight("e1") == 0 and tickets.in_flight() == 0
