"""``LoadAwareStrategy``: the plug point of LiteLLM's SDK ``Router``. LiteLLM narrows a
model group to its healthy deployments (aliases, cooldowns, filters, tags, order); this
replica's poller ``Router`` chooses the endpoint and counts the request from pick to end
(``tickets.py``)."""

from __future__ import annotations

import logging
import random
import warnings
from collections.abc import Mapping
from typing import Any

import litellm
from litellm.integrations.custom_logger import CustomLogger
from litellm.litellm_core_utils.core_helpers import get_parent_otel_span_from_kwargs
from litellm.router_strategy.simple_shuffle import simple_shuffle
from litellm.router_utils.handle_error import async_raise_no_deployment_exception
from litellm.types.router import CustomRoutingStrategyBase

from poller.integrations.litellm.deprecated import options_of
from poller.integrations.litellm.routing import Routing
from poller.integrations.litellm.source import ViewSource
from poller.integrations.litellm.tickets import Key, Tickets
from poller.reader.load.local import LocalLoad
from poller.reader.prefix.blocks import prompt_of
from poller.reader.router import Router
from poller.reader.routing.options import RoutingOptions
from poller.reader.ticket import Ticket
from poller.util.logs import count

__all__ = ["LoadAwareStrategy"]

log = logging.getLogger("poller.integrations.litellm")
Deployment = dict[str, Any]


