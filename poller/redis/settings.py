"""How to reach Redis (``[redis]``): the URL forms, timeouts and TLS.

The pollers, the CLI and the readers all connect through this one model, so it lives
with the Redis plumbing rather than with the service's settings (``poller.config``
re-exports it as the ``[redis]`` section)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from redis.asyncio.connection import URL_QUERY_ARGUMENT_PARSERS

from poller.util.messages import closest
from poller.util.text import digits
from poller.util.urls import redact_url

__all__ = [
    "NAMESPACE_PATTERN",
    "REDIS_SCHEMES",
    "RedisSettings",
    "SentinelUrl",
    "check_redis_url",
    "parse_sentinel_url",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid")

#: What a namespace may be: it is the hash tag of every key, ``{namespace}``.
NAMESPACE_PATTERN = r"^[A-Za-z0-9._:-]{1,64}$"

REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel")
_FORMS = (
    "redis://HOST:PORT/DB, rediss://HOST:PORT/DB, unix:///PATH?db=DB or "
    "redis+sentinel://HOST:PORT[,HOST:PORT]/MASTER[/DB]"
)
# "redis//host", "redis:/host", "rediss:host": a scheme with its "://" mistyped.
_MISTYPED_SCHEME_RE = re.compile(r"^(rediss?(?:\+sentinel)?|unix)(:/?|//?|:)(?!//)(.*)$")


def _check_db(value: str, url: str) -> None:
    if not digits(value):
        raise ValueError(
            f"database {value!r} in {redact_url(url)!r} is not a number: "
            "name it as /0, /1, ... (e.g. redis://127.0.0.1:6379/0)"
        )


@dataclass(frozen=True, slots=True)
class SentinelUrl:
    """A ``redis+sentinel://`` or ``rediss+sentinel://`` URL, read once
    (``parse_sentinel_url``): what the check refuses and what the connection uses."""

    #: The sentinels, in the URL's order (26379 where a host names no port; IPv6
    #: addresses without their brackets).
    hosts: tuple[tuple[str, int], ...]
    #: The master's name the sentinels monitor.
    service: str
    db: int = 0
    #: The master's ACL user and password (percent-decoded); None when not given.
    username: str | None = None
    password: str | None = None
    #: The sentinels' own password (``?sentinel_password=``); None when not given.
    sentinel_password: str | None = None
    #: ``rediss+sentinel://``: sentinels and master both over TLS.
    tls: bool = False


def _sentinel_address(item: str, url: str) -> tuple[str, int]:
    """``HOST[:PORT]`` or ``[IPv6][:PORT]`` -> (host, port)."""
    if item.startswith("["):
        host, bracket, rest = item[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ("" if rest else "26379")
        if not bracket:
            host = ""
    elif ":" in item:
        host, _, port = item.rpartition(":")
    else:
        host, port = item, "26379"
    if not host or not digits(port) or not 0 < int(port) < 65536:
        raise ValueError(f"bad sentinel address {item!r} in {redact_url(url)!r}: use HOST:PORT")
    return host, int(port)


def parse_sentinel_url(url: str) -> SentinelUrl:
    """``redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]`` (or
    ``rediss+sentinel://``), with ``?sentinel_password=`` for the sentinels; a
    ValueError names the part that is wrong (the URL shown without its passwords)."""
    parts = urlsplit(url)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    hosts = tuple(_sentinel_address(item, url) for item in hostlist.split(","))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError(
            f"{redact_url(url)!r}: a sentinel URL names the service: "
            "redis+sentinel://HOST:26379/MASTER[/DB]"
        )
    if len(path) == 2:
        _check_db(path[1], url)
    user, _, password = userinfo.partition(":")
    sentinel_password = parse_qs(parts.query).get("sentinel_password")
    return SentinelUrl(
        hosts=hosts,
        service=path[0],
        db=int(path[1]) if len(path) == 2 else 0,
        username=unquote(user) or None,
        password=unquote(password) or None,
        sentinel_password=sentinel_password[0] if sentinel_password else None,
        tls=parts.scheme.startswith("rediss"),
    )


def _check_host_url(url: str) -> None:
    """redis:// and rediss://: a host, a port redis-py can use, at most a database."""
    parts = urlsplit(url)
    shown = redact_url(url)
    if not parts.hostname:
        raise ValueError(f"{shown!r} has no host: use {parts.scheme}://HOST:PORT/DB")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 0 < port < 65536:
        named = parts.netloc.rpartition(":")[2]
        raise ValueError(f"port {named!r} in {shown!r} is not a number from 1 to 65535")
    db = parts.path.strip("/")
    if db:
        if "/" in db:
            raise ValueError(f"{shown!r}: the path is only the database number (/0, /1, ...)")
        _check_db(db, url)


#: Connection arguments a URL may give as plain strings, beside those redis-py parses.
_QUERY_STRINGS = ("client_name", "lib_name", "lib_version")


def _check_query(query: dict[str, list[str]], sentinel: bool, shown: str) -> None:
    """Only the parameters the client reads, each with a value it can use: redis-py
    passes any other name to its connection class (a TypeError at the first call) and
    parses a bad value there too (a bare ValueError). The asyncio client's table: the
    blocking client's ``retry_on_error`` breaks the asyncio one at its first outage."""
    parsers: Mapping[str, Callable[[str], object]] = URL_QUERY_ARGUMENT_PARSERS
    known = ("sentinel_password",) if sentinel else tuple(sorted([*parsers, *_QUERY_STRINGS]))
    for key, values in query.items():
        if key not in known:
            near = closest(key, known)
            hint = f" (did you mean {near!r}?)" if near else f"; known: {', '.join(known)}"
            if key.startswith("ssl_") and not near:
                hint = ": TLS is set by redis.tls_ca_file, redis.tls_insecure and the like"
            raise ValueError(f"unknown parameter {key!r} in the Redis URL {shown!r}{hint}")
        parse = parsers.get(key)
        if parse is None:  # a plain string: sentinel_password, client_name, ...
            continue
        for value in values:
            try:
                parse(value)
            except (TypeError, ValueError):
                raise ValueError(
                    f"{key}={value!r} in the Redis URL {shown!r} is not a value redis-py takes"
                ) from None


def check_redis_url(url: str) -> str:
    """The Redis URL if redis-py (or our sentinel form) can use it as meant; else a
    ValueError naming the part that is wrong. redis-py itself raises a bare ValueError at
    the first connection for a bad scheme or port, and takes ``/abc`` as database 0."""
    shown = redact_url(url)
    if url != url.strip():
        where = "trailing" if url == url.lstrip() else "leading"
        raise ValueError(f"{where} space in the Redis URL {shown!r}: remove it")
    if "://" not in url:
        mistyped = _MISTYPED_SCHEME_RE.match(url)
        if mistyped:
            fixed = f"{mistyped.group(1)}://{mistyped.group(3).lstrip('/')}"
            raise ValueError(f"{shown!r} is not a URL: did you mean {redact_url(fixed)!r}?")
        raise ValueError(f"{shown!r} has no scheme: use {_FORMS}")
    parts = urlsplit(url)
    if parts.scheme not in REDIS_SCHEMES:
        raise ValueError(
            f"scheme {parts.scheme!r} of {shown!r} is not one of {', '.join(REDIS_SCHEMES)}"
        )
    query = parse_qs(parts.query)
    for value in query.get("db", []):
        _check_db(value, url)
    _check_query(query, parts.scheme.endswith("+sentinel"), shown)
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"{shown!r} names no socket: use unix:///PATH/TO/redis.sock")
        return url
    if parts.scheme.endswith("+sentinel"):
        parse_sentinel_url(url)
        return url
    _check_host_url(url)
    return url


