"""A prompt as the blocks an engine's prefix cache keeps: ids every process agrees on.

Engines cache a prompt's KV in fixed blocks (vLLM: 16 tokens), each identified by a hash
of the whole prompt up to its end, so two prompts share blocks exactly as far as they
share a prefix. The picker works on text, not tokens: ``BLOCK_BYTES`` of the prompt's
UTF-8 (128 tokens of about 4 bytes) make a block. A block's id is 64 bits: the CRC-32
(zlib's, IEEE) of the bytes from the start of the prompt to the block's end in the high
half, their Adler-32 in the low half, both seeded with the model's name and a NUL
(docs/schema.md gives the rule for other languages). The two running checksums cost one
pass over the text: ~5 us for a 4,000-character prompt. A block's id depends on the
bytes before its end only, so two block sizes agree wherever their blocks end together.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["BLOCK_BYTES", "BYTES_PER_TOKEN", "MAX_PROMPT_BLOCKS", "block_ids", "prompt_of"]

#: Bytes of text per token, about (English text; the engines' tokenizers vary).
BYTES_PER_TOKEN = 4
#: Bytes of prompt per block: 128 tokens, 8 of vLLM's 16-token blocks. A router needs
#: no finer grain (which engine holds more of a prompt is told as well in steps of 128
#: tokens as of 16; a shared prefix shorter than a block saves little prefill), and the
#: pick's cost is per block: 7 blocks for a 4,000-character prompt.
BLOCK_BYTES = 512
#: Blocks of one prompt looked at (4 MiB of text, beyond any context window).
MAX_PROMPT_BLOCKS = 8192
_MAX_BYTES = MAX_PROMPT_BLOCKS * BLOCK_BYTES


def block_ids(prompt: str, model: str | None = None) -> list[int]:
    """The id of each full block of ``prompt`` (a trailing part block is not cached by
    an engine and has none), at most ``MAX_PROMPT_BLOCKS``. ``model``: a cache is per model
    (and per LoRA adapter), so the ids are too."""
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str (the text to prefill), got {type(prompt).__name__}")
    # No more characters than the bytes looked at (a character is 1 to 4 of them): a
    # huge prompt is not encoded whole for its first blocks.
    data = prompt[:_MAX_BYTES].encode("utf-8", "surrogatepass")
    seed = b"" if not model else model.encode("utf-8", "surrogatepass") + b"\0"
    crc, adler = zlib.crc32(seed), zlib.adler32(seed)
    crc32, adler32 = zlib.crc32, zlib.adler32
    end = min(len(data), _MAX_BYTES) // BLOCK_BYTES * BLOCK_BYTES
    ids: list[int] = []
    add = ids.append
    for at in range(BLOCK_BYTES, end + 1, BLOCK_BYTES):
        block = data[at - BLOCK_BYTES : at]
        crc = crc32(block, crc)
        adler = adler32(block, adler)
        add(crc << 32 | adler)
    return ids


def prompt_of(messages: Iterable[Mapping[str, Any]]) -> str:
    """OpenAI-style chat ``messages`` as one text, in order: each message is
    ``"<|" + role + "|>\\n" + its text + "\\n"``; its text is ``content`` when a string,
    the ``text`` of its ``{"type": "text"}`` parts joined by newlines when a list (other
    parts, images, are left out), empty when None. A conversation's messages at one turn
    render to a prefix of the next turn's text, as an engine's chat template does.

    Raises ``TypeError`` for anything else (a message that is not a mapping, a content
    that is neither a string, a list of parts nor None)."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Iterable):
        raise TypeError(
            f"messages must be a list of {{'role', 'content'}} mappings, "
            f"got {type(messages).__name__}"
        )
    out: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{i}] must be a mapping, got {type(message).__name__}")
        out.append(f"<|{message.get('role') or ''}|>\n{_text(message.get('content'), i)}\n")
    return "".join(out)


def _text(content: object, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list | tuple):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type") == "text":
                texts.append(str(part.get("text") or ""))
        return "\n".join(texts)
    raise TypeError(
        f"messages[{i}]['content'] must be a string, a list of parts or None, "
        f"got {type(content).__name__}"
    )