class LoadAwareStrategy(CustomRoutingStrategyBase, CustomLogger):  # type: ignore[misc]
    """Chooses each request's deployment with a poller ``Router`` over the shared view.

    ``install()`` sets it on LiteLLM's Router (``set_custom_routing_strategy``) and
    registers it as a LiteLLM callback, which is how it learns when a request ended.
    Among the deployments LiteLLM considers healthy, the poller Router chooses an
    endpoint (a group whose deployments name one engine model picks with that model; a
    mixed group keeps those whose endpoint serves their own model, then picks among
    them); deployments sharing that endpoint are chosen between at random. A chat
    request's ``messages`` are the pick's ``prompt`` (``prompt_of``): prefix affinity.
    ``poller_router``: a poller Router of the caller's (else one opened on the first
    request, with ``options``). Nothing eligible (logged once per change
    of the reasons): deployments that map to no endpoint (a hosted provider, an
    ``llmgw_endpoint`` the registry lacks: uninformed, logged once each) by LiteLLM's
    weighted shuffle, else LiteLLM's own no-deployment error. The view unreadable, or
    without current numbers for any of the group's endpoints (the pollers are down):
    LiteLLM's weighted shuffle over all (``fail_open_total``).
    """

    def __init__(
        self,
        router: litellm.Router,
        *,
        redis_url: str | None = None,
        namespace: str | None = None,
        options: RoutingOptions | None = None,
        poller_router: Router | None = None,
        max_open_s: float = 600.0,
        rng: random.Random | None = None,
        cache: Any = None,
        picker: Any = None,
        local: Any = None,
    ) -> None:
        CustomLogger.__init__(self)
        self.router = router
        if local is not None:
            warnings.warn(
                "LoadAwareStrategy(local=...) is deprecated and no longer used: the "
                "poller Router counts each request (strategy.local is its LocalLoad)",
                DeprecationWarning,
                stacklevel=2,
            )
        owner = type(self).__name__
        options, poller_router = options_of(owner, options, poller_router, cache, picker)
        self.tickets = Tickets(max_open_s)
        source = ViewSource(redis_url, namespace, router=poller_router, options=options, rng=rng)
        spare = "the strategy uses it only when no mapped deployment is eligible"
        self.routing = Routing(source, litellm.provider_list, uninformed=spare)
        self.rng = rng if rng is not None else random.Random()
        self._idle = LocalLoad()  # what ``local`` shows before a Router is open

    @property
    def local(self) -> LocalLoad:
        """This replica's requests in flight: the poller Router's count."""
        router = self.routing.source.router
        return self._idle if router is None else router.local

    def install(self) -> LoadAwareStrategy:
        self.router.set_custom_routing_strategy(self)
        litellm.logging_callback_manager.add_litellm_callback(self)
        return self

    def uninstall(self) -> None:
        """Take it off the Router and out of LiteLLM's callbacks."""
        for name in ("get_available_deployment", "async_get_available_deployment"):
            self.router.__dict__.pop(name, None)
        litellm.logging_callback_manager.remove_callback_from_all_lists(self)

    @property
    def fail_open_total(self) -> int:
        return self.routing.fail_open_total

    # --- choosing -----------------------------------------------------------------------

    async def async_get_available_deployment(
        self,
        model: str,
        messages: list[dict[str, str]] | None = None,
        input: str | list[Any] | None = None,
        specific_deployment: bool | None = False,
        request_kwargs: dict[str, Any] | None = None,
    ) -> Deployment:
        kwargs = request_kwargs if request_kwargs is not None else {}
        span = get_parent_otel_span_from_kwargs(kwargs)
        healthy = await self.router.async_get_healthy_deployments(
            model=model,
            request_kwargs=kwargs,
            messages=messages,
            input=input,
            specific_deployment=specific_deployment,
            parent_otel_span=span,
        )
        ticket = None
        if isinstance(healthy, dict):  # a specific deployment was asked for
            deployment: Deployment | None = healthy
        else:
            prompt = _prompt(messages)
            router = await self.routing.router()
            deployment, ticket = self.choose(router, model, healthy, kwargs, prompt=prompt)
        if deployment is None:
            raise await async_raise_no_deployment_exception(
                litellm_router_instance=self.router, model=model, parent_otel_span=span
            )
        self._opened(deployment, kwargs, ticket)
        return deployment

    def get_available_deployment(
        self,
        model: str,
        messages: list[dict[str, str]] | None = None,
        input: str | list[Any] | None = None,
        specific_deployment: bool | None = False,
        request_kwargs: dict[str, Any] | None = None,
    ) -> Deployment:
        """The sync Router path: LiteLLM's common checks (aliases, unknown models), then
        the same choice on the cache as it is (a sync call cannot open the reader)."""
        kwargs = request_kwargs if request_kwargs is not None else {}
        model, healthy = self.router._common_checks_available_deployment(
            model=model,
            messages=messages,
            input=input,
            specific_deployment=specific_deployment,
            request_kwargs=kwargs,
        )
        ticket = None
        if isinstance(healthy, dict):
            deployment: Deployment | None = healthy
        else:
            prompt = _prompt(messages)
            router = self.routing.router_now()
            deployment, ticket = self.choose(router, model, healthy, kwargs, prompt=prompt)
        if deployment is None:
            raise litellm.RouterRateLimitError(
                model=model,
                cooldown_time=0,
                enable_pre_call_checks=self.router.enable_pre_call_checks,
                cooldown_list=[],
                model_ids=self.router.get_model_ids(model_name=model),
            )
        self._opened(deployment, kwargs, ticket)
        return deployment

    def choose(
        self,
        router: Router | None,
        model: str,
        healthy: list[Deployment],
        kwargs: Mapping[str, Any],
        *,
        prompt: str | None = None,
    ) -> tuple[Deployment | None, Ticket | None]:
        """The deployment for one request among ``healthy`` (None: nothing may take it)
        and the poller Router's ticket that counts it (None: not chosen by a pick; the
        caller ends the ticket, as ``async_get_available_deployment`` does through its
        attempt). ``prompt``: the request's messages as the engine prefills them
        (``prompt_of``), for prefix affinity."""
        if not healthy:
            return None, None
        if router is None:
            return self._shuffle(model, healthy, kwargs), None
        routing = self.routing
        targets = routing.targets(router, healthy)
        mapped = [
            (d, t.endpoint_id, t)
            for d, t in zip(healthy, targets, strict=True)
            if t.endpoint_id is not None
        ]
        ticket = None
        if mapped:
            served = {routing.asked(router, t) for _, _, t in mapped}
            if len(served) == 1:
                ids = [e for _, e, _ in mapped]
                ticket = router.pick(served.pop(), prompt=prompt, candidates=ids)
            else:
                ok = routing.eligible(router, [t for _, _, t in mapped])
                ids = [e for (_, e, _), k in zip(mapped, ok, strict=True) if k]
                if ids:
                    ticket = router.pick(None, prompt=prompt, candidates=ids)
        if ticket is not None:
            routing.something_eligible(model)
            on_it = [d for d, e, _ in mapped if e == ticket.id]
            return (on_it[0] if len(on_it) == 1 else self.rng.choice(on_it)), ticket
        if routing.without_numbers(router, targets):
            return self._shuffle(model, healthy, kwargs), None
        unmapped = [d for d, t in zip(healthy, targets, strict=True) if t.endpoint_id is None]
        if mapped:
            routing.nothing_eligible(
                router,
                model,
                [t for _, _, t in mapped],
                f"sending to its {count(len(unmapped), 'uninformed deployment')}"
                if unmapped
                else "LiteLLM answers 'No deployments available'",
            )
        return (self._shuffle(model, unmapped, kwargs) if unmapped else None), None

    def _shuffle(
        self, model: str, deployments: list[Deployment], kwargs: Mapping[str, Any]
    ) -> Deployment:
        chosen: Deployment = simple_shuffle(
            resolve_model_alias=self.router.get_model_from_alias,
            healthy_deployments=deployments,
            model=model,
            request_kwargs=kwargs,
        )
        return chosen

    # --- the count, from pick to end ---------------------------------------------------

    def _opened(
        self, deployment: Mapping[str, Any], kwargs: Mapping[str, Any], ticket: Ticket | None
    ) -> None:
        """Hold the attempt's ticket until its end is reported: the pick's, or one of
        ``track`` for a deployment LiteLLM chose itself (a shuffle, a named one)."""
        if ticket is None:
            router = self.routing.source.router
            if router is None:
                return
            target = self.routing.targets(router, [deployment])[0]
            if target.endpoint_id is None:
                return
            ticket = router.track(target.endpoint_id)
        key = (str(kwargs.get("litellm_trace_id", "")), _deployment_id(deployment))
        self.tickets.open(ticket, key, stream=bool(kwargs.get("stream")))

    def _ended(self, kwargs: Mapping[str, Any], *, ok: bool) -> None:
        key = _callback_key(kwargs)
        if key is not None:
            self.tickets.close_key(key, ok=ok)

    async def async_log_success_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        self._ended(kwargs, ok=True)

    async def async_log_failure_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        self._ended(kwargs, ok=_request_at_fault(kwargs))

    def log_success_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        self._ended(kwargs, ok=True)

    def log_failure_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        self._ended(kwargs, ok=_request_at_fault(kwargs))


