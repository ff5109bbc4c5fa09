"""The compact records of the view hashes and the update channel, decoded by hand.

A stats record is ``<scraped_at_ms> <interval_ms> <expires_at_ms> <poller> <token>|<JSON>``
and a failure record ``<at_ms> <expires_at_ms> <poller> <token>|<JSON>`` (docs/schema.md).
Only the header is read to judge a state; the JSON waits until a caller asks for the
stats. Updates on ``P:updates`` are ``stats <id> <seq> <record>``,
``failure <id> <count> <record>``, ``endpoints <rev>`` and ``released <id>``.
"""

from __future__ import annotations

from typing import NamedTuple

from poller.util.text import digits

__all__ = [
    "FAILURE_HEADER",
    "STATS_HEADER",
    "UPDATE_KINDS",
    "Update",
    "json_int",
    "parse_update",
    "split",
]

STATS_HEADER = 5  # scraped_at_ms interval_ms expires_at_ms poller token
FAILURE_HEADER = 4  # at_ms expires_at_ms poller token
#: The messages of P:updates, and the script that publishes each.
UPDATE_KINDS = {
    "stats": "write_stats",
    "failure": "write_failure",
    "endpoints": "registry",
    "released": "release",
}


def split(record: str | None, now_ms: int, fields: int) -> tuple[list[str], str] | None:
    """A record's header fields and JSON body; None if absent, expired (its expiry is
    not after ``now_ms``) or malformed."""
    if not record:
        return None
    head, sep, body = record.partition("|")
    parts = head.split(" ")
    numbers = parts[: fields - 2]  # ASCII digits (``digits``, inline: a snapshot's hot path)
    if not sep or len(parts) != fields or not all(p.isascii() and p.isdigit() for p in numbers):
        return None
    return (parts, body) if int(parts[fields - 3]) > now_ms else None


def written_ms(record: str) -> int:
    """The Redis time of the write (the header's first field), -1 if malformed."""
    first = record[: record.find(" ")]
    return int(first) if digits(first) else -1


def json_int(record: str, name: str) -> int | None:
    """An integer field of the record's JSON without decoding it: the writer (cjson)
    writes every value as a string, ``"name":"123"``."""
    at = record.find(f'"{name}":"', record.find("|"))
    if at < 0:
        return None
    start = at + len(name) + 4
    value = record[start : record.find('"', start)]
    return int(value) if digits(value) else None


class Update(NamedTuple):
    """One message of ``P:updates``; ``seq`` is the stats seq or the failure count."""

    kind: str  # stats, failure, endpoints, released
    endpoint_id: str  # the revision for "endpoints"
    seq: int
    record: str


def parse_update(data: str) -> Update | None:
    """None for a message this reader does not know (a later writer may add kinds)."""
    kind, _, rest = data.partition(" ")
    if kind not in UPDATE_KINDS:
        return None
    if kind in ("stats", "failure"):
        endpoint_id, _, rest = rest.partition(" ")
        seq, _, record = rest.partition(" ")
        if not endpoint_id or not digits(seq) or "|" not in record:
            return None
        return Update(kind, endpoint_id, int(seq), record)
    return Update(kind, rest, 0, "") if rest else None
