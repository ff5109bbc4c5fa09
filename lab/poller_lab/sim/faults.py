"""Fault modes of a simulated endpoint: names, parameters, and the bodies they serve.

A fault is data (``Fault(mode, params)``), validated once when it is set (from Python,
``poller sim --fault``, or the admin API), so the request path only branches on
``mode``. What a client sees is ``DESCRIPTIONS`` (``poller sim --help`` prints it).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from poller.errors import ConfigError

__all__ = ["DESCRIPTIONS", "FAULT_MODES", "Fault", "defaults", "garbage_body", "padding_block"]

# mode -> {parameter: default}; a default of None means "the engine decides".
_PARAMS: dict[str, dict[str, Any]] = {
    "ok": {},
    "down": {},
    "refuse": {},
    "slow": {"delay_s": 2.0},
    "hang": {},
    "drip": {"chunk_bytes": 256, "interval_s": 0.1},
    "http500": {},
    "http401": {},
    "garbage": {"kind": "mixed"},
    "oversized": {"mb": 16.0, "declare_length": False},
    "missing": {"metrics": None},
    "flap": {"period_s": 5.0, "fail": "http500"},
    "restart": {},
    "json": {},
}
FAULT_MODES = tuple(_PARAMS)
#: mode -> what a client sees, one line each (``poller sim --help`` lists them).
DESCRIPTIONS: dict[str, str] = {
    "ok": "the page",
    "down": "per-port: its port is closed (refused); path: the connection closed unanswered",
    "refuse": "per-port: as down; path: the connection is reset (RST)",
    "slow": "the page after delay_s seconds",
    "hang": "nothing, ever (until the client gives up or the simulator stops)",
    "drip": "the page, chunk_bytes at a time every interval_s seconds",
    "http500": "500 Internal Server Error (completions too)",
    "http401": "401 Unauthorized (completions too)",
    "garbage": "HTML or binary that is not exposition text (kind: html, binary, mixed)",
    "oversized": "a valid-looking page of mb MB, streamed (declare_length: with its length)",
    "missing": "the page without metrics (default: the engine's KV usage gauge)",
    # Lazily, per request: a per-port endpoint's down drops the connection instead.
    "flap": "period_s seconds healthy, then period_s seconds of fail, and so on",
    "restart": "counters reset to zero once, then ok",
    "json": "JSON iteration stats, like trtllm-serve's plain /metrics",
}
#: What the failing half of ``flap`` may be: anything served from inside a request.
_FLAP_FAILS = (
    *("down", "refuse", "slow", "hang", "drip", "http500", "http401", "garbage"),
    *("oversized", "missing", "json"),
)
_GARBAGE_KINDS = ("html", "binary", "mixed")


def defaults(mode: str) -> dict[str, Any]:
    """A mode's parameters and their defaults (None: the engine decides)."""
    return dict(_PARAMS[mode])


@dataclass(frozen=True, slots=True)
class Fault:
    mode: str = "ok"
    params: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, mode: str, params: Mapping[str, Any]) -> Fault:
        """Validate ``mode`` and its parameters, filling in defaults; ConfigError if bad."""
        if mode not in _PARAMS:
            raise ConfigError(f"unknown fault mode {mode!r}; accepted: {', '.join(FAULT_MODES)}")
        allowed = _PARAMS[mode]
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            accepted = ", ".join(allowed) or "none"
            raise ConfigError(f"fault {mode!r} takes no {unknown}; accepted: {accepted}")
        merged = {**allowed, **params}
        for name, value in merged.items():
            merged[name] = _check(mode, name, value)
        return cls(mode, merged)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, **self.params}


def _seconds_or_size(mode: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"fault {mode!r}: {name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0 or (name in ("period_s", "mb") and value == 0):
        raise ConfigError(f"fault {mode!r}: {name} out of range: {value!r}")
    return float(value)


def _check(mode: str, name: str, value: Any) -> Any:
    if name in ("delay_s", "interval_s", "period_s", "mb"):
        return _seconds_or_size(mode, name, value)
    if name == "chunk_bytes":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"fault {mode!r}: chunk_bytes must be a positive integer")
        return value
    if name == "declare_length":
        if not isinstance(value, bool):
            raise ConfigError(f"fault {mode!r}: declare_length must be true or false")
        return value
    if name == "kind" and value not in _GARBAGE_KINDS:
        raise ConfigError(f"fault 'garbage': kind must be one of {', '.join(_GARBAGE_KINDS)}")
    if name == "fail" and value not in _FLAP_FAILS:
        raise ConfigError(f"fault 'flap': fail must be one of {', '.join(_FLAP_FAILS)}")
    if name == "metrics" and value is not None:
        if isinstance(value, str):
            value = (value,)
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ConfigError("fault 'missing': metrics must be a name or a list of names")
        return tuple(value)
    return value


_HTML = (
    b"<!DOCTYPE html>\n<html><head><title>502 Bad Gateway</title></head>\n"
    b"<body><center><h1>502 Bad Gateway</h1></center><hr><center>nginx</center>\n"
)


def garbage_body(rng: random.Random, kind: str, hit: int) -> tuple[bytes, str]:
    """A body that is not exposition text, and its content type; ``mixed`` alternates."""
    if kind == "mixed":
        kind = "html" if hit % 2 else "binary"
    if kind == "html":
        filler = b"".join(
            b"<!-- %08x -->\n" % rng.getrandbits(32) for _ in range(rng.randint(1, 8))
        )
        return _HTML + filler + b"</body></html>\n", "text/html"
    # 0x89 can never start a UTF-8 sequence, so the decode fails on the first byte.
    return b"\x89PNG\r\n\x1a\n" + rng.randbytes(rng.randint(64, 4096)), "application/octet-stream"


def padding_block(size: int = 64 * 1024) -> bytes:
    """Valid sample lines, ``size`` bytes or a little more, to grow an oversized page."""
    lines = []
    total = 0
    i = 0
    while total < size:
        line = b'sim_padding_bucket{series="%d",le="+Inf"} 0\n' % i
        lines.append(line)
        total += len(line)
        i += 1
    return b"".join(lines)
