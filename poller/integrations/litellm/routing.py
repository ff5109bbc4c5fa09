"""What the filter and the strategy share: deployments as endpoints, and the picker's rules.

Eligibility is the picker's own: each deployment's endpoint is asked of the picker as the
only candidate, once as configured and once with ``when_saturated="none"`` (so a
saturated endpoint answers None). An endpoint whose engine names no model on its page
(llama.cpp, TGI, trtllm-serve) is asked without one. Nothing here re-states the rules;
``why`` only reads the view to say, for the log, why an endpoint was not eligible.

A deployment that maps to no endpoint of the registry (no ``model_info.llmgw_endpoint``
and an ``api_base`` no entry has, or an ``llmgw_endpoint`` the registry lacks) is
uninformed: not judged, logged once at WARNING with the reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from poller.integrations.litellm.deployments import (
    ENDPOINT_KEY,
    MODEL_KEY,
    UrlIndex,
    api_base,
    explicit_endpoint,
)
from poller.integrations.litellm.source import ViewSource
from poller.reader.cache import ViewCache
from poller.reader.picker import Picker

__all__ = ["Routing", "Target", "Why", "describe"]

log = logging.getLogger("poller.integrations.litellm")


class Target(NamedTuple):
    """A deployment as the view sees it: its endpoint (None: not in the registry) and
    the model name its engine lists."""

    endpoint_id: str | None
    model: str


class Why(NamedTuple):
    """Why an endpoint may not take a request now: ``kind`` (stable, for "once per
    change") and the words for the log."""

    kind: str
    text: str


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
        #: (deployment, reason) pairs already logged: each is said once.
        self._said: set[tuple[str, str]] = set()
        #: Model group -> the reasons last logged for its having nothing eligible.
        self._nothing: dict[str, tuple[tuple[str, str], ...]] = {}

    # --- the view ---------------------------------------------------------------------

    async def cache(self) -> ViewCache | None:
        """The view's cache if its numbers may be used now; None: fail open (said once)."""
        try:
            cache = await self.source.open()
        except Exception as exc:  # a bad URL or no URL at all: the proxy keeps serving
            self._fail_open(f"{type(exc).__name__}: {exc}")
            return None
        if not self.readable(cache):
            self._fail_open(self._unreadable(cache))
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
            self._fail_open("the reader is not open" if cache is None else self._unreadable(cache))
            return None
        return cache

    def _unreadable(self, cache: ViewCache) -> str:
        """Why a cache's numbers may not be used: never read (Redis not reached since the
        reader started), or Redis lost after it was."""
        if not cache.loaded:
            return "cannot reach Redis: no view read from it yet"
        at = cache.confirmed_at
        ago = "" if at is None else f" for {time.monotonic() - at:.0f} s"
        return f"lost Redis: no answer{ago}, longer than stale_grace_s"

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
                target = self._target(cache, index, deployment)
                if key is not None:
                    memo[key] = target
            out.append(target)
        return out

    def _target(self, cache: ViewCache, index: UrlIndex, deployment: Mapping[str, Any]) -> Target:
        """The deployment's endpoint (None: uninformed, said once) and model."""
        endpoint_id = index.endpoint_for(deployment)
        named = explicit_endpoint(deployment)
        why = ""
        if endpoint_id is not None and not cache.knows(endpoint_id):
            why = f"names endpoint {endpoint_id!r} in model_info.{ENDPOINT_KEY}, which the "
            endpoint_id, why = None, why + "registry lacks"
        elif endpoint_id is None and named is None:
            base = api_base(deployment)
            why = (
                f"its api_base {base} matches no registry entry's url"
                if base is not None
                else "has no api_base"
            )
            why += f" and it names no endpoint in model_info.{ENDPOINT_KEY}"
        if endpoint_id is None:
            self.say_once(
                deployment,
                "uninformed:" + why,
                "%s: %s: kept, uninformed (the view does not judge it; the strategy uses it "
                "only when no mapped deployment is eligible)",
                describe(deployment),
                why,
            )
        return Target(endpoint_id, self.served_model(deployment))

    def say_once(self, deployment: Mapping[str, Any], reason: str, msg: str, *args: Any) -> None:
        """Log ``msg`` at WARNING the first time this deployment has this reason."""
        key = (_deployment_id(deployment) or describe(deployment), reason)
        if key not in self._said:
            self._said.add(key)
            log.warning(msg, *args)

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

    def asked(self, cache: ViewCache, target: Target) -> str | None:
        """The model to ask the picker for: the deployment's, or None when the view lists
        no model for the endpoint (its page names none and its ``/v1/models`` was not
        read: llama.cpp, TGI, trtllm-serve before the poller reads that), which would
        otherwise never be eligible for any."""
        endpoint_id = target.endpoint_id
        view = None if endpoint_id is None else cache.base(endpoint_id)
        stats = None if view is None else view.stats
        if stats is not None and not (stats.models or stats.lora_running or stats.lora_waiting):
            return None
        return target.model

    def eligible(self, cache: ViewCache, targets: Sequence[Target]) -> list[bool]:
        """Per target: may it take the request now? (unmapped targets: True). Saturated
        endpoints count only when no other mapped one is eligible, as the picker does."""
        asked = [self.asked(cache, t) for t in targets]
        free = [
            t.endpoint_id is not None
            and self.strict.pick(cache, m, candidates=(t.endpoint_id,)) is not None
            for t, m in zip(targets, asked, strict=True)
        ]
        if any(free) or self.picker.when_saturated == "none":
            return [f or t.endpoint_id is None for f, t in zip(free, targets, strict=True)]
        return [
            t.endpoint_id is None
            or self.picker.pick(cache, m, candidates=(t.endpoint_id,)) is not None
            for t, m in zip(targets, asked, strict=True)
        ]

    # --- saying why ---------------------------------------------------------------------

    def why(self, cache: ViewCache, target: Target) -> Why:
        """Why the picker would not send this target a request now, read from the view
        (for the log only: the decision is the picker's)."""
        endpoint_id = target.endpoint_id
        view = None if endpoint_id is None else cache.get(endpoint_id)
        if view is None:
            return Why("unknown", "not in the registry")
        if view.state == "failing":
            failure = view.failure
            if failure is None:
                return Why("failing", "failing")
            detail = f": {failure.detail}" if failure.detail else ""
            return Why("failing", f"failing ({failure.reason}{detail})")
        if view.state == "stale":
            return Why("stale", "stale (no recent scrape)")
        stats = view.stats
        if view.state == "unknown" or stats is None:
            return Why("unknown", "no numbers yet")
        if stats.sleeping:
            return Why("asleep", "asleep (sleep mode)")
        model = self.asked(cache, target)
        if model is not None and model not in (
            *stats.models,
            *stats.lora_running,
            *stats.lora_waiting,
        ):
            listed = ", ".join(stats.models) or "none"
            return Why("model", f"serves another model (lists {listed}, not {model})")
        picker = self.picker
        if stats.waiting >= picker.max_waiting:
            return Why("saturated", f"saturated (waiting {stats.waiting} >= {picker.max_waiting})")
        kv = stats.kv_cache_usage
        if kv is not None and kv >= picker.max_kv_cache_usage:
            return Why("saturated", f"saturated (KV usage {kv:.2f} >= {picker.max_kv_cache_usage})")
        return Why("other", "not eligible")

    def dropped(self, cache: ViewCache, deployment: Mapping[str, Any], target: Target) -> None:
        """Log, once per deployment and reason, that the filter dropped it and why."""
        why = self.why(cache, target)
        self.say_once(
            deployment,
            "dropped:" + why.kind,
            "%s (endpoint %s) dropped: %s",
            describe(deployment),
            target.endpoint_id,
            why.text,
        )

    def nothing_eligible(
        self, cache: ViewCache, group: str, targets: Sequence[Target], then: str
    ) -> None:
        """Log why no mapped deployment of ``group`` may take requests, once per change
        of the reasons (``then``: what happens to the request instead)."""
        whys = {t.endpoint_id: self.why(cache, t) for t in targets if t.endpoint_id is not None}
        key = tuple(sorted((e, w.kind) for e, w in whys.items()))
        if self._nothing.get(group) == key:
            return
        self._nothing[group] = key
        words = "; ".join(f"{e} {w.text}" for e, w in sorted(whys.items()))
        log.warning("no endpoint may take requests for model group %r (%s): %s", group, words, then)

    def something_eligible(self, group: str) -> None:
        """The group has an eligible endpoint again: the next "nothing" is news."""
        if self._nothing:
            self._nothing.pop(group, None)


def describe(deployment: Mapping[str, Any]) -> str:
    """``deployment <id> of model group <name>``, for the log."""
    key = _deployment_id(deployment)
    group = deployment.get("model_name")
    name = f"LiteLLM deployment {key}" if key is not None else "a LiteLLM deployment"
    return f"{name} of model group {group!r}" if group else name


def _deployment_id(deployment: Mapping[str, Any]) -> str | None:
    info = deployment.get("model_info")
    if isinstance(info, Mapping) and info.get("id") is not None:
        return str(info["id"])
    return None
