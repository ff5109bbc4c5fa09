"""DNS discovery sources: ``[[discovery]]`` tables and ``dns+srv://`` / ``dns+a://`` URIs.

Every option is validated here, with one-line errors naming it; what a source's entries
get (engine, paths, keys, labels) is checked with the registry's own validator.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from poller.errors import ConfigError
from poller.util.text import digits

__all__ = ["DISCOVERY_OPTIONS", "DiscoverySource", "discovery_sources", "parse_discovery_uri"]

DISCOVERY_OPTIONS = (
    "engine",
    "scheme",
    "metrics_path",
    "interval_s",
    "timeout_s",
    "api_key_env",
    "api_key_file",
    "labels",
    "refresh",
    "name",
    "nameserver",
    "allow_empty",
)
_DISCOVERY_SCHEMES = {"dns+srv": "srv", "dns+a": "a"}
_SOURCE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


class DiscoverySource(BaseModel):
    """One DNS discovery source: what to ask, and what every discovered entry gets.

    Built from ``dns+srv://_metrics._tcp.vllm.llm.svc.cluster.local?engine=vllm`` (SRV:
    targets give host and port) or ``dns+a://vllm.llm.svc.cluster.local:8000`` (A and AAAA
    answers give addresses; the port is the URI's). See ``parse_discovery_uri``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    uri: str
    kind: Literal["srv", "a"]
    #: The DNS name asked for, absolute (trailing dot); no search domains are applied.
    query: str
    #: dns+a only: the port every address gets.
    port: int | None = Field(default=None, ge=1, le=65535)
    #: The source's id: it owns registry entries ``<name>/<host>:<port>``.
    name: str = Field(pattern=_SOURCE_NAME_RE.pattern)
    engine: str | None = None
    scheme: Literal["http", "https"] = "http"
    metrics_path: str | None = None
    interval_s: float | None = None
    timeout_s: float | None = None
    api_key_env: str | None = None
    api_key_file: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    #: Seconds between two resolutions.
    refresh_s: float = Field(default=10.0, ge=0.2, le=86400)
    #: ``(host, port)`` of the DNS server to ask; default: the system resolver.
    nameserver: tuple[str, int] | None = None
    #: Let an empty answer (or NXDOMAIN) count as "no targets", so entries leave.
    allow_empty: bool = False

    def entry_template(self) -> dict[str, Any]:
        """What every discovered registry entry carries besides ``id`` and ``url``."""
        fields = (
            *("engine", "metrics_path", "interval_s", "timeout_s"),
            *("api_key_env", "api_key_file", "labels"),
        )
        out = {f: getattr(self, f) for f in fields if getattr(self, f)}
        return {**out, "source": self.name}

    @model_validator(mode="after")
    def _check(self) -> DiscoverySource:
        if (self.kind == "a") != (self.port is not None):
            raise ValueError(
                "dns+a:// needs the engines' port (dns+a://NAME:PORT); "
                "dns+srv:// takes ports from the SRV records and must not name one"
            )
        from poller.schema.endpoint import Endpoint

        # The entry options are the registry's: validate them with its validator, once.
        entry = {**self.entry_template(), "id": "x", "url": f"{self.scheme}://example.invalid"}
        try:
            Endpoint.model_validate(entry)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in err["loc"])
            message = str(err["msg"]).removeprefix("Value error, ")
            raise ValueError(f"{where}: {message}" if where else message) from None
        return self


def _discovery_option(key: str, value: str) -> Any:
    if key == "labels":
        labels: dict[str, str] = {}
        for item in filter(None, value.split(",")):
            k, sep, v = item.partition("=")
            if not sep or not k.strip():
                raise ValueError(f"labels: {item!r} is not KEY=VALUE")
            labels[k.strip()] = v.strip()
        return labels
    if key == "allow_empty":
        if value.lower() not in _BOOLS:
            raise ValueError(f"allow_empty: {value!r} is not true or false")
        return _BOOLS[value.lower()]
    if key == "nameserver":
        host, sep, port = value.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not sep or not digits(port) or not 0 < int(port) < 65536:
            raise ValueError(f"nameserver: {value!r} is not HOST:PORT")
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"nameserver: {host!r} is not an IP address") from None
        return (host, int(port))
    return value


