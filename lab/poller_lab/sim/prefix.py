"""An engine's prefix cache: KV blocks of the prompts it has seen, in an LRU.

A prompt is text; a token is about 4 characters and a block holds 16 tokens (vLLM's block
size), so a block is 64 characters of prompt. A block's id is a hash of the prompt up to
the block's end (chained: the previous block's id and this block's text), so two prompts
share blocks exactly as far as they share a prefix, whole blocks only; a last partial
block is never cached, as in vLLM.

The cache holds at most ``capacity`` blocks (the engine's KV pool). A request looks its
prompt up when it is scheduled: the hits are the leading blocks present, stopping at the
first one missing. Its blocks are then stored, the prompt's head most recent: eviction
takes a chain's tail before its head (vLLM frees a finished request's blocks in reverse
order for the same reason), so a cached prefix never has holes.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["BLOCK_CHARS", "BLOCK_TOKENS", "PrefixCache", "block_ids", "prompt_tokens"]

#: Tokens per block (vLLM's default block size).
BLOCK_TOKENS = 16
#: Characters per block: 16 tokens of about 4 characters.
BLOCK_CHARS = 4 * BLOCK_TOKENS


def prompt_tokens(text: str) -> int:
    """A tokenizer-free estimate: about 4 characters per token, at least one."""
    return max(1, len(text) // 4)


def block_ids(text: str) -> list[int]:
    """The ids of the prompt's whole blocks, first to last."""
    ids: list[int] = []
    h = 0
    for start in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        h = hash((h, text[start : start + BLOCK_CHARS]))
        ids.append(h)
    return ids


class PrefixCache:
    """The blocks of one engine, least recently used first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"a prefix cache holds >= 0 blocks, got {capacity}")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def cached_blocks(self, ids: list[int]) -> int:
        """How many leading blocks of ``ids`` are cached (a look, no change)."""
        blocks = self._blocks
        n = 0
        for block in ids:
            if block not in blocks:
                break
            n += 1
        return n

    def cached_tokens(self, ids: list[int], tokens: int) -> int:
        """Tokens of a prompt (``tokens`` long, blocks ``ids``) found in the cache."""
        return min(tokens, self.cached_blocks(ids) * BLOCK_TOKENS)

    def store(self, ids: list[int]) -> int:
        """Look ``ids`` up, then keep them all, the first most recent; returns the hits
        in blocks. Least recently used blocks go when the cache is full."""
        hits = self.cached_blocks(ids)
        if self.capacity == 0:
            return hits
        blocks = self._blocks
        # A prompt longer than the whole pool keeps its head.
        for block in reversed(ids[: self.capacity]):
            if block in blocks:
                blocks.move_to_end(block)
            else:
                blocks[block] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
            self.evicted += 1
        return hits

    def clear(self) -> None:
        self._blocks.clear()
