"""``scrape.allowed_hosts``: which hosts the poller may contact, compiled once.

Nothing is resolved, ever: an IP literal is checked against CIDR entries, a host name
against name entries (``name`` or ``*.suffix``).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

__all__ = ["HostAllowlist", "IPNetwork"]

_LABEL = r"(?!-)[a-z0-9_-]{1,63}(?<!-)"
_NAME_RE = re.compile(rf"(\*\.)?{_LABEL}(\.{_LABEL})*")
# What getaddrinfo would read as an IPv4 address although ipaddress does not: 10.1,
# 0x0a000001, 167772161, 012.0.0.1. Such a host never matches a name pattern.
_NUMERIC_HOST_RE = re.compile(r"(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+)){0,3}")

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class HostAllowlist:
    """``scrape.allowed_hosts``, compiled. Nothing is resolved, ever.

    An IP literal in a URL is checked against the CIDR entries only; a host name against
    the name entries only. So ``10.0.0.0/8`` does not allow ``gw.internal`` even if it
    resolves into 10/8, and ``gw.internal`` does not allow its addresses: resolving at
    check time would let DNS decide, and the answer could change before the request.
    ``*.x.internal`` matches names under ``x.internal`` at any depth, not ``x.internal``.
    """

    networks: tuple[IPNetwork, ...] = ()
    names: frozenset[str] = frozenset()
    suffixes: tuple[str, ...] = ()  # ".x.internal" for "*.x.internal"

    @classmethod
    def parse(cls, entries: tuple[str, ...] | list[str]) -> HostAllowlist:
        networks: list[IPNetwork] = []
        names: set[str] = set()
        suffixes: list[str] = []
        for raw in entries:
            entry = raw.strip().lower().removeprefix("[").removesuffix("]").rstrip(".")
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            if not _NAME_RE.fullmatch(entry) or _NUMERIC_HOST_RE.fullmatch(
                entry.removeprefix("*.")
            ):
                raise ValueError(
                    f"allowed_hosts entry {raw!r} is neither a CIDR/IP nor a host name "
                    "pattern (gw.internal, *.engines.internal)"
                )
            if entry.startswith("*."):
                suffixes.append(entry[1:])
            else:
                names.add(entry)
        return cls(tuple(networks), frozenset(names), tuple(suffixes))

    @property
    def empty(self) -> bool:
        return not (self.networks or self.names or self.suffixes)

    def allows(self, host: str) -> bool:
        """``host`` as in a URL (``urlsplit().hostname``: lower case, IPv6 unbracketed)."""
        if self.empty:
            return True
        host = host.lower().removeprefix("[").removesuffix("]").rstrip(".")
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            if _NUMERIC_HOST_RE.fullmatch(host):
                return False  # an IPv4 address in disguise: neither a name nor a CIDR match
            return host in self.names or any(host.endswith(s) for s in self.suffixes)
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # ::ffff:10.0.0.5 connects to 10.0.0.5
        return any(address in network for network in self.networks)
