"""What a simulated endpoint is: ``EndpointSpec``, its validation, and ``fleet``."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from poller.errors import ConfigError
from poller.util.messages import closest
from poller_lab.sim.engines import ENGINES, SAFE_LABEL
from poller_lab.sim.model import LoadParams

__all__ = ["KV_BLOCKS_PER_SLOT", "KV_USAGE", "STYLES", "EndpointSpec", "fleet"]

STYLES = ("path", "port")
#: What the page's KV usage gauge counts (docs/simulator.md, "KV usage"): ``tokens``, the
#: running requests' tokens over the pool; ``occupancy``, ``kv_fill`` x the running share
#: of the slots, as a vLLM whose batch is bound by its KV pool shows; ``cached``, the same
#: plus the idle blocks the prefix cache holds, near 1.0 once the cache has filled.
KV_USAGE = ("tokens", "occupancy", "cached")
# The id is one path segment of a path-style URL (/e/<id>/metrics): no '/'.
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,99}")
#: KV blocks (16 tokens) per running slot: the bundled vLLM page's 28642 blocks for its
#: 256 slots, so an engine's KV capacity grows with its slots.
KV_BLOCKS_PER_SLOT = 28642 / 256
_ADAPTER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: The first endpoint's background load in a ``fleet`` built without one: none.
IDLE = 0.0


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    """One simulated engine endpoint.

    ``style="path"`` serves it under ``/e/<id>`` on the shared port (cheap: hundreds fit
    on one socket); ``"port"`` gives it a port of its own, so ``down`` can refuse
    connections. ``api_key`` guards the metrics path with a bearer token (llama.cpp's
    ``--api-key``; real vLLM leaves /metrics open). ``dp`` is the number of
    data-parallel ranks (vLLM ``engine``, SGLang ``dp_rank``); ``lora`` names vLLM
    adapters. ``capacity`` (running slots per rank) and ``load`` (offered load per
    capacity, 1.0 = full; > 1 builds a queue) default per engine and from the seed.
    ``kv_usage`` says what the page's KV usage counts (``KV_USAGE``), ``kv_fill`` the
    usage of a full batch under ``occupancy`` and ``cached``.
    """

    id: str
    engine: str = "vllm"
    style: str = "path"
    api_key: str | None = None
    dp: int = 1
    lora: tuple[str, ...] = ()
    model: str | None = None
    capacity: int | None = None
    load: float | None = None
    port: int = 0
    speed_tps: float = 30.0
    metrics_lag_s: float = 0.0
    prefill_tps: float | None = None
    kv_blocks: int | None = None
    kv_usage: str = "tokens"
    kv_fill: float = 0.9

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not _ID.fullmatch(self.id):
            raise ConfigError(f"invalid simulator endpoint id {self.id!r} (no '/', 1-100 chars)")
        if isinstance(self.lora, str):
            raise ConfigError(f"endpoint {self.id!r}: lora is a tuple of names, not a string")
        object.__setattr__(self, "lora", tuple(self.lora))  # a list from JSON is fine too
        problem = _engine_problem(self) or _number_problem(self) or _kv_problem(self)
        if problem:
            raise ConfigError(f"endpoint {self.id!r}: {problem}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EndpointSpec:
        """Build from JSON (the admin API); unknown keys are an error, not ignored."""
        if not isinstance(data, Mapping):
            raise ConfigError("an endpoint spec must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown endpoint spec keys {unknown}; accepted: {sorted(known)}")
        if "id" not in data:
            raise ConfigError("an endpoint spec needs an id")
        data = dict(data)
        for name in ("speed_tps", "prefill_tps", "kv_fill"):
            if isinstance(data.get(name), int) and not isinstance(data.get(name), bool):
                data[name] = float(data[name])
        if isinstance(data.get("lora"), str):  # "a,b" as on the command line
            data["lora"] = tuple(a for a in data["lora"].split(",") if a)
        try:
            return cls(**data)
        except TypeError as exc:  # e.g. lora given as a number
            raise ConfigError(f"endpoint {data.get('id')!r}: {exc}") from None

    def load_params(self, seed: int) -> LoadParams:
        """This endpoint's load shape: from the spec where given, else from the seed."""
        rng = random.Random(f"{seed}:{self.id}:params")
        engine = ENGINES[self.engine]
        capacity = self.capacity or engine.capacity
        return LoadParams(
            capacity=capacity,
            load=self.load if self.load is not None else rng.uniform(0.3, 0.9),
            service_s=rng.uniform(5.0, 12.0),
            period_s=rng.uniform(60.0, 300.0),
            phase=rng.uniform(0.0, 2 * math.pi),
            prompt_tokens=rng.randint(300, 2000),
            hit_ratio=rng.uniform(0.1, 0.7),
            kv_fill=rng.uniform(0.6, 0.95),
            kv_blocks=self.kv_blocks or max(1, round(capacity * KV_BLOCKS_PER_SLOT)),
            gen_tokens_per_s=self.speed_tps,
        )

    @property
    def served_model(self) -> str:
        """The model name requests must ask for (the one on the page)."""
        return self.model if self.model is not None else ENGINES[self.engine].model


