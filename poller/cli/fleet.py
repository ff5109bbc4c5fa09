"""The pollers in ``poller status``: who is live, serving or draining, how many leases
each holds, its heartbeat and version (what the operator's page shows as its fleet), and
any id seen from two processes (``DUPLICATE``, with a line under the table)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from poller.schema.keys import Keys
from poller.store.members import Client, Member, lease_holders, read_members

__all__ = ["Fleet", "fleet_parts", "fleet_table", "read_fleet"]

_STYLE = {"serving": "green", "draining": "yellow", "drain requested": "yellow"}


@dataclass(frozen=True, slots=True)
class Fleet:
    now_ms: int
    members: list[Member]
    #: poller id -> leases it holds now.
    leases: dict[str, int]

    def to_json(self) -> list[dict[str, Any]]:
        return [{**m.to_dict(), "leases": self.leases.get(m.id, 0)} for m in self.members]


async def read_fleet(client: Client, keys: Keys, endpoint_ids: Iterable[str]) -> Fleet:
    """The live pollers, and how many of ``endpoint_ids``' leases each holds."""
    now_ms, members = await read_members(client, keys)
    held = Counter((await lease_holders(client, keys, endpoint_ids)).values())
    return Fleet(now_ms, members, dict(held))


def fleet_table(fleet: Fleet) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold", title_justify="left")
    table.title = "pollers"
    for column in ("POLLER", "STATE", "LEASES", "HEARTBEAT", "VERSION"):
        table.add_column(column, justify="right" if column in ("LEASES", "HEARTBEAT") else "left")
    for m in fleet.members:
        ttl_ms = m.info.get("member_ttl_ms")
        beat = "-"
        if isinstance(ttl_ms, int):  # age of the last heartbeat: TTL minus time left
            beat = f"{max(0, ttl_ms - (m.expires_ms - fleet.now_ms)) / 1000:.1f}s ago"
        poller = Text(m.id)
        if m.duplicate is not None:
            poller.append(" DUPLICATE", style="bold red")
        state = Text(m.state, style=_STYLE[m.state])
        if m.drain is not None and m.drain.get("by"):
            state.append(f" (by {m.drain['by']})")
        table.add_row(
            poller, state, str(fleet.leases.get(m.id, 0)), beat, str(m.info.get("version", "-"))
        )
    return table


def fleet_parts(fleet: Fleet) -> list[RenderableType]:
    """The table, then one line per id seen from two processes."""
    lines = [m.duplicate_line(fleet.now_ms) for m in fleet.members if m.duplicate is not None]
    return [fleet_table(fleet), *(Text(line, style="red") for line in lines)]
