"""What the filter and the strategy share: deployments as endpoints, and the picker's rules.

Eligibility is the picker's own: each deployment's endpoint is asked of the picker as the
only candidate, once as configured and once with ``when_saturated="none"`` (so a
saturated endpoint answers None). Nothing here re-states the rules.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from poller.integrations.litellm.deployments import MODEL_KEY, UrlIndex
from poller.integrations.litellm.source import ViewSource
from poller.reader.cache import ViewCache
from poller.reader.picker import Picker

__all__ = ["Routing", "Target"]

log = logging.getLogger("poller.integrations.litellm")


class Target(NamedTuple):
    """A deployment as the view sees it: its endpoint (None: not in the registry) and
    the model name its engine lists."""

    endpoint_id: str | None
    model: str


class Routing:
    """The picker, the view source and the deployment map of one filter or strategy."""

    def __init__(self, picker: Picker, source: ViewSource, providers: Iterable[str]) -> None:
        self.picker = picker
        # The same rules with saturated endpoints answering None: "eligible and not
        # saturated" in one call. Its random source is never used for a single candidate.
        self.strict = Picker(
            max_waiting=picker.max_waiting,
            max_kv_cache_usage=picker.max_kv_cache_usage,
            when_saturated="none",
            stale_grace_s=picker.stale_grace_s,
        )
        self.source = source
        self.providers = frozenset(providers)
        self._memo: dict[str, Target] = {}
        self._memo_index: UrlIndex | None = None
        #: Requests routed without the view (it could not be read): LiteLLM's list kept.
        self.fail_open_total = 0
        self._failing_open = False

    # --- the view ---------------------------------------------------------------------

    async def cache(self) -> ViewCache | None:
        """The view's cache if its numbers may be used now; None: fail open (said once)."""
        try:
            cache = await self.source.open()
        except Exception as exc:  # a bad URL or no URL at all: the proxy keeps serving
            self._fail_open(f"{type(exc).__name__}: {exc}")
            return None
        if not self.readable(cache):
            self._fail_open("no view from Redis yet" if not cache.loaded else "Redis lost")
            return None
        if self._failing_open:
            self._failing_open = False
            log.warning("the shared view is readable again: routing on it")
        return cache

    def cache_now(self) -> ViewCache | None:
        """The same without opening anything (sync callers): None until a first async
        use has opened the reader, or when the numbers may not be used."""
        cache = self.source.cache
        if cache is None or not self.readable(cache):
            self._fail_open("the reader is not open" if cache is None else "no usable view")
            return None
        return cache

    def readable(self, cache: ViewCache) -> bool:
        """Loaded, and Redis answered within the picker's ``stale_grace_s``."""
        if not cache.loaded:
            return False
        if cache.healthy:
            return True
        at = cache.confirmed_at
        return at is not None and time.monotonic() - at <= self.picker.stale_grace_s

    def without_numbers(self, cache: ViewCache, targets: Sequence[Target]) -> bool:
        """True when none of these endpoints has current numbers in the view (all stale or
        unknown: the pollers are down or far behind). Failing ones count as current: a
        failure is news. Then the view says nothing about them: fail open (said once)."""
        mapped = [t.endpoint_id for t in targets if t.endpoint_id is not None]
        if not mapped:
            return False
        for endpoint_id in mapped:
            view = cache.get(endpoint_id)
            if view is not None and view.state in ("fresh", "failing"):
                return False
        self._fail_open(f"no current numbers for {', '.join(sorted(set(mapped))[:5])}")
        return True

    def fail_open(self, why: str) -> None:
        self._fail_open(why)

    def _fail_open(self, why: str) -> None:
        self.fail_open_total += 1
        if not self._failing_open:
            self._failing_open = True
            log.warning(
                "the shared view cannot be read (%s): keeping LiteLLM's deployments until "
                "it can (counted in fail_open_total)",
                why,
            )

    # --- deployments ------------------------------------------------------------------

    def targets(self, cache: ViewCache, deployments: Sequence[Mapping[str, Any]]) -> list[Target]:
        index = self.source.urls(cache)
        if index is not self._memo_index:
            self._memo, self._memo_index = {}, index
        memo = self._memo
        out = []
        for deployment in deployments:
            key = _deployment_id(deployment)
            target = memo.get(key) if key is not None else None
            if target is None:
                target = Target(index.endpoint_for(deployment), self.served_model(deployment))
                if key is not None:
                    memo[key] = target
            out.append(target)
        return out

    def served_model(self, deployment: Mapping[str, Any]) -> str:
        """``model_info.llmgw_model``, else ``litellm_params.model`` without LiteLLM's
        provider prefix (``openai/``, ``hosted_vllm/``, ...): the name engines list."""
        info = deployment.get("model_info")
        if isinstance(info, Mapping) and info.get(MODEL_KEY):
            return str(info[MODEL_KEY])
        params = deployment.get("litellm_params")
        model = str(params.get("model", "")) if isinstance(params, Mapping) else ""
        provider, sep, rest = model.partition("/")
        return rest if sep and provider in self.providers else model

    # --- the picker's rules -------------------------------------------------------------

    def eligible(self, cache: ViewCache, targets: Sequence[Target]) -> list[bool]:
        """Per target: may it take the request now? (unmapped targets: True). Saturated
        endpoints count only when no other mapped one is eligible, as the picker does."""
        free = [
            t.endpoint_id is not None
            and self.strict.pick(cache, t.model, candidates=(t.endpoint_id,)) is not None
            for t in targets
        ]
        if any(free) or self.picker.when_saturated == "none":
            return [f or t.endpoint_id is None for f, t in zip(free, targets, strict=True)]
        return [
            t.endpoint_id is None
            or self.picker.pick(cache, t.model, candidates=(t.endpoint_id,)) is not None
            for t in targets
        ]


def _deployment_id(deployment: Mapping[str, Any]) -> str | None:
    info = deployment.get("model_info")
    if isinstance(info, Mapping) and info.get("id") is not None:
        return str(info["id"])
    return None
