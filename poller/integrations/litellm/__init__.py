"""LiteLLM routing on the shared view (``pip install 'llmgw-poller[litellm]'``).

- ``LoadAwareFilter``: a ``CustomLogger`` whose ``async_filter_deployments`` drops the
  deployments the picker would not route to. ``load_aware_filter`` is a module-level
  instance configured from ``POLLER_REDIS_URL`` / ``POLLER_NAMESPACE`` at first use; a
  proxy names it in ``litellm_settings.callbacks``.
- ``LoadAwareStrategy``: a ``CustomRoutingStrategyBase`` for an SDK ``Router`` that
  chooses with the ``Picker`` and keeps this replica's ``LocalLoad``.

A deployment's endpoint: ``model_info.llmgw_endpoint``, else its ``api_base`` matched
against the registry's URLs (``normalize_url``). See docs/litellm.md.
"""

from __future__ import annotations

from poller.integrations.litellm.deployments import ENDPOINT_KEY, MODEL_KEY, normalize_url
from poller.integrations.litellm.filter import LoadAwareFilter
from poller.integrations.litellm.source import ViewSource
from poller.integrations.litellm.strategy import LoadAwareStrategy

__all__ = [
    "ENDPOINT_KEY",
    "MODEL_KEY",
    "LoadAwareFilter",
    "LoadAwareStrategy",
    "ViewSource",
    "load_aware_filter",
    "normalize_url",
]

#: What a proxy's config.yaml names: ``callbacks: poller.integrations.litellm.load_aware_filter``.
load_aware_filter = LoadAwareFilter()
