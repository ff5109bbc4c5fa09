"""The operator's page on every poller's health port: ``GET /`` and its two static files.

One server-rendered HTML page (``render.py``) of the shared view, read with the
reader's own snapshot script and ``build_view``, so it shows what ``poller status --json``
shows. ``/static/page.js`` refreshes it every 2 s without a reload and draws each
endpoint's load from ``/v1/view`` as the page observes it; with scripts off the page
reloads itself. Every response carries a Content-Security-Policy that allows scripts and
styles from the page's own origin only, so nothing inline ever runs, even if an escape
were missed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import replace
from importlib import resources
from typing import Any

from poller._version import __version__
from poller.errors import StoreError
from poller.reader.replies import build_view, snapshot_call
from poller.redis.errors import redis_call
from poller.schema.keys import Keys
from poller.schema.lua import lua
from poller.service.web.health import RawRoute, Response
from poller.service.web.render import Fleet, parse_query, render_page, with_entries
from poller.store.discovery import read_sources
from poller.store.members import duplicate_of

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
    """Routes for ``HealthServer(raw_routes=...)``; reads Redis through ``client``."""

    def __init__(self, client: Any, namespace: str, poller_id: str, member_ttl_ms: int) -> None:
        self.client = client
        self.keys = Keys(namespace)
        self.poller_id = poller_id
        self.member_ttl_ms = member_ttl_ms
        self._snapshot = client.register_script(lua("snapshot"))
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
            keys, args = snapshot_call(self.keys)
            reply = await redis_call(self._snapshot(keys=keys, args=args), "snapshot")
            schema = await redis_call(self.client.get(self.keys.schema), "GET schema")
            sources = await read_sources(self.client, self.keys)
            infos = await redis_call(self.client.hgetall(self.keys.members_info), "members info")
            drains = await redis_call(self.client.hgetall(self.keys.members_drain), "drains")
            duplicates = await redis_call(
                self.client.hgetall(self.keys.members_duplicates), "duplicates"
            )
        except StoreError as exc:
            return None, replace(fleet, reachable=False, error=str(exc))
        members = reply[4]
        expiries = {str(members[i]): float(members[i + 1]) for i in range(0, len(members), 2)}
        # ~20 ms per 1,000 endpoints with the rendering: off the loop that runs the scrapes.
        view = await asyncio.to_thread(lambda: with_entries(build_view(reply)))
        view["sources"] = sources  # DNS discovery sources, as /v1/view carries them
        known = _infos(infos)
        now_ms = int(view["now_ms"])
        seen_twice = {
            poller: record
            for poller, text in duplicates.items()
            if (record := duplicate_of(text, known.get(poller, {}), now_ms)) is not None
        }
        return view, replace(
            fleet,
            schema=schema or "",
            expiries=expiries,
            infos=known,
            drains=set(drains),
            duplicates=seen_twice,
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


def _infos(raw: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """``P:members:info``: poller id -> its JSON object; anything else is skipped."""
    out: dict[str, dict[str, Any]] = {}
    for poller, text in raw.items():
        try:
            value = json.loads(text)
        except ValueError:
            continue
        if isinstance(value, dict):
            out[str(poller)] = value
    return out
