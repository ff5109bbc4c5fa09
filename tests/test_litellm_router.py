"""LoadAwareStrategy on a real litellm Router, against simulated engines a real poller
scrapes: the saturated, failing and sleeping endpoints receive nothing."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from litellm_fleet import BAD, HELD, MODEL, OK, Fleet, fleet

# isort: off
# litellm_fleet first: it sets LITELLM_LOCAL_MODEL_COST_MAP before litellm loads.
import litellm
from poller.integrations.litellm import LoadAwareStrategy

# isort: on

pytestmark = [
    pytest.mark.slow,
    # LiteLLM's own types make pydantic warn; nothing of ours.
    pytest.mark.filterwarnings("ignore:Items? .* using the `ReadOnly` qualifier:UserWarning"),
]


def model_list(f: Fleet) -> list[dict[str, Any]]:
    """One group, "chat", over all six; half name their endpoint, half match by URL."""
    out = []
    for i, endpoint_id in enumerate((*OK, *BAD)):
        entry: dict[str, Any] = {
            "model_name": "chat",
            "litellm_params": {
                "model": f"openai/{MODEL}",
                "api_base": f.api_base(endpoint_id),
                "api_key": "unused",
            },
        }
        if i % 2:
            entry["model_info"] = {"llmgw_endpoint": endpoint_id}
        out.append(entry)
    return out


def served_by(response: Any) -> str:
    headers = response._hidden_params["additional_headers"]
    return str(headers["llm_provider-x-sim-endpoint"])


async def test_router_sends_nothing_to_saturated_failing_or_sleeping(tmp_path: Path) -> None:
    async with fleet(tmp_path) as f:
        router = litellm.Router(model_list=model_list(f), num_retries=0)
        strategy = LoadAwareStrategy(router, cache=f.cache, rng=random.Random(7)).install()
        try:
            served: Counter[str] = Counter()
            for i in range(30):
                response = await router.acompletion(
                    model="chat",
                    messages=[{"role": "user", "content": f"q{i}"}],
                    max_tokens=4,
                    stream=i % 3 == 0,
                )
                if i % 3 == 0:
                    async for _ in response:
                        pass
                    served["stream"] += 1
                else:
                    served[served_by(response)] += 1
            # Every request succeeded (no retries: one sent to the failing or sleeping
            # endpoint would have raised), none queued behind the saturated one.
            assert served["stream"] == 10
            assert set(served) - {"stream"} <= set(OK), served
            assert len(set(served) - {"stream"}) >= 2, served  # spread, not one endpoint
            queued = await f.served()
            assert queued["saturated"] == HELD, queued  # only the test's own
            await asyncio.sleep(0)
            assert strategy.fail_open_total == 0
        finally:
            strategy.uninstall()
