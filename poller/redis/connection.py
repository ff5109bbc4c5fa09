"""Redis clients as the poller builds them: timeouts, one quick retry, TLS, Sentinel.

``connect(settings)`` (asyncio) is used by pollers, the CLI and (through
``from_settings``) the asyncio reader; ``connect_sync(settings)`` builds the same client
on redis-py's blocking API for the threaded reader: the same URL forms (Sentinel and
Cluster included), timeouts, retry and TLS, so every process talks to Redis the same
way. Their errors are mapped in ``errors.py``.

A ``rediss://`` client whose TLS handshake fails (a timeout, or a reply that is no TLS
record) asks the port once in plain text; a Redis answering there is a plain port, and
the connection raises ``NotTLS`` at once, then and on every retry, rather than a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis
import redis.asyncio.connection
import redis.cluster
import redis.connection
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.retry import Retry as SyncRetry

from poller.redis.errors import REDIS_ERRORS, NotTLS, redis_call, store_error
from poller.redis.settings import RedisSettings, parse_sentinel_url

__all__ = [
    "close_client",
    "close_client_sync",
    "connect",
    "connect_sync",
    "pubsub_client",
    "pubsub_client_sync",
    "subscribe",
    "tls_options",
]

log = logging.getLogger(__name__)

#: How long the plain-text question to a port whose TLS handshake failed may take.
PLAIN_PROBE_S = 1.0
_PING = b"PING\r\n"


def _plain_answer(head: bytes) -> bool:
    """A RESP reply to PING (+PONG, -NOAUTH, -ERR ...): the port speaks plain Redis."""
    return head[:1] in (b"+", b"-")


def _speaks_plain(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(_PING)
            return _plain_answer(sock.recv(1))
    except OSError:
        return False


async def _speaks_plain_async(host: str, port: int, timeout_s: float) -> bool:
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(_PING)
                return _plain_answer(await reader.read(1))
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return False


def _handshake_failure(exc: BaseException) -> bool:
    """A failure that a plain port explains: a timeout, or bytes that are no TLS record
    (not a certificate refused, not a port nobody listens on)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return False
    return isinstance(exc, TimeoutError | ssl.SSLError)


class _TLSConnection(redis.connection.SSLConnection):
    """redis-py's TLS connection that names a plain port (``NotTLS``)."""

    _plain = False

    def _connect(self) -> Any:
        if self._plain:
            raise NotTLS(self.host, self.port)
        return super()._connect()  # type: ignore[no-untyped-call]

    def _wrap_socket_with_ssl(self, sock: Any) -> Any:
        try:
            return super()._wrap_socket_with_ssl(sock)  # type: ignore[no-untyped-call]
        except Exception as exc:
            if _handshake_failure(exc) and _speaks_plain(self.host, self.port, PLAIN_PROBE_S):
                self._plain = True
                raise NotTLS(self.host, self.port) from exc
            raise


class _AsyncTLSConnection(redis.asyncio.connection.SSLConnection):
    """``_TLSConnection`` for the asyncio client."""

    _plain = False

    async def _connect(self) -> None:
        if self._plain:
            raise NotTLS(self.host, self.port)
        try:
            await super()._connect()  # type: ignore[no-untyped-call]
        except Exception as exc:
            if _handshake_failure(exc) and await _speaks_plain_async(
                self.host, self.port, PLAIN_PROBE_S
            ):
                self._plain = True
                raise NotTLS(self.host, self.port) from exc
            raise


C = TypeVar("C", aioredis.Redis, redis.Redis)


def _name_plain_ports(client: C) -> C:
    """``client`` with its TLS connections replaced by ours (a rediss:// URL's)."""
    pool = client.connection_pool
    if pool.connection_class is redis.asyncio.connection.SSLConnection:
        pool.connection_class = _AsyncTLSConnection
    elif pool.connection_class is redis.connection.SSLConnection:
        pool.connection_class = _TLSConnection  # type: ignore[assignment]
    return client


def _options(settings: RedisSettings) -> dict[str, Any]:
    """The client options both flavours share."""
    return {
        "socket_timeout": settings.socket_timeout_s,
        "socket_connect_timeout": settings.connect_timeout_s,
        "decode_responses": True,
        # A foreign writer's invalid UTF-8 must not break every read of the registry:
        # decode with U+FFFD, and the entry fails validation like any bad entry.
        "encoding_errors": "replace",
        "health_check_interval": 10,
        **tls_options(settings),
    }


