"""Prompts as the blocks engines cache, and where the gateways sent them.

    blocks.py      a prompt's block ids (every process agrees on them), prompt_of
    table.py       BlockTable: block id -> the endpoints that could hold it, bounded
    placements.py  Placements: the table, with forks and the queue to share it
    outbox.py      the placements waiting to be shared, and their stream entry's format

It imports nothing of the exchange that carries the placements.
"""

from poller.reader.prefix.blocks import block_ids, prompt_of
from poller.reader.prefix.placements import Placements

__all__ = ["Placements", "block_ids", "prompt_of"]