def _uri_options(where: str, query: str, options: dict[str, Any]) -> dict[str, Any]:
    """The URI's ?options and the table's keys, each once, each known."""
    from urllib.parse import parse_qsl

    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ConfigError(f"{where}: malformed query string") from None
    given: dict[str, Any] = {}
    for key, value in [*pairs, *options.items()]:
        if key in given:
            raise ConfigError(f"{where}: option {key!r} given twice (URI or table)")
        given[key] = value
    unknown = sorted(set(given) - set(DISCOVERY_OPTIONS))
    if unknown:
        raise ConfigError(
            f"{where}: unknown option(s) {', '.join(unknown)}; "
            f"accepted: {', '.join(DISCOVERY_OPTIONS)}"
        )
    try:
        return {
            "refresh_s" if key == "refresh" else key: (
                _discovery_option(key, value) if isinstance(value, str) else value
            )
            for key, value in given.items()
        }
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def parse_discovery_uri(uri: str, options: dict[str, Any] | None = None) -> DiscoverySource:
    """A ``dns+srv://`` or ``dns+a://`` URI (plus table options) as a DiscoverySource.

    Raises ConfigError with one line naming the URI and the bad or unknown option(s).
    """
    from urllib.parse import urlsplit

    where = f"discovery source {uri!r}"
    parts = urlsplit(uri.strip())
    kind = _DISCOVERY_SCHEMES.get(parts.scheme)
    if kind is None:
        raise ConfigError(f"{where}: scheme must be dns+srv:// or dns+a://")
    if parts.username or parts.password or parts.path not in ("", "/") or parts.fragment:
        raise ConfigError(f"{where}: only a DNS name, a port (dns+a) and ?options are allowed")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise ConfigError(f"{where}: no DNS name to resolve")
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"{where}: bad port") from None
    data: dict[str, Any] = {"uri": uri, "kind": kind, "query": host + ".", "port": port}
    data.update(_uri_options(where, parts.query, options or {}))
    if "name" not in data:
        # _metrics._tcp.vllm.llm.svc.cluster.local -> vllm.llm.svc.cluster.local
        labels = [label for label in host.split(".") if not label.startswith("_")]
        derived = re.sub(r"[^A-Za-z0-9._-]", "-", ".".join(labels)).strip(".-_")[:64]
        data["name"] = derived or "dns"
    try:
        return DiscoverySource.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        field = ".".join(str(p) for p in err["loc"])
        option = {"refresh_s": "refresh"}.get(field, field)
        message = str(err["msg"]).removeprefix("Value error, ")
        raise ConfigError(
            f"{where}: {option}: {message}" if option else f"{where}: {message}"
        ) from None


def discovery_sources(value: Any) -> tuple[DiscoverySource, ...]:
    """``[[discovery]]`` tables (``uri`` plus options) or URI strings (``--discover``)."""
    if isinstance(value, str):
        value = value.split()  # POLLER_DISCOVER style: space-separated URIs
    if not isinstance(value, list | tuple):
        raise ConfigError("discovery must be a list of URIs or [[discovery]] tables")
    sources: list[DiscoverySource] = []
    for item in value:
        if isinstance(item, DiscoverySource):
            sources.append(item)
        elif isinstance(item, str):
            sources.append(parse_discovery_uri(item))
        elif isinstance(item, dict) and isinstance(item.get("uri"), str):
            sources.append(
                parse_discovery_uri(item["uri"], {k: v for k, v in item.items() if k != "uri"})
            )
        else:
            raise ConfigError('each [[discovery]] table needs uri = "dns+srv://..."')
    names = [s.name for s in sources]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"two discovery sources are named {dupes[0]!r}; give one ?name=")
    return tuple(sources)
