"""Per-engine mappings applied to a page: which series carry which signal, folded how.

The names and fold rules per engine live in ``specs.py``. Here a spec gets an endpoint's
(and the settings') overrides and reads a page: counts are summed over engines (vLLM's
and LMDeploy's ``engine``, SGLang's ``dp_rank``) but not over ranks that repeat one batch
(SGLang's ``tp_rank``/``pp_rank``/``moe_ep_rank``: max) or over a breakdown of a total
(SGLang's ``priority``: the total only); usage takes the max, and vLLM's LoRA info
the newest series and those within ``LORA_RECENT_S`` of it (one per data-parallel engine).
NaN and negative sentinels (vLLM V0's -1 hit rate with prefix caching off) are absent,
never numbers. Sources for every name: docs/engines.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

from poller.errors import ConfigError, ContractError, ParseError, ScrapeError
from poller.schema.endpoint import Endpoint
from poller.schema.stats import Signals
from poller.scrape import sizing
from poller.scrape.parse import Sample, Selector, decode_body, looks_like_exposition, parse
from poller.scrape.specs import ENGINE_SPECS, LORA_RECENT_S, EngineSpec, Metric, Ratio, Source
from poller.util.text import digits

if TYPE_CHECKING:
    from poller.config import ScrapeSettings

__all__ = [
    "ENGINE_SPECS",
    "EngineMapping",
    "EngineSpec",
    "Metric",
    "Ratio",
    "mapping_for",
    "mapping_for_endpoint",
    "page_engines",
]


# Values that are placeholders, not model names (trtllm-serve writes "undefined").
_NOT_A_MODEL = frozenset({"", "undefined", "unknown"})


# Larger values are not counts or fractions an engine could mean (and 2**53 is where
# floats stop being exact integers, which readers in other languages rely on).
_MAX_VALUE = float(2**53)


Overrides = tuple[tuple[str, tuple[str, ...]], ...]
#: A page's samples by name, in page order within each name.
ByName = Mapping[str, Sequence[Sample]]


def _dedupe(samples: Sequence[Sample]) -> list[Sample]:
    """One sample per series (the last one written): a page listing a series twice
    must not count it twice."""
    seen: dict[tuple[str, tuple[tuple[str, str], ...]], Sample] = {}
    for sample in samples:
        seen[(sample.name, tuple(sorted(sample.labels.items())))] = sample
    return list(seen.values()) if len(seen) < len(samples) else list(samples)


@dataclass(frozen=True)
class EngineMapping:
    """A spec with overrides applied; knows which names to parse and how to fold them."""

    spec: EngineSpec
    running: tuple[Metric, ...]
    waiting: tuple[Metric, ...]
    kv_cache_usage: tuple[Source, ...]
    prefix_cache_hit_rate: tuple[Metric, ...]
    prefix_cache_counters: tuple[tuple[Metric, Metric], ...]
    lora: Metric | None
    #: The path appended to an entry's URL unless the entry sets its own.
    metrics_path: str = ""
    wanted: frozenset[str] = field(init=False)
    selector: Selector = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names: set[str] = set()
        for source in (
            *self.running,
            *self.waiting,
            *self.spec.api_waiting,
            *self.kv_cache_usage,
            *self.prefix_cache_hit_rate,
            *(m for pair in self.prefix_cache_counters for m in pair),
            *((self.lora,) if self.lora else ()),
            *((self.spec.awake,) if self.spec.awake else ()),
        ):
            if isinstance(source, Ratio):
                names.update((source.used.name, source.total.name))
            else:
                names.add(source.name)
        names |= sizing.wanted(self.spec.kv_capacity_tokens, self.spec.waiting_by_reason)
        object.__setattr__(self, "wanted", frozenset(names))
        object.__setattr__(self, "selector", Selector(names))
        if not self.metrics_path:
            object.__setattr__(self, "metrics_path", self.spec.metrics_path)

    @property
    def engine(self) -> str:
        return self.spec.name

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
        try:
            return self.extract(parse(text, self.selector, max_samples))
        except ContractError as exc:
            raise self._with_hint(exc, text, max_samples) from None

    def _with_hint(self, exc: ContractError, text: str, max_samples: int | None) -> ContractError:
        """The contract failure, saying which engines' contracts the page satisfies (an
        entry registered with the wrong engine): ``looks_like`` and a hint naming the
        first; the spec's own hint when the page is no other engine's either."""
        others = page_engines(text, exclude=self.engine, max_samples=max_samples)
        hint = self.spec.contract_hint
        if others:
            hint = (
                f"the page looks like {' or '.join(others)}'s: register the endpoint with "
                f"engine {others[0]} (poller check --engine {others[0]} shows what it reads)"
            )
        error = ContractError(exc.missing, engine=self.engine, endpoint=exc.endpoint, hint=hint)
        error.looks_like = tuple(others)
        return error

    def extract(self, samples: Sequence[Sample]) -> Signals:
        """Fold parsed samples into Signals; ContractError lists every missing signal."""
        samples = _dedupe(samples)
        by_name: dict[str, list[Sample]] = {}
        for sample in samples:
            by_name.setdefault(sample.name, []).append(sample)
        sources: dict[str, str] = {}
        missing: list[str] = []

        def pick(signal: str, candidates: Iterable[Source], fold: str) -> float | None:
            for source in candidates:
                value = self._fold(by_name, source, fold)
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
            raise ContractError(missing, engine=self.engine, hint=self.spec.contract_hint)
        api_waiting = pick("api_waiting", self.spec.api_waiting, "sum")
        if api_waiting is not None:
            sources["waiting"] += "+" + sources["api_waiting"]
        gauge = pick("prefix_cache_hit_rate", self.prefix_cache_hit_rate, "mean")
        hits, queries = self._counters(by_name, sources, gauge_present=gauge is not None)
        if hits is not None:
            gauge = None  # counters give a windowed rate; the gauge is then not used
        lora_running, lora_waiting, lora_max = self._lora(by_name, sources)
        assert running is not None and waiting is not None

        def series(metric: Metric) -> list[Sample]:
            return self._series(by_name, metric)

        spec = self.spec
        return Signals(
            engine=self.engine,
            running=round(running),
            # Requests queued in front of the engine wait too (LMDeploy's API handles).
            waiting=round(waiting) + round(api_waiting or 0),
            kv_cache_usage=None if kv is None else min(kv, 1.0),
            prefix_cache_hit_rate=None if gauge is None else min(gauge, 1.0),
            prefix_cache_hits_total=hits,
            prefix_cache_queries_total=queries,
            lora_running=lora_running,
            lora_waiting=lora_waiting,
            lora_max=lora_max,
            models=self._models(samples),
            api_waiting=None if api_waiting is None else round(api_waiting),
            sleeping=self._sleeping(by_name, sources),
            kv_capacity_tokens=sizing.capacity_tokens(
                spec.kv_capacity_tokens, series, self._sum, sources
            ),
            waiting_by_reason=sizing.waiting_by_reason(
                spec.waiting_by_reason, series, self._sum, sources
            ),
            sources=sources,
        )

    def _series(self, by_name: ByName, metric: Metric) -> list[Sample]:
        """Usable series of one source: NaN, infinities, negative sentinels and absurdly
        large numbers dropped; of a broken-down total, the total only."""
        found = [
            s
            for s in by_name.get(metric.name, ())
            if 0 <= s.value < _MAX_VALUE and (not metric.where or metric.matches(s))
        ]
        for label, total in self.spec.totals:
            # A breakdown without its total (no series at the total's value) is summed:
            # its parts still count each request or token once.
            if any(s.labels.get(label) == total for s in found):
                found = [s for s in found if s.labels.get(label, total) == total]
        return found

    def _sum(self, series: Sequence[Sample]) -> float:
        replicas = self.spec.replicas
        if not replicas:
            return sum(s.value for s in series)
        # Ranks that differ only in a replica label report one batch: max within, then
        # sum across what remains (data-parallel ranks, models).
        groups: dict[tuple[tuple[str, str], ...], float] = {}
        for s in series:
            key = tuple(sorted((k, v) for k, v in s.labels.items() if k not in replicas))
            groups[key] = max(groups.get(key, s.value), s.value)
        return sum(groups.values())

    def _fold(self, by_name: ByName, source: Source, fold: str) -> float | None:
        if isinstance(source, Ratio):
            used, total = self._series(by_name, source.used), self._series(by_name, source.total)
            if not used or not total or self._sum(total) <= 0:
                return None
            return self._sum(used) / self._sum(total)
        series = self._series(by_name, source)
        if not series:
            return None
        if fold == "sum":
            return self._sum(series)
        if fold == "max":
            return max(s.value for s in series)
        return sum(s.value for s in series) / len(series)

    def _counters(
        self, by_name: ByName, sources: dict[str, str], gauge_present: bool
    ) -> tuple[float | None, float | None]:
        # SGLang creates its hits counter at the first hit, but versions without the
        # counter at all (0.4) publish only the gauge: absent hits mean zero only when
        # there is no gauge to fall back on.
        absent_is_zero = self.spec.hits_absent_is_zero and not gauge_present
        for hits_m, queries_m in self.prefix_cache_counters:
            queries = self._series(by_name, queries_m)
            hits = self._series(by_name, hits_m)
            if queries and (hits or absent_is_zero):
                hits_total, queries_total = self._sum(hits), self._sum(queries)
                if self.spec.queries_exclude_hits:
                    # llama.cpp: prompt_tokens_total counts only the tokens not cached.
                    sources["prefix_cache_hit_rate"] = f"{hits_m}/({hits_m}+{queries_m})"
                    return hits_total, hits_total + queries_total
                sources["prefix_cache_hit_rate"] = f"{hits_m}/{queries_m}"
                return hits_total, queries_total
        return None, None

    def _sleeping(self, by_name: ByName, sources: dict[str, str]) -> bool | None:
        """vLLM: sleeping when none of the endpoint's engines is awake; None if unsaid."""
        if self.spec.awake is None:
            return None
        series = self._series(by_name, self.spec.awake)
        if not series:
            return None
        sources["sleeping"] = str(self.spec.awake)
        return not any(s.value > 0 for s in series)

    def _lora(
        self, by_name: ByName, sources: dict[str, str]
    ) -> tuple[tuple[str, ...], tuple[str, ...], int | None]:
        if self.lora is None:
            return (), (), None
        series = [s for s in by_name.get(self.lora.name, ()) if not math.isnan(s.value)]
        if not series:
            return (), (), None
        # Every adapter combination ever seen lingers as a series, set to the time it was
        # last seen; each data-parallel engine sets its own (LORA_RECENT_S).
        series.sort(key=lambda s: s.value, reverse=True)
        latest = series[0]
        recent = [s for s in series if s.value >= latest.value - LORA_RECENT_S]
        sources["lora"] = self.lora.name

        def names(label: str) -> tuple[str, ...]:
            found = (a for s in recent for a in s.labels.get(label, "").split(","))
            return tuple(dict.fromkeys(a for a in found if a))

        max_lora = latest.labels.get("max_lora", "")
        return (
            names("running_lora_adapters"),
            names("waiting_lora_adapters"),
            int(max_lora) if digits(max_lora) else None,
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
def _mapping(engine: str, overrides: Overrides, metrics_path: str) -> EngineMapping:
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

    def names(signal: str) -> tuple[Metric, ...] | None:
        return tuple(Metric(n) for n in o[signal]) if signal in o else None

    return EngineMapping(
        spec=spec,
        running=names("running") or spec.running,
        waiting=names("waiting") or spec.waiting,
        kv_cache_usage=names("kv_cache_usage") or spec.kv_cache_usage,
        prefix_cache_hit_rate=names("prefix_cache_hit_rate") or spec.prefix_cache_hit_rate,
        prefix_cache_counters=counters,
        lora=Metric(o["lora"][0]) if "lora" in o else spec.lora,
        metrics_path=metrics_path or spec.metrics_path,
    )


def page_engines(
    page: bytes | str, exclude: str | None = None, max_samples: int | None = None
) -> list[str]:
    """The scraped engines (in ``ENGINE_SPECS`` order, ``exclude`` left out) whose
    contract the page satisfies with their own names: what a page with no ``--engine``
    is, and which engine a failing entry should have been registered with."""
    text = decode_body(page) if isinstance(page, bytes) else page
    found = []
    for name, spec in ENGINE_SPECS.items():
        if name == exclude or not spec.scraped:
            continue
        mapping = mapping_for(name)
        try:
            mapping.extract(parse(text, mapping.selector, max_samples))
        except ScrapeError:
            continue
        found.append(name)
    return found


def _freeze(overrides: Mapping[str, Sequence[str]] | None) -> Overrides:
    return tuple(sorted((k, tuple(v)) for k, v in (overrides or {}).items()))


def mapping_for(
    engine: str,
    overrides: Mapping[str, Sequence[str]] | None = None,
    metrics_path: str | None = None,
) -> EngineMapping:
    """The (cached) mapping for an engine with name overrides and a default path applied.

    An override replaces that signal's candidate names (an operator's fix for a metric
    an engine version renamed); ``prefix_cache_hits``/``_queries`` replace the counters.
    ``metrics_path`` replaces the engine's default path (an entry's own still wins).
    """
    if engine not in ENGINE_SPECS:
        raise KeyError(f"unknown engine {engine!r}; accepted: {', '.join(ENGINE_SPECS)}")
    return _mapping(engine, _freeze(overrides), metrics_path or "")


def mapping_for_endpoint(endpoint: Endpoint, settings: ScrapeSettings) -> EngineMapping:
    """The mapping an entry is scraped with: engine default < settings < the entry.

    The engine is the entry's, else ``settings.default_engine``. Per signal, the entry's
    ``overrides`` win over ``[scrape.engines.<engine>].overrides``, which win over the
    engine's names; the settings' ``metrics_path`` replaces the engine's default path,
    and an entry's own ``metrics_path`` wins over both (applied when fetching).
    """
    engine = endpoint.engine or settings.default_engine
    defaults = settings.engines.get(engine)
    if defaults is None:
        return mapping_for(engine, endpoint.overrides)
    merged = {**defaults.overrides, **endpoint.overrides}
    return mapping_for(engine, merged, defaults.metrics_path)
