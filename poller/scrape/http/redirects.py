"""Redirects: followed within the endpoint's origin only.

Up to ``MAX_REDIRECTS`` redirects are followed within the origin (scheme, host and port)
the request was sent to, with the same headers; a redirect to another origin is an
``http_status`` failure naming it, and nothing is sent there, so the bearer key never
leaves the origin it was named for.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx

from poller.errors import FetchError

__all__ = ["MAX_REDIRECTS", "follow", "origin"]

MAX_REDIRECTS = 3
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}


def origin(url: httpx.URL) -> tuple[str, str, int]:
    """(scheme, host, port) with the scheme's default port filled in."""
    return (url.scheme, url.host.lower(), url.port or _DEFAULT_PORTS.get(url.scheme, 0))


async def follow(
    endpoint_id: str,
    request: httpx.Request,
    exchange: Callable[[httpx.Request], Awaitable[httpx.Response]],
    rebuild: Callable[[httpx.URL], httpx.Request],
) -> httpx.Response:
    """The first answer that is not a redirect; ``rebuild`` makes the request for a
    same-origin ``Location`` (same headers and timeout)."""
    start = origin(request.url)
    for hop in range(MAX_REDIRECTS + 1):
        response = await exchange(request)
        status = response.status_code
        if status not in _REDIRECT_STATUSES:
            return response
        location = response.headers.get("location", "").strip()
        await response.aclose()
        try:
            target = request.url.join(location) if location else None
        except (httpx.InvalidURL, ValueError, UnicodeError):
            target = None
        if target is None or not target.host:
            raise _failure(endpoint_id, status, " redirect without a usable Location")
        if origin(target) != start:
            scheme, host, port = origin(target)
            shown = f"[{host}]" if ":" in host else host
            raise _failure(
                endpoint_id,
                status,
                f" redirect to {scheme}://{shown[:120]}:{port}, another origin: not followed "
                "(only the same scheme, host and port are)",
            )
        if hop == MAX_REDIRECTS:
            raise _failure(endpoint_id, status, f": more than {MAX_REDIRECTS} redirects")
        request = rebuild(target)
    raise AssertionError("unreachable")  # the loop returns or raises


def _failure(endpoint_id: str, status: int, what: str) -> FetchError:
    return FetchError("http_status", f"HTTP {status}{what}", endpoint=endpoint_id, status=status)
