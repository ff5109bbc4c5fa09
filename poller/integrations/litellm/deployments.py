"""Which endpoint of the registry a LiteLLM deployment sends its requests to.

A deployment names its endpoint in ``model_info: {llmgw_endpoint: <id>}``; without it,
its ``litellm_params.api_base`` is compared with the registry entries' ``url`` after both
are normalised by ``normalize_url``. Pure functions over plain dicts: no LiteLLM import.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

__all__ = ["ENDPOINT_KEY", "MODEL_KEY", "UrlIndex", "explicit_endpoint", "normalize_url"]

#: ``model_info`` key naming the registry endpoint a deployment sends to.
ENDPOINT_KEY = "llmgw_endpoint"
#: ``model_info`` key naming the model as the engine lists it (default: from ``model``).
MODEL_KEY = "llmgw_model"
_DEFAULT_PORTS = {"http": 80, "https": 443}

log = logging.getLogger(__name__)


def normalize_url(url: str) -> str | None:
    """``scheme://host:port/path`` compared case-insensitively where URLs are: scheme and
    host lower case, the scheme's default port written out, the path without trailing
    slashes and without a final ``/v1`` (LiteLLM's OpenAI-compatible ``api_base`` ends in
    ``/v1``, an engine's registry ``url`` does not). Query and fragment are ignored. No
    name is resolved: ``localhost`` and ``127.0.0.1`` differ. None: not an http(s) URL."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    host = parts.hostname
    if scheme not in _DEFAULT_PORTS or not host:
        return None
    if ":" in host:
        host = f"[{host}]"  # an IPv6 literal keeps its brackets
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")].rstrip("/")
    return f"{scheme}://{host}:{port or _DEFAULT_PORTS[scheme]}{path}"


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
        by_url: dict[str, str | None] = {}
        for endpoint_id, url in entries:
            key = normalize_url(url)
            if key is None:
                continue
            if key in by_url and by_url[key] != endpoint_id:
                log.warning(
                    "endpoints %s and %s share the URL %s: deployments must name theirs "
                    "in model_info.%s",
                    by_url[key],
                    endpoint_id,
                    key,
                    ENDPOINT_KEY,
                )
                by_url[key] = None
            else:
                by_url[key] = endpoint_id
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
