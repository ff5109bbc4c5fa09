"""Redis clients as the poller builds them: timeouts, one quick retry, TLS, Sentinel.

``connect(settings)`` (asyncio) is used by pollers, the CLI and (through
``from_settings``) the asyncio reader; ``connect_sync(settings)`` builds the same client
on redis-py's blocking API for the threaded reader: the same URL forms (Sentinel and
Cluster included), timeouts, retry and TLS, so every process talks to Redis the same
way. Their errors are mapped in ``errors.py``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.cluster
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.retry import Retry as SyncRetry

from poller.redis.errors import REDIS_ERRORS, redis_call, store_error
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
    return aioredis.Redis.from_url(settings.url, retry=retry, **options)


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
    return redis.Redis.from_url(settings.url, retry=retry, **options)


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
    # slot: listen on that node (every key of a namespace shares one slot).
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
