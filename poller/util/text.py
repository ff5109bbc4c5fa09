"""Reading numbers written by others (Redis records, headers, settings)."""

from __future__ import annotations

__all__ = ["digits", "is_number"]


def digits(text: str) -> bool:
    """``text`` is ASCII digits only, so ``int(text)`` reads it. ``str.isdigit`` is not
    enough: it also takes characters ``int`` refuses, such as ``"²"``."""
    return text.isascii() and text.isdigit()


def is_number(value: object) -> bool:
    """An int or a float: not a bool, nor a number written as a string (a config file's)."""
    return isinstance(value, int | float) and not isinstance(value, bool)