#: HTTP statuses that blame the request, not the engine: a bad request (LiteLLM's
#: BadRequestError, ContextWindowExceededError), one too large, one not processable.
_REQUEST_AT_FAULT = frozenset({400, 413, 422})


def _request_at_fault(kwargs: Mapping[str, Any]) -> bool:
    """A failure callback's attempt failed through the request's own fault (its
    exception's ``status_code`` in ``_REQUEST_AT_FAULT``): the engine answered as it
    should and is not counted as failing. Anything else (5xx, 404 for a model it does
    not serve, 429, a timeout, a refused connection) is the engine's."""
    status = getattr(kwargs.get("exception"), "status_code", None)
    return status in _REQUEST_AT_FAULT


def _prompt(messages: Any) -> str | None:
    """A chat request's messages as one text (``prompt_of``); None when there are none
    (embeddings, text completions) or they are not OpenAI-style (never an error here:
    the request is LiteLLM's to judge)."""
    if not messages:
        return None
    try:
        return prompt_of(messages)
    except TypeError:
        return None


def _deployment_id(deployment: Mapping[str, Any]) -> str:
    info = deployment.get("model_info")
    return str(info.get("id", "")) if isinstance(info, Mapping) else ""


def _callback_key(kwargs: Mapping[str, Any]) -> Key | None:
    """(trace id, deployment id) of the attempt a callback reports."""
    params = kwargs.get("litellm_params")
    if not isinstance(params, Mapping):
        return None
    trace = kwargs.get("litellm_trace_id") or params.get("litellm_trace_id")
    info = params.get("model_info")
    if trace is None or not isinstance(info, Mapping) or info.get("id") is None:
        return None
    return str(trace), str(info["id"])
