"""The prefix benchmark's workloads: multi-turn conversations, with and without shared prefixes.

``prefix-heavy``: each conversation opens with one of a handful of long system prompts
(shared by every conversation that drew it), then a document of its own with the first
question; every later turn adds the previous answer and a new question, and its prompt is
the whole conversation so far. A think time (exponential) passes between an answer and
the next turn. ``no-prefix``: the same conversations, sizes and think times, but every
prompt opens with a tag of its own (conversation and turn), so no two prompts share even
their first block.

Everything comes from the seed: the same seed gives the same conversations (texts, sizes,
think times, start times), so every policy of a cell serves the same requests.
``best_hit_rate`` and ``capacity_per_s`` are the load rule of the benchmark (see
docs/performance.md, "The prefix bench"): the hit rate a fleet with one unbounded cache
would reach on the workload, and the requests per second a fleet serves at that hit rate.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from poller.errors import ConfigError
from poller_lab.sim.prefix import block_ids, prompt_tokens

__all__ = [
    "KINDS",
    "Conversation",
    "Shape",
    "Turn",
    "best_hit_rate",
    "capacity_per_s",
    "conversations",
    "render",
    "start_times",
]

KINDS = ("prefix-heavy", "no-prefix")
Message = dict[str, str]
_WORDS = (
    "the", "engine", "cache", "block", "prefix", "token", "model", "gateway", "replica",
    "request", "answer", "question", "document", "section", "figure", "table", "value",
    "latency", "queue", "memory", "router", "policy", "shared", "system", "prompt", "user",
    "turn", "think", "time", "first", "second", "third", "report", "result", "measure",
)  # fmt: skip


@dataclass(frozen=True)
class Shape:
    """Sizes in characters (about 4 a token) and seconds."""

    system_prompts: int = 4
    system_chars: int = 4000
    document_chars: int = 6000
    question_chars: int = 300
    min_turns: int = 3
    max_turns: int = 8
    #: Mean answer length in tokens (max_tokens of a turn, exponential, at least 8).
    answer_tokens: float = 48.0
    think_s: float = 2.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_turns <= self.max_turns:
            raise ConfigError(f"turns: need 1 <= min_turns <= max_turns, got {self}")
        for name in ("system_prompts", "system_chars", "document_chars", "question_chars"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if not (self.answer_tokens >= 1 and self.think_s >= 0):
            raise ConfigError("answer_tokens must be >= 1 and think_s >= 0")

    @property
    def mean_turns(self) -> float:
        return (self.min_turns + self.max_turns) / 2


@dataclass(frozen=True)
class Turn:
    #: The whole conversation so far, ending with this turn's question.
    messages: tuple[Message, ...]
    max_tokens: int
    #: Seconds between the previous turn's answer and this turn (0 for the first).
    think_s: float
    #: The answer the conversation carries on with (what the next turn's prompt holds).
    answer: str


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[Turn, ...]


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    n = 0
    while n <= chars:
        word = rng.choice(_WORDS)
        words.append(word)
        n += len(word) + 1
    return " ".join(words)[:chars]


def render(messages: Iterable[Mapping[str, Any]]) -> str:
    """The prompt an engine prefills for ``messages``: the simulator's rendering."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


def conversations(kind: str, n: int, seed: int, shape: Shape = Shape()) -> list[Conversation]:
    """``n`` conversations of workload ``kind``, the same for the same arguments."""
    if kind not in KINDS:
        raise ConfigError(f"unknown workload {kind!r}; known: {', '.join(KINDS)}")
    rng = random.Random(f"prefix-workload:{seed}")
    systems = [_text(rng, shape.system_chars) for _ in range(shape.system_prompts)]
    out = []
    for c in range(n):
        cid = f"c{seed}-{c}"
        system = rng.choice(systems)
        document = _text(rng, shape.document_chars)
        history: list[Message] = [{"role": "system", "content": system}]
        turns = []
        for t in range(rng.randint(shape.min_turns, shape.max_turns)):
            question = _text(rng, shape.question_chars)
            if t == 0:
                question = f"{document}\n\n{question}"
            history.append({"role": "user", "content": question})
            max_tokens = max(8, round(rng.expovariate(1 / shape.answer_tokens)))
            answer = _text(rng, 4 * max_tokens)
            messages = tuple(history)
            if kind == "no-prefix":
                # A tag first: nothing, not even the first block, is like any other prompt.
                tag = {"role": "system", "content": f"[{cid} turn {t}] {system}"}
                messages = (tag, *messages[1:])
            think = 0.0 if t == 0 else rng.expovariate(1 / shape.think_s) if shape.think_s else 0
            turns.append(Turn(messages, max_tokens, think, answer))
            history.append({"role": "assistant", "content": answer})
        out.append(Conversation(cid, tuple(turns)))
    return out


def start_times(n: int, rate_per_s: float, seed: int) -> list[float]:
    """Poisson start offsets (seconds) of ``n`` conversations at ``rate_per_s``."""
    if not (rate_per_s > 0 and math.isfinite(rate_per_s)):
        raise ConfigError(f"rate_per_s must be > 0, got {rate_per_s!r}")
    rng = random.Random(f"prefix-starts:{seed}")
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


def _uncached(convs: Sequence[Conversation]) -> list[tuple[int, int, int]]:
    """(prompt tokens, tokens one unbounded cache would hold, max_tokens) per request,
    conversations in order, turns in order."""
    seen: set[int] = set()
    out = []
    for conv in convs:
        for turn in conv.turns:
            prompt = render(turn.messages)
            ids = block_ids(prompt)
            tokens = prompt_tokens(prompt)
            hits = 0
            for block in ids:
                if block not in seen:
                    break
                hits += 1
            seen.update(ids)
            out.append((tokens, max(0, min(tokens - 1, 16 * hits)), turn.max_tokens))
    return out


def best_hit_rate(convs: Sequence[Conversation]) -> float:
    """The fleet's hit rate if every request found every block it ever could (one
    unbounded cache): the best any routing reaches on this workload."""
    rows = _uncached(convs)
    queries = sum(t for t, _, _ in rows)
    return sum(h for _, h, _ in rows) / queries if queries else 0.0


def capacity_per_s(
    convs: Sequence[Conversation],
    slots: int,
    prefill_tps: float,
    speed_tps: float,
) -> float:
    """Requests per second ``slots`` running slots serve at the best hit rate: each
    request holds a slot for its uncached prefill and its decode."""
    rows = _uncached(convs)
    if not rows:
        raise ConfigError("no requests in the workload")
    service = sum((t - h) / prefill_tps + m / speed_tps for t, h, m in rows) / len(rows)
    return slots / service
