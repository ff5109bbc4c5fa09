"""Reading numbers written by others (Redis records, headers, settings)."""

from __future__ import annotations

__all__ = ["digits"]


def digits(text: str) -> bool:
    """``text`` is ASCII digits only, so ``int(text)`` reads it. ``str.isdigit`` is not
    enough: it also takes characters ``int`` refuses, such as ``"²"``."""
    return text.isascii() and text.isdigit()
