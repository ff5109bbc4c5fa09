"""Asking DNS for a discovery source's targets (dnspython's asyncio resolver).

One call, ``resolve(source, lifetime_s)``, maps every answer and error to an ``Answer``:
targets, or None with a failure reason. No cache (each refresh must see the zone as it
is now) and no search domains (names are absolute).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import dns.asyncresolver
import dns.exception
import dns.resolver

from poller.config import DiscoverySource

__all__ = ["Answer", "Target", "resolve"]


@dataclass(frozen=True, slots=True, order=True)
class Target:
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class Answer:
    """``targets`` is None when the resolution failed; ``failure`` names why (or "")."""

    targets: tuple[Target, ...] | None
    failure: str = ""
    detail: str = ""


def _resolver(source: DiscoverySource, lifetime_s: float) -> dns.asyncresolver.Resolver:
    resolver = dns.asyncresolver.Resolver(configure=source.nameserver is None)
    if source.nameserver is not None:
        resolver.nameservers = [source.nameserver[0]]
        resolver.port = source.nameserver[1]
    resolver.cache = None  # every refresh asks: the answer is what we are here for
    resolver.lifetime = lifetime_s
    resolver.timeout = lifetime_s
    return resolver


async def _query(resolver: dns.asyncresolver.Resolver, name: str, rdtype: str) -> list[Any]:
    answer = await resolver.resolve(name, rdtype, search=False, raise_on_no_answer=False)
    return list(answer.rrset) if answer.rrset is not None else []


def _host(text: str) -> str:
    return text.rstrip(".").lower()


async def resolve(source: DiscoverySource, lifetime_s: float) -> Answer:
    """Ask DNS once (SRV; or A and AAAA together) and map errors to failure reasons:
    ``timeout``, ``servfail`` (every server failed or refused), ``nxdomain``, ``empty``
    (the name exists without such records, or SRV says "no service") and ``error``."""
    try:
        resolver = _resolver(source, lifetime_s)
        if source.kind == "srv":
            rdatas = await _query(resolver, source.query, "SRV")
            targets = {
                Target(_host(r.target.to_text()), int(r.port))
                for r in rdatas
                if r.target.to_text() != "."
            }
        else:
            assert source.port is not None
            both = await asyncio.gather(
                _query(resolver, source.query, "A"),
                _query(resolver, source.query, "AAAA"),
                return_exceptions=True,  # both finish before we judge: no orphaned query
            )
            for result in both:
                if isinstance(result, BaseException):
                    raise result
            records = [r for result in both if isinstance(result, list) for r in result]
            targets = {Target(r.address, source.port) for r in records}
    except dns.resolver.NXDOMAIN:
        return Answer((), "nxdomain", f"{source.query} does not exist")
    except dns.resolver.NoNameservers as exc:
        return Answer(None, "servfail", str(exc)[:300])
    except dns.exception.Timeout:
        return Answer(None, "timeout", f"no answer within {lifetime_s:g}s")
    except (dns.exception.DNSException, OSError) as exc:
        return Answer(None, "error", f"{type(exc).__name__}: {exc}"[:300])
    if not targets:
        return Answer((), "empty", f"{source.query} has no {source.kind.upper()} records")
    return Answer(tuple(sorted(targets)))
