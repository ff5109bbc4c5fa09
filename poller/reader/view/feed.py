"""The update channel read in the event loop's data callback.

A cached reader follows ``P:updates`` at the poller's write rate (1,000 messages a second
at 1,000 endpoints). Through redis-py's ``PubSub.get_message`` each message costs its own
call chain and task switch (~70-110 us of CPU here); with 24 reader processes on two
cores that alone saturates the machine. ``UpdateFeed`` owns the subscription's socket as
an ``asyncio.Protocol``: every ``data_received`` feeds hiredis and queues the messages it
completes, and the follower wakes once per arrival to apply them all (~40 us per message
at the same rate, less when the poller's writes arrive in batches).

The connection is made the way the client makes its own (host and port, or the Sentinel
primary, or the Cluster node that carries the channel; TLS context; credentials), read
off a connection object the client's pool makes (and never connects). A client whose
connections this cannot copy (a Unix socket, a custom connection class) gets ``None``
from ``open_feed``, and the caller uses redis-py's ``PubSub`` instead.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping
from typing import Any, cast

import hiredis

from poller.errors import StoreError, StoreUnreachable
from poller.redis.errors import reply_error, store_error

__all__ = ["UpdateFeed", "open_feed"]


class UpdateFeed(asyncio.Protocol):
    """``SSUBSCRIBE`` to one shard channel; ``next()`` returns the messages that arrived.
    ``also``: more shard channels of the same slot, each with the callable that takes
    its messages as they arrive (the gateways' shared counts, poller/reader/exchange/)."""

    def __init__(
        self, channel: str, also: Mapping[str, Callable[[str], None]] | None = None
    ) -> None:
        self.channel = channel
        self.also = dict(also or {})
        self._unconfirmed = 1 + len(self.also)
        self.transport: asyncio.Transport | None = None
        self._reader = hiredis.Reader(encoding="utf-8", errors="replace")
        self._pending: list[str] = []
        self._arrived = asyncio.Event()
        self._subscribed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._error: Exception | None = None

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports (the LiteLLM proxy runs uvloop) implement asyncio.Transport
        # without subclassing it: an isinstance check refuses them.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        try:
            while (reply := reader.gets()) is not False:
                self._reply(reply)
        except hiredis.ProtocolError as exc:
            self._fail(StoreError(f"Redis sent something that is not RESP: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        why = f": {exc}" if exc is not None else ""
        self._fail(StoreUnreachable(f"Redis closed the update subscription{why}"))

    # --- what the follower calls --------------------------------------------------------

    async def next(self, timeout_s: float) -> list[str]:
        """The messages that arrived, waiting up to ``timeout_s`` for one (else [])."""
        if not self._pending and self._error is None:
            self._arrived.clear()
            try:
                async with asyncio.timeout(timeout_s):
                    await self._arrived.wait()
            except TimeoutError:
                pass
        if self._error is not None:
            raise self._error
        batch, self._pending = self._pending, []
        return batch

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # --- replies ------------------------------------------------------------------------

    def _reply(self, reply: Any) -> None:
        if isinstance(reply, hiredis.ReplyError):
            self._fail(reply_error(str(reply), "the update subscription"))
        elif isinstance(reply, list) and len(reply) == 3 and reply[0] == "smessage":
            take = self.also.get(reply[1]) if self.also else None
            if take is not None:
                take(str(reply[2]))
            else:
                self._pending.append(str(reply[2]))
                self._arrived.set()
        elif isinstance(reply, list) and reply and reply[0] == "ssubscribe":
            self._unconfirmed -= 1
            if self._unconfirmed <= 0 and not self._subscribed.done():
                self._subscribed.set_result(None)
        elif isinstance(reply, list) and reply and reply[0] == "sunsubscribe":
            # Cluster moved the slot away (resharding): follow it from the new owner.
            self._fail(StoreError("Redis ended the update subscription (slot moved)"))
        # "+OK" of AUTH and anything else a later Redis may send: nothing to do

    def _fail(self, error: Exception) -> None:
        if self._error is None:
            self._error = error
        if not self._subscribed.done():
            self._subscribed.set_exception(error)
        self._arrived.set()
        if self.transport is not None:
            self.transport.abort()


async def open_feed(
    client: Any,
    channel: str,
    timeout_s: float,
    also: Mapping[str, Callable[[str], None]] | None = None,
) -> UpdateFeed | None:
    """A feed on ``channel`` (and the channels of ``also``) over a connection made as
    ``client`` makes its own, or None when its connections cannot be copied (the caller
    then uses redis-py's PubSub). Raises ``StoreError`` when Redis cannot be reached or
    refuses the subscription."""
    pool = client.connection_pool
    conn = pool.make_connection()  # a connection object as the pool makes them, unused
    arguments = getattr(conn, "_connection_arguments", None)
    if arguments is None or not hasattr(conn, "host"):
        return None
    master = getattr(pool, "get_master_address", None)  # Sentinel: the current primary
    if master is not None:
        try:
            conn.host, conn.port = await master()
        except Exception as exc:  # redis-py's MasterNotFoundError, a Sentinel down
            raise store_error(exc, "the update subscription's primary lookup") from exc
    target = dict(arguments())  # host, port, ssl
    auth = await _credentials(conn)
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout_s):
            _, feed = await loop.create_connection(lambda: UpdateFeed(channel, also), **target)
            command = [] if auth is None else [_pack("AUTH", *auth)]
            command.append(_pack("SSUBSCRIBE", channel, *feed.also))
            assert feed.transport is not None
            feed.transport.write(b"".join(command))
            try:
                await feed._subscribed
            except BaseException:
                feed.close()
                raise
    except TimeoutError:
        raise StoreUnreachable(f"no update subscription within {timeout_s:g}s") from None
    except OSError as exc:
        raise StoreUnreachable(f"Redis unreachable for the update subscription: {exc}") from exc
    return feed


def _pack(*parts: str) -> bytes:
    return cast(bytes, hiredis.pack_command(cast(Any, parts)))


async def _credentials(conn: Any) -> tuple[str, ...] | None:
    """(password,) or (username, password) as redis-py would AUTH with, or None."""
    provider = getattr(conn, "credential_provider", None)
    if provider is not None:
        get = getattr(provider, "get_credentials_async", None)
        found = await get() if get is not None else provider.get_credentials()
        if inspect.isawaitable(found):
            found = await found
        return tuple(str(part) for part in found) or None
    username, password = getattr(conn, "username", None), getattr(conn, "password", None)
    if password is None:
        return None
    return (str(username), str(password)) if username else (str(password),)
