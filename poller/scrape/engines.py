"""Per-engine metric mappings: which series carry which load signal, and how to fold them.

Each signal lists its candidate sources in order of preference; the first one present on
the page wins (engine versions renamed metrics, and old names linger on some versions).
Aggregation follows DESIGN.md: counts are summed over series (vLLM's ``engine`` label
under data parallelism, SGLang's ``tp_rank``/``dp_rank``), usage takes the max, and
``vllm:lora_requests_info`` takes the series with the largest value (a timestamp).
NaN and negative sentinels (vLLM V0's -1 hit rate with prefix caching off) are absent,
never numbers. Sources for every name: docs/engines.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from poller.errors import ConfigError, ContractError, ParseError
from poller.registry import ENGINES
from poller.scrape.parse import Sample, Selector, decode_body, looks_like_exposition, parse
from poller.stats import Signals

__all__ = ["ENGINE_SPECS", "EngineMapping", "Metric", "mapping_for"]


@dataclass(frozen=True, slots=True)
class Metric:
    """One source: a sample name, optionally narrowed by label values (Triton)."""

    name: str
    where: tuple[tuple[str, str], ...] = ()

    def matches(self, sample: Sample) -> bool:
        return all(sample.labels.get(k) == v for k, v in self.where)

    def __str__(self) -> str:
        if not self.where:
            return self.name
        return self.name + "{" + ",".join(f'{k}="{v}"' for k, v in self.where) + "}"


@dataclass(frozen=True, slots=True)
class Ratio:
    """A fraction computed from two gauges (used / total) when no ratio is published."""

    used: Metric
    total: Metric

    def __str__(self) -> str:
        return f"{self.used}/{self.total}"


Source = Metric | Ratio


def _m(*names: str) -> tuple[Metric, ...]:
    return tuple(Metric(n) for n in names)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    name: str
    metrics_path: str = "/metrics"
    running: tuple[Metric, ...] = ()
    waiting: tuple[Metric, ...] = ()
    kv_cache_usage: tuple[Source, ...] = ()
    #: The engine's own hit-rate gauge (used when no counter pair is on the page).
    prefix_cache_hit_rate: tuple[Metric, ...] = ()
    #: (hits, queries) cumulative counter pairs, preferred over the gauge.
    prefix_cache_counters: tuple[tuple[Metric, Metric], ...] = ()
    #: SGLang creates its hits counter only at the first hit: absent may mean zero.
    hits_absent_is_zero: bool = False
    lora: Metric | None = None
    model_labels: tuple[str, ...] = ()
    required: frozenset[str] = frozenset({"running", "waiting", "kv_cache_usage"})
    scraped: bool = True


ENGINE_SPECS: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec(
            "vllm",
            running=_m("vllm:num_requests_running"),
            waiting=_m("vllm:num_requests_waiting"),
            # kv_cache_usage_perc since 0.9.2; gpu_cache_usage_perc before (removed 0.12).
            # Both are 0..1 fractions despite "perc".
            kv_cache_usage=_m("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
            prefix_cache_hit_rate=_m("vllm:gpu_prefix_cache_hit_rate"),  # V0; -1 = off
            prefix_cache_counters=(
                (Metric("vllm:prefix_cache_hits_total"), Metric("vllm:prefix_cache_queries_total")),
                (
                    Metric("vllm:gpu_prefix_cache_hits_total"),
                    Metric("vllm:gpu_prefix_cache_queries_total"),
                ),
            ),
            lora=Metric("vllm:lora_requests_info"),
            model_labels=("model_name",),
        ),
        EngineSpec(
            "sglang",
            # sgl-router's /engine_metrics rewrites ':' to '_': accept both spellings.
            running=_m("sglang:num_running_reqs", "sglang_num_running_reqs"),
            waiting=_m("sglang:num_queue_reqs", "sglang_num_queue_reqs"),
            kv_cache_usage=(
                *_m("sglang:token_usage", "sglang_token_usage"),
                Ratio(Metric("sglang:num_used_tokens"), Metric("sglang:max_total_num_tokens")),
            ),
            # cache_hit_rate is the last prefill batch's only; counters are better.
            prefix_cache_hit_rate=_m("sglang:cache_hit_rate", "sglang_cache_hit_rate"),
            prefix_cache_counters=(
                (Metric("sglang:cached_tokens_total"), Metric("sglang:prompt_tokens_total")),
                (Metric("sglang_cached_tokens_total"), Metric("sglang_prompt_tokens_total")),
            ),
            hits_absent_is_zero=True,
            model_labels=("model_name", "name"),
        ),
        EngineSpec(
            "llamacpp",
            running=_m("llamacpp:requests_processing"),
            waiting=_m("llamacpp:requests_deferred"),
            # Removed upstream by llama.cpp PR #13660 with no replacement: optional.
            kv_cache_usage=_m("llamacpp:kv_cache_usage_ratio"),
            required=frozenset({"running", "waiting"}),
        ),
        EngineSpec(
            "trtllm",
            metrics_path="/prometheus/metrics",
            # trtllm_-prefixed since about 1.2; the unprefixed names are the same series.
            running=_m("trtllm_num_requests_running", "num_requests_running"),
            waiting=_m("trtllm_num_requests_waiting", "num_requests_waiting"),
            kv_cache_usage=(
                *_m("trtllm_kv_cache_utilization", "kv_cache_utilization"),
                Ratio(Metric("trtllm_kv_cache_used_blocks"), Metric("trtllm_kv_cache_max_blocks")),
            ),
            prefix_cache_hit_rate=_m("trtllm_kv_cache_hit_rate", "kv_cache_hit_rate"),
            prefix_cache_counters=(
                (
                    Metric("trtllm_prompt_cached_tokens_total"),
                    Metric("trtllm_prompt_tokens_total"),
                ),
            ),
            model_labels=("model_name",),
        ),
        EngineSpec(
            "triton",
            running=(Metric("nv_trt_llm_request_metrics", (("request_type", "scheduled"),)),),
            waiting=(
                Metric("nv_trt_llm_request_metrics", (("request_type", "waiting"),)),
                Metric("nv_inference_pending_request_count"),  # backends without "waiting"
            ),
            kv_cache_usage=(
                Metric("nv_trt_llm_kv_cache_block_metrics", (("kv_cache_block_type", "fraction"),)),
                Ratio(
                    Metric("nv_trt_llm_kv_cache_block_metrics", (("kv_cache_block_type", "used"),)),
                    Metric("nv_trt_llm_kv_cache_block_metrics", (("kv_cache_block_type", "max"),)),
                ),
            ),
            model_labels=("model",),
        ),
        EngineSpec(
            "tgi",
            running=_m("tgi_batch_current_size"),
            waiting=_m("tgi_queue_size"),
            required=frozenset({"running", "waiting"}),  # TGI publishes no KV usage
        ),
        EngineSpec("external", scraped=False, required=frozenset()),
    )
}
assert tuple(ENGINE_SPECS) == ENGINES, "registry.ENGINES and ENGINE_SPECS must agree"

# Values that are placeholders, not model names (trtllm-serve writes "undefined").
_NOT_A_MODEL = frozenset({"", "undefined", "unknown"})


# Larger values are not counts or fractions an engine could mean (and 2**53 is where
# floats stop being exact integers, which readers in other languages rely on).
_MAX_VALUE = float(2**53)


def _values(samples: Sequence[Sample], metric: Metric) -> list[float]:
    """Usable values of one source: NaN, infinities, negative sentinels and absurdly
    large numbers dropped."""
    return [
        s.value
        for s in samples
        if s.name == metric.name and metric.matches(s) and 0 <= s.value < _MAX_VALUE
    ]


def _dedupe(samples: Sequence[Sample]) -> list[Sample]:
    """One sample per series (the last one written): a page listing a series twice
    must not count it twice."""
    seen: dict[tuple[str, tuple[tuple[str, str], ...]], Sample] = {}
    for sample in samples:
        seen[(sample.name, tuple(sorted(sample.labels.items())))] = sample
    return list(seen.values()) if len(seen) < len(samples) else list(samples)


@dataclass(frozen=True)
class EngineMapping:
    """A spec with an endpoint's overrides applied; knows which names to parse."""

    spec: EngineSpec
    running: tuple[Metric, ...]
    waiting: tuple[Metric, ...]
    kv_cache_usage: tuple[Source, ...]
    prefix_cache_hit_rate: tuple[Metric, ...]
    prefix_cache_counters: tuple[tuple[Metric, Metric], ...]
    lora: Metric | None
    wanted: frozenset[str] = field(init=False)
    selector: Selector = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names: set[str] = set()
        for source in (
            *self.running,
            *self.waiting,
            *self.kv_cache_usage,
            *self.prefix_cache_hit_rate,
            *(m for pair in self.prefix_cache_counters for m in pair),
            *((self.lora,) if self.lora else ()),
        ):
            if isinstance(source, Ratio):
                names.update((source.used.name, source.total.name))
            else:
                names.add(source.name)
        object.__setattr__(self, "wanted", frozenset(names))
        object.__setattr__(self, "selector", Selector(names))

    @property
    def engine(self) -> str:
        return self.spec.name

    @property
    def metrics_path(self) -> str:
        return self.spec.metrics_path

    def read(self, body: bytes, content_type: str = "", max_samples: int | None = None) -> Signals:
        """Body of a /metrics response -> Signals; ParseError or ContractError on failure
        (``too_large`` ScrapeError past ``max_samples`` wanted samples)."""
        if "json" in content_type.lower():
            raise ParseError(
                f"got {content_type.split(';')[0]}, not Prometheus text "
                "(trtllm-serve serves Prometheus text at /prometheus/metrics)"
            )
        text = decode_body(body)
        if not looks_like_exposition(text):
            first = text.lstrip()[:60]
            raise ParseError("body is not Prometheus text exposition", line=1, excerpt=first)
        return self.extract(parse(text, self.selector, max_samples))

    def extract(self, samples: Sequence[Sample]) -> Signals:
        """Fold parsed samples into Signals; ContractError lists every missing signal."""
        samples = _dedupe(samples)
        sources: dict[str, str] = {}
        missing: list[str] = []

        def pick(signal: str, candidates: Iterable[Source], fold: str) -> float | None:
            for source in candidates:
                value = self._fold(samples, source, fold)
                if value is not None:
                    sources[signal] = str(source)
                    return value
            if signal in self.spec.required:
                missing.append("|".join(str(c) for c in candidates))
            return None

        running = pick("running", self.running, "sum")
        waiting = pick("waiting", self.waiting, "sum")
        kv = pick("kv_cache_usage", self.kv_cache_usage, "max")
        if missing:
            raise ContractError(missing, engine=self.engine)
        gauge = pick("prefix_cache_hit_rate", self.prefix_cache_hit_rate, "mean")
        hits, queries = self._counters(samples, sources, gauge_present=gauge is not None)
        if hits is not None:
            gauge = None  # counters give a windowed rate; the gauge is then not used
        lora_running, lora_waiting, lora_max = self._lora(samples, sources)
        assert running is not None and waiting is not None
        return Signals(
            engine=self.engine,
            running=round(running),
            waiting=round(waiting),
            kv_cache_usage=None if kv is None else min(kv, 1.0),
            prefix_cache_hit_rate=None if gauge is None else min(gauge, 1.0),
            prefix_cache_hits_total=hits,
            prefix_cache_queries_total=queries,
            lora_running=lora_running,
            lora_waiting=lora_waiting,
            lora_max=lora_max,
            models=self._models(samples),
            sources=sources,
        )

    @staticmethod
    def _fold(samples: Sequence[Sample], source: Source, fold: str) -> float | None:
        if isinstance(source, Ratio):
            used, total = _values(samples, source.used), _values(samples, source.total)
            if not used or not total or sum(total) <= 0:
                return None
            return sum(used) / sum(total)
        values = _values(samples, source)
        if not values:
            return None
        if fold == "sum":
            return sum(values)
        if fold == "max":
            return max(values)
        return sum(values) / len(values)

    def _counters(
        self, samples: Sequence[Sample], sources: dict[str, str], gauge_present: bool
    ) -> tuple[float | None, float | None]:
        # SGLang creates its hits counter at the first hit, but versions without the
        # counter at all (0.4) publish only the gauge: absent hits mean zero only when
        # there is no gauge to fall back on.
        absent_is_zero = self.spec.hits_absent_is_zero and not gauge_present
        for hits_m, queries_m in self.prefix_cache_counters:
            queries = _values(samples, queries_m)
            hits = _values(samples, hits_m)
            if queries and (hits or absent_is_zero):
                sources["prefix_cache_hit_rate"] = f"{hits_m}/{queries_m}"
                return sum(hits), sum(queries)
        return None, None

    def _lora(
        self, samples: Sequence[Sample], sources: dict[str, str]
    ) -> tuple[tuple[str, ...], tuple[str, ...], int | None]:
        if self.lora is None:
            return (), (), None
        series = [s for s in samples if s.name == self.lora.name and not math.isnan(s.value)]
        if not series:
            return (), (), None
        # Every adapter combination ever seen lingers as a series; the newest is the max.
        latest = max(series, key=lambda s: s.value)
        sources["lora"] = self.lora.name

        def names(label: str) -> tuple[str, ...]:
            return tuple(a for a in latest.labels.get(label, "").split(",") if a)

        max_lora = latest.labels.get("max_lora", "")
        return (
            names("running_lora_adapters"),
            names("waiting_lora_adapters"),
            int(max_lora) if max_lora.isascii() and max_lora.isdigit() else None,
        )

    def _models(self, samples: Sequence[Sample]) -> tuple[str, ...]:
        found: set[str] = set()
        for label in self.spec.model_labels:
            for s in samples:
                value = s.labels.get(label)
                if value is not None and value not in _NOT_A_MODEL:
                    found.add(value)
            if found:
                break
        return tuple(sorted(found))