def _is_sentinel(settings: RedisSettings) -> bool:
    return settings.url.split("://", 1)[0] in ("redis+sentinel", "rediss+sentinel")


def connect(settings: RedisSettings) -> aioredis.Redis | RedisCluster:
    """A client with timeouts on every call and one quick retry on a dropped connection.

    redis-py's default retry backs off for seconds; a poller prefers to fail the call
    and try again at its next tick, with its own capped backoff.
    """
    options = _options(settings)
    retry = Retry(NoBackoff(), 1)
    if _is_sentinel(settings):
        return _sentinel_master(settings.url, retry, options)
    if settings.cluster:
        return RedisCluster.from_url(settings.url, retry=retry, **options)
    client: aioredis.Redis = aioredis.Redis.from_url(settings.url, retry=retry, **options)
    return _name_plain_ports(client)


def connect_sync(settings: RedisSettings) -> redis.Redis | redis.cluster.RedisCluster:
    """``connect``'s client on redis-py's blocking API (the threaded reader's)."""
    options = _options(settings)
    retry = SyncRetry(NoBackoff(), 1)
    if _is_sentinel(settings):
        return _sentinel_master_sync(settings.url, retry, options)
    if settings.cluster:
        try:  # the blocking Cluster client reads the slots at once, not at the first call
            return redis.cluster.RedisCluster.from_url(settings.url, retry=retry, **options)
        except REDIS_ERRORS as exc:
            raise store_error(exc, "the Cluster's slot map") from exc
    client: redis.Redis = redis.Redis.from_url(settings.url, retry=retry, **options)
    return _name_plain_ports(client)


def tls_options(settings: RedisSettings) -> dict[str, Any]:
    """redis-py's ``ssl_*`` arguments for a rediss URL (plain connections reject them).

    Verification is explicit rather than left to redis-py's defaults, which older
    versions set to no host name check.
    """
    if not settings.url.startswith("rediss"):
        return {}  # RedisSettings refuses TLS settings without a rediss URL
    options: dict[str, Any] = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}
    if settings.tls_insecure:
        log.warning("redis.tls_insecure is set: the Redis server's certificate is not verified")
        options = {"ssl_cert_reqs": "none", "ssl_check_hostname": False}
    if settings.tls_ca_file:
        options["ssl_ca_certs"] = settings.tls_ca_file
    if settings.tls_cert_file:
        options["ssl_certfile"] = settings.tls_cert_file
    if settings.tls_key_file:
        options["ssl_keyfile"] = settings.tls_key_file
    return options


class _SentinelURL:
    """What both faces need of a sentinel URL (``parse_sentinel_url`` reads it): the
    sentinels, their connection options, and the master's credentials and database."""

    def __init__(self, url: str, options: dict[str, Any], retry: Any) -> None:
        from poller.errors import ConfigError

        try:
            parsed = parse_sentinel_url(url)
        except ValueError as exc:  # settings built without validation (model_construct)
            raise ConfigError(str(exc), field="redis.url") from None
        self.hosts = list(parsed.hosts)
        self.tls = parsed.tls
        self.service = parsed.service
        self.sentinel_kwargs: dict[str, Any] = {
            "socket_timeout": options["socket_timeout"],
            "socket_connect_timeout": options["socket_connect_timeout"],
            # redis-py's default retry backs off for seconds per sentinel (~9 s for a
            # certificate that can never verify); fail fast like the master connections.
            "retry": retry,
        }
        if parsed.sentinel_password is not None:
            self.sentinel_kwargs["password"] = parsed.sentinel_password
        if parsed.tls:
            self.sentinel_kwargs["ssl"] = True
            self.sentinel_kwargs.update((k, v) for k, v in options.items() if k.startswith("ssl_"))
        self.master: dict[str, Any] = {
            "retry": retry,
            "username": parsed.username,
            "password": parsed.password,
            "db": parsed.db,
        }


