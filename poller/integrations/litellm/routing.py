"""What the filter and the strategy share: deployments as endpoints, and the Router's rules.

Eligibility is the Router's own (``Router.eligible``, ``Router.saturated``): nothing
here re-states the rules. An endpoint whose engine names no model on its page
(llama.cpp, TGI, trtllm-serve) is asked without one. ``why`` only reads the view to
say, for the log, why an endpoint was not eligible.

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
from poller.reader.router import Router

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
    """The view source (its Router) and the deployment map of one filter or strategy.
    ``uninformed``: what the plug point does with a deployment the view does not judge,
    for the log line that says so."""

    def __init__(self, source: ViewSource, providers: Iterable[str], *, uninformed: str) -> None:
        self.source = source
        self.uninformed = uninformed
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

    async def router(self) -> Router | None:
        """The Router if its numbers may be used now; None: fail open (said once)."""
        try:
            router = await self.source.open()
        except Exception as exc:  # a bad URL or no URL at all: the proxy keeps serving
            self._fail_open(f"{type(exc).__name__}: {exc}")
            return None
        if not self.readable(router):
            self._fail_open(self._unreadable(router))
            return None
        if self._failing_open:
            self._failing_open = False
            log.warning("the shared view is readable again: routing on it")
        return router

    def router_now(self) -> Router | None:
        """The same without opening anything (sync callers): None until a first async
        use has opened the reader, or when the numbers may not be used."""
        router = self.source.router
        if router is None or not self.readable(router):
            why = "the reader is not open" if router is None else self._unreadable(router)
            self._fail_open(why)
            return None
        return router

    def _unreadable(self, router: Router) -> str:
        """Why a Router's numbers may not be used: a namespace nothing wrote (the
        Router's own words), never read (Redis not reached since the reader started), or
        Redis lost after it was."""
        cache = router.cache
        if cache.schema_missing:
            return router.explain().detail
        if not cache.loaded:
            return "cannot reach Redis: no view read from it yet"
        at = cache.confirmed_at
        ago = "" if at is None else f" for {time.monotonic() - at:.0f} s"
        return f"lost Redis: no answer{ago}, longer than stale_grace_s"

    @staticmethod
    def readable(router: Router) -> bool:
        """Loaded, and Redis answered within ``stale_grace_s`` (``Router.ready``)."""
        return router.ready

    def without_numbers(self, router: Router, targets: Sequence[Target]) -> bool:
        """True when none of these endpoints has current numbers in the view (all stale or
        unknown: the pollers are down or far behind). Failing ones count as current: a
        failure is news. Then the view says nothing about them: fail open (said once)."""
        mapped = [t.endpoint_id for t in targets if t.endpoint_id is not None]
        if not mapped:
            return False
        for endpoint_id in mapped:
            view = router.get(endpoint_id)
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

    def targets(self, router: Router, deployments: Sequence[Mapping[str, Any]]) -> list[Target]:
        index = self.source.urls(router)
        if index is not self._memo_index:
            self._memo, self._memo_index = {}, index
        memo = self._memo
        out = []
        for deployment in deployments:
            key = _deployment_id(deployment)
            target = memo.get(key) if key is not None else None
            if target is None:
                target = self._target(router, index, deployment)
                if key is not None:
                    memo[key] = target
            out.append(target)
        return out

    def _target(self, router: Router, index: UrlIndex, deployment: Mapping[str, Any]) -> Target:
        """The deployment's endpoint (None: uninformed, said once) and model."""
        endpoint_id = index.endpoint_for(deployment)
        named = explicit_endpoint(deployment)
        why = ""
        if endpoint_id is not None and not router.cache.knows(endpoint_id):
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
                "%s: %s: kept, uninformed (the view does not judge it; %s)",
                describe(deployment),
                why,
                self.uninformed,
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

    # --- the Router's rules -------------------------------------------------------------

    def asked(self, router: Router, target: Target) -> str | None:
        """The model to ask the Router for: the deployment's, or None when the view lists
        no model for the endpoint (its page names none and its ``/v1/models`` was not
        read: llama.cpp, TGI, trtllm-serve before the poller reads that), which would
        otherwise never be eligible for any."""
        endpoint_id = target.endpoint_id
        view = None if endpoint_id is None else router.cache.base(endpoint_id)
        stats = None if view is None else view.stats
        if stats is not None and not (stats.models or stats.lora_running or stats.lora_waiting):
            return None
        return target.model

    def eligible(self, router: Router, targets: Sequence[Target]) -> list[bool]:
        """Per target: may it take the request now? (unmapped targets: True). Saturated
        endpoints count only when no other mapped one is eligible, as a pick does."""
        asked = [self.asked(router, t) for t in targets]
        able = [
            t.endpoint_id is not None and router.eligible(t.endpoint_id, m)
            for t, m in zip(targets, asked, strict=True)
        ]
        free = [
            ok and not router.saturated(t.endpoint_id)  # type: ignore[arg-type]
            for ok, t in zip(able, targets, strict=True)
        ]
        chosen = free if any(free) else able  # all saturated: least_loaded lets them take it
        return [ok or t.endpoint_id is None for ok, t in zip(chosen, targets, strict=True)]

    # --- saying why ---------------------------------------------------------------------

    def why(self, router: Router, target: Target) -> Why:
        """Why the Router would not send this target a request now, read from the view
        (for the log only: the decision is the Router's)."""
        endpoint_id = target.endpoint_id
        view = None if endpoint_id is None else router.get(endpoint_id)
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
        model = self.asked(router, target)
        if model is not None and model not in (
            *stats.models,
            *stats.lora_running,
            *stats.lora_waiting,
        ):
            listed = ", ".join(stats.models) or "none"
            return Why("model", f"serves another model (lists {listed}, not {model})")
        options = router.options
        if endpoint_id is not None and router.saturated(endpoint_id):
            kv = stats.kv_cache_usage
            if kv is not None and kv >= options.max_kv_cache_usage:
                said = f"KV usage {kv:.2f} >= {options.max_kv_cache_usage}"
                return Why("saturated", f"saturated ({said})")
            if stats.waiting >= options.max_waiting:
                said = f"waiting {stats.waiting} >= {options.max_waiting}"
                return Why("saturated", f"saturated ({said})")
            return Why("saturated", "saturated")
        return Why("other", "not eligible")

    def dropped(self, router: Router, deployment: Mapping[str, Any], target: Target) -> None:
        """Log, once per deployment and reason, that the filter dropped it and why."""
        why = self.why(router, target)
        self.say_once(
            deployment,
            "dropped:" + why.kind,
            "%s (endpoint %s) dropped: %s",
            describe(deployment),
            target.endpoint_id,
            why.text,
        )

    def nothing_eligible(
        self, router: Router, group: str, targets: Sequence[Target], then: str
    ) -> None:
        """Log why no mapped deployment of ``group`` may take requests, once per change
        of the reasons (``then``: what happens to the request instead)."""
        whys = {t.endpoint_id: self.why(router, t) for t in targets if t.endpoint_id is not None}
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