@lru_cache(maxsize=256)
def _mapping(engine: str, overrides: tuple[tuple[str, tuple[str, ...]], ...]) -> EngineMapping:
    spec = ENGINE_SPECS[engine]
    o = dict(overrides)
    counters = spec.prefix_cache_counters
    if "prefix_cache_hits" in o or "prefix_cache_queries" in o:
        default_hits, default_queries = counters[0] if counters else (None, None)
        hits = o.get("prefix_cache_hits") or ((default_hits.name,) if default_hits else ())
        queries = o.get("prefix_cache_queries") or (
            (default_queries.name,) if default_queries else ()
        )
        if not hits or not queries:
            raise ConfigError(
                f"{engine} has no prefix-cache counters: override both prefix_cache_hits "
                "and prefix_cache_queries",
                field="overrides",
            )
        counters = ((Metric(hits[0]), Metric(queries[0])),)
    return EngineMapping(
        spec=spec,
        running=_m(*o["running"]) if "running" in o else spec.running,
        waiting=_m(*o["waiting"]) if "waiting" in o else spec.waiting,
        kv_cache_usage=_m(*o["kv_cache_usage"]) if "kv_cache_usage" in o else spec.kv_cache_usage,
        prefix_cache_hit_rate=_m(*o["prefix_cache_hit_rate"])
        if "prefix_cache_hit_rate" in o
        else spec.prefix_cache_hit_rate,
        prefix_cache_counters=counters,
        lora=Metric(o["lora"][0]) if "lora" in o else spec.lora,
    )


def mapping_for(engine: str, overrides: Mapping[str, Sequence[str]] | None = None) -> EngineMapping:
    """The (cached) mapping for an engine with an endpoint's name overrides applied.

    An override replaces that signal's candidate names (an operator's fix for a metric
    an engine version renamed); ``prefix_cache_hits``/``_queries`` replace the counters.
    """
    if engine not in ENGINE_SPECS:
        raise KeyError(f"unknown engine {engine!r}; accepted: {', '.join(ENGINE_SPECS)}")
    frozen = tuple(sorted((k, tuple(v)) for k, v in (overrides or {}).items()))
    return _mapping(engine, frozen)
