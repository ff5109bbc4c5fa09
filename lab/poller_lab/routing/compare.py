"""Virtual time against real processes, on the cells both run.

Each real-process cell (fleets.py) maps onto the virtual-time family's cell of the same
engines, sizes, outside share, metrics lag, gateways, load and poller interval
(cells.py); that cell is run in virtual time (family.py, ``run_cell``) with the oracle
and the picker, and the two ratios to the oracle are printed side by side. What the
virtual family does not model shows in the difference: its pages' KV usage never
reaches the picker's saturation threshold (0.7 x running / slots), its requests last
0.4 s on every mix, and it leaves out the process and network costs. Fleets without a
virtual mix (none today) are left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from poller_lab.routing.cells import MIXES, Cell
from poller_lab.routing.fleets import FLEETS, RealCell

__all__ = ["COMPARE_HEADER", "compare", "format_compare", "virtual_cell"]

#: Real fleets whose engines a virtual mix has under another name.
_MIX = {"heavy-tail": "six", "outside": "six", "lag": "six", "six-kv-half": "six"}


def virtual_cell(cell: RealCell, interval_s: float) -> Cell | None:
    fleet = FLEETS[cell.fleet]
    mix = _MIX.get(fleet.name, fleet.name)
    if mix not in MIXES or fleet.sizes not in ("exp", "lognormal"):
        return None
    return Cell(mix, fleet.sizes, fleet.outside, fleet.lag_s, cell.gateways, cell.load,
                interval_s)  # fmt: skip


def compare(
    rows: Sequence[dict[str, Any]], interval_s: float, duration_s: float, seed: int
) -> list[dict[str, Any]]:
    """For every real row with the picker and the oracle: the virtual ratios beside."""
    from poller_lab.routing.family import run_cell

    out = []
    for row in rows:
        cell = RealCell(row["fleet"], row["gateways"], row["load"])
        virtual = virtual_cell(cell, interval_s)
        if virtual is None or row.get("picker_p99_x") is None:
            continue
        oracle = run_cell(virtual, "oracle", duration_s, seed)
        picker = run_cell(virtual, "picker", duration_s, seed)

        def x(q: str, a: dict[str, Any] = picker, b: dict[str, Any] = oracle) -> float | None:
            return None if not b[q] else round(a[q] / b[q], 2)

        out.append(
            {
                "cell": row["cell"],
                "virtual_cell": virtual.name(),
                "real_p50_x": row["picker_p50_x"],
                "real_p99_x": row["picker_p99_x"],
                "virtual_p50_x": x("p50_s"),
                "virtual_p99_x": x("p99_s"),
            }
        )
    return out


COMPARE_HEADER = f"{'cell':<22} {'real p50/p99 x':>15} {'virtual p50/p99 x':>18}  virtual cell"


def format_compare(row: dict[str, Any]) -> str:
    real = f"{row['real_p50_x']:.2f}/{row['real_p99_x']:.2f}"
    virtual = f"{row['virtual_p50_x']:.2f}/{row['virtual_p99_x']:.2f}"
    return f"{row['cell']:<22} {real:>15} {virtual:>18}  {row['virtual_cell']}"
