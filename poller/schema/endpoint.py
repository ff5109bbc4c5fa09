"""Endpoint registry entries: the ``Endpoint`` model, its validation and its JSON form
in ``P:endpoints`` (registry files are read by ``poller.config.registry_file``).

An entry says where an engine is and how to scrape it; it never holds a secret (only
where the poller finds one: ``api_key_env`` or ``api_key_file``). Entries come from
three places with one validator: the CLI, a YAML/TOML file (``endpoints sync``,
``--endpoints-file``), and foreign writers of the Redis hash. A bad entry is reported
with its id and field; it never takes the other entries down with it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from poller.errors import ConfigError
from poller.util.messages import closest, describe_errors
from poller.util.text import digits

__all__ = [
    "ENGINES",
    "SIGNALS",
    "check_metrics_path",
    "Endpoint",
    "endpoint_from_json",
    "endpoint_from_dict",
    "check_overrides",
    "check_model_name",
    "merge_models",
    "normalize_url",
    "url_conflicts",
    "validate_endpoint_id",
]

#: Engines with a mapping; ``external`` (a hosted provider) is registered but never scraped.
ENGINES = ("vllm", "sglang", "llamacpp", "trtllm", "triton", "tgi", "lmdeploy", "external")
#: Signals an endpoint may override metric names for.
SIGNALS = (
    "running",
    "waiting",
    "kv_cache_usage",
    "prefix_cache_hit_rate",
    "prefix_cache_hits",
    "prefix_cache_queries",
    "lora",
)

# Ids appear in Redis keys and in space-separated events: no spaces, bounded length.
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,199}")
_ENV_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SECRET_KEYS = frozenset({"api_key", "apikey", "token", "bearer", "password", "authorization"})
MAX_ENTRY_BYTES = 16 * 1024  # a registry entry is a few hundred bytes; refuse abuse
#: Model names an entry may declare, and the length of one (Hugging Face ids are at most
#: 96 characters; a path-like name with a revision stays well under this).
MAX_MODELS = 32
MAX_MODEL_CHARS = 256


def validate_endpoint_id(endpoint_id: str) -> str:
    if not isinstance(endpoint_id, str) or not _ID_RE.fullmatch(endpoint_id):
        raise ConfigError(
            f"invalid endpoint id {endpoint_id!r}: use 1-200 characters from "
            "A-Z a-z 0-9 . _ : @ / -, starting with a letter or digit"
        )
    return endpoint_id


def _check_host(host: str) -> None:
    """Reject host names the HTTP client would refuse later (at every scrape)."""
    if host.startswith("[") or ":" in host or digits(host.replace(".", "")):
        return  # IP literals are checked by the client as addresses
    if len(host) > 253:
        raise ValueError("the host name is longer than 253 characters")
    for label in host.split("."):
        try:
            ascii_label = label.encode("idna")
            if ascii_label.startswith(b"xn--"):
                ascii_label.decode("idna")  # punycode that decodes to nothing is invalid
        except UnicodeError:
            raise ValueError(f"host label {label[:70]!r} is not a valid name") from None
        if not 0 < len(ascii_label) <= 63:
            raise ValueError(f"host label {label[:70]!r} must be 1 to 63 characters")


# The path part: as before queries were allowed, anything but whitespace, controls, '#'.
_PATH_RE = re.compile(r"/[^\s\x00-\x1f\x7f#?]*")
_QUERY_RE = re.compile(r"[A-Za-z0-9._~!$'()*+,;:@%/?-]+")
_PERCENT_RE = re.compile(r"%(?![0-9A-Fa-f]{2})")


_DEFAULT_PORTS = {"http": 80, "https": 443}


def normalize_url(url: str) -> str | None:
    """``scheme://host:port/path``, compared case-insensitively where URLs are: scheme and
    host lower case, the scheme's default port written out, the path without trailing
    slashes and without a final ``/v1`` (LiteLLM's OpenAI-compatible ``api_base`` ends in
    ``/v1``, an engine's registry ``url`` does not). Query and fragment are ignored. No
    name is resolved: ``localhost`` and ``127.0.0.1`` differ. None: not an http(s) URL.

    Two registry entries with one normalised URL are refused (``url_conflicts``): a
    gateway matching deployments by URL could not tell them apart."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    host = parts.hostname
    if scheme not in _DEFAULT_PORTS or not host:
        return None
    if ":" in host:
        host = f"[{host}]"  # an IPv6 literal keeps its brackets
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")].rstrip("/")
    return f"{scheme}://{host}:{port or _DEFAULT_PORTS[scheme]}{path}"


def url_conflicts(
    new: Iterable[tuple[str, str]], existing: Iterable[tuple[str, str]] = ()
) -> list[str]:
    """One line per entry of ``new`` (id, url) whose normalised URL an earlier entry of
    ``existing`` or ``new`` already has, naming both ids and the URL."""
    seen: dict[str, str] = {}
    for endpoint_id, url in existing:
        key = normalize_url(url)
        if key is not None:
            seen.setdefault(key, endpoint_id)
    lines = []
    for endpoint_id, url in new:
        key = normalize_url(url)
        if key is None:
            continue
        first = seen.setdefault(key, endpoint_id)
        if first != endpoint_id:
            lines.append(
                f"endpoint {endpoint_id!r} has the URL of endpoint {first!r} ({key}): "
                "one engine, one entry (a gateway matching deployments by URL could not "
                "tell them apart); remove one, or give each its own URL"
            )
    return lines


def check_metrics_path(value: str) -> str:
    """A path, optionally with a query (llama-server's router mode needs ``?model=<id>``).

    Raises ValueError naming the problem: the poller appends this to the base URL as is.
    """
    path, sep, query = value.partition("?")
    if not _PATH_RE.fullmatch(path):
        raise ValueError(
            f"metrics_path {value[:80]!r} must start with '/' and have no spaces, '#' or "
            "control characters"
        )
    if sep:
        if _PERCENT_RE.search(query):
            raise ValueError(
                f"metrics_path query {query[:80]!r} has a '%' not followed by two hex digits"
            )
        for pair in query.split("&"):
            key, eq, item = pair.partition("=")
            if (
                not key
                or not eq
                or not _QUERY_RE.fullmatch(key)
                or (item and not _QUERY_RE.fullmatch(item))
            ):
                raise ValueError(
                    f"metrics_path query {query[:80]!r} must be name=value pairs joined by "
                    "'&' (e.g. /metrics?model=qwen3-8b), URL-encoded"
                )
    return value


#: The shortest scrape interval, an entry's or the pollers' (a typo such as 0.001 would
#: scrape an engine hundreds of times a second).
MIN_INTERVAL_S = 0.05


class Endpoint(BaseModel):
    """One registry entry. ``id`` is the hash field; the rest is its JSON value."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    id: str
    url: str
    engine: str | None = None
    metrics_path: str | None = None
    api_key_env: str | None = None
    api_key_file: str | None = None
    interval_s: float | None = Field(default=None, ge=MIN_INTERVAL_S, le=3600)
    timeout_s: float | None = Field(default=None, gt=0, le=600)
    overrides: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    #: Ask for gzip. Off by default: compressing moves CPU onto the engine's API server.
    accept_gzip: bool = False
    #: https only: a PEM CA bundle on the pollers to verify the engine's certificate with
    #: (default: the system trust store).
    tls_ca_file: str | None = None
    #: https only: do not verify the engine's certificate (logged as a WARNING).
    tls_insecure: bool = False
    #: Model names the endpoint serves, added to those the poller reads from the engine
    #: (its page's model label, else its /v1/models): docs/schema.md.
    models: tuple[str, ...] = ()
    #: The discovery source that created (and owns) this entry; None for hand-written ones.
    source: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

    @model_validator(mode="before")
    @classmethod
    def _no_inline_secrets(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            for key in data:
                if str(key).lower() in _SECRET_KEYS or str(key).lower() == "headers":
                    raise ValueError(
                        f"inline secret field {key!r} is not allowed: name where the poller "
                        "finds the key with api_key_env (a variable) or api_key_file (a path)"
                    )
        return data

    @field_validator("id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        try:
            return validate_endpoint_id(value)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in value):
            # urlsplit drops tabs and newlines silently; the HTTP client would refuse them
            raise ValueError("the URL contains whitespace or control characters")
        parts = urlsplit(value)
        if "://" not in value:
            raise ValueError(
                f"{value[:80]!r} has no scheme: write http://{value[:80]} (or https://)"
            )
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"scheme must be http or https, got {parts.scheme!r}")
        if not parts.hostname:
            raise ValueError("URL has no host")
        if parts.username is not None or parts.password is not None:
            raise ValueError("credentials in the URL are not allowed; use api_key_env")
        if parts.query or parts.fragment:
            raise ValueError("the base URL must not have a query or fragment")
        try:
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError as exc:
            raise ValueError(f"bad port: {exc}") from None
        _check_host(parts.hostname)
        return value.rstrip("/")

    @field_validator("engine")
    @classmethod
    def _check_engine(cls, value: str | None) -> str | None:
        if value is not None and value not in ENGINES:
            guess = closest(value, ENGINES)
            hint = f" (did you mean {guess!r}?)" if guess else ""
            raise ValueError(f"unknown engine {value!r}{hint}; accepted: {', '.join(ENGINES)}")
        return value

    @field_validator("metrics_path")
    @classmethod
    def _check_path(cls, value: str | None) -> str | None:
        if value is not None:
            check_metrics_path(value)
        return value

    @field_validator("api_key_env")
    @classmethod
    def _check_env(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_RE.fullmatch(value):
            raise ValueError(f"{value!r} is not an environment variable name")
        return value

    @field_validator("overrides")
    @classmethod
    def _check_overrides(cls, value: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        return check_overrides(value)

    @field_validator("models")
    @classmethod
    def _check_models(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(value) > MAX_MODELS:
            raise ValueError(f"{len(value)} model names: at most {MAX_MODELS}")
        seen: set[str] = set()
        for name in value:
            problem = check_model_name(name)
            if problem:
                raise ValueError(problem)
            if name in seen:
                raise ValueError(f"model {name!r} is listed twice")
            seen.add(name)
        return value

    @model_validator(mode="after")
    def _check_combination(self) -> Endpoint:
        if self.api_key_env and self.api_key_file:
            raise ValueError("set api_key_env or api_key_file, not both")
        if (self.tls_ca_file or self.tls_insecure) and urlsplit(self.url).scheme != "https":
            raise ValueError("tls_ca_file and tls_insecure need an https URL")
        if self.tls_ca_file and self.tls_insecure:
            raise ValueError("set tls_ca_file or tls_insecure, not both")
        # timeout_s at or above the interval is not an error: the pollers lower it to half
        # the interval (poller.config.effective_timeout_s), as the Go poller does.
        return self

    def to_json(self) -> str:
        """The compact JSON value stored in ``P:endpoints`` (id is the hash field)."""
        data = self.model_dump(exclude={"id"}, exclude_defaults=True)
        return json.dumps(data, sort_keys=True, separators=(",", ":"))


def endpoint_from_dict(endpoint_id: str | None, data: Mapping[str, Any]) -> Endpoint:
    """Validate one entry; raises ConfigError naming the entry and its problems (all of
    them, joined by ``; ``), ``field`` the first one's key."""
    full = {**data, "id": endpoint_id} if endpoint_id else data
    try:
        return Endpoint.model_validate(full)
    except ValidationError as exc:
        problems = describe_errors(exc, Endpoint)
    name = endpoint_id or str(data.get("id", "")) or None
    if len(problems) == 1 and problems[0][1].startswith(f"{problems[0][0]}: "):
        # keep the ``endpoint 'x' field: message`` form of a single value error
        key, line = problems[0]
        raise ConfigError(line.removeprefix(f"{key}: "), endpoint=name, field=key or None)
    error = ConfigError("; ".join(line for _, line in problems), endpoint=name)
    error.field = problems[0][0] or None
    raise error


def endpoint_from_json(endpoint_id: str, raw: str | bytes) -> Endpoint:
    """Parse a ``P:endpoints`` value written by us or by a foreign writer."""
    if len(raw) > MAX_ENTRY_BYTES:
        raise ConfigError(
            f"entry is {len(raw)} bytes (limit {MAX_ENTRY_BYTES})", endpoint=endpoint_id
        )
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        # RecursionError: nesting deeper than the interpreter's stack (a hostile writer).
        raise ConfigError(f"entry is not valid JSON: {exc}", endpoint=endpoint_id) from None
    if not isinstance(data, dict):
        raise ConfigError("entry must be a JSON object", endpoint=endpoint_id)
    if "id" in data and data["id"] != endpoint_id:
        raise ConfigError(f"entry's id {data['id']!r} differs from its key", endpoint=endpoint_id)
    return endpoint_from_dict(endpoint_id, data)


_METRIC_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def check_overrides(value: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """Metric-name overrides (an entry's, or ``[scrape.engines.<e>]``'s): known signals,
    each naming at least one valid metric name."""
    for signal, names in value.items():
        if signal not in SIGNALS:
            guess = closest(str(signal), SIGNALS)
            hint = f" (did you mean {guess!r}?)" if guess else ""
            raise ValueError(f"unknown signal {signal!r}{hint}; accepted: {', '.join(SIGNALS)}")
        if not names:
            raise ValueError(f"override for {signal!r} names no metric")
        for name in names:
            if not _METRIC_NAME_RE.fullmatch(name):
                raise ValueError(f"override for {signal!r}: {name!r} is not a metric name")
    return value


def check_model_name(name: str) -> str | None:
    """Why ``name`` cannot be a model name of the view, or None if it can.

    The stats field ``models`` is a comma-separated list (docs/schema.md), so a name holds
    no comma; no whitespace or control characters either (a request's ``model`` never has
    them, and they would make ``poller status`` lie).
    """
    if not name:
        return "a model name is empty"
    if len(name) > MAX_MODEL_CHARS:
        return f"model name {name[:40]!r}... is longer than {MAX_MODEL_CHARS} characters"
    if "," in name:
        return f"model name {name[:80]!r} has a comma (the view's models are comma-separated)"
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in name):
        return f"model name {name[:80]!r} has whitespace or control characters"
    return None


def merge_models(*sources: tuple[str, ...]) -> tuple[str, ...]:
    """The names of every source, each once, in the order met (page, /v1/models, entry)."""
    seen: dict[str, None] = {}
    for names in sources:
        for name in names:
            seen.setdefault(name, None)
    return tuple(seen)
