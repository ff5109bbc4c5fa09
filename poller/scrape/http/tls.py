"""TLS contexts for scrapes: one ``ssl.SSLContext`` per distinct (CA file, insecure) pair.

Engines are verified against the system trust store, or against the endpoint's
``tls_ca_file`` only (a private CA narrows trust); ``tls_insecure`` turns verification
off (the Scraper logs a WARNING once per endpoint). A CA file that cannot be read is a
``config`` failure, and is not cached: a file mounted later works.
"""

from __future__ import annotations

import ssl

from poller.errors import FetchError
from poller.schema.endpoint import Endpoint

__all__ = ["TlsContexts", "TlsKey", "tls_key"]

#: An endpoint's TLS settings, (tls_ca_file, tls_insecure): one SSLContext per value.
TlsKey = tuple[str | None, bool]


def tls_key(endpoint: Endpoint) -> TlsKey:
    return (endpoint.tls_ca_file, endpoint.tls_insecure)


class TlsContexts:
    """The cached context for each endpoint's TLS settings."""

    def __init__(self) -> None:
        self._contexts: dict[TlsKey, ssl.SSLContext] = {}

    def get(self, endpoint: Endpoint) -> ssl.SSLContext:
        key = tls_key(endpoint)
        context = self._contexts.get(key)
        if context is not None:
            return context
        ca_file, insecure = key
        try:
            context = ssl.create_default_context(cafile=ca_file)
        except OSError as exc:  # ssl.SSLError too
            why = exc.strerror or str(exc)
            raise FetchError(
                "config", f"cannot use tls_ca_file {ca_file}: {why}", endpoint=endpoint.id
            ) from None
        if insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        self._contexts[key] = context
        return context
