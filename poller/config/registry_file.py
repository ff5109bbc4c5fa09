"""Registry files: the YAML, JSON or TOML list of endpoints that ``endpoints sync`` and
``--endpoints-file`` load, every entry validated before any is used.

The suffix names the format (``.json``, ``.toml``; anything else is YAML) and a syntax
error is reported in it. Entries are named by id and counted from 1; two entries with
one normalised URL (``poller.schema.endpoint.normalize_url``) are refused."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from poller.errors import ConfigError
from poller.schema.endpoint import Endpoint, url_conflicts
from poller.util.messages import closest, describe_errors, not_utf8

__all__ = ["endpoints_from_file", "endpoints_from_items"]

#: The problems of one valid entry, as lines that do not name it.
Check = Callable[[Endpoint], Iterable[str]]


def endpoints_from_items(
    items: Iterable[Any], source: str, check: Check | None = None
) -> dict[str, Endpoint]:
    """Validate every entry of a file; raises ConfigError with one line per problem of
    every entry (not just the first), each naming the entry and its key. ``check`` finds
    the problems of a valid entry that its model cannot see (``poller.cli.register``)."""
    result: dict[str, Endpoint] = {}
    lines: list[str] = []
    for number, item in enumerate(items, start=1):
        if not isinstance(item, Mapping):
            lines.append(f"{source}: entry {number} is not a table/mapping")
            continue
        if "id" not in item:
            lines.append(f"{source}: entry {number} has no id")
            continue
        where = f"{source}: endpoint {str(item['id'])!r} (entry {number})"
        try:
            endpoint = Endpoint.model_validate(item)
        except ValidationError as exc:
            lines += [f"{where}: {line}" for _, line in describe_errors(exc, Endpoint)]
            continue
        if endpoint.id in result:
            lines.append(f"{where}: duplicate endpoint id {endpoint.id!r}: an earlier entry has it")
            continue
        taken = url_conflicts(
            [(endpoint.id, endpoint.url)], [(e.id, e.url) for e in result.values()]
        )
        lines += [f"{source}: {line}" for line in taken]
        lines += [f"{where}: {line}" for line in (check(endpoint) if check else ())]
        result[endpoint.id] = endpoint
    if lines:
        raise ConfigError("\n".join(lines))
    return result


def _syntax_error(exc: Exception) -> str:
    """A parser's error on one line: PyYAML's spans several, with a caret drawing."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(exc).split())


def endpoints_from_file(path: str | Path, check: Check | None = None) -> dict[str, Endpoint]:
    """Read a YAML, JSON or TOML endpoints file: ``endpoints = [ {id, url, ...}, ... ]``.

    YAML and JSON may also be a bare list. The whole file is validated before anything
    is used.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read endpoints file {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"endpoints file {str(path)!r} {not_utf8(exc)}") from None
    data: Any
    kind = {".toml": "TOML", ".json": "JSON"}.get(path.suffix.lower(), "YAML")
    try:
        if kind == "TOML":
            data = tomllib.loads(text)
        elif kind == "JSON":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # syntax errors carry their own line numbers
        raise ConfigError(f"{path}: not valid {kind}: {_syntax_error(exc)}") from None
    if data is None:
        data = []
    if isinstance(data, Mapping):
        unknown = set(data) - {"endpoints"}
        if {"rev", "invalid"} & unknown and "endpoints" in data:
            raise ConfigError(
                f"{path}: this looks like `poller endpoints ls --json` output; write a file "
                "sync reads with `poller endpoints export`"
            )
        if unknown:
            guess = closest(str(next(iter(unknown))), ["endpoints"]) if len(unknown) == 1 else None
            raise ConfigError(
                f"{path}: unknown top-level keys {sorted(unknown)}; expected 'endpoints'"
                + (f" (did you mean `{guess}`?)" if guess else "")
            )
        data = data.get("endpoints", [])
    if not isinstance(data, list):
        raise ConfigError(f"{path}: 'endpoints' must be a list of entries")
    return endpoints_from_items(data, str(path), check)
