"""What an ``EndpointView`` costs as a slotted record, against the tuple it replaced.

Usage: python tests/bench/bench_records.py [--n 200000] [--json]

A cache builds one ``EndpointView`` per endpoint a lookup or a view returns, and a pick
reads a few of its fields, so building and reading are what count. Timed in one run,
each the best of 9 rounds of ``--n`` operations, the three forms alternating (ns per
operation), and the size of one record without what it points to (bytes):

- ``slotted``: ``EndpointView`` as the reader builds it (poller/reader/view/records.py:
  the fields set on an assignable class of the same slots, then the class switched);
- ``guarded``: the same slots set through ``object.__setattr__``, as a class whose own
  ``__setattr__`` refuses must be built without that switch;
- ``tuple``: a ``tuple`` subclass with the same eight fields as properties over item
  getters, built by ``tuple.__new__`` (what ``EndpointView`` was: ``len()``, iteration
  and ``==`` showed them).

Compare runs on one machine, not single numbers: docs/performance.md, "The view's
records".
"""

from __future__ import annotations

import argparse
import json
import operator
import sys
import timeit
from collections.abc import Callable
from typing import Any

from poller.reader.view.records import Timing, _build

FIELDS = ("id", "state", "age_ms", "owner", "token", "raw", "timing", "_parsed")


class TupleView(tuple):  # type: ignore[type-arg]
    """The tuple form: eight items, each field an item getter."""

    __slots__ = ()

    def __new__(cls, *values: Any) -> TupleView:
        return tuple.__new__(cls, values)


for _index, _name in enumerate(FIELDS):
    setattr(TupleView, _name, property(operator.itemgetter(_index)))


class Guarded:
    """The same slots, refusing assignment, built through ``object.__setattr__``."""

    __slots__ = FIELDS

    def __init__(self, *values: Any) -> None:
        for name, value in zip(FIELDS, values, strict=True):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(name)


def measure(n: int, repeat: int = 9) -> dict[str, dict[str, float]]:
    raw = ('{"url": "http://10.0.0.1:8000"}', "k=1", "")
    timing = Timing(1, 3000, None, False)
    ways: dict[str, Callable[[], Any]] = {
        "slotted": lambda: _build("e-1", "fresh", 12, "poller-a", 7, raw, timing, [False] * 3),
        "guarded": lambda: Guarded("e-1", "fresh", 12, "poller-a", 7, raw, timing, [False] * 3),
        "tuple": lambda: TupleView("e-1", "fresh", 12, "poller-a", 7, raw, timing, [False] * 3),
    }
    reads = {name: _reader(build()) for name, build in ways.items()}
    best: dict[str, list[float]] = {name: [float("inf")] * 2 for name in ways}
    for _ in range(repeat):  # the ways alternate, so a busy moment hits them alike
        for name, build in ways.items():
            best[name][0] = min(best[name][0], timeit.timeit(build, number=n) / n * 1e9)
            best[name][1] = min(best[name][1], timeit.timeit(reads[name], number=n) / n * 1e9)
    out = {
        name: {
            "build_ns": round(build_ns, 1),
            "read_4_fields_ns": round(read_ns, 1),
            "bytes": sys.getsizeof(ways[name]()),
        }
        for name, (build_ns, read_ns) in best.items()
    }
    base = out["tuple"]
    for row in out.values():
        row["build_x"] = round(row["build_ns"] / base["build_ns"], 2)
        row["read_x"] = round(row["read_4_fields_ns"] / base["read_4_fields_ns"], 2)
    return out


def _reader(record: Any) -> Callable[[], tuple[Any, ...]]:
    return lambda: (record.state, record.age_ms, record.timing, record.id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = measure(args.n)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    head = ("record", "build ns", "x tuple", "read 4 ns", "x tuple", "bytes")
    print("{:<8} {:>9} {:>8} {:>10} {:>8} {:>6}".format(*head))
    for name, row in out.items():
        print(f"{name:<8} {row['build_ns']:>9} {row['build_x']:>8} "
              f"{row['read_4_fields_ns']:>10} {row['read_x']:>8} {row['bytes']:>6}")  # fmt: skip


if __name__ == "__main__":
    main()
