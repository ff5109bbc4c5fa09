"""The model names a scrape writes: the page's, then the engine's ``/v1/models``, then
the entry's declared ``models`` (docs/schema.md).

``/v1/models`` is asked only of engines whose page names none
(``EngineSpec.models_from_api``: llama.cpp, TGI, trtllm-serve) when this page names no
model, and at most once per lease (again only if the entry's URL changes under it); a
failed read never fails the scrape, and is said once per endpoint.
"""

from __future__ import annotations

import logging
from dataclasses import replace as replaced

from poller.errors import ScrapeError
from poller.schema.endpoint import merge_models
from poller.schema.stats import Signals
from poller.scrape.http.client import Scraper
from poller.scrape.models import read_models
from poller.service.metrics import Surprises
from poller.service.owned import JobSpec, Window

__all__ = ["ModelNames", "with_models"]

log = logging.getLogger(__name__)


def with_models(signals: Signals, spec: JobSpec, window: Window) -> Signals:
    """The page's names, then those read from /v1/models, then the entry's own."""
    declared = spec.endpoint.models if spec.endpoint is not None else ()
    if not declared and not window.models:
        return signals  # the common case: nothing to add
    models = merge_models(signals.models, window.models or (), declared)
    return signals if models == signals.models else replaced(signals, models=models)


class ModelNames:
    """Reads ``/v1/models`` for the jobs of one poller and adds the names to their stats."""

    def __init__(self, scraper: Scraper, surprises: Surprises) -> None:
        self.scraper = scraper
        self.surprises = surprises
        # Endpoints whose /v1/models read failed here already: said once, then DEBUG.
        self._failed: set[str] = set()

    async def add(self, signals: Signals, spec: JobSpec, window: Window) -> Signals:
        """``signals`` with every name the endpoint has (``/v1/models`` read if due)."""
        if (
            not signals.models
            and window.models is None
            and spec.mapping is not None
            and spec.mapping.spec.models_from_api
        ):
            window.models = await self._read(spec)
        return with_models(signals, spec, window)

    async def _read(self, spec: JobSpec) -> tuple[str, ...]:
        """The names the engine lists on /v1/models; () when the read fails, which is
        logged once per endpoint (the endpoint keeps its declared names)."""
        endpoint = spec.endpoint
        assert endpoint is not None
        try:
            names = await read_models(self.scraper, endpoint, spec.timeout_s)
        except ScrapeError as exc:
            self._unread(spec, f"{exc.reason}: {exc.detail}")
            return ()
        except Exception as exc:  # a bug, never the scrape's failure
            self.surprises.report("models", exc)
            return ()
        self._failed.discard(spec.endpoint_id)
        log.debug(
            "models read",
            extra={"endpoint": spec.endpoint_id, "models": ",".join(names) or "(none)"},
        )
        return names

    def _unread(self, spec: JobSpec, why: str) -> None:
        fields = {"endpoint": spec.endpoint_id, "why": why}
        if spec.endpoint_id in self._failed:
            log.debug("/v1/models not read", extra=fields)
            return
        self._failed.add(spec.endpoint_id)
        if spec.endpoint is not None and spec.endpoint.models:
            log.info("/v1/models not read: the endpoint keeps its declared models", extra=fields)
        else:
            log.warning(
                "/v1/models not read: the endpoint lists no model, so no pick for a model "
                "chooses it; declare them in its registry entry (models)",
                extra=fields,
            )
