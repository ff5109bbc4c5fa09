"""The simulated load of one engine endpoint: lazy, deterministic, cheap when idle.

Time is cut into fixed steps of ``STEP_S`` simulated seconds. The state after step ``k``
depends only on the seed, the endpoint id and ``k``, never on when (or how often) it is
looked at: ``advance_to(now)`` runs the steps between the last look and ``now``. No timer
runs per endpoint, so an endpoint nobody scrapes costs nothing until the next request.

Each data-parallel rank is its own little queue: requests arrive (Poisson, around a rate
that swings slowly with a sine), start when a running slot is free (otherwise they wait),
and finish after an exponential service time. KV usage follows the running count; the
counters (prompt tokens, prefix hits/queries, successes) only grow, until ``restart``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

__all__ = ["STEP_S", "EndpointLoad", "LoadParams", "RankState"]

#: Simulated seconds per step: finer than any sane scrape interval, coarse enough that a
#: 10-minute catch-up is a few thousand cheap steps.
STEP_S = 0.25
#: Longer gaps are fast-forwarded with expected counter increments instead of simulated
#: step by step, so a request after an hour of idleness stays cheap.
MAX_CATCHUP_STEPS = 2400
#: The running adapter set changes this often (in steps); old combinations linger as series.
LORA_CHANGE_STEPS = 20


@dataclass(frozen=True, slots=True)
class LoadParams:
    capacity: int  # running slots per rank (vLLM max_num_seqs, llama.cpp --parallel)
    load: float  # offered load / capacity, averaged over the sine (1.0 = full)
    service_s: float = 8.0  # mean request duration
    period_s: float = 120.0  # period of the load swing
    phase: float = 0.0
    prompt_tokens: int = 900  # mean prompt length
    gen_tokens_per_s: float = 30.0  # per running request
    hit_ratio: float = 0.4  # mean share of prompt tokens found in the prefix cache
    kv_fill: float = 0.85  # KV usage when every slot is busy
    kv_blocks: int = 28642  # blocks (vLLM/TRT-LLM) or tokens/16 (SGLang) in the pool


@dataclass(slots=True)
class RankState:
    """One data-parallel rank's gauges and counters; page templates read these fields."""

    max_tokens: int
    capacity: int
    running: int = 0
    waiting: int = 0
    kv: float = 0.0
    admitted: int = 0  # requests ever started (also the arrivals counter)
    prompt_tokens: int = 0
    gen_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    success_stop: int = 0
    success_length: int = 0
    preemptions: int = 0
    decodes: int = 0  # llama_decode calls / engine iterations
    busy_slots: int = 0  # sum of running over decodes (llama.cpp's busy-slots ratio)
    batch_hit_rate: float = 0.0  # the last prefill batch's hit rate (SGLang, V0 gauges)
    prompt_tps: float = 0.0
    gen_tps: float = 0.0
    sleep_level: int = 0  # vLLM sleep mode: 0 awake, 1 weights offloaded, 2 all discarded

    @property
    def awake(self) -> int:
        return int(self.sleep_level == 0)

    @property
    def weights_offloaded(self) -> int:
        return int(self.sleep_level == 1)

    @property
    def discard_all(self) -> int:
        return int(self.sleep_level == 2)

    @property
    def success(self) -> int:
        return self.success_stop + self.success_length

    @property
    def active(self) -> int:
        return self.running + self.waiting

    @property
    def kv_used_tokens(self) -> int:
        return round(self.kv * self.max_tokens)

    @property
    def kv_max_blocks(self) -> int:
        return self.max_tokens // 16

    @property
    def kv_used_blocks(self) -> int:
        return round(self.kv * self.kv_max_blocks)

    @property
    def kv_free_blocks(self) -> int:
        return self.kv_max_blocks - self.kv_used_blocks

    @property
    def reused_blocks(self) -> int:
        return self.prefix_hits // 16

    @property
    def missed_blocks(self) -> int:
        return (self.prefix_queries - self.prefix_hits) // 16

    @property
    def busy_per_decode(self) -> float:
        # llama.cpp divides by n_decode_total and prints -nan before the first decode.
        return self.busy_slots / self.decodes if self.decodes else math.nan

    @property
    def prompt_seconds(self) -> float:
        return round(self.prompt_tokens / 2500.0, 3)

    @property
    def gen_seconds(self) -> float:
        return round(self.gen_tokens / 45.0, 3)


def _poisson(rng: random.Random, mean: float) -> int:
    if mean <= 0:
        return 0
    if mean > 30:  # normal approximation; Knuth's loop would take `mean` iterations
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, product = math.exp(-mean), 0, rng.random()
    while product > limit:
        k += 1
        product *= rng.random()
    return k


