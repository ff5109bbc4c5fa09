"""Scrape settings (``[scrape]``, ``[scrape.engines.<engine>]``), the API-key directory
and the per-endpoint timeout rule."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from poller.config.allowlist import HostAllowlist
from poller.schema.endpoint import MIN_INTERVAL_S
from poller.util.messages import closest

__all__ = [
    "DEFAULT_JITTER_S",
    "DEFAULT_KEY_DIR",
    "DEFAULT_TIMEOUT_S",
    "MIN_INTERVAL_S",
    "EngineSettings",
    "ScrapeSettings",
    "default_timeout_s",
    "effective_timeout_s",
    "key_directory",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
#: The jitter when none is named (a quarter of the interval when that is less).
DEFAULT_JITTER_S = 0.05


def _hint(engine: str) -> str:
    from poller.schema.endpoint import ENGINES

    guess = closest(engine, [e for e in ENGINES if e != "external"])
    return f" (did you mean {guess!r}?)" if guess else ""


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
        from poller.schema.endpoint import check_metrics_path

        return None if value is None else check_metrics_path(value)

    @field_validator("overrides")
    @classmethod
    def _check_overrides(cls, value: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        from poller.schema.endpoint import check_overrides

        return check_overrides(value)


class ScrapeSettings(BaseModel):
    model_config = _FROZEN

    # The Go poller's DefaultConfig: scrape every 2 s, give each scrape 1 s.
    interval_s: float = Field(default=2.0, ge=MIN_INTERVAL_S, le=3600)
    #: Strictly below the interval, so a slow engine never stacks scrapes. Default: 1 s,
    #: or half the interval when that is not below it (the Go poller's ``normalize``).
    timeout_s: float = Field(default=1.0, gt=0, le=600)
    #: Each run is moved by up to +-jitter_s around its slot (no drift; see worker). At
    #: most a quarter of the interval; unset: 0.05 s, or a quarter of a shorter interval.
    jitter_s: float = Field(default=DEFAULT_JITTER_S, ge=0, le=60)
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
    #: (asyncio protocols, llhttp; scrape/http/wire.py). "asyncio" is the only value accepted,
    #: so a config naming another stack fails to load instead of silently changing it.
    http_client: str = "asyncio"
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

    @field_validator("http_client")
    @classmethod
    def _check_http_client(cls, value: str) -> str:
        if value != "asyncio":
            raise ValueError(
                f"{value!r} is not available: the poller has one HTTP stack, 'asyncio' "
                "(remove scrape.http_client or set it to 'asyncio')"
            )
        return value

    @field_validator("engines")
    @classmethod
    def _check_engines(cls, value: dict[str, EngineSettings]) -> dict[str, EngineSettings]:
        from poller.schema.endpoint import ENGINES

        for engine in value:
            if engine not in ENGINES or engine == "external":
                accepted = ", ".join(e for e in ENGINES if e != "external")
                raise ValueError(
                    f"unknown engine {engine!r} in [scrape.engines]{_hint(engine)}; "
                    f"accepted: {accepted}"
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
    def _defaults_for_interval(cls, data: Any) -> Any:
        """An unset timeout and jitter follow the interval: a timeout below it, a jitter
        of at most a quarter. A bad interval is left to its own check to report."""
        if not isinstance(data, dict) or "interval_s" not in data:
            return data
        try:
            interval = float(data["interval_s"])
        except (TypeError, ValueError):
            return data
        if not MIN_INTERVAL_S <= interval <= 3600:
            return data
        data = dict(data)
        if data.get("timeout_s") is None:
            data["timeout_s"] = default_timeout_s(interval)
        if data.get("jitter_s") is None:
            data["jitter_s"] = min(DEFAULT_JITTER_S, round(interval / 4, 6))
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
            raise ValueError(
                f"jitter_s ({self.jitter_s:g}) must be at most a quarter of interval_s "
                f"({self.interval_s:g}): at most {self.interval_s / 4:g}"
            )
        from poller.schema.endpoint import ENGINES

        if self.default_engine not in ENGINES or self.default_engine == "external":
            accepted = ", ".join(e for e in ENGINES if e != "external")
            raise ValueError(
                f"unknown default_engine {self.default_engine!r}{_hint(self.default_engine)}; "
                f"accepted: {accepted}"
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
