"""The service's settings: one frozen ``Settings`` of one model per section.

=================  ==================================================================
``settings``       the root model, ``[health]``, ``[logging]``, ``load_settings``
``coordination``   ``[coordination]``: lease and membership timings
``scrape``         ``[scrape]``: interval, timeouts, engines, API keys
``discovery``      ``[discovery]``: DNS sources (SRV, A/AAAA)
``epp``            ``[epp]``: the Endpoint Picker ``poller epp`` serves to Envoy
``allowlist``      the hosts scrapes may reach
``load``           the TOML file, ``POLLER_*`` variables and flags, merged
``registry_file``  YAML/TOML files of registry entries
=================  ==================================================================

``[redis]`` is ``poller.redis.settings.RedisSettings``: the readers connect with it too,
and they must not load this package.
"""

from __future__ import annotations

from poller.config.settings import (
    DEFAULT_KEY_DIR,
    DEFAULT_TIMEOUT_S,
    FLAT_ENV,
    CoordinationSettings,
    DiscoverySource,
    EngineSettings,
    EppSettings,
    HealthSettings,
    HostAllowlist,
    RedisSettings,
    ScrapeSettings,
    Settings,
    check_redis_url,
    default_poller_id,
    default_timeout_s,
    effective_timeout_s,
    key_directory,
    load_settings,
    parse_discovery_uri,
)

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
    "effective_timeout_s",
    "key_directory",
    "load_settings",
    "parse_discovery_uri",
]
