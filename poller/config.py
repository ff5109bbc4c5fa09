"""Settings: one frozen root model of sub-models, from a TOML file, env and flags.

Precedence (highest first): command-line flags, ``POLLER_*`` environment variables
(nested fields as ``POLLER_SCRAPE__TIMEOUT_S``), the TOML file, defaults. Each module
takes only its own sub-model. Unknown keys are errors, and every cross-field rule
(scrape timeout < interval < lease TTL ...) is checked here, once.
"""

from __future__ import annotations

import os
import socket
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from poller.allowlist import HostAllowlist
from poller.errors import ConfigError
from poller.sources import DiscoverySource, discovery_sources, parse_discovery_uri

__all__ = [
    "DEFAULT_KEY_DIR",
    "CoordinationSettings",
    "DiscoverySource",
    "EngineSettings",
    "HealthSettings",
    "HostAllowlist",
    "RedisSettings",
    "ScrapeSettings",
    "Settings",
    "default_poller_id",
    "default_timeout_s",
    "key_directory",
    "effective_timeout_s",
    "load_settings",
    "parse_discovery_uri",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class RedisSettings(BaseModel):
    model_config = _FROZEN

    #: redis://, rediss:// (TLS), unix:// or redis+sentinel://h1:26379,h2:26379/master[/db]
    #: URL; user and password may be in it (ACL).
    url: str = "redis://127.0.0.1:6379/0"
    #: Key prefix is ``{namespace}``: the hash tag keeps every key in one Cluster slot.
    namespace: str = Field(default="llmgw", pattern=r"^[A-Za-z0-9._:-]{1,64}$")
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


class CoordinationSettings(BaseModel):
    model_config = _FROZEN

    # Chosen so a SIGKILLed poller's endpoints are written again within ~3 s at a 1 s
    # interval: its lease and membership lapse after 2 s, survivors see the membership
    # change at their next heartbeat (<= 0.5 s) and reconcile at once.
    #: A lease lapses this long after its last renewal (every write and every reconcile).
    lease_ttl_ms: int = Field(default=2000, ge=200, le=600_000)
    #: A member counts as alive this long after its last heartbeat.
    member_ttl_ms: int = Field(default=2000, ge=200, le=600_000)
    heartbeat_interval_ms: int = Field(default=500, ge=50, le=200_000)
    #: Reconcile (and renew every held lease) at least this often.
    reconcile_interval_ms: int = Field(default=1000, ge=50, le=300_000)

    @model_validator(mode="after")
    def _check(self) -> CoordinationSettings:
        if self.heartbeat_interval_ms * 3 > self.member_ttl_ms:
            raise ValueError(
                f"heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be at most a third "
                f"of member_ttl_ms ({self.member_ttl_ms})"
            )
        if self.reconcile_interval_ms * 2 > self.lease_ttl_ms:
            raise ValueError(
                f"reconcile_interval_ms ({self.reconcile_interval_ms}) must be at most half "
                f"of lease_ttl_ms ({self.lease_ttl_ms}): reconcile renews the leases"
            )
        return self


class EngineSettings(BaseModel):
    """``[scrape.engines.<engine>]``: defaults for every entry of one engine (the Go
    poller's ``Path`` and ``Mapping``). An entry's own ``metrics_path`` and ``overrides``
    win over these, which win over the engine's built-in names and path."""

    model_config = _FROZEN

    #: Replaces the engine's default metrics path (may carry a query, as an entry's).
    metrics_path: str | None = None
    #: signal -> metric names, as an entry's ``overrides``.
    overrides: dict[str, tuple[str, ...]] = Field(default_factory=dict)

    @field_validator("metrics_path")
    @classmethod
    def _check_path(cls, value: str | None) -> str | None:
        from poller.registry import check_metrics_path

        return None if value is None else check_metrics_path(value)

    @field_validator("overrides")
    @classmethod
    def _check_overrides(cls, value: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        from poller.registry import check_overrides

        return check_overrides(value)


class ScrapeSettings(BaseModel):
    model_config = _FROZEN

    # The Go poller's DefaultConfig: scrape every 2 s, give each scrape 1 s.
    interval_s: float = Field(default=2.0, ge=0.05, le=3600)
    #: Strictly below the interval, so a slow engine never stacks scrapes. Default: 1 s,
    #: or half the interval when that is not below it (the Go poller's ``normalize``).
    timeout_s: float = Field(default=1.0, gt=0, le=600)
    #: Each run is moved by up to +-jitter_s around its slot (no drift; see worker).
    jitter_s: float = Field(default=0.05, ge=0, le=60)
    #: Runs start on multiples of this many ms of the epoch (0: anywhere), so the jobs
    #: due within one tick share the scheduler's and the event loop's wake-ups; at most
    #: a tenth of an endpoint's interval is used.
    tick_ms: int = Field(default=50, ge=0, le=1000)
    #: At most this many samples of the mapped metrics are read from one page; more is a
    #: ``too_large`` failure. Bounds the CPU (and GIL) one runaway page can take.
    max_samples: int = Field(default=10_000, ge=10, le=10_000_000)
    #: Bodies larger than this are mapped in a worker thread, so one large page does not
    #: hold up the event loop (heartbeats, every other endpoint's scrape).
    thread_map_bytes: int = Field(default=256 * 1024, ge=0, le=1024**3)
    #: Bodies larger than this are a ``too_large`` failure (a vLLM page is ~60 KB).
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, le=1024**3)
    #: The HTTP stack: there is one, the poller's own HTTP/1.1 transport under httpx
    #: (asyncio protocols, llhttp; scrape/wire.py). "asyncio" is the only value accepted,
    #: so a config naming another stack fails to load instead of silently changing it.
    http_client: str = "asyncio"

    @field_validator("http_client")
    @classmethod
    def _check_http_client(cls, value: str) -> str:
        if value != "asyncio":
            raise ValueError(
                f"{value!r} is not available: the poller has one HTTP stack, 'asyncio' "
                "(remove scrape.http_client or set it to 'asyncio')"
            )
        return value

    #: Engine mapping for entries that name none.
    default_engine: str = "vllm"
    #: Stats and failure hashes expire after this many intervals without a write.
    stats_ttl_intervals: float = Field(default=3.0, ge=1.5, le=1000)
    #: Hosts the poller may scrape: CIDRs or IPs (``10.0.0.0/8``, ``fd00::/8``) for IP
    #: literals, names (``gw.internal``) or wildcards (``*.engines.internal``) for host
    #: names. Empty: any host. See ``HostAllowlist`` for the exact rules.
    allowed_hosts: tuple[str, ...] = ()
    #: Per-engine default metrics path and metric-name overrides, below an entry's own.
    engines: dict[str, EngineSettings] = Field(default_factory=dict)

    @field_validator("engines")
    @classmethod
    def _check_engines(cls, value: dict[str, EngineSettings]) -> dict[str, EngineSettings]:
        from poller.registry import ENGINES

        for engine in value:
            if engine not in ENGINES or engine == "external":
                accepted = ", ".join(e for e in ENGINES if e != "external")
                raise ValueError(
                    f"unknown engine {engine!r} in [scrape.engines]; accepted: {accepted}"
                )
        return value

    # Engine API keys. Whoever can write the registry names api_key_env/api_key_file, and
    # the poller sends what it finds there as a bearer token: only these may be named.
    #: ``api_key_env`` must start with this prefix.
    key_env_prefix: str = Field(default="LLMGW_KEY_", pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    #: ``api_key_file`` must resolve, after symlinks, inside this directory (an absolute
    #: path). Unset: ``$CREDENTIALS_DIRECTORY`` (systemd's LoadCredential=) when set, else
    #: ``/etc/llmgw-poller/keys``. See ``key_directory``.
    key_dir: str | None = None

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value: Any) -> Any:
        # POLLER_SCRAPE__ALLOWED_HOSTS=10.0.0.0/8,*.engines.internal
        if isinstance(value, str):
            return tuple(item.strip() for item in value.split(",") if item.strip())
        return value

    @field_validator("allowed_hosts")
    @classmethod
    def _check_hosts(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        HostAllowlist.parse(value)  # raises ValueError naming the bad entry
        return value

    @field_validator("key_dir")
    @classmethod
    def _check_key_dir(cls, value: str | None) -> str | None:
        if value is not None and not os.path.isabs(value):
            raise ValueError(f"key_dir must be an absolute path, got {value!r}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _default_timeout(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("timeout_s") is None and "interval_s" in data:
            try:
                interval = float(data["interval_s"])
            except (TypeError, ValueError):
                return data  # the field validator reports the bad interval
            return {**data, "timeout_s": default_timeout_s(interval)}
        return data

    @model_validator(mode="after")
    def _check(self) -> ScrapeSettings:
        if self.timeout_s >= self.interval_s:
            # An explicit pair is a mistake to fix, not to guess around; only entries'
            # timeouts are lowered (effective_timeout_s), as the Go poller does.
            raise ValueError(
                f"timeout_s ({self.timeout_s:g}) must be below interval_s ({self.interval_s:g})"
            )
        if self.jitter_s * 4 > self.interval_s:
            raise ValueError(f"jitter_s ({self.jitter_s}) must be at most a quarter of interval_s")
        from poller.registry import ENGINES

        if self.default_engine not in ENGINES or self.default_engine == "external":
            accepted = ", ".join(e for e in ENGINES if e != "external")
            raise ValueError(
                f"unknown default_engine {self.default_engine!r}; accepted: {accepted}"
            )
        return self


#: Where ``api_key_file`` entries must live unless ``scrape.key_dir`` or systemd says.
DEFAULT_KEY_DIR = "/etc/llmgw-poller/keys"


def key_directory(scrape: ScrapeSettings, environ: Mapping[str, str] | None = None) -> str:
    """The directory ``api_key_file`` must resolve into: ``scrape.key_dir``, else systemd's
    ``$CREDENTIALS_DIRECTORY`` (set for a unit with ``LoadCredential=``), else
    ``/etc/llmgw-poller/keys``."""
    if scrape.key_dir:
        return scrape.key_dir
    env = os.environ if environ is None else environ
    credentials = env.get("CREDENTIALS_DIRECTORY", "")
    return credentials if os.path.isabs(credentials) else DEFAULT_KEY_DIR


# --- per-endpoint timeout (the Go poller's normalize) ------------------------------------

#: The Go poller's default scrape timeout.
DEFAULT_TIMEOUT_S = 1.0


def default_timeout_s(interval_s: float) -> float:
    """The timeout for an interval when none is named: 1 s, or half the interval when
    1 s is not below it."""
    return DEFAULT_TIMEOUT_S if DEFAULT_TIMEOUT_S < interval_s else round(interval_s / 2, 6)


def effective_timeout_s(
    entry_timeout_s: float | None, entry_interval_s: float | None, scrape: ScrapeSettings
) -> tuple[float, bool]:
    """An endpoint's scrape timeout and whether it was lowered.

    The entry's own ``timeout_s``/``interval_s`` win over ``scrape``'s. A timeout at or
    above the interval would let scrapes of a slow engine overlap: like the Go poller's
    ``normalize()``, it is lowered to half the interval, and ``lowered`` is True."""
    interval = entry_interval_s or scrape.interval_s
    timeout = entry_timeout_s or scrape.timeout_s
    if timeout >= interval:
        return round(interval / 2, 6), True
    return timeout, False


class HealthSettings(BaseModel):
    model_config = _FROZEN

    host: str = "0.0.0.0"
    #: 0 disables the health/metrics server.
    port: int = Field(default=9464, ge=0, le=65535)


# --- discovery sources (issue 15) ----------------------------------------------------------


#: Query options of a discovery URI (or keys of a ``[[discovery]]`` table besides ``uri``).
def default_poller_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Settings(BaseModel):
    model_config = _FROZEN

    id: str = Field(default_factory=default_poller_id, pattern=r"^[A-Za-z0-9._:@/-]{1,200}$")
    redis: RedisSettings = RedisSettings()
    coordination: CoordinationSettings = CoordinationSettings()
    scrape: ScrapeSettings = ScrapeSettings()
    health: HealthSettings = HealthSettings()
    #: Keep the registry equal to this YAML/TOML file.
    endpoints_file: str | None = None
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["text", "json"] = "text"
    #: DNS discovery sources: ``[[discovery]]`` tables or ``--discover URI``.
    discovery: tuple[DiscoverySource, ...] = ()

    @field_validator("discovery", mode="before")
    @classmethod
    def _parse_discovery(cls, value: Any) -> Any:
        try:
            return discovery_sources(value)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for key in path[:-1]:
        node = tree.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(path)}: {key} is not a section")
        tree = node
    tree[path[-1]] = value


def _env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    """``POLLER_SCRAPE__TIMEOUT_S=0.5`` -> {"scrape": {"timeout_s": "0.5"}}."""
    tree: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith("POLLER_") or "__" not in name:
            continue
        path = name.removeprefix("POLLER_").lower().split("__")
        _set_path(tree, path, value)
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_settings(
    config_file: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> Settings:
    """Build Settings from file < env (``POLLER_<SECTION>__<KEY>``) < overrides.

    ``overrides`` uses dotted keys (``{"scrape.interval_s": 2}``); None values are ignored.
    Raises ConfigError with one line naming the field and the problem.
    """
    data: dict[str, Any] = {}
    if config_file is not None:
        path = Path(config_file)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    data = _merge(data, _env_overrides(dict(os.environ if environ is None else environ)))
    flat: dict[str, Any] = {}
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_path(flat, dotted.split("."), value)
    data = _merge(data, flat)
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        field = ".".join(str(p) for p in err["loc"]) or "settings"
        message = str(err["msg"]).removeprefix("Value error, ")
        raise ConfigError(message, field=field) from None
