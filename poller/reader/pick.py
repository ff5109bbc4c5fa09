"""``pick``: the picker in one call, for a gateway that keeps no state of its own."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

from poller.reader.cache import ViewCache
from poller.reader.load import LocalLoad
from poller.reader.picker import Picker, WhenSaturated
from poller.reader.view import EndpointView, View

__all__ = ["pick"]

# One picker per set of options, shared by every caller of ``pick`` in this process:
# it keeps the index of the last view or cache it was given between calls.
_pickers: dict[tuple[int, float, str, float], Picker] = {}
_lock = threading.Lock()


def pick(
    view: View | ViewCache | Mapping[str, EndpointView],
    model: str | None = None,
    *,
    prompt: str | None = None,
    candidates: Iterable[str] | None = None,
    max_waiting: int = 5,
    max_kv_cache_usage: float = 0.8,
    when_saturated: WhenSaturated = "least_loaded",
    stale_grace_s: float = 5.0,
    local: LocalLoad | None = None,
) -> str | None:
    """The endpoint for one request by ``Picker``'s rules (eligible, not saturated, the
    better of two random candidates), or None when no endpoint may take it; with
    ``model``, only an endpoint that serves it; with ``candidates``, only one of those
    ids; with ``prompt``, prefix affinity (``Picker``'s placements, of this process).
    The arguments are ``Picker.pick``'s, in its order; a wrong type (a list where
    the model goes, ``candidates`` as one string) raises ``TypeError``.

    A gateway replica does better with its own ``Picker`` (its own random source) and a
    ``LocalLoad``; pass the ``ViewCache`` rather than ``cache.view()`` for speed.
    """
    key = (max_waiting, max_kv_cache_usage, when_saturated, stale_grace_s)
    picker = _pickers.get(key)
    if picker is None:
        with _lock:
            picker = _pickers.setdefault(
                key, Picker(max_waiting, max_kv_cache_usage, when_saturated, stale_grace_s)
            )
    return picker.pick(view, model, prompt=prompt, candidates=candidates, local=local)
