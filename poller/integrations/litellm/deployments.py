"""Which endpoint of the registry a LiteLLM deployment sends its requests to.

A deployment names its endpoint in ``model_info: {llmgw_endpoint: <id>}``; without it,
its ``litellm_params.api_base`` is compared with the registry entries' ``url`` after both
are normalised by ``normalize_url`` (``poller.schema.endpoint``, the rule the registry
refuses duplicate URLs by). Pure functions over plain dicts: no LiteLLM import.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from poller.schema.endpoint import normalize_url

__all__ = ["ENDPOINT_KEY", "MODEL_KEY", "UrlIndex", "explicit_endpoint", "normalize_url"]

#: ``model_info`` key naming the registry endpoint a deployment sends to.
ENDPOINT_KEY = "llmgw_endpoint"
#: ``model_info`` key naming the model as the engine lists it (default: from ``model``).
MODEL_KEY = "llmgw_model"

log = logging.getLogger(__name__)


def explicit_endpoint(deployment: Mapping[str, Any]) -> str | None:
    """The endpoint id a deployment names in ``model_info``, if any."""
    info = deployment.get("model_info")
    if isinstance(info, Mapping):
        value = info.get(ENDPOINT_KEY)
        if value:
            return str(value)
    return None


def api_base(deployment: Mapping[str, Any]) -> str | None:
    params = deployment.get("litellm_params")
    if isinstance(params, Mapping):
        value = params.get("api_base")
        if isinstance(value, str) and value:
            return value
    return None


class UrlIndex:
    """Normalised registry URL -> endpoint id. Two entries with one URL are ambiguous:
    neither is matched by URL (a deployment then names its endpoint in ``model_info``)."""

    __slots__ = ("_by_url",)

    def __init__(self, entries: Iterable[tuple[str, str]]) -> None:
        ids_by_url: dict[str, list[str]] = {}
        for endpoint_id, url in entries:
            key = normalize_url(url)
            if key is None:
                continue
            ids = ids_by_url.setdefault(key, [])
            if endpoint_id not in ids:
                ids.append(endpoint_id)
        by_url: dict[str, str | None] = {}
        for key, ids in ids_by_url.items():
            if len(ids) == 1:
                by_url[key] = ids[0]
                continue
            # The registry refuses such entries; a foreign writer may still have made them.
            log.warning(
                "endpoints %s share the URL %s: deployments must name theirs in model_info.%s",
                " and ".join(", ".join(ids).rsplit(", ", 1)),
                key,
                ENDPOINT_KEY,
            )
            by_url[key] = None
        self._by_url = by_url

    def endpoint_for(self, deployment: Mapping[str, Any]) -> str | None:
        """The deployment's endpoint id: named in ``model_info``, else matched by URL."""
        named = explicit_endpoint(deployment)
        if named is not None:
            return named
        base = api_base(deployment)
        if base is None:
            return None
        key = normalize_url(base)
        return None if key is None else self._by_url.get(key)

    def __len__(self) -> int:
        return len(self._by_url)
