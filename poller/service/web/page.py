"""The operator's page on every poller's health port: ``GET /`` and its two static files.

One server-rendered HTML page (``render.py``) of the shared view, read through the same
``StatsReader`` that serves ``/v1/view`` on this port, so the two never disagree; the
fleet table adds each live member's heartbeat expiry, own word and drain request
(``poller/store/members.py``), and the discovery sources come from
``poller/store/discovery.py``. ``/static/page.js`` refreshes the page every 2 s without a
reload and draws each endpoint's load from ``/v1/view`` as the page observes it; with
scripts off the page reloads itself. Every response carries a Content-Security-Policy
that allows scripts and styles from the page's own origin only, so nothing inline ever
runs, even if an escape were missed.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from importlib import resources
from typing import Any

from poller._version import __version__
from poller.errors import StoreError
from poller.reader.reader import StatsReader
from poller.service.web.health import RawRoute, Response
from poller.service.web.render import Fleet, parse_query, render_page, with_entries
from poller.store.discovery import read_sources
from poller.store.members import read_members

__all__ = ["CSP", "OperatorPage"]

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
_HEADERS = (
    ("Content-Security-Policy", CSP),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
)
_STATIC = {
    "/static/page.js": "text/javascript; charset=utf-8",
    "/static/page.css": "text/css; charset=utf-8",
}


class OperatorPage:
    """Routes for ``HealthServer(raw_routes=...)``; reads Redis through ``client``.

    ``reader`` is the server's ``StatsReader`` on that client (one is made when not
    given): the page's view is its ``snapshot()``.
    """

    def __init__(
        self,
        client: Any,
        namespace: str,
        poller_id: str,
        member_ttl_ms: int,
        *,
        reader: StatsReader | None = None,
    ) -> None:
        self.client = client
        self.reader = reader if reader is not None else StatsReader(client, namespace)
        self.keys = self.reader.keys
        self.poller_id = poller_id
        self.member_ttl_ms = member_ttl_ms
        folder = resources.files("poller.service.web") / "static"
        self._files = {path: (folder / path.rsplit("/", 1)[1]).read_bytes() for path in _STATIC}

    def routes(self) -> dict[str, RawRoute]:
        routes: dict[str, RawRoute] = {"/": self.page, "/favicon.ico": _no_icon}
        for path in _STATIC:
            routes[path] = self._static_route(path)
        return routes

    def _static_route(self, path: str) -> RawRoute:
        async def route(query: str) -> Response:
            return Response(200, _STATIC[path], self._files[path], _HEADERS)

        return route

    async def read(self) -> tuple[dict[str, Any] | None, Fleet]:
        """(``View.to_dict()`` or None when Redis is unreachable, what the page adds)."""
        fleet = Fleet(self.poller_id, __version__, self.member_ttl_ms)
        try:
            # Raises SchemaMismatch (a StoreError) when Redis holds another schema version.
            view = await self.reader.snapshot()
            _, members = await read_members(self.client, self.keys)
            sources = await read_sources(self.client, self.keys)
        except StoreError as exc:
            return None, replace(fleet, reachable=False, error=str(exc))
        # ~20 ms per 1,000 endpoints with the rendering: off the loop that runs the scrapes.
        shown = await asyncio.to_thread(with_entries, view)
        shown["sources"] = sources  # DNS discovery sources, as /v1/view carries them
        return shown, replace(
            fleet,
            schema=str(shown["schema"]),  # the version the snapshot checked Redis holds
            expiries={m.id: float(m.expires_ms) for m in members},
            infos={m.id: m.info for m in members},
            drains={m.id for m in members if m.drain is not None},
            duplicates={m.id: m.duplicate for m in members if m.duplicate is not None},
        )

    async def page(self, query: str) -> Response:
        try:
            q = parse_query(query)
        except ValueError as exc:
            return Response(400, "text/plain; charset=utf-8", f"{exc}\n".encode(), _HEADERS)
        view, fleet = await self.read()
        body = await asyncio.to_thread(lambda: render_page(view, fleet, q).encode())
        status = 200 if view is not None else 503
        return Response(status, "text/html; charset=utf-8", body, _HEADERS)


async def _no_icon(query: str) -> Response:
    """Browsers ask for it; an empty answer keeps their consoles free of 404s."""
    return Response(204, "image/x-icon", b"", _HEADERS)
