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

TLS: engines are verified against the system trust store, or against the endpoint's
``tls_ca_file``; ``tls_insecure`` turns verification off (with a WARNING). One
``ssl.SSLContext`` is built per distinct (CA file, insecure) pair, and the aiohttp stack
gets one session per pair, since httpx-aiohttp cannot pass aiohttp a per-request
``ssl=``; endpoints with the default TLS settings all share the first session.

URL policy: up to 3 redirects are followed within the endpoint's origin (scheme, host and
port), with the same headers; a redirect to another origin is an ``http_status`` failure
and nothing is sent there, so the bearer key never leaves the origin it was named for.
With ``scrape.allowed_hosts`` set a host outside it is never contacted (a ``config``
failure). The host checked is the one in the request httpx builds, i.e. exactly what the
transport will connect to.

Keys: ``api_key_env`` must start with ``scrape.key_env_prefix`` and ``api_key_file`` must
resolve inside ``scrape.key_dir`` (``KeyPolicy``), so a registry writer cannot make the
poller send another variable or file of its host.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

from poller.config import HostAllowlist, ScrapeSettings
from poller.errors import FetchError
from poller.registry import Endpoint
from poller.scrape.apikeys import KeyPolicy, resolve_api_key
from poller.scrape.body import Decoder, once, raw_chunks
from poller.scrape.http_errors import disconnected, status_error, unreachable_detail
from poller.scrape.wire import WireTransport

__all__ = ["Fetched", "KeyPolicy", "Scraper", "TransportFactory", "resolve_api_key"]

log = logging.getLogger(__name__)

#: Builds the transport for one endpoint's client; tests pass httpx.MockTransport.
TransportFactory = Callable[[Endpoint], httpx.AsyncBaseTransport]

_ACCEPT = "text/plain;version=0.0.4;q=0.9,*/*;q=0.1"

#: An endpoint's TLS settings, (tls_ca_file, tls_insecure): one SSLContext per value.
TlsKey = tuple[str | None, bool]


def _tls_key(endpoint: Endpoint) -> TlsKey:
    return (endpoint.tls_ca_file, endpoint.tls_insecure)


@dataclass(frozen=True, slots=True)
class Fetched:
    body: bytes
    status: int
    content_type: str
    elapsed_s: float


# A bearer token is visible ASCII (RFC 6750 allows less; anything else cannot be a
# header value, and the HTTP libraries' errors would quote it).
MAX_REDIRECTS = 3
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin(url: httpx.URL) -> tuple[str, str, int]:
    """(scheme, host, port) with the scheme's default port filled in."""
    return (url.scheme, url.host.lower(), url.port or _DEFAULT_PORTS.get(url.scheme, 0))


def metrics_url(endpoint: Endpoint, default_path: str) -> str:
    return endpoint.url + (endpoint.metrics_path or default_path)


