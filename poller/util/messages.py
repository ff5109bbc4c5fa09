"""Validation errors in plain words: one line per problem, naming its key, with the
closest known name suggested for an unknown one.

Pydantic says ``scrape.intervall_s: Extra inputs are not permitted``; an operator needs
``unknown key `scrape.intervall_s` (did you mean `scrape.interval_s`?)``. Every problem
of one validation is reported, so a file with three mistakes takes one run to fix.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Iterable, Sequence
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

__all__ = ["closest", "describe_errors", "locate_unknown", "not_utf8"]


def not_utf8(exc: UnicodeDecodeError) -> str:
    """What a file that is not UTF-8 text gets told: where, and the usual cause."""
    byte = exc.object[exc.start : exc.start + 1].hex()
    hint = (
        "a UTF-16 file (PowerShell's `>` writes one)? "
        if exc.object[:2] in (b"\xff\xfe", b"\xfe\xff")
        else ""
    )
    return f"is not UTF-8 text (byte 0x{byte} at offset {exc.start}); {hint}save it as UTF-8"


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate ``name`` most likely misspells, if one is close enough."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def _unwrap(annotation: Any) -> Any:
    """``X | None`` -> ``X`` (the only unions the settings and entries use)."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def locate_unknown(
    model: type[BaseModel], path: Sequence[str | int]
) -> tuple[int, list[str]] | None:
    """Where ``path`` leaves the model: the index of its first unknown part and the names
    known there; None when every part is known (or the path ends below a plain value,
    whose own check reports it)."""
    annotation: Any = model
    for index, part in enumerate(path):
        annotation = _unwrap(annotation)
        origin = get_origin(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            fields = annotation.model_fields
            if part not in fields:
                return index, list(fields)
            annotation = fields[str(part)].annotation
        elif origin is dict:
            annotation = get_args(annotation)[1]  # any key: its value has the shape
        elif origin in (tuple, list) and isinstance(part, int):
            annotation = get_args(annotation)[0]
        else:
            return None
    return None


def _unknown(model: type[BaseModel], loc: tuple[str | int, ...]) -> str:
    dotted = ".".join(str(p) for p in loc)
    found = locate_unknown(model, loc)
    if found is None:
        return f"unknown key `{dotted}`"
    index, known = found
    guess = closest(str(loc[index]), known)
    if guess is None:
        return f"unknown key `{dotted}`"
    fixed = ".".join(str(p) for p in (*loc[:index], guess, *loc[index + 1 :]))
    return f"unknown key `{dotted}` (did you mean `{fixed}`?)"


#: Pydantic's bounds in fewer words.
_PLAIN = (
    ("greater than or equal to", "at least"),
    ("less than or equal to", "at most"),
)


def _value(err: Any) -> str:
    value = err.get("input")
    text = f"{value:g}" if isinstance(value, float) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe_errors(exc: ValidationError, model: type[BaseModel]) -> list[tuple[str, str]]:
    """Each problem as (its dotted key, one plain line)."""
    out: list[tuple[str, str]] = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        dotted = ".".join(str(p) for p in loc)
        kind = err["type"]
        if kind == "extra_forbidden":
            out.append((dotted, _unknown(model, loc)))
            continue
        if kind == "missing":
            out.append((dotted, f"missing key `{dotted}`"))
            continue
        message = str(err["msg"]).removeprefix("Value error, ")
        for long, short in _PLAIN:
            message = message.replace(long, short)
        if message.startswith("Input should"):
            message = f"{message.removeprefix('Input ')}, got {_value(err)}"
        elif message.startswith("String should"):
            message = f"{message}, got {_value(err)}"
        out.append((dotted, f"{dotted}: {message}" if dotted else message))
    return out
