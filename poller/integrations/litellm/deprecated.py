"""The plug points' arguments of earlier releases (``picker=``, ``cache=``, ``local=``),
kept for one release with a DeprecationWarning that names the replacement."""

from __future__ import annotations

import warnings
from typing import Any

from poller.reader.legacy import LegacyCache, Picker
from poller.reader.router import Router
from poller.reader.routing.options import RoutingOptions
from poller.reader.view.cache import ViewCache

__all__ = ["options_of"]


def options_of(
    owner: str,
    options: RoutingOptions | None,
    router: Router | None,
    cache: Any,
    picker: Any,
) -> tuple[RoutingOptions | None, Router | None]:
    """(options, router) from the arguments a plug point was given: ``picker=`` gives
    its options, ``cache=`` its Router (a cache of ``reader.cached()``) or one built on
    it (a cache of the caller's own, sharing nothing)."""
    if picker is not None:
        _warn(owner, "picker", "options=RoutingOptions(...)")
        if not isinstance(picker, Picker):
            raise TypeError(f"picker must be a Picker, got {type(picker).__name__}")
        options = options or picker.options
    if cache is not None:
        _warn(owner, "cache", "router= (a Router of reader.router())")
        if isinstance(cache, LegacyCache):
            router = router or cache.router
        elif isinstance(cache, ViewCache):
            router = router or Router(cache, options)
        else:
            raise TypeError(f"cache must be a ViewCache, got {type(cache).__name__}")
    return options, router


def _warn(owner: str, name: str, instead: str) -> None:
    warnings.warn(
        f"{owner}({name}=...) is deprecated: pass {instead}",
        DeprecationWarning,
        stacklevel=4,
    )