def _sentinel_master(url: str, retry: Retry, options: dict[str, Any]) -> aioredis.Redis:
    """The master a sentinel URL names (``parse_sentinel_url`` reads it).

    The client asks the sentinels for the current master on every (re)connection, so it
    follows a failover by itself. The user and password are the master's; sentinels
    protected by a password take it from ``?sentinel_password=``. With
    ``rediss+sentinel://`` the sentinels and the master are both spoken to over TLS, with
    the same CA and client certificate: the sentinel password must not travel in clear.
    """
    from redis.asyncio.sentinel import Sentinel

    parsed = _SentinelURL(url, options, retry)
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        parsed.hosts, sentinel_kwargs=parsed.sentinel_kwargs, ssl=parsed.tls, **options
    )
    master: aioredis.Redis = sentinel.master_for(parsed.service, **parsed.master)
    return master


def _sentinel_master_sync(url: str, retry: SyncRetry, options: dict[str, Any]) -> redis.Redis:
    """``_sentinel_master`` on redis-py's blocking API."""
    from redis.sentinel import Sentinel

    parsed = _SentinelURL(url, options, retry)
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        parsed.hosts, sentinel_kwargs=parsed.sentinel_kwargs, ssl=parsed.tls, **options
    )
    master: redis.Redis = sentinel.master_for(parsed.service, **parsed.master)  # type: ignore[no-untyped-call]
    return master


async def close_client(client: Any) -> None:
    """Close a client, and the sentinel connections a Sentinel-managed one keeps."""
    await client.aclose()
    manager = getattr(getattr(client, "connection_pool", None), "sentinel_manager", None)
    for sentinel in getattr(manager, "sentinels", ()):
        await sentinel.aclose()


def close_client_sync(client: Any) -> None:
    """``close_client`` for a blocking client."""
    client.close()
    manager = getattr(getattr(client, "connection_pool", None), "sentinel_manager", None)
    for sentinel in getattr(manager, "sentinels", ()):
        sentinel.close()


@asynccontextmanager
async def subscribe(
    client: Any, *channels: str, shard_channels: tuple[str, ...] = ()
) -> AsyncIterator[aioredis.client.PubSub]:
    """A pub/sub connection on ``channels`` and the shard channels ``shard_channels``
    (``SSUBSCRIBE``, Redis 7); callers read with get_message."""
    async with pubsub_client(client, shard_channels) as own:
        pubsub = own.pubsub(ignore_subscribe_messages=True)
        try:
            if channels:
                await redis_call(pubsub.subscribe(*channels), "SUBSCRIBE")
            if shard_channels:
                await redis_call(pubsub.ssubscribe(*shard_channels), "SSUBSCRIBE")
            yield pubsub
        finally:
            try:
                await pubsub.aclose()
            except Exception:
                log.debug("pubsub close failed", exc_info=True)


@asynccontextmanager
async def pubsub_client(client: Any, shard_channels: tuple[str, ...] = ()) -> AsyncIterator[Any]:
    """The client to subscribe with: ``client`` itself, or on Cluster one of the node
    that carries the shard channels (closed on exit)."""
    if not isinstance(client, RedisCluster):
        yield client
        return
    # Cluster PUBLISH reaches every node, SPUBLISH only the shard owning the channel's
    # slot: listen on that node (every key of a namespace shares one slot). The slot map
    # is read at the client's first call: this may be it.
    await redis_call(client.initialize(), "the Cluster's slot map")
    owner = client.get_node_from_key(shard_channels[0]) if shard_channels else None
    node = owner or client.get_random_node()
    own = aioredis.Redis(host=node.host, port=int(node.port), **_pubsub_options(client))
    try:
        yield own
    finally:
        await own.aclose()


@contextmanager
def pubsub_client_sync(client: Any, shard_channels: tuple[str, ...] = ()) -> Iterator[Any]:
    """``pubsub_client`` for a blocking client: ``client`` itself, or on Cluster one of
    the node that carries the shard channels (closed on exit)."""
    if not isinstance(client, redis.cluster.RedisCluster):
        yield client
        return
    key = shard_channels[0] if shard_channels else None
    owner = client.get_node_from_key(key) if key else None  # type: ignore[no-untyped-call]
    node = owner or client.get_random_node()  # type: ignore[no-untyped-call]
    own = redis.Redis(host=node.host, port=int(node.port), **_pubsub_options(client))
    try:
        yield own
    finally:
        own.close()


def _pubsub_options(client: Any) -> dict[str, Any]:
    kwargs = client.get_connection_kwargs() if hasattr(client, "get_connection_kwargs") else {}
    keep = ("username", "password", "ssl", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
    return {k: kwargs[k] for k in keep if k in kwargs} | {"decode_responses": True}
