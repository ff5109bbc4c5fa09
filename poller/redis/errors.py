"""The one place redis-py's exceptions, and Redis's error replies, become the poller's.

    redis-py raises (Redis replies)                         the poller raises
    AuthenticationError (WRONGPASS, NOAUTH, "invalid        StoreAuthError, kind "authentication"
      username-password pair"), AuthorizationError          (no password sent: says to put one
                                                            in the URL)
    NoPermissionError (NOPERM), a script's command refused  StoreAuthError, kind "permission"
      by the ACL ("The user executing the script can't ...")
    NotTLS (connection.py: a rediss:// URL at a port        StoreUnreachable ("does not speak
      that answers plain RESP)                                TLS")
    ConnectionError, TimeoutError, OSError                  StoreUnreachable
    ResponseError "unknown command 'SENTINEL'" (a           StoreError ("not a Sentinel")
      redis+sentinel:// URL at a plain Redis)
    ResponseError (anything else Redis refused)             StoreError ("rejected")
    InvalidResponse "Protocol error" (a port that is not    StoreError ("does not speak
      Redis's: an HTTP server)                                Redis's protocol")
    RedisClusterException "Cluster mode is not enabled"     StoreError ("not a Cluster")
    RedisClusterException (no node answered)                StoreUnreachable
    any other RedisError; UnicodeDecodeError                StoreError

Every caller (store, discovery, reader, worker, CLI) goes through ``redis_call``,
``redis_call_sync`` or ``store_error``. Leaves only: the reader imports this module.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.exceptions as rexc

from poller.errors import StoreAuthError, StoreError, StoreUnreachable

__all__ = [
    "REDIS_ERRORS",
    "NotTLS",
    "redis_call",
    "redis_call_sync",
    "reply_error",
    "store_error",
]

T = TypeVar("T")

#: What a Redis call may raise before it is mapped (redis-py's Cluster client raises
#: RedisClusterException, which is not a RedisError).
REDIS_ERRORS: tuple[type[BaseException], ...] = (
    rexc.RedisError,
    rexc.RedisClusterException,
    OSError,
    UnicodeDecodeError,
)

# Error replies (or their start) that mean the ACL or the credentials, not the call.
_AUTH_PREFIXES = ("WRONGPASS", "NOAUTH", "invalid username-password pair", "invalid password")
_PERMISSION_MARKS = ("NOPERM", "The user executing the script can't", "no permissions to")
# The replies of a server that wants a password the client never sent: NOAUTH to a
# command, or (RESP3 clients) to the HELLO that opens the connection.
_NO_PASSWORD_MARKS = ("NOAUTH", "Authentication required", "HELLO must be called with the client")
_NOT_SENTINEL = re.compile(r"unknown command .SENTINEL.", re.IGNORECASE)


class NotTLS(rexc.ConnectionError):
    """A TLS connection (``rediss://``) met a server that answers plain RESP: the port
    is a plain Redis port. Raised by ``poller.redis.connection``'s TLS connections."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(f"the server at {host}:{port} does not speak TLS")
        self.host = host
        self.port = port


def _not_tls(exc: BaseException) -> NotTLS | None:
    """The ``NotTLS`` behind ``exc``: redis-py's asyncio client wraps what a connection
    raises in a ConnectionError of its own."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None or isinstance(seen, NotTLS):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _refused(exc: BaseException) -> bool:
    """A connection refused (ECONNREFUSED), by ``exc`` or what it wraps: redis-py raises
    its ConnectionError with the socket's error as the context."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return False
        if getattr(seen, "errno", None) == errno.ECONNREFUSED:
            return True
        seen = seen.__cause__ or seen.__context__
    return str(exc).startswith(f"Error {errno.ECONNREFUSED} ")


def store_error(exc: BaseException, what: str) -> StoreError:
    """Our exception for ``exc``, raised by redis-py (or the socket) during ``what``."""
    if isinstance(exc, StoreError):
        return exc
    plain = _not_tls(exc)
    if plain is not None:
        return StoreUnreachable(
            f"the server at {plain.host}:{plain.port} does not speak TLS: use redis:// or "
            f"the TLS port (during {what})"
        )
    if isinstance(exc, rexc.AuthenticationError | rexc.AuthorizationError):
        return _auth(str(exc), what)
    if isinstance(exc, rexc.InvalidResponse) and str(exc).lower().startswith("protocol error"):
        http = "'H'" in str(exc) or '"H"' in str(exc) or "HTTP/" in str(exc)
        return StoreError(
            f"the server at the Redis URL does not speak Redis's protocol (during {what}: "
            f"{exc})" + (": it answers HTTP; check the URL's port" if http else "")
        )
    if isinstance(exc, rexc.ResponseError):
        return reply_error(str(exc), what)
    if isinstance(exc, rexc.ConnectionError | rexc.TimeoutError | OSError):
        # Refused: nothing listens at the URL's port, which only the URL can fix.
        said = str(exc) or type(exc).__name__
        if _refused(exc):
            said = said.rstrip(".") + ": nothing listens there; check the Redis URL's host and port"
        return StoreUnreachable(f"Redis unreachable during {what}: {said}")
    if isinstance(exc, rexc.RedisClusterException):
        if "cluster mode is not enabled" in str(exc).lower():
            return StoreError(
                f"the Redis at the URL is not a Cluster (during {what}): unset "
                "redis.cluster (POLLER_REDIS__CLUSTER) for a single Redis or Sentinel"
            )
        # "cannot be connected": no node answered (the cause follows the colon).
        return StoreUnreachable(f"Redis Cluster unreachable during {what}: {exc}")
    if isinstance(exc, UnicodeDecodeError):
        # Only with a client of the caller's that decodes strictly; connect() replaces.
        return StoreError(
            f"Redis returned invalid UTF-8 during {what} (use a client with "
            "encoding_errors='replace', as poller.redis.connection.connect() builds)"
        )
    return StoreError(f"Redis error during {what}: {exc}")


def reply_error(message: str, what: str) -> StoreError:
    """Our exception for an error reply Redis sent during ``what`` (as redis-py or a
    hand-rolled connection read it)."""
    if any(mark in message for mark in _PERMISSION_MARKS):
        return StoreAuthError(
            f"Redis refused permission (ACL) during {what}: {message}; the Redis user "
            "lacks a command, key or channel the poller uses (deploy/redis/users.acl)",
            kind="permission",
        )
    if message.startswith(_AUTH_PREFIXES):
        return _auth(message, what)
    if _NOT_SENTINEL.search(message):
        return StoreError(
            f"the server a redis+sentinel:// URL names is not a Sentinel (it does not know "
            f"SENTINEL; during {what}): use redis://HOST:PORT/DB for a plain Redis, or the "
            "Sentinels' port (26379) with the master's name"
        )
    return StoreError(f"Redis rejected {what}: {message}")


def _auth(message: str, what: str) -> StoreAuthError:
    if any(mark in message for mark in _NO_PASSWORD_MARKS):
        return StoreAuthError(
            f"Redis refused authentication: it wants a password and the Redis URL has none "
            f"(during {what}): put the user and password in it, "
            "redis://USER:PASSWORD@HOST:PORT/DB "
            "(redis://:PASSWORD@HOST:PORT/DB for requirepass)",
            kind="authentication",
        )
    return StoreAuthError(
        f"Redis refused authentication: {message} (during {what}; check the user and "
        "password in the Redis URL)",
        kind="authentication",
    )


async def redis_call(awaitable: Awaitable[T], what: str) -> T:
    """Await one call of an asyncio client, its errors mapped."""
    try:
        return await awaitable
    except REDIS_ERRORS as exc:
        raise store_error(exc, what) from exc


def redis_call_sync(fn: Callable[..., T], what: str, /, *args: Any, **kwargs: Any) -> T:
    """Make one call of a blocking client, its errors mapped."""
    try:
        return fn(*args, **kwargs)
    except REDIS_ERRORS as exc:
        raise store_error(exc, what) from exc
