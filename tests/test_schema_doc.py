"""docs/schema.md is the public contract: it must list exactly what the code writes."""

from __future__ import annotations

import re
from pathlib import Path

from poller.redis.lua import lua
from poller.registry import Endpoint
from poller.stats import FAILURE_FIELDS, FAILURE_REASONS, STATS_FIELDS

DOC = (Path(__file__).parent.parent / "docs" / "schema.md").read_text()


def table_after(marker: str) -> list[str]:
    """First-column names of the markdown table that follows ``marker``."""
    rest = DOC[DOC.index(marker) :].splitlines()[1:]
    names = []
    for line in rest:
        if not line.startswith("|"):
            if names:
                break
            continue
        cell = line.split("|")[1].strip()
        if cell.startswith("`"):
            names.append(cell.strip("`"))
    return names


def test_stats_fields_match_the_code() -> None:
    assert table_after("<!-- stats-fields") == list(STATS_FIELDS)


def test_failure_fields_match_the_code() -> None:
    documented = table_after("<!-- failure-fields")
    assert documented == list(FAILURE_FIELDS)
    for name in documented:  # and the script really writes each of them
        assert f"'{name}'" in lua("write_failure") or name in ("poller", "token")


def test_registry_fields_match_the_model() -> None:
    documented = table_after("### Registry entry")
    assert sorted(documented) == sorted(f for f in Endpoint.model_fields if f != "id")


def test_failure_reasons_are_all_documented() -> None:
    section = DOC[DOC.index("Reasons:") :].split("\n\n")[0]
    assert sorted(re.findall(r"`([a-z_]+)`", section)) == sorted(FAILURE_REASONS)
