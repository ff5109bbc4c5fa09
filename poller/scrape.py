"""Fetch one /metrics page: timeouts, a body cap, bearer auth, and one error mapping.

This is the only module that knows httpx's exceptions; each becomes a ``FetchError``
whose ``reason`` is a DESIGN.md failure reason. Secrets are resolved here, on the
poller, from the endpoint's ``api_key_env``/``api_key_file``, and never leave it except
as the Authorization header (never in an error message or a log line).

Clients: one ``httpx.AsyncClient`` per endpoint. A single shared client scans its whole
connection pool on every request, which stops scaling at a few hundred endpoints
(PERFORMANCE.md); a client per endpoint keeps each pool at one connection.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from .errors import FetchError
from .registry import Endpoint

__all__ = ["Fetched", "Scraper", "TransportFactory", "resolve_api_key"]

#: Builds the transport for one endpoint's client; tests pass httpx.MockTransport.
TransportFactory = Callable[[Endpoint], httpx.AsyncBaseTransport]

_ACCEPT = "text/plain;version=0.0.4;q=0.9,*/*;q=0.1"


@dataclass(frozen=True, slots=True)
class Fetched:
    body: bytes
    status: int
    content_type: str
    elapsed_s: float


def resolve_api_key(endpoint: Endpoint) -> str | None:
    """The bearer token for an endpoint, from the poller's environment or a file."""
    if endpoint.api_key_env:
        value = os.environ.get(endpoint.api_key_env)
        if not value:
            raise FetchError(
                "config",
                f"environment variable {endpoint.api_key_env} (api_key_env) is not set",
                endpoint=endpoint.id,
            )
        return value.strip()
    if endpoint.api_key_file:
        try:
            value = Path(endpoint.api_key_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise FetchError(
                "config",
                f"cannot read api_key_file {endpoint.api_key_file}: {why}",
                endpoint=endpoint.id,
            ) from None
        if not value:
            raise FetchError(
                "config", f"api_key_file {endpoint.api_key_file} is empty", endpoint=endpoint.id
            )
        return value
    return None


def metrics_url(endpoint: Endpoint, default_path: str) -> str:
    return endpoint.url + (endpoint.metrics_path or default_path)


class Scraper:
    """Fetches pages; keeps one small client per endpoint, created on first use."""

    def __init__(
        self,
        *,
        max_body_bytes: int,
        transport_factory: TransportFactory | None = None,
    ) -> None:
        self.max_body_bytes = max_body_bytes
        self._transport_factory = transport_factory
        self._clients: dict[str, httpx.AsyncClient] = {}

    def _client(self, endpoint: Endpoint) -> httpx.AsyncClient:
        client = self._clients.get(endpoint.id)
        if client is None:
            transport = self._transport_factory(endpoint) if self._transport_factory else None
            client = httpx.AsyncClient(
                transport=transport,
                limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
                follow_redirects=False,  # a redirect is a misconfigured URL, not a page
                trust_env=False,  # no proxy or netrc surprises: engines are addressed directly
            )
            self._clients[endpoint.id] = client
        return client

    async def discard(self, endpoint_id: str) -> None:
        """Close the endpoint's client (lease lost or endpoint removed)."""
        client = self._clients.pop(endpoint_id, None)
        if client is not None:
            await client.aclose()

    async def aclose(self) -> None:
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.aclose()

    async def fetch(self, endpoint: Endpoint, default_path: str, timeout_s: float) -> Fetched:
        """GET the page within ``timeout_s`` overall (a drip-fed body cannot stretch it)."""
        headers = {
            "Accept": _ACCEPT,
            "Accept-Encoding": "gzip" if endpoint.accept_gzip else "identity",
        }
        api_key = resolve_api_key(endpoint)
        if api_key is not None:
            headers["Authorization"] = f"Bearer {api_key}"
        url = metrics_url(endpoint, default_path)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                return await self._get(endpoint, url, headers, timeout_s, started)
        except TimeoutError:
            raise FetchError(
                "timeout", f"no complete response within {timeout_s:g}s", endpoint=endpoint.id
            ) from None
        except httpx.TimeoutException as exc:
            raise FetchError(
                "timeout", f"{type(exc).__name__} after {timeout_s:g}s", endpoint=endpoint.id
            ) from exc
        except (httpx.ConnectError, httpx.UnsupportedProtocol) as exc:
            raise FetchError("unreachable", _describe(exc), endpoint=endpoint.id) from exc
        except httpx.DecodingError as exc:
            raise FetchError("parse", f"cannot decode body: {exc}", endpoint=endpoint.id) from exc
        except (httpx.TransportError, OSError) as exc:
            # Reset or closed mid-response, protocol violations: the engine is not serving.
            raise FetchError("unreachable", _describe(exc), endpoint=endpoint.id) from exc

    async def _get(
        self, endpoint: Endpoint, url: str, headers: dict[str, str], timeout_s: float, t0: float
    ) -> Fetched:
        client = self._client(endpoint)
        request = client.build_request("GET", url, headers=headers, timeout=timeout_s)
        response = await client.send(request, stream=True)
        try:
            status = response.status_code
            if status in (401, 403):
                raise FetchError(
                    "auth",
                    f"HTTP {status} (check the API key)",
                    endpoint=endpoint.id,
                    status=status,
                )
            if not 200 <= status < 300:
                raise FetchError(
                    "http_status", f"HTTP {status}", endpoint=endpoint.id, status=status
                )
            declared = response.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > self.max_body_bytes:
                raise FetchError("too_large", self._too_large(int(declared)), endpoint=endpoint.id)
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise FetchError("too_large", self._too_large(size), endpoint=endpoint.id)
                chunks.append(chunk)
        finally:
            await response.aclose()
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return Fetched(
            body, status, response.headers.get("content-type", ""), time.perf_counter() - t0
        )

    def _too_large(self, size: int) -> str:
        return f"body of {size}+ bytes exceeds the {self.max_body_bytes}-byte cap"


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]
