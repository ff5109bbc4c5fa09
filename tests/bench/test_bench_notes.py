"""What a benchmark says when it misses its own targets: on a busy machine, that the
machine missed them (a loaded 2-core machine printed a bare MISS)."""

from __future__ import annotations

from tests.bench.bench_reader import miss_note

ROWS = [
    {"name": "snapshot (1000 endpoints)", "ok": True},
    {"name": "event -> cache (write start to seq seen)", "ok": False},
    {"name": "  write_stats round trip (writer process)"},
]


def test_a_miss_on_a_busy_machine_is_said_to_be_the_machines() -> None:
    [_, note] = miss_note(ROWS, "3.10 2.00 1.50", 2)
    assert note.startswith("MISS (event -> cache (write start to seq seen)): the targets are ")
    assert "busy (load average 3.10 on 2 usable cores" in note
    assert "the machine missed them, not the reader" in note


def test_a_miss_on_a_quiet_machine_is_worth_a_look_and_no_miss_says_nothing() -> None:
    [_, note] = miss_note(ROWS, "0.40 0.30 0.20", 2)
    assert "not busy (load average 0.40 on 2 usable cores): worth a look" in note
    assert miss_note(ROWS[:1], "3.10 2.00 1.50", 2) == []
