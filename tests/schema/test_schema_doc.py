"""docs/schema.md is the public contract: it must list exactly what the code writes."""

from __future__ import annotations

import json
import re

from poller.schema.endpoint import Endpoint
from poller.schema.keys import Keys
from poller.schema.lua import lua
from poller.schema.records import STATS_HEADER, UPDATE_KINDS, json_int, parse_update, split
from poller.schema.stats import FAILURE_FIELDS, FAILURE_REASONS, STATS_FIELDS
from tests.support.paths import REPO

DOC = (REPO / "docs" / "schema.md").read_text()


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


def test_the_registry_engine_list_names_every_engine() -> None:
    from poller.schema.endpoint import ENGINES

    row = next(line for line in DOC.splitlines() if line.startswith("| `engine` | string |"))
    assert re.findall(r"`([a-z]+)`", row.split("|")[3]) == [*ENGINES, "vllm"]  # + the default


def test_failure_reasons_are_all_documented() -> None:
    section = DOC[DOC.index("Reasons:") :].split("\n\n")[0]
    assert sorted(re.findall(r"`([a-z_]+)`", section)) == sorted(FAILURE_REASONS)


def test_key_table_matches_the_code() -> None:
    documented = set(table_after("## Keys"))
    keys = Keys("ns")
    names = [v for n, v in vars(keys).items() if n != "prefix" and v.startswith(keys.prefix)]
    code = {v.replace(keys.prefix, "P") for v in names}
    code |= {fn("<id>").replace(keys.prefix, "P") for fn in (keys.lease, keys.stats, keys.failure)}
    code.add(keys.discovery_lease("<source>").replace(keys.prefix, "P"))
    assert documented == code


def test_update_messages_match_the_code_and_the_scripts() -> None:
    rows = DOC[DOC.index("<!-- update-messages") :].splitlines()[3:]
    kinds = []
    for line in rows:
        if not line.startswith("|"):
            break
        kinds.append(line.split("`")[1].split(" ")[0])
    assert kinds == list(UPDATE_KINDS)
    for kind, script in UPDATE_KINDS.items():
        source = lua(script)
        assert "'SPUBLISH'" in source and f"'{kind} '" in source, script
        # the channel is given in KEYS, as "updates" (tests/schema/test_lua_keys.py runs them)
        assert re.search(r"'SPUBLISH', KEYS\[\d+\]", source), script
        assert "updates" in source.split("\n", 1)[0], script  # the header's KEYS line


def test_the_example_update_is_a_valid_message() -> None:
    section = DOC[DOC.index("An example (one message") :]
    example = section.split("\n\n")[1].strip().replace(",...}", "}")
    update = parse_update(example)
    assert update is not None and update.kind == "stats" and update.seq == 42
    head, body = split(update.record, 0, STATS_HEADER) or ([], "")
    assert head[0] == json.loads(body)["scraped_at_ms"] and json_int(update.record, "seq") == 42
