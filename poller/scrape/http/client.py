"""Fetch one /metrics page (or another path of an endpoint, such as ``/v1/models``):
timeouts, a body cap, bearer auth, redirects, TLS.

httpx is the client API; under it, one ``WireTransport`` (``wire.py``: asyncio protocols,
answers parsed by llhttp) per distinct TLS setting carries every endpoint's requests and
keeps its connections per origin. Tests pass a ``transport_factory`` (an
``httpx.MockTransport`` per endpoint, say) instead.

Errors: every exception of a fetch goes through ``errors.to_fetch_error``, the one
mapping from httpx's exceptions to the failure reasons of docs/schema.md. Secrets are
resolved here, on the poller, from the endpoint's ``api_key_env``/``api_key_file``
(``KeyPolicy`` says which may be named), and never leave it except as the Authorization
header (never in an error message or a log line).

URL policy: redirects are followed within the endpoint's origin only (``redirects.py``).
With ``scrape.allowed_hosts`` set a host outside it is never contacted (a ``config``
failure). The host checked is the one in the request httpx builds, i.e. exactly what the
transport will connect to.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from poller.config import HostAllowlist, ScrapeSettings
from poller.errors import FetchError
from poller.schema.endpoint import Endpoint
from poller.scrape.http import redirects
from poller.scrape.http.apikeys import KeyPolicy, resolve_api_key
from poller.scrape.http.body import Decoder, once, raw_chunks
from poller.scrape.http.errors import MAPPED, status_error, to_fetch_error
from poller.scrape.http.tls import TlsContexts, TlsKey, tls_key
from poller.scrape.http.wire import WireTransport
from poller.util.text import digits

__all__ = ["Fetched", "KeyPolicy", "Scraper", "TransportFactory", "resolve_api_key"]

log = logging.getLogger(__name__)

#: Builds the transport for one endpoint's client; tests pass httpx.MockTransport.
TransportFactory = Callable[[Endpoint], httpx.AsyncBaseTransport]

_ACCEPT = "text/plain;version=0.0.4;q=0.9,*/*;q=0.1"


@dataclass(frozen=True, slots=True)
class Fetched:
    body: bytes
    status: int
    content_type: str
    elapsed_s: float


def metrics_url(endpoint: Endpoint, default_path: str) -> str:
    return endpoint.url + (endpoint.metrics_path or default_path)


class Scraper:
    """Fetches pages over one shared transport per TLS setting (or the test factory's)."""

    def __init__(
        self,
        *,
        max_body_bytes: int,
        transport_factory: TransportFactory | None = None,
        allowed_hosts: Sequence[str] = (),
        key_policy: KeyPolicy | None = None,
    ) -> None:
        self.max_body_bytes = max_body_bytes
        #: Default: the default settings' rules (LLMGW_KEY_*, $CREDENTIALS_DIRECTORY or
        #: /etc/llmgw-poller/keys); a poller passes ``KeyPolicy.from_settings``.
        self.key_policy = key_policy or KeyPolicy.from_settings(ScrapeSettings())
        self._transport_factory = transport_factory
        self._allowlist = HostAllowlist.parse(tuple(allowed_hosts))
        self._tls = TlsContexts()
        # Per-endpoint clients (test factories) remember the TLS settings they were built
        # with, so an entry whose tls_ca_file/tls_insecure changed gets a new client.
        self._clients: dict[str, tuple[TlsKey, httpx.AsyncClient]] = {}
        self._wire: dict[TlsKey, httpx.AsyncClient] = {}
        # Each client's transport, and each endpoint's prepared request (see _prepared).
        self._transports: dict[httpx.AsyncClient, httpx.AsyncBaseTransport] = {}
        self._requests: dict[str, _Prepared] = {}
        self._warned_insecure: set[str] = set()

    @staticmethod
    def _new_client(transport: httpx.AsyncBaseTransport) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=transport,
            follow_redirects=False,  # followed by redirects.follow, within the origin only
            trust_env=False,  # no proxy or netrc surprises: engines are addressed directly
        )

    async def _client(self, endpoint: Endpoint) -> httpx.AsyncClient:
        key = tls_key(endpoint)
        if self._transport_factory is None:
            wire = self._wire.get(key)
            if wire is None:
                # One transport for every endpoint with these TLS settings; it keeps its
                # connections per origin, so a request's cost does not grow with them.
                transport = WireTransport(
                    max_body_bytes=self.max_body_bytes, ssl_context=self._tls.get(endpoint)
                )
                wire = self._wire[key] = self._new_client(transport)
                self._transports[wire] = transport
            return wire
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
        """Forget the endpoint's request and close its own client, if it has one (lease
        lost, endpoint removed); shared transports close idle connections themselves."""
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
        url = metrics_url(endpoint, default_path)
        return await self._fetch(endpoint, url, _ACCEPT, timeout_s, prepared=True)

    async def fetch_path(
        self, endpoint: Endpoint, path: str, timeout_s: float, accept: str = "application/json"
    ) -> Fetched:
        """GET another path of the endpoint's base URL (``/v1/models``) under the page's
        rules: the same key, TLS, allowlist, same-origin redirects, body cap and overall
        timeout. Its request is built for this call only (the page's stays prepared)."""
        return await self._fetch(endpoint, endpoint.url + path, accept, timeout_s, prepared=False)

    async def _fetch(
        self, endpoint: Endpoint, url: str, accept: str, timeout_s: float, *, prepared: bool
    ) -> Fetched:
        headers = {
            "Accept": accept,
            "Accept-Encoding": "gzip" if endpoint.accept_gzip else "identity",
        }
        api_key = resolve_api_key(endpoint, self.key_policy)
        if api_key is not None:
            headers["Authorization"] = f"Bearer {api_key}"
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                return await self._get(endpoint, url, headers, timeout_s, started, prepared)
        except MAPPED as exc:
            raise to_fetch_error(exc, endpoint.id, timeout_s) from exc

    async def _get(
        self,
        endpoint: Endpoint,
        url: str,
        headers: dict[str, str],
        timeout_s: float,
        t0: float,
        prepared: bool = True,
    ) -> Fetched:
        client = await self._client(endpoint)
        if prepared:
            request = self._prepared(client, endpoint, url, headers, timeout_s)
        else:
            request = client.build_request(
                "GET", url, headers=headers, timeout=_timeouts(timeout_s)
            )
            self._check_host(endpoint, request)
        if endpoint.tls_insecure and endpoint.id not in self._warned_insecure:
            self._warned_insecure.add(endpoint.id)
            log.warning(
                "endpoint=%s has tls_insecure: its certificate is not verified", endpoint.id
            )

        def rebuild(target: httpx.URL) -> httpx.Request:
            return client.build_request(
                "GET", target, headers=headers, timeout=_timeouts(timeout_s)
            )

        response = await redirects.follow(
            endpoint.id, request, lambda r: self._exchange(client, r), rebuild
        )
        try:
            status = response.status_code
            if not 200 <= status < 300:
                raise await status_error(endpoint.id, response)
            body = await self._body(endpoint, response)
        finally:
            await response.aclose()
        return Fetched(
            body, status, response.headers.get("content-type", ""), time.perf_counter() - t0
        )

    async def _body(self, endpoint: Endpoint, response: httpx.Response) -> bytes:
        """The decoded body, or ``too_large`` once past the cap (declared or counted)."""
        cap = self.max_body_bytes
        declared = response.headers.get("content-length")
        if declared and digits(declared) and int(declared) > cap:
            raise FetchError("too_large", self._too_large(int(declared)), endpoint=endpoint.id)
        chunks: list[bytes] = []
        size = 0
        # Raw bytes, decoded here with a bound: httpx would inflate a whole network
        # chunk before we could count it (a 64 KB gzip bomb is 64 MiB decoded).
        # (In-memory test transports hand over a response already read and decoded.)
        read = response.is_stream_consumed
        decoder = Decoder("" if read else response.headers.get("content-encoding", ""), endpoint.id)
        async for raw in once(response.content) if read else raw_chunks(response):
            for chunk in decoder.feed(raw, cap - size + 1):
                size += len(chunk)
                if size > cap:
                    raise FetchError("too_large", self._too_large(size), endpoint=endpoint.id)
                chunks.append(chunk)
        decoder.finish()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    # ``client.send`` costs ~15% of a scrape's CPU (URL merging, cookie extraction through
    # urllib, an INFO log record, a stream wrapper): an endpoint's request never changes
    # between scrapes (no cookies, no auth flow; redirects are followed by
    # ``redirects.follow``), so it is built and host-checked once, and sent straight to
    # the client's transport.

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
        request = client.build_request("GET", url, headers=headers, timeout=_timeouts(timeout_s))
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


def _timeouts(timeout_s: float) -> httpx.Timeout:
    """Connect within the fetch's time; no read timer of its own: ``fetch``'s overall
    deadline already bounds the answer (one timer per scrape instead of two)."""
    return httpx.Timeout(None, connect=timeout_s)


@dataclass(frozen=True, slots=True)
class _Prepared:
    """An endpoint's request and what it was built from."""

    client: httpx.AsyncClient
    url: str
    headers: dict[str, str]
    timeout_s: float
    request: httpx.Request