class Scraper:
    """Fetches pages; keeps one small client per endpoint, created on first use."""

    def __init__(
        self,
        *,
        max_body_bytes: int,
        http_client: str = "asyncio",
        transport_factory: TransportFactory | None = None,
        allowed_hosts: Sequence[str] = (),
        key_policy: KeyPolicy | None = None,
    ) -> None:
        self.max_body_bytes = max_body_bytes
        #: Default: the default settings' rules (LLMGW_KEY_*, $CREDENTIALS_DIRECTORY or
        #: /etc/llmgw-poller/keys); a poller passes ``KeyPolicy.from_settings``.
        self.key_policy = key_policy or KeyPolicy.from_settings(ScrapeSettings())
        if transport_factory is None and http_client == "httpcore":
            transport_factory = self._httpcore_transport
        self._http_client = http_client
        self._transport_factory = transport_factory
        self._allowlist = HostAllowlist.parse(tuple(allowed_hosts))
        self._contexts: dict[TlsKey, ssl.SSLContext] = {}
        # Per-endpoint clients remember the TLS settings they were built with, so an entry
        # whose tls_ca_file/tls_insecure changed gets a new client.
        self._clients: dict[str, tuple[TlsKey, httpx.AsyncClient]] = {}
        self._shared: dict[TlsKey, tuple[aiohttp.ClientSession, httpx.AsyncClient]] = {}
        self._wire: dict[TlsKey, httpx.AsyncClient] = {}
        # perf (issue 13): each client's transport, and each endpoint's prepared request.
        self._transports: dict[httpx.AsyncClient, httpx.AsyncBaseTransport] = {}
        self._requests: dict[str, _Prepared] = {}
        self._warned_insecure: set[str] = set()

    @staticmethod
    def _new_client(transport: httpx.AsyncBaseTransport) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=transport,
            follow_redirects=False,  # followed by _send, within the origin only
            trust_env=False,  # no proxy or netrc surprises: engines are addressed directly
        )

    def _ssl_context(self, endpoint: Endpoint) -> ssl.SSLContext:
        """The cached context for the endpoint's TLS settings; a bad CA file is ``config``."""
        key = _tls_key(endpoint)
        context = self._contexts.get(key)
        if context is not None:
            return context
        ca_file, insecure = key
        try:
            # Only the named bundle, not the system store too: a private CA narrows trust.
            context = ssl.create_default_context(cafile=ca_file)
        except OSError as exc:  # ssl.SSLError too; not cached: a file mounted later works
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise FetchError(
                "config", f"cannot use tls_ca_file {ca_file}: {why}", endpoint=endpoint.id
            ) from None
        if insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        self._contexts[key] = context
        return context

    def _httpcore_transport(self, endpoint: Endpoint) -> httpx.AsyncBaseTransport:
        return httpx.AsyncHTTPTransport(
            verify=self._ssl_context(endpoint),
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
        )

    async def _client(self, endpoint: Endpoint) -> httpx.AsyncClient:
        key = _tls_key(endpoint)
        if self._transport_factory is None and self._http_client == "asyncio":
            wire = self._wire.get(key)
            if wire is None:
                # One transport for every endpoint with these TLS settings; it keeps its
                # connections per origin, so a request's cost does not grow with them.
                transport: httpx.AsyncBaseTransport = WireTransport(
                    max_body_bytes=self.max_body_bytes, ssl_context=self._ssl_context(endpoint)
                )
                wire = self._wire[key] = self._new_client(transport)
                self._transports[wire] = transport
            return wire
        if self._transport_factory is None:
            shared = self._shared.get(key)
            if shared is None:
                # One session for every endpoint with these TLS settings: aiohttp keys its
                # pool by host, so the cost per request does not grow with the endpoints.
                session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(
                        limit=0, limit_per_host=0, ssl=self._ssl_context(endpoint)
                    ),
                    auto_decompress=False,  # httpx decodes; we ask for identity anyway
                    trust_env=False,
                )
                transport = AiohttpTransport(client=session)
                shared = (session, self._new_client(transport))
                self._transports[shared[1]] = transport
                self._shared[key] = shared
            return shared[1]
        cached = self._clients.get(endpoint.id)
        if cached is not None and cached[0] == key:
            return cached[1]
        if cached is not None:
            await self.discard(endpoint.id)
        own = self._transport_factory(endpoint)
        client = self._new_client(own)
        self._transports[client] = own
        self._clients[endpoint.id] = (key, client)
        return client

    async def discard(self, endpoint_id: str) -> None:
        """Close the endpoint's own client, if it has one (lease lost, endpoint removed)."""
        self._requests.pop(endpoint_id, None)
        cached = self._clients.pop(endpoint_id, None)
        if cached is not None:
            self._transports.pop(cached[1], None)
            await cached[1].aclose()

    async def aclose(self) -> None:
        self._requests.clear()
        self._transports.clear()
        clients, self._clients = self._clients, {}
        for _, client in clients.values():
            await client.aclose()
        wire, self._wire = self._wire, {}
        for client in wire.values():
            await client.aclose()
        shared, self._shared = self._shared, {}
        for session, client in shared.values():
            await client.aclose()
            await session.close()

    def _check_host(self, endpoint: Endpoint, request: httpx.Request) -> None:
        if self._allowlist.empty:
            return
        host = request.url.raw_host.decode("ascii", "replace")
        if not self._allowlist.allows(host):
            raise FetchError(
                "config", f"host {host} is not in scrape.allowed_hosts", endpoint=endpoint.id
            )

    async def fetch(self, endpoint: Endpoint, default_path: str, timeout_s: float) -> Fetched:
        """GET the page within ``timeout_s`` overall (a drip-fed body cannot stretch it)."""
        headers = {
            "Accept": _ACCEPT,
            "Accept-Encoding": "gzip" if endpoint.accept_gzip else "identity",
        }
        api_key = resolve_api_key(endpoint, self.key_policy)
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
            if disconnected(exc):
                raise FetchError(
                    "unreachable", unreachable_detail(exc.__cause__ or exc), endpoint=endpoint.id
                ) from exc
            raise FetchError(
                "timeout", f"{type(exc).__name__} after {timeout_s:g}s", endpoint=endpoint.id
            ) from exc
        except (httpx.ConnectError, httpx.UnsupportedProtocol) as exc:
            raise FetchError("unreachable", unreachable_detail(exc), endpoint=endpoint.id) from exc
        except httpx.DecodingError as exc:
            raise FetchError("parse", f"cannot decode body: {exc}", endpoint=endpoint.id) from exc
        except (httpx.TransportError, aiohttp.ClientError, OSError) as exc:
            # Reset or closed mid-response, protocol violations (a bad status line, a bad
            # Content-Length or chunk size: aiohttp's errors pass httpx-aiohttp unmapped):
            # the engine is not serving.
            raise FetchError("unreachable", unreachable_detail(exc), endpoint=endpoint.id) from exc
        except (httpx.InvalidURL, UnicodeError, ValueError) as exc:
            # The request could not even be built (a URL or header the client refuses);
            # the exception text may quote the header, so it is not repeated.
            raise FetchError(
                "config",
                f"cannot build the request ({type(exc).__name__}): check the URL",
                endpoint=endpoint.id,
            ) from exc

    async def _get(
        self, endpoint: Endpoint, url: str, headers: dict[str, str], timeout_s: float, t0: float
    ) -> Fetched:
        client = await self._client(endpoint)
        request = self._prepared(client, endpoint, url, headers, timeout_s)
        if endpoint.tls_insecure and endpoint.id not in self._warned_insecure:
            self._warned_insecure.add(endpoint.id)
            log.warning(
                "endpoint=%s has tls_insecure: its certificate is not verified", endpoint.id
            )
        response = await self._send(endpoint, client, request, headers, timeout_s)
        try:
            status = response.status_code
            if not 200 <= status < 300:
                raise await status_error(endpoint.id, response)
            declared = response.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > self.max_body_bytes:
                raise FetchError("too_large", self._too_large(int(declared)), endpoint=endpoint.id)
            chunks: list[bytes] = []
            size = 0
            # Raw bytes, decoded here with a bound: httpx would inflate a whole network
            # chunk before we could count it (a 64 KB gzip bomb is 64 MiB decoded).
            # (In-memory test transports hand over a response already read and decoded.)
            encoding = response.headers.get("content-encoding", "")
            read = response.is_stream_consumed
            decoder = Decoder("" if read else encoding, endpoint.id)
            async for raw in (
                once(response.content) if read else raw_chunks(response, self.max_body_bytes)
            ):
                for chunk in decoder.feed(raw, self.max_body_bytes - size + 1):
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        raise FetchError("too_large", self._too_large(size), endpoint=endpoint.id)
                    chunks.append(chunk)
            decoder.finish()
        finally:
            await response.aclose()
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return Fetched(
            body, status, response.headers.get("content-type", ""), time.perf_counter() - t0
        )

    async def _send(
        self,
        endpoint: Endpoint,
        client: httpx.AsyncClient,
        request: httpx.Request,
        headers: dict[str, str],
        timeout_s: float,
    ) -> httpx.Response:
        """Send, following up to ``MAX_REDIRECTS`` redirects within the request's origin
        (scheme, host, port), with the same headers (the bearer key too). A redirect to
        another origin is an ``http_status`` failure naming it; nothing is sent there."""
        origin = _origin(request.url)
        for hop in range(MAX_REDIRECTS + 1):
            response = await self._exchange(client, request)
            status = response.status_code
            if status not in _REDIRECT_STATUSES:
                return response
            location = response.headers.get("location", "")
            await response.aclose()
            try:
                target = request.url.join(location.strip()) if location.strip() else None
            except (httpx.InvalidURL, ValueError, UnicodeError):
                target = None
            if target is None or not target.host:
                raise FetchError(
                    "http_status",
                    f"HTTP {status} redirect without a usable Location",
                    endpoint=endpoint.id,
                    status=status,
                )
            if _origin(target) != origin:
                scheme, host, port = _origin(target)
                shown = f"[{host}]" if ":" in host else host
                raise FetchError(
                    "http_status",
                    f"HTTP {status} redirect to {scheme}://{shown[:120]}:{port}, another "
                    "origin: not followed (only the same scheme, host and port are)",
                    endpoint=endpoint.id,
                    status=status,
                )
            if hop == MAX_REDIRECTS:
                raise FetchError(
                    "http_status",
                    f"HTTP {status}: more than {MAX_REDIRECTS} redirects",
                    endpoint=endpoint.id,
                    status=status,
                )
            request = client.build_request("GET", target, headers=headers, timeout=timeout_s)
        raise AssertionError("unreachable")  # the loop returns or raises

    # --- perf (issue 13): the request path without per-request client machinery ------
    # ``client.send`` costs ~15% of a scrape's CPU (URL merging, cookie extraction through
    # urllib, an INFO log record, a stream wrapper): an endpoint's request never changes
    # between scrapes (no cookies, no auth flow; redirects are followed by our own loop in
    # ``_send``), so it is built and host-checked once, and sent straight to the client's
    # transport.

    def _prepared(
        self,
        client: httpx.AsyncClient,
        endpoint: Endpoint,
        url: str,
        headers: dict[str, str],
        timeout_s: float,
    ) -> httpx.Request:
        """The endpoint's request, built once and rebuilt only when an input changed."""
        cached = self._requests.get(endpoint.id)
        if (
            cached is not None
            and cached.client is client
            and cached.url == url
            and cached.timeout_s == timeout_s
            and cached.headers == headers
        ):
            return cached.request
        request = client.build_request("GET", url, headers=headers, timeout=timeout_s)
        self._check_host(endpoint, request)
        self._requests[endpoint.id] = _Prepared(client, url, dict(headers), timeout_s, request)
        return request

    async def _exchange(self, client: httpx.AsyncClient, request: httpx.Request) -> httpx.Response:
        """One exchange on the client's transport; the response's body is not read yet."""
        transport = self._transports.get(client)
        if transport is None:  # not a client this Scraper built
            return await client.send(request, stream=True)
        return await transport.handle_async_request(request)

    def _too_large(self, size: int) -> str:
        return f"body of {size}+ bytes exceeds the {self.max_body_bytes}-byte cap"


@dataclass(frozen=True, slots=True)
class _Prepared:
    """An endpoint's request and what it was built from."""

    client: httpx.AsyncClient
    url: str
    headers: dict[str, str]
    timeout_s: float
    request: httpx.Request
