"""Settings: one frozen root model of sub-models, from a TOML file, env and flags.

Precedence (highest first): command-line flags, ``POLLER_*`` environment variables
(nested fields as ``POLLER_SCRAPE__TIMEOUT_S``), the TOML file, defaults. Each module
takes only its own sub-model. Unknown keys are errors, and every cross-field rule
(scrape timeout < interval < lease TTL ...) is checked here, once.

The sections live by concern (``poller.redis.settings`` for ``[redis]``, ``coordination``,
``scrape``, ``discovery``), loading in ``load``; ``poller.config`` re-exports every name.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from poller.config.allowlist import HostAllowlist
from poller.config.coordination import CoordinationSettings
from poller.config.discovery import DiscoverySource, discovery_sources, parse_discovery_uri
from poller.config.epp import EppSettings
from poller.config.load import (
    FLAT_ENV,
    env_overrides,
    flag_overrides,
    merge,
    read_toml,
    unknown_env,
)
from poller.config.scrape import (
    DEFAULT_KEY_DIR,
    DEFAULT_TIMEOUT_S,
    EngineSettings,
    ScrapeSettings,
    default_timeout_s,
    effective_timeout_s,
    key_directory,
)
from poller.errors import ConfigError
from poller.redis.settings import RedisSettings, check_redis_url
from poller.util.messages import describe_errors

__all__ = [
    "DEFAULT_KEY_DIR",
    "DEFAULT_TIMEOUT_S",
    "FLAT_ENV",
    "CoordinationSettings",
    "DiscoverySource",
    "EngineSettings",
    "EppSettings",
    "HealthSettings",
    "HostAllowlist",
    "RedisSettings",
    "ScrapeSettings",
    "Settings",
    "check_redis_url",
    "default_poller_id",
    "default_timeout_s",
    "key_directory",
    "effective_timeout_s",
    "load_settings",
    "parse_discovery_uri",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
#: Poller ids appear in lease values and space-separated events.
_ID_RE = re.compile(r"[A-Za-z0-9._:@/-]{1,200}")


class HealthSettings(BaseModel):
    model_config = _FROZEN

    host: str = "0.0.0.0"
    #: 0 disables the health/metrics server.
    port: int = Field(default=9464, ge=0, le=65535)


def default_poller_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Settings(BaseModel):
    model_config = _FROZEN

    id: str = Field(default_factory=default_poller_id)
    redis: RedisSettings = RedisSettings()
    coordination: CoordinationSettings = CoordinationSettings()
    scrape: ScrapeSettings = ScrapeSettings()
    health: HealthSettings = HealthSettings()
    #: ``poller epp``, the Endpoint Picker (poller/config/epp.py).
    epp: EppSettings = EppSettings()
    #: Keep the registry equal to this YAML/TOML file.
    endpoints_file: str | None = None
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["text", "json"] = "text"
    #: DNS discovery sources: ``[[discovery]]`` tables or ``--discover URI``.
    discovery: tuple[DiscoverySource, ...] = ()

    @field_validator("id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        if not _ID_RE.fullmatch(value):
            raise ValueError(
                f"poller id {value[:80]!r} must be 1-200 characters from A-Z a-z 0-9 . _ : @ "
                "/ - (no spaces), e.g. the pod name"
            )
        return value

    @field_validator("discovery", mode="before")
    @classmethod
    def _parse_discovery(cls, value: Any) -> Any:
        try:
            return discovery_sources(value)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None


def _holds(tree: dict[str, Any], path: list[str]) -> bool:
    """Whether ``tree`` sets the key at ``path`` (or a section there)."""
    node: Any = tree
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def load_settings(
    config_file: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
    flat_env: frozenset[str] = FLAT_ENV,
    sources: Mapping[str, str] | None = None,
) -> Settings:
    """Build Settings from file < env (``POLLER_<SECTION>__<KEY>``) < overrides.

    ``overrides`` uses dotted keys (``{"scrape.interval_s": 2}``); None values are ignored.
    ``sources`` says where an override came from (dotted key -> ``--interval`` or
    ``POLLER_INTERVAL``), for its error line.
    ``flat_env`` names the ``POLLER_*`` variables without ``__`` that are known (the
    command line's); any other ``POLLER_*`` variable is an error. Raises ConfigError
    with one line per problem (all of them), each naming its key or variable; ``field``
    is the first one's key.
    """
    env = dict(os.environ if environ is None else environ)
    from_file: dict[str, Any] = {} if config_file is None else read_toml(config_file)
    from_env = env_overrides(env, Settings)
    from_flags = flag_overrides(overrides)
    problems = [("env", line) for line in unknown_env(env, Settings, flat_env)]
    try:
        settings = Settings.model_validate(merge(merge(from_file, from_env), from_flags))
    except ValidationError as exc:
        for key, line in describe_errors(exc, Settings):
            # Say where a bad value came from when it was not a flag (those name themselves).
            path = key.split(".")
            if _holds(from_flags, path):
                where = (sources or {}).get(key)
                problems.append((key, f"{line} (from {where})" if where else line))
            elif _holds(from_env, path):
                problems.append((key, f"{line} (from POLLER_{'__'.join(path).upper()})"))
            elif config_file is not None and _holds(from_file, path):
                problems.append((key, f"{config_file}: {line}"))
            else:
                problems.append((key, line))
    if problems:
        error = ConfigError("\n".join(line for _, line in problems))
        error.field = problems[0][0]  # set after: the lines name their keys themselves
        raise error
    return settings