@dataclass(slots=True)
class EndpointLoad:
    """The load of one endpoint (``ranks`` independent queues) from simulated time ``t0``."""

    params: LoadParams
    seed: str
    t0: float
    ranks: int = 1
    lora: tuple[str, ...] = ()
    step: int = 0
    restarts: int = 0
    #: Simulated time of the last (re)start: process_start_time and ``_created`` values.
    started_at: float = 0.0
    states: list[RankState] = field(default_factory=list)
    #: (running adapters, waiting adapters) -> simulated time it was last current.
    lora_seen: dict[tuple[str, str], float] = field(default_factory=dict)
    _rngs: list[random.Random] = field(default_factory=list)
    _lora_now: tuple[str, str] = ("", "")

    def __post_init__(self) -> None:
        self.started_at = self.t0
        self._reset()

    def _reset(self) -> None:
        tokens = self.params.kv_blocks * 16
        self.states = [
            RankState(max_tokens=tokens, capacity=self.params.capacity) for _ in range(self.ranks)
        ]
        # A string seed is hashed with SHA-512 by random.Random: stable across processes,
        # unlike hash(), which PYTHONHASHSEED randomises.
        self._rngs = [random.Random(f"{self.seed}:{self.restarts}:{r}") for r in range(self.ranks)]
        self.lora_seen = {}
        self._lora_now = ("", "")

    def restart(self, now: float) -> None:
        """An engine restart: counters and queues back to zero, LoRA history forgotten."""
        self.advance_to(now)
        self.restarts += 1
        self.started_at = self.t0 + self.step * STEP_S
        self._reset()

    def advance_to(self, now: float) -> int:
        """Run the steps up to ``now`` (simulated seconds); returns the current step."""
        target = max(0, math.floor((now - self.t0) / STEP_S))
        gap = target - self.step
        if gap <= 0:
            return self.step
        if gap > MAX_CATCHUP_STEPS:
            self._fast_forward(gap - MAX_CATCHUP_STEPS)
        while self.step < target:
            self.step += 1
            t = self.step * STEP_S
            rate = self._rate(t)
            for state, rng in zip(self.states, self._rngs, strict=True):
                self._step(state, rng, rate)
            if self.lora:
                self._step_lora()
        return self.step

    def _rate(self, t: float) -> float:
        """Arrivals per second per rank at simulated time ``t`` (a slow sine swing)."""
        p = self.params
        swing = 1.0 + 0.5 * math.sin(2 * math.pi * t / p.period_s + p.phase)
        return p.load * p.capacity / p.service_s * swing

    def _step(self, s: RankState, rng: random.Random, rate: float) -> None:
        p = self.params
        done = min(s.running, _poisson(rng, s.running * STEP_S / p.service_s))
        s.running -= done
        length = sum(1 for _ in range(done) if rng.random() < 0.22)
        s.success_length += length
        s.success_stop += done - length
        s.waiting += _poisson(rng, rate * STEP_S)
        admit = min(s.waiting, p.capacity - s.running)
        s.running += admit
        s.waiting -= admit
        s.admitted += admit
        prompt = round(admit * p.prompt_tokens * rng.uniform(0.5, 1.5))
        hits = round(prompt * min(0.95, max(0.0, rng.gauss(p.hit_ratio, 0.08))))
        s.prompt_tokens += prompt
        s.prefix_queries += prompt
        s.prefix_hits += hits
        if prompt:
            s.batch_hit_rate = hits / prompt
        generated = round(s.running * p.gen_tokens_per_s * STEP_S * rng.uniform(0.8, 1.2))
        s.gen_tokens += generated
        s.prompt_tps, s.gen_tps = prompt / STEP_S, generated / STEP_S
        if s.running:
            calls = round(p.gen_tokens_per_s * STEP_S)
            s.decodes += calls
            s.busy_slots += calls * s.running
        # KV usage chases its target (blocks are freed and allocated over a few steps).
        target = s.running / p.capacity * p.kv_fill + min(s.waiting, p.capacity) * 0.0005
        kv = s.kv + 0.6 * (target - s.kv) + rng.gauss(0.0, 0.004)
        s.kv = round(min(1.0, max(0.0, kv)), 4) if s.running else 0.0
        if s.kv > 0.97 and s.waiting and rng.random() < 0.3:
            s.preemptions += 1

    def _step_lora(self) -> None:
        if self.step % LORA_CHANGE_STEPS == 1 or self._lora_now not in self.lora_seen:
            rng = self._rngs[0]
            running = sum(s.running for s in self.states)
            waiting = sum(s.waiting for s in self.states)
            on = [a for a in self.lora if running and rng.random() < 0.6]
            queued = [a for a in self.lora if waiting and a not in on and rng.random() < 0.5]
            self._lora_now = (",".join(on), ",".join(queued))
        # vLLM calls set_to_current_time() on the current combination at every log step.
        self.lora_seen[self._lora_now] = self.t0 + self.step * STEP_S

    def _fast_forward(self, steps: int) -> None:
        """Skip ``steps`` steps: counters grow by their expected amounts, queues stay."""
        p = self.params
        self.step += steps
        seconds = steps * STEP_S
        for s in self.states:
            admitted = round(p.load * p.capacity / p.service_s * seconds)
            prompt = admitted * p.prompt_tokens
            finished = admitted
            s.admitted += admitted
            s.prompt_tokens += prompt
            s.prefix_queries += prompt
            s.prefix_hits += round(prompt * p.hit_ratio)
            s.success_length += round(finished * 0.22)
            s.success_stop += finished - round(finished * 0.22)
            s.gen_tokens += round(s.running * p.gen_tokens_per_s * seconds)
            if s.running:
                calls = round(p.gen_tokens_per_s * seconds)
                s.decodes += calls
                s.busy_slots += calls * s.running
