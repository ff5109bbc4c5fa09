"""The Lua scripts of schema v1, kept as ``scripts/*.lua`` package data.

Each file starts with a header naming its KEYS, ARGV and return value. Scripts target
Lua 5.1 (real Redis and fakeredis both run it), are registered once per client and run
with EVALSHA; redis-py's ``Script`` reloads them after NOSCRIPT.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

__all__ = ["lua"]


@cache
def lua(name: str) -> str:
    """The source of ``scripts/<name>.lua``."""
    return resources.files("poller.schema").joinpath(f"scripts/{name}.lua").read_text("utf-8")