def _unknown_engine(name: str) -> str:
    guess = closest(name, ENGINES)
    hint = f" (did you mean {guess!r}?)" if guess else ""
    return f"unknown engine {name!r}{hint}; accepted: {', '.join(ENGINES)}"


def _engine_problem(spec: EndpointSpec) -> str | None:
    engine = ENGINES.get(spec.engine)
    if engine is None:
        return _unknown_engine(spec.engine)
    if spec.style not in STYLES:
        return f"style must be 'path' or 'port', got {spec.style!r}"
    if spec.dp != 1 and engine.rank_label is None:
        return f"{spec.engine} has no data-parallel series (dp=1 only)"
    if spec.lora and not engine.lora:
        return "only vllm and vllm-v0 publish LoRA series"
    bad = [a for a in spec.lora if not isinstance(a, str) or not _ADAPTER.fullmatch(a)]
    if bad:
        return f"invalid LoRA adapter names {bad}"
    if spec.model is not None and not SAFE_LABEL.fullmatch(spec.model):
        return f"model name {spec.model!r} has unsupported characters"
    if spec.api_key is not None and (not isinstance(spec.api_key, str) or not spec.api_key):
        return "api_key must be a non-empty string"
    return None


def _number_problem(spec: EndpointSpec) -> str | None:
    def whole(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not whole(spec.dp) or not 1 <= spec.dp <= 64:
        return "dp must be an integer from 1 to 64"
    if spec.capacity is not None and not (whole(spec.capacity) and spec.capacity > 0):
        return "capacity must be a positive integer"
    load = spec.load
    if load is not None and not (
        isinstance(load, int | float) and not isinstance(load, bool) and 0 <= load < math.inf
    ):
        return "load must be a number >= 0"
    for name in ("speed_tps", "metrics_lag_s"):
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"{name} must be a number"
        if not (math.isfinite(value) and (value > 0 if name == "speed_tps" else value >= 0)):
            return f"{name} out of range: {value!r}"
    prefill = spec.prefill_tps
    if prefill is not None and (
        isinstance(prefill, bool)
        or not isinstance(prefill, int | float)
        or not (math.isfinite(prefill) and prefill > 0)
    ):
        return f"prefill_tps must be a number > 0 (tokens per second) or null, got {prefill!r}"
    if spec.kv_blocks is not None and not (whole(spec.kv_blocks) and spec.kv_blocks > 0):
        return "kv_blocks must be a positive integer"
    if not whole(spec.port) or not 0 <= spec.port < 65536:
        return "port must be 0 (any free port) or a port number"
    return None


def _kv_problem(spec: EndpointSpec) -> str | None:
    if spec.kv_usage not in KV_USAGE:
        return f"kv_usage must be one of {', '.join(KV_USAGE)}, got {spec.kv_usage!r}"
    fill = spec.kv_fill
    if isinstance(fill, bool) or not isinstance(fill, int | float) or not 0 < fill <= 1:
        return f"kv_fill must be a number in (0, 1], got {fill!r}"
    return None


def fleet(
    n: int,
    engines: Sequence[str] | str = ("vllm", "sglang", "llamacpp", "trtllm", "triton", "tgi"),
    style: str = "path",
    *,
    prefix: str = "",
    api_key: str | None = None,
    load: float | None = None,
    **common: Any,
) -> list[EndpointSpec]:
    """``n`` specs cycling through ``engines``: ids ``<prefix><engine>-<i>``.

    ``api_key`` guards the llama.cpp endpoints only (the engine whose /metrics honours
    one); ``common`` goes to every spec (e.g. ``dp=2`` needs engines that support it).
    ``load`` is every endpoint's background load; without it the first endpoint has
    none, so that a first request to it (a newcomer's ``curl``, a lone endpoint's) is
    answered at once, and the others get one from the seed.
    """
    names = engines.split(",") if isinstance(engines, str) else list(engines)
    if not names:
        raise ConfigError("engines: name at least one engine")
    unknown = [name for name in names if name not in ENGINES]
    if unknown:
        raise ConfigError(f"engines: {_unknown_engine(unknown[0])}")
    specs: Iterable[EndpointSpec] = (
        EndpointSpec(
            f"{prefix}{names[i % len(names)]}-{i}",
            names[i % len(names)],
            style,
            api_key=api_key if names[i % len(names)] == "llamacpp" else None,
            load=load if load is not None or i else IDLE,
            **common,
        )
        for i in range(n)
    )
    return list(specs)
