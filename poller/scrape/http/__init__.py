"""The scrape client: httpx over the poller's own asyncio transport (``wire``), each
answer parsed by llhttp (``h1``); TLS, redirects, bearer keys and the error mapping.

``Scraper`` is what the service and ``poller check`` use."""

from __future__ import annotations

from poller.scrape.http.client import KeyPolicy, Scraper, TransportFactory, metrics_url

__all__ = ["KeyPolicy", "Scraper", "TransportFactory", "metrics_url"]
