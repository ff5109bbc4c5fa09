"""The prefix benchmark's clients: conversations sent through the gateways.

Each conversation starts at its offset and sends its turns one after the other: a turn
goes out its think time after the previous answer ended. Each turn goes to the gateway a
hash of (conversation, turn) names, as a load balancer in front of the gateways spreads
requests, so a conversation's turns land on different gateways. Every request streams;
time to first token is until the first chunk of the body, latency until its end. A turn
not sent by ``deadline_s`` is not sent at all (``cut``): an overloaded fleet's queues
would otherwise keep a cell running for many minutes.
"""

from __future__ import annotations

import asyncio
import math
import time
import zlib
from collections.abc import Sequence
from typing import Any

import aiohttp

from poller_lab.prefix.workload import Conversation

__all__ = ["REQUEST_TIMEOUT_S", "drive", "gateway_for"]

REQUEST_TIMEOUT_S = 150.0


def gateway_for(conversation_id: str, turn: int, gateways: int) -> int:
    """The gateway of one turn: a stable hash, the same in every run."""
    return zlib.crc32(f"{conversation_id}:{turn}".encode()) % gateways


async def _send(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, str, float | None, float]:
    """(status, endpoint the gateway named, seconds to the first chunk, seconds in all)."""
    t0 = time.monotonic()
    first: float | None = None
    try:
        async with http.post(url, json=body) as response:
            endpoint = response.headers.get("x-gateway-endpoint", "")
            async for chunk in response.content.iter_any():
                if chunk and first is None:
                    first = time.monotonic() - t0
            status = response.status
    except (aiohttp.ClientError, TimeoutError):
        status, endpoint = 0, ""
    return status, endpoint, first, time.monotonic() - t0


async def drive(
    conversations: Sequence[Conversation],
    starts: Sequence[float],
    gateway_urls: Sequence[str],
    model: str,
    t0: float,
    deadline_s: float = math.inf,
) -> tuple[list[dict[str, Any]], int]:
    """Run every conversation (offsets ``starts`` from monotonic ``t0``) to its end or
    ``deadline_s``; returns one record per request (``sent_s`` counted from ``t0``) and
    the number of turns cut."""
    records: list[dict[str, Any]] = []
    cut = [0]
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:

        async def talk(conv: Conversation, start: float) -> None:
            await asyncio.sleep(max(0.0, t0 + start - time.monotonic()))
            for index, turn in enumerate(conv.turns):
                if turn.think_s:
                    await asyncio.sleep(turn.think_s)
                if time.monotonic() - t0 > deadline_s:
                    cut[0] += len(conv.turns) - index
                    return
                g = gateway_for(conv.id, index, len(gateway_urls))
                body = {
                    "model": model,
                    "messages": list(turn.messages),
                    "max_tokens": turn.max_tokens,
                    "stream": True,
                }
                sent = time.monotonic() - t0
                status, endpoint, first, latency = await _send(
                    http, gateway_urls[g] + "/v1/chat/completions", body
                )
                records.append(
                    {
                        "sent_s": sent,
                        "conversation": conv.id,
                        "turn": index,
                        "gateway": g,
                        "endpoint": endpoint,
                        "status": status,
                        "ttft_s": first,
                        "latency_s": latency,
                    }
                )

        tasks = [
            asyncio.create_task(talk(c, s)) for c, s in zip(conversations, starts, strict=True)
        ]
        # Bounded: every turn is bounded by the request timeout and its think time.
        bound = (
            max(
                (s + sum(REQUEST_TIMEOUT_S + t.think_s for t in c.turns))
                for c, s in zip(conversations, starts, strict=True)
            )
            if conversations
            else 0.0
        )
        _, pending = await asyncio.wait(tasks, timeout=bound)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return records, cut[0]
