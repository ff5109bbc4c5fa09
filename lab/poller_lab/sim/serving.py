"""The requests an endpoint actually serves: running slots, a FIFO queue, and their history.

A request holds one running slot for its prefill and its decode; when every slot is
taken it waits, first come first served. Once scheduled, its prompt is looked up in the
endpoint's prefix cache (``prefix.PrefixCache``) and its blocks stored; the prefill takes
``uncached prompt tokens / prefill_tps`` seconds (none when ``prefill_tps`` is None), then
the first token is out (``on_start``: a stream's first chunk), then the decode takes
``max_tokens / speed_tps`` seconds. The prefix-cache counters count tokens when the request
is scheduled, as vLLM's do; a prompt found whole still computes its last token. The
counts show on the endpoint's page on top of the synthetic background load (whose
running requests take slots too), and the page may trail the truth by ``lag_s``:
``at(t)`` answers what the queue was at time ``t`` from a history of every change, so a
lagging page needs no timer.

Time is the simulator's clock; the wait itself is ``hold(seconds)``, ``asyncio.sleep`` by
default, which tests replace with a gate they open, so no test depends on speed.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from poller_lab.sim.prefix import BLOCK_TOKENS, PrefixCache, block_ids, prompt_tokens

__all__ = ["Hold", "ServeQueue", "ServeState", "cached_tokens", "prompt_tokens"]

Hold = Callable[[float], Awaitable[None]]
#: History entries kept at most when nobody reads a lagging page.
_MAX_HISTORY = 100_000
#: Weight of the latest request in ``mean_service_s`` (an exponential average).
_SERVICE_ALPHA = 0.1


def cached_tokens(cache: PrefixCache, ids: list[int], tokens: int) -> int:
    """Tokens of a prompt the engine would not prefill: its cached leading blocks, less
    the last token when the prompt is found whole (vLLM computes it again)."""
    return max(0, min(tokens - 1, cache.cached_blocks(ids) * BLOCK_TOKENS))


class ServeState(NamedTuple):
    """The served requests at one moment (counters only grow)."""

    running: int = 0
    waiting: int = 0
    kv_tokens: int = 0  # prompt + max_tokens of the running requests
    prompt_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    gen_tokens: int = 0
    success: int = 0
    cached_blocks: int = 0  # blocks the prefix cache holds, running requests' included


class ServeQueue:
    """Slots and queue of one endpoint; ``busy()`` gives the background's running count."""

    def __init__(
        self,
        capacity: int,
        speed_tps: float,
        clock: Callable[[], float],
        *,
        busy: Callable[[], int] = lambda: 0,
        hold: Hold = asyncio.sleep,
        kv_blocks: int = 0,
        prefill_tps: float | None = None,
    ) -> None:
        self.capacity = capacity
        self.speed_tps = speed_tps
        self.prefill_tps = prefill_tps
        #: The prefix cache, as large as the KV pool (blocks of 16 tokens).
        self.cache = PrefixCache(kv_blocks)
        #: Seconds a request held its slot (prefill and decode), averaged exponentially.
        self.mean_service_s = 0.0
        self._clock = clock
        self._busy = busy
        self._hold = hold
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.state = ServeState()
        self.peak_waiting = 0
        self._history: deque[tuple[float, ServeState]] = deque(maxlen=_MAX_HISTORY)
        self._history.append((clock(), self.state))
        self._reserved = 0  # slots handed to woken waiters that have not yet started

    def _set(self, **changes: int) -> None:
        self.state = self.state._replace(**changes)
        self._history.append((self._clock(), self.state))

    def free_slots(self) -> int:
        return self.capacity - self._busy() - self.state.running - self._reserved

    def at(self, t: float) -> ServeState:
        """The state at time ``t``; history before ``t`` is dropped, so ``t`` only moves
        forward (``now - lag``); the state now is ``state``."""
        history = self._history
        while len(history) > 1 and history[1][0] <= t:
            history.popleft()
        first_t, first = history[0]
        return first if first_t <= t else ServeState()

    def reset_prefix_cache(self) -> None:
        """Every cached block dropped; the prefix-cache counters start again from zero."""
        self.cache.clear()
        self._set(prefix_queries=0, prefix_hits=0, cached_blocks=0)

    async def serve(
        self,
        prompt: str,
        max_tokens: int,
        on_start: Callable[[], Awaitable[None]] | None = None,
    ) -> float:
        """Run one request to the end; returns the seconds it waited for a slot.
        ``on_start`` runs once the prefill is done (a stream's first chunk)."""
        tokens = prompt_tokens(prompt)
        queued_at = self._clock()
        if self._waiters or self.free_slots() <= 0:
            await self._wait()
            self._reserved -= 1
        waited_s = self._clock() - queued_at
        ids = block_ids(prompt)
        hits = cached_tokens(self.cache, ids, tokens)
        self.cache.store(ids)
        s = self.state
        self._set(
            running=s.running + 1,
            kv_tokens=s.kv_tokens + tokens + max_tokens,
            prompt_tokens=s.prompt_tokens + tokens,
            prefix_queries=s.prefix_queries + tokens,
            prefix_hits=s.prefix_hits + hits,
            cached_blocks=len(self.cache),
        )
        prefill_s = (tokens - hits) / self.prefill_tps if self.prefill_tps else 0.0
        decode_s = max_tokens / self.speed_tps
        self.mean_service_s += _SERVICE_ALPHA * (prefill_s + decode_s - self.mean_service_s)
        try:
            if prefill_s > 0:
                await self._hold(prefill_s)
            if on_start is not None:
                await on_start()
            await self._hold(decode_s)
        finally:
            s = self.state
            self._set(
                running=s.running - 1,
                kv_tokens=s.kv_tokens - tokens - max_tokens,
                gen_tokens=s.gen_tokens + max_tokens,
                success=s.success + 1,
            )
            self._admit()
        return waited_s

    def poke(self) -> None:
        """The background freed slots: start what waits for them."""
        self._admit()

    async def _wait(self) -> None:
        future = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        self._set(waiting=self.state.waiting + 1)
        self.peak_waiting = max(self.peak_waiting, self.state.waiting)
        try:
            await future
        except BaseException:
            # A client that hangs up while queued leaves the queue (or hands its slot on).
            if future in self._waiters:
                self._waiters.remove(future)
                self._set(waiting=self.state.waiting - 1)
            elif future.done() and not future.cancelled():
                self._reserved -= 1
                self._admit()
            raise

    def _admit(self) -> None:
        """Wake queued requests, oldest first, while slots are free; each gets its slot
        reserved at once, so a newcomer cannot overtake it before it runs."""
        while self._waiters and self.free_slots() > 0:
            future = self._waiters.popleft()
            if future.done():
                continue
            self._reserved += 1
            self._set(waiting=self.state.waiting - 1)
            future.set_result(None)
