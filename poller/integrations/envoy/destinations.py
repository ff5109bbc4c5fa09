"""Endpoint ids and the addresses Envoy dials: ``Destinations``.

The Endpoint Picker Protocol names endpoints as ``ip:port`` (the header
``x-gateway-destination-endpoint``, the subset hint, the endpoint that served), while
the Router names them by registry id. Each registry entry's base URL gives the address:
an IP literal as it is, a host name resolved (Envoy's ORIGINAL_DST cluster and its
override_host policy take addresses, not names). The data-parallel ports of one engine
are registry entries of their own, so each is an address of its own.

An entry whose URL carries a path prefix (``http://gw/engines/a``) cannot be reached
by address alone (Envoy would send the client's path to ``ip:port``): it is left out of
the picks, with a WARNING once. So is a name that does not resolve, until it does.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import urlsplit

from poller.reader import Router

__all__ = ["Destinations", "Resolver", "split_address"]

log = logging.getLogger(__name__)

#: host, port -> the addresses it resolves to (``ip`` strings), first preferred.
Resolver = Callable[[str, int], Awaitable[list[str]]]
_DEFAULT_PORTS = {"http": 80, "https": 443}


async def resolve(host: str, port: int) -> list[str]:
    """The system resolver (``getaddrinfo``, off the event loop), IPv4 first."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found = [str(info[4][0]) for info in infos]
    return sorted(dict.fromkeys(found), key=lambda ip: ":" in ip)


def _joined(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def split_address(text: str) -> tuple[str, int | None]:
    """``ip:port``, ``[v6]:port``, a bare ``ip`` or ``[v6]`` -> (ip, port or None); the ip
    normalised, so ``::1`` and ``0:0::1`` agree. ValueError for anything else."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":") if rest.startswith(":") else None
        if rest and port is None:
            raise ValueError(text)
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:
        host, port = text, None
    ip = str(ipaddress.ip_address(host))
    if port is None:
        return ip, None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(text)
    return ip, int(port)


class Destinations:
    """Registry id <-> ``ip:port``, rebuilt when the registry changes (``refresh``, a
    revision compare per request) and when host names resolve again (``run``)."""

    def __init__(
        self, router: Router, *, resolver: Resolver = resolve, resolve_interval_s: float = 30.0
    ) -> None:
        self.router = router
        self.resolver = resolver
        self.resolve_interval_s = resolve_interval_s
        self._rev: object = None
        self._names: dict[tuple[str, int], str] = {}  # (host, port) -> ip, resolved
        self._wanted: set[tuple[str, int]] = set()
        self._address: dict[str, str] = {}  # id -> ip:port
        self._at: dict[str, str] = {}  # ip:port -> id (the first registered there)
        self._by_ip: dict[str, list[str]] = {}  # ip -> ids
        self._warned: set[str] = set()
        self._changed = asyncio.Event()
        #: Every id is routable (no path prefix, every name resolved): picks need no
        #: candidate list.
        self.complete = True
        self.routable: list[str] = []

    # --- lookups (per request: dict reads) --------------------------------------------

    def address(self, endpoint_id: str) -> str | None:
        """Where Envoy sends a request for ``endpoint_id`` (None: not routable now)."""
        return self._address.get(endpoint_id)

    def endpoint_at(self, address: str) -> str | None:
        """The id registered at ``address`` (the endpoint that served), or None."""
        found = self._at.get(address)
        if found is not None:
            return found
        try:
            ip, port = split_address(address)
        except ValueError:
            return None
        return None if port is None else self._at.get(_joined(ip, port))

    def ids_in(self, hint: Iterable[str]) -> list[str]:
        """The ids a subset hint names: ``ip:port`` one endpoint, a bare ``ip`` every
        endpoint at that address (each data-parallel port); unknown ones are ignored."""
        found: list[str] = []
        for item in hint:
            try:
                ip, port = split_address(item)
            except ValueError:
                continue
            if port is None:
                found += self._by_ip.get(ip, ())
            else:
                one = self._at.get(_joined(ip, port))
                if one is not None:
                    found.append(one)
        return list(dict.fromkeys(found))

    # --- keeping it current -------------------------------------------------------------

    def refresh(self) -> None:
        """Rebuild if the registry's revision moved (or names resolved since)."""
        cache = self.router.cache
        key = (cache.rev, len(self._names))
        if key != self._rev:
            self._rev = key
            self._rebuild()

    def _rebuild(self) -> None:
        cache = self.router.cache
        address: dict[str, str] = {}
        wanted: set[tuple[str, int]] = set()
        for endpoint_id in cache.ids():
            base = cache.base(endpoint_id)
            entry = None if base is None else base.entry
            if entry is None:
                continue
            found = self._locate(endpoint_id, entry.url, wanted)
            if found is not None:
                address[endpoint_id] = found
        at: dict[str, str] = {}
        by_ip: dict[str, list[str]] = {}
        for endpoint_id, where in address.items():
            if where in at:
                self._warn(
                    endpoint_id,
                    f"endpoint {endpoint_id} has the address {where} of endpoint {at[where]}: "
                    f"the endpoint that served a request there is taken to be {at[where]}",
                )
            at.setdefault(where, endpoint_id)
            by_ip.setdefault(split_address(where)[0], []).append(endpoint_id)
        self._address, self._at, self._by_ip = address, at, by_ip
        self.routable = list(address)
        self.complete = len(address) == len(cache.ids())
        if wanted - set(self._names):
            self._changed.set()  # names to resolve now, not at the next interval
        self._wanted = wanted

    def _locate(self, endpoint_id: str, url: str, wanted: set[tuple[str, int]]) -> str | None:
        parts = urlsplit(url)
        try:
            port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
        except ValueError:
            port = None
        host = parts.hostname
        if not host or port is None:
            self._warn(endpoint_id, f"endpoint {endpoint_id}: url {url} names no host and port")
            return None
        if parts.path.strip("/"):
            self._warn(
                endpoint_id,
                f"endpoint {endpoint_id}: url {url} has a path prefix, which an address "
                "cannot carry: it is left out of the picks (register the engine's own "
                "host:port)",
            )
            return None
        try:
            return _joined(str(ipaddress.ip_address(host)), port)
        except ValueError:
            pass
        wanted.add((host, port))
        ip = self._names.get((host, port))
        return None if ip is None else _joined(ip, port)

    def _warn(self, endpoint_id: str, message: str) -> None:
        if endpoint_id not in self._warned:
            self._warned.add(endpoint_id)
            log.warning("%s", message)

    async def run(self) -> None:
        """Resolve the host names the registry uses, at once when new ones appear and
        every ``resolve_interval_s``; an answer that fails keeps the last address."""
        while True:
            self.refresh()
            names: dict[tuple[str, int], str] = {}
            for host, port in sorted(self._wanted):
                try:
                    ips = await self.resolver(host, port)
                except OSError as exc:
                    ips = []
                    log.warning("cannot resolve %s: %s", host, exc)
                if ips:
                    names[(host, port)] = ips[0]
                elif (host, port) in self._names:
                    names[(host, port)] = self._names[(host, port)]
            if names != self._names:
                self._names = names
                self._rev = None  # rebuild with the new addresses
                self.refresh()
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), self.resolve_interval_s)
            except TimeoutError:
                pass
