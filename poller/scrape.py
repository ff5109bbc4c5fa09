"""Fetch one /metrics page: timeouts, a body cap, bearer auth, and one error mapping.

This is the only module that knows httpx's exceptions; each becomes a ``FetchError``
whose ``reason`` is a DESIGN.md failure reason. Secrets are resolved here, on the
poller, from the endpoint's ``api_key_env``/``api_key_file``, and never leave it except
as the Authorization header (never in an error message or a log line).

Clients (docs/performance.md has the measurements): httpx is the client API, and by
default its requests go through one shared aiohttp session (the ``httpx-aiohttp``
transport): 0.55 ms of CPU per scrape of a 61 KB page at 200 endpoints, against 0.99 ms
with one httpcore-backed client per endpoint and 18 ms with one shared httpcore client,
whose pool scan grows with the number of hosts. ``http_client="httpcore"`` selects the
per-endpoint clients; tests inject a transport per endpoint.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

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
        http_client: str = "aiohttp",
        transport_factory: TransportFactory | None = None,
    ) -> None:
        self.max_body_bytes = max_body_bytes
        if transport_factory is None and http_client == "httpcore":
            transport_factory = _httpcore_transport
        self._transport_factory = transport_factory
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._shared: httpx.AsyncClient | None = None
        self._session: aiohttp.ClientSession | None = None

    @staticmethod
    def _new_client(transport: httpx.AsyncBaseTransport) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=transport,
            follow_redirects=False,  # a redirect is a misconfigured URL, not a page
            trust_env=False,  # no proxy or netrc surprises: engines are addressed directly
        )

    def _client(self, endpoint: Endpoint) -> httpx.AsyncClient:
        if self._transport_factory is None:
            if self._shared is None:
                # One session for every endpoint: aiohttp keys its pool by host, so the
                # cost per request does not grow with the number of endpoints.
                self._session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
                    auto_decompress=False,  # httpx decodes; we ask for identity anyway
                    trust_env=False,
                )
                self._shared = self._new_client(AiohttpTransport(client=self._session))
            return self._shared
        client = self._clients.get(endpoint.id)
        if client is None:
            client = self._new_client(self._transport_factory(endpoint))
            self._clients[endpoint.id] = client
        return client

    async def discard(self, endpoint_id: str) -> None:
        """Close the endpoint's own client, if it has one (lease lost, endpoint removed)."""
        client = self._clients.pop(endpoint_id, None)
        if client is not None:
            await client.aclose()

    async def aclose(self) -> None:
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.aclose()
        if self._shared is not None:
            await self._shared.aclose()
            self._shared = None
        if self._session is not None:
            await self._session.close()
            self._session = None

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
            if _disconnected(exc):
                raise FetchError(
                    "unreachable", _describe(exc.__cause__ or exc), endpoint=endpoint.id
                ) from exc
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


def _httpcore_transport(endpoint: Endpoint) -> httpx.AsyncBaseTransport:
    return httpx.AsyncHTTPTransport(
        limits=httpx.Limits(max_connections=1, max_keepalive_connections=1)
    )


def _disconnected(exc: httpx.TimeoutException) -> bool:
    """httpx-aiohttp maps every aiohttp connection error to ConnectTimeout; a refused
    connect or a server that hung up is 'unreachable', not a timeout."""
    cause = exc.__cause__
    if isinstance(cause, aiohttp.ServerTimeoutError | aiohttp.SocketTimeoutError):
        return False
    return isinstance(cause, aiohttp.ClientConnectionError | OSError)


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]