class RedisSettings(BaseModel):
    model_config = _FROZEN

    #: redis://, rediss:// (TLS), unix:// or redis+sentinel://h1:26379,h2:26379/master[/db]
    #: URL; user and password may be in it (ACL).
    url: str = "redis://127.0.0.1:6379/0"
    #: Key prefix is ``{namespace}``: the hash tag keeps every key in one Cluster slot.
    namespace: str = Field(default="llmgw", pattern=NAMESPACE_PATTERN)
    #: Every command gives up after this; a scrape's write must not stall the loop.
    socket_timeout_s: float = Field(default=2.0, gt=0, le=60)
    connect_timeout_s: float = Field(default=2.0, gt=0, le=60)
    #: Talk to a Redis Cluster (url names any node).
    cluster: bool = False
    #: Gather the fenced writes of this many milliseconds into one pipeline (0: off).
    #: A lone command costs the client ~5x the CPU of a pipelined one.
    write_batch_ms: float = Field(default=5.0, ge=0, le=100)
    # TLS (rediss:// and rediss+sentinel:// only). The server certificate and its host
    # name are always verified, against the system trust store unless a CA file is named.
    #: PEM bundle of the CA(s) that signed the Redis (and Sentinel) server certificates.
    tls_ca_file: str | None = None
    #: Client certificate (PEM; may hold the key too) for servers with tls-auth-clients.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    #: Skip certificate verification (encrypted but unauthenticated). Logged as a WARNING.
    tls_insecure: bool = False

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return check_redis_url(value)

    @field_validator("namespace", mode="before")
    @classmethod
    def _check_namespace(cls, value: object) -> object:
        # The key prefix copied whole, `{llmgw}`: say what to write rather than the pattern.
        if isinstance(value, str) and len(value) > 2 and value[0] + value[-1] == "{}":
            inner = value[1:-1]
            if re.match(NAMESPACE_PATTERN, inner):
                raise ValueError(
                    f"write the namespace without the braces: {inner} (every key starts "
                    f"with {{{inner}}}: the braces are added)"
                )
        if isinstance(value, str) and not re.match(NAMESPACE_PATTERN, value):
            raise ValueError(f"{value!r} is not a namespace: 1-64 of A-Z a-z 0-9 . _ : -")
        return value

    @model_validator(mode="after")
    def _check_tls(self) -> RedisSettings:
        tls_files = {
            "tls_ca_file": self.tls_ca_file,
            "tls_cert_file": self.tls_cert_file,
            "tls_key_file": self.tls_key_file,
        }
        named = [name for name, path in tls_files.items() if path]
        if (named or self.tls_insecure) and not self.url.startswith("rediss"):
            which = ", ".join(named or ["tls_insecure"])
            raise ValueError(f"{which} needs a rediss:// or rediss+sentinel:// URL")
        if self.tls_key_file and not self.tls_cert_file:
            raise ValueError("tls_key_file needs tls_cert_file")
        if self.tls_insecure and self.tls_ca_file:
            raise ValueError("tls_insecure skips verification: tls_ca_file would be ignored")
        # Checked here, at start-up, because redis-py reads them only at the first
        # connection, where a missing file would look like an unreachable Redis forever.
        for name in named:
            path = tls_files[name] or ""
            try:
                with open(path, "rb"):
                    pass
            except OSError as exc:
                raise ValueError(f"{name}: cannot read {path!r}: {exc.strerror}") from None
        return self
