"""Every routing option in one frozen record: ``RoutingOptions``.

A ``Router`` takes one (``reader.router(RoutingOptions(...))``); the defaults are what
docs/reader.md describes and every benchmark cell runs. A value of the wrong type or
out of range is a ``ConfigError`` naming the option, at construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from poller.errors import ConfigError
from poller.util.text import is_number

__all__ = ["PREFIX_LOAD_FACTOR", "PREFIX_LOAD_SLACK", "RoutingOptions", "WhenSaturated"]

WhenSaturated = Literal["least_loaded", "none"]
#: Prefix affinity's bound: an endpoint holding the prompt's prefix takes the request
#: while its load is at most this factor x the load-only choice's + the slack.
PREFIX_LOAD_FACTOR = 1.5
PREFIX_LOAD_SLACK = 2.0


@dataclass(frozen=True, slots=True)
class RoutingOptions:
    """How a gateway replica routes (docs/reader.md, "The Router").

    - ``max_waiting``, ``max_kv_cache_usage``: when an endpoint is saturated (the
      Gateway API Inference Extension's 5 and 0.8).
    - ``when_saturated``: every eligible endpoint saturated: ``"least_loaded"`` still
      chooses one (its engine queues the request), ``"none"`` answers None (shed).
    - ``stale_grace_s``: how long the last numbers are used after Redis stopped
      answering (a Sentinel failover), then no pick.
    - ``share``: exchange this replica's requests in flight with the other replicas;
      ``share_placements``: exchange the prefix placements of picks with a prompt too.
    - ``scale_local``, ``use_latency``: the load corrections (docs/reader.md).
    - ``prefix_load_factor``, ``prefix_load_slack``: prefix affinity's bound.
    """

    max_waiting: int = 5
    max_kv_cache_usage: float = 0.8
    when_saturated: WhenSaturated = "least_loaded"
    stale_grace_s: float = 5.0
    share: bool = True
    share_placements: bool = True
    scale_local: bool = True
    use_latency: bool = True
    prefix_load_factor: float = PREFIX_LOAD_FACTOR
    prefix_load_slack: float = PREFIX_LOAD_SLACK

    def __post_init__(self) -> None:
        check_options(
            self.max_waiting,
            self.max_kv_cache_usage,
            self.when_saturated,
            self.stale_grace_s,
            self.prefix_load_factor,
            self.prefix_load_slack,
        )
        for name in ("share", "share_placements", "scale_local", "use_latency"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"{name} must be True or False, got {value!r}")


def check_options(
    max_waiting: object,
    max_kv_cache_usage: object,
    when_saturated: object,
    stale_grace_s: object,
    prefix_load_factor: object,
    prefix_load_slack: object,
) -> None:
    """``ConfigError`` naming the first option of the wrong type or out of range."""
    if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1:
        raise ConfigError(f"max_waiting must be an integer >= 1, got {max_waiting!r}")
    if not (is_number(max_kv_cache_usage) and 0.0 < max_kv_cache_usage <= 1.0):  # type: ignore[operator]
        raise ConfigError(f"max_kv_cache_usage must be in (0, 1], got {max_kv_cache_usage!r}")
    if when_saturated not in ("least_loaded", "none"):
        raise ConfigError(
            f"when_saturated must be 'least_loaded' or 'none', got {when_saturated!r}"
        )
    if not (is_number(stale_grace_s) and 0.0 <= stale_grace_s < math.inf):  # type: ignore[operator]
        raise ConfigError(f"stale_grace_s must be >= 0 seconds, got {stale_grace_s!r}")
    for name, value, least in (
        ("prefix_load_factor", prefix_load_factor, 1.0),
        ("prefix_load_slack", prefix_load_slack, 0.0),
    ):
        if not (is_number(value) and least <= value < math.inf):  # type: ignore[operator]
            raise ConfigError(f"{name} must be a number >= {least:g}, got {value!r}")
