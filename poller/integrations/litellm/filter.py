"""``LoadAwareFilter``: the proxy's plug point, a ``CustomLogger`` that narrows
LiteLLM's healthy deployments to those the shared view says may take the request."""

from __future__ import annotations

from typing import Any

import litellm
from litellm.integrations.custom_logger import CustomLogger

from poller.integrations.litellm.deprecated import options_of
from poller.integrations.litellm.routing import Routing
from poller.integrations.litellm.source import ViewSource
from poller.reader.router import Router
from poller.reader.routing.options import RoutingOptions
from poller.util.logs import count

__all__ = ["LoadAwareFilter"]


class LoadAwareFilter(CustomLogger):  # type: ignore[misc]
    """Drops deployments whose endpoint is failing, stale, unknown, asleep, saturated
    (while another is not), or does not serve the deployment's model: the Router's
    rules, with ``options`` (``RoutingOptions``). Deployments that map to no registry
    endpoint (a hosted provider, an ``llmgw_endpoint`` the registry lacks) are kept,
    uninformed.
    LiteLLM's strategy then chooses among what is left. Each dropped or uninformed
    deployment is logged once per reason at WARNING; a group left with no eligible
    endpoint, once per change of the reasons.

    When the view cannot be read (no Redis URL, Redis not answering since before
    ``stale_grace_s``), or has no current numbers for any of the deployments' endpoints
    (all stale or unknown: the pollers are down), it keeps LiteLLM's list: logged once
    per outage, each such request counted in ``fail_open_total``. ``poller_router``: a
    poller ``Router`` of the caller's to judge with (else one opened on the first
    request, with ``options``).
    """

    def __init__(
        self,
        *,
        redis_url: str | None = None,
        namespace: str | None = None,
        options: RoutingOptions | None = None,
        poller_router: Router | None = None,
        cache: Any = None,
        picker: Any = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        options, router = options_of(owner, options, poller_router, cache, picker)
        source = ViewSource(redis_url, namespace, router=router, options=options)
        kept = "LiteLLM's strategy chooses among it and the deployments the filter keeps"
        self.routing = Routing(source, litellm.provider_list, uninformed=kept)
        #: Deployments this filter removed, over all requests.
        self.dropped_total = 0

    @property
    def fail_open_total(self) -> int:
        return self.routing.fail_open_total

    async def async_filter_deployments(
        self,
        model: str,
        healthy_deployments: list[dict[str, Any]],
        messages: Any,
        request_kwargs: dict[str, Any] | None = None,
        parent_otel_span: Any = None,
    ) -> list[dict[str, Any]]:
        if not healthy_deployments:
            return healthy_deployments
        router = await self.routing.router()
        if router is None:
            return healthy_deployments
        routing = self.routing
        targets = routing.targets(router, healthy_deployments)
        keep = routing.eligible(router, targets)
        kept = [d for d, ok in zip(healthy_deployments, keep, strict=True) if ok]
        if len(kept) == len(healthy_deployments):
            routing.something_eligible(model)
            return kept
        if routing.without_numbers(router, targets):
            return healthy_deployments
        self.dropped_total += len(healthy_deployments) - len(kept)
        for deployment, target, ok in zip(healthy_deployments, targets, keep, strict=True):
            if not ok:
                routing.dropped(router, deployment, target)
        mapped = [t for t in targets if t.endpoint_id is not None]
        if any(ok and t.endpoint_id is not None for t, ok in zip(targets, keep, strict=True)):
            routing.something_eligible(model)
        else:
            uninformed = len(targets) - len(mapped)
            routing.nothing_eligible(
                router,
                model,
                mapped,
                f"kept only its {count(uninformed, 'uninformed deployment')}"
                if uninformed
                else "LiteLLM answers 'No deployments available'",
            )
        return kept

    async def aclose(self) -> None:
        await self.routing.source.aclose()
