"""LiteLLM's routing in the routing benchmark: each replica sends through a real
``litellm.Router`` (``pip install 'llmgw-poller[litellm]'``).

- ``litellm-shuffle``: LiteLLM's default, ``simple-shuffle`` (weighted random).
- ``litellm-least-busy``: LiteLLM's ``least-busy``; the replicas share their in-flight
  counts through the bench's Redis (the Router's ``redis_host``/``redis_port``), as a
  proxy fleet with a shared cache does.
- ``litellm-loadaware``: ``LoadAwareStrategy`` on the replica's cached view.

They are opt-in (``--policy litellm-...``): a default run needs no LiteLLM. No retries,
no fallbacks, LiteLLM's cooldowns as they come. ``choose()`` is never called: the
replica awaits ``send()``, which records where LiteLLM sent the request (the Router's
pick, per task) and the CPU of that pick (``thread_time`` across
``async_get_available_deployment``; least-busy's includes its Redis read). A request
LiteLLM refuses (no deployment) is recorded as a fallback sent nowhere.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from poller_lab.routing.policies import Policy, PolicyContext, register

__all__ = ["LiteLLMPolicy"]

log = logging.getLogger(__name__)

#: How long a request may take through the Router (as the replica's own bound).
TIMEOUT_S = 120.0


class LiteLLMPolicy:
    """A replica's ``litellm.Router`` over the candidates, with one routing strategy."""

    def __init__(self, ctx: PolicyContext, strategy: str) -> None:
        # The bench runs offline: no cost-map fetch at import, no tokenizer lookups.
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import litellm

        self.ctx = ctx
        model_list = [
            {
                "model_name": ctx.model,
                "litellm_params": {
                    "model": f"openai/{ctx.model}",
                    "api_base": ctx.urls[endpoint_id] + "/v1",
                    "api_key": "-",
                },
                "model_info": {"id": endpoint_id, "llmgw_endpoint": endpoint_id},
            }
            for endpoint_id in ctx.candidates
        ]
        options: dict[str, Any] = {}
        if strategy == "least-busy":
            assert ctx.redis_url is not None
            parts = urlsplit(ctx.redis_url)
            options = {"redis_host": parts.hostname, "redis_port": parts.port or 6379}
        self.router = litellm.Router(
            model_list=model_list,
            routing_strategy="simple-shuffle" if strategy == "loadaware" else strategy,
            num_retries=0,
            timeout=TIMEOUT_S,
            **options,
        )
        self.strategy: Any = None
        if strategy == "loadaware":
            from poller.integrations.litellm import LoadAwareStrategy

            self.strategy = LoadAwareStrategy(self.router, poller_router=ctx.router).install()
        self._picked: dict[asyncio.Task[Any] | None, tuple[str, int]] = {}
        pick = self.router.async_get_available_deployment

        async def timed_pick(*args: Any, **kwargs: Any) -> Any:
            cpu0 = time.thread_time_ns()
            deployment = await pick(*args, **kwargs)
            cpu_ns = time.thread_time_ns() - cpu0
            self._picked[asyncio.current_task()] = (deployment["model_info"]["id"], cpu_ns)
            return deployment

        self.router.async_get_available_deployment = timed_pick

    async def prepare(self) -> None:
        return None

    async def warm_up(self) -> None:
        """One call through the whole Router with a canned answer (no engine is asked):
        LiteLLM's first call imports and builds what the measured ones then reuse."""
        try:
            await self.router.acompletion(
                model=self.ctx.model, messages=[{"role": "user", "content": "warm up"}],
                mock_response="ok",
            )  # fmt: skip
        except Exception as exc:  # the measured requests will say what is wrong
            log.warning("LiteLLM warm-up call failed: %s", exc)
        self._picked.pop(asyncio.current_task(), None)

    def choose(self) -> str | None:
        raise NotImplementedError("the replica calls send(): LiteLLM chooses and sends")

    def started(self, endpoint_id: str) -> None:
        return None

    def finished(self, endpoint_id: str, ok: bool = True) -> None:
        return None

    async def send(self, body: Mapping[str, Any]) -> tuple[str | None, int, float, int]:
        """(endpoint, HTTP status or 0, latency in s, CPU of the pick in ns)."""
        t0 = time.monotonic()
        status = 200
        try:
            await self.router.acompletion(
                model=body["model"], messages=body["messages"], max_tokens=body["max_tokens"]
            )
        except Exception as exc:  # LiteLLM's exceptions carry the engine's status
            status = int(getattr(exc, "status_code", 0) or 0)
        latency_s = time.monotonic() - t0
        endpoint_id, cpu_ns = self._picked.pop(asyncio.current_task(), (None, 0))
        return endpoint_id, status, latency_s, cpu_ns


def _factory(strategy: str) -> Any:
    def factory(ctx: PolicyContext) -> Policy:
        return LiteLLMPolicy(ctx, strategy)

    return factory


register("litellm-shuffle", _factory("simple-shuffle"), default=False)
register("litellm-least-busy", _factory("least-busy"), default=False)
register("litellm-loadaware", _factory("loadaware"), uses_view=True, default=False)
