"""The shared view inside a LiteLLM process: a Router opened on first use.

The proxy imports the callback module before its event loop runs, so nothing connects
at import: the first request opens ``StatsReader.router()`` in the loop that serves it
(and a new loop, as in tests or an app that runs one loop per request, gets a new one).
Configuration comes from the arguments or from ``POLLER_REDIS_URL`` /
``POLLER_NAMESPACE``, the names the poller itself reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from poller.integrations.litellm.deployments import UrlIndex
from poller.reader.reader import StatsReader
from poller.reader.router import Router
from poller.reader.routing.options import RoutingOptions
from poller.util.urls import redact_url

__all__ = ["RETRY_OPEN_S", "ViewSource"]

log = logging.getLogger(__name__)

#: A reader that could not open (a Redis of another schema version, a bad URL) is
#: opened again this long after, not at every request (each open logs its error).
RETRY_OPEN_S = 10.0


class ViewSource:
    """A ``Router`` for the running event loop, and the registry's URL index.

    Give ``router`` to use one the caller keeps open (an SDK gateway that already runs
    ``reader.router()``), or a Redis URL and namespace (default: the
    ``POLLER_REDIS_URL`` and ``POLLER_NAMESPACE`` variables, read at first use) and the
    ``options`` an own Router routes with.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        namespace: str | None = None,
        *,
        router: Router | None = None,
        options: RoutingOptions | None = None,
        reader_options: Mapping[str, Any] | None = None,
        rng: Any = None,
    ) -> None:
        self._url = redis_url
        self._namespace = namespace
        self._options = dict(reader_options or {})
        #: What an own Router routes with (the caller's own Router: its own).
        self.options = router.options if router is not None else options or RoutingOptions()
        self._rng = rng
        self._router = router
        self._own = router is None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._lock: asyncio.Lock | None = None
        self._index: UrlIndex | None = None
        self._index_rev: int | None = None
        #: (monotonic time to retry at, why): kept across event loops, since an app may
        #: run one loop per request.
        self._failed: tuple[float, Exception] | None = None

    @property
    def router(self) -> Router | None:
        """The Router as it is now (None before the first ``open`` of an own one)."""
        return self._router

    def settings(self) -> tuple[str, str]:
        """(Redis URL, namespace) this source reads; raises ValueError if none is set."""
        url = self._url or os.environ.get("POLLER_REDIS_URL", "")
        if not url:
            raise ValueError(
                "no Redis URL for the shared view: set POLLER_REDIS_URL (the poller's own "
                "variable) or pass redis_url"
            )
        return url, self._namespace or os.environ.get("POLLER_NAMESPACE") or "llmgw"

    async def open(self) -> Router:
        """The Router, opening the reader in this event loop on first use. Raises what
        opening raises (a bad URL, a Redis of another schema version), again without
        trying for ``RETRY_OPEN_S``; an unreachable Redis is not an error here: the view
        then stays unloaded and the reader keeps retrying in the background."""
        if not self._own:
            assert self._router is not None
            return self._router
        loop = asyncio.get_running_loop()
        if self._router is not None and self._loop is loop:
            return self._router
        if self._lock is None or self._loop is not loop:
            # A new loop (the old one ended with its reader's tasks, cancelled by it).
            self._lock, self._loop, self._router, self._stack = asyncio.Lock(), loop, None, None
        async with self._lock:
            if self._failed is not None and time.monotonic() < self._failed[0]:
                raise self._failed[1].with_traceback(None)
            if self._router is None:
                stack = contextlib.AsyncExitStack()
                try:
                    url, namespace = self.settings()
                    reader = StatsReader.from_url(url, namespace, **self._options)
                    stack.push_async_callback(reader.aclose)
                    opened = reader.router(self.options, rng=self._rng)
                    self._router = await stack.enter_async_context(opened)
                except Exception as exc:
                    await stack.aclose()  # its connections too
                    self._failed = (time.monotonic() + RETRY_OPEN_S, exc)
                    raise
                self._stack, self._failed = stack, None
                log.info(
                    "reading the shared view from %s (namespace %s)", redact_url(url), namespace
                )
        return self._router

    async def aclose(self) -> None:
        """Stop an own reader (the proxy never needs to: the process ends)."""
        stack, self._stack = self._stack, None
        if self._own:
            self._router = None
        if stack is not None:
            await stack.aclose()

    def urls(self, router: Router) -> UrlIndex:
        """The registry's URL index, rebuilt when the registry's revision changed (every
        registry change reaches the view as a new snapshot with its revision)."""
        cache = router.cache
        if self._index is None or self._index_rev != cache.rev:
            pairs = []
            for endpoint_id in cache.ids():
                view = cache.get(endpoint_id)
                entry = None if view is None else view.entry
                if entry is not None:
                    pairs.append((endpoint_id, entry.url))
            self._index, self._index_rev = UrlIndex(pairs), cache.rev
        assert self._index is not None
        return self._index
