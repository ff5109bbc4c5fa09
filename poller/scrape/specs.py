"""What each engine publishes: metric names per signal and the labels that shape a fold.

Each signal lists its candidate sources in order of preference; the first one present on
the page wins (engine versions renamed metrics, and old names linger on some versions).
Series are folded by the rules of docs/engines.md ("Folding series"): a label in
``totals`` breaks a total down (read only the total), a label in ``replicas`` repeats one
batch (take the max over it), and whatever else differs between series (vLLM's and
LMDeploy's ``engine``, SGLang's ``dp_rank``) is a separate engine (sum). Sources for
every name: docs/engines.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from poller.schema.endpoint import ENGINES
from poller.scrape.parse import Sample

__all__ = [
    "ENGINE_SPECS",
    "LORA_RECENT_S",
    "Capacity",
    "EngineSpec",
    "InfoTokens",
    "Metric",
    "Product",
    "Ratio",
    "Source",
]


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


@dataclass(frozen=True, slots=True)
class Product:
    """A count in blocks times the tokens per block (TensorRT-LLM's KV capacity)."""

    blocks: Metric
    per_block: Metric

    def __str__(self) -> str:
        return f"{self.blocks}*{self.per_block}"


@dataclass(frozen=True, slots=True)
class InfoTokens:
    """Tokens read from the labels of an info gauge (vLLM's ``cache_config_info``, whose
    value is always 1): the ``tokens`` label where it holds a number, else the
    ``blocks`` label times the ``block_size`` label."""

    metric: Metric
    tokens: str
    blocks: str
    block_size: str

    def __str__(self) -> str:
        return f"{self.metric}{{{self.tokens}|{self.blocks}*{self.block_size}}}"


Capacity = Metric | Product | InfoTokens


def _m(*names: str) -> tuple[Metric, ...]:
    return tuple(Metric(n) for n in names)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    name: str
    metrics_path: str = "/metrics"
    running: tuple[Metric, ...] = ()
    waiting: tuple[Metric, ...] = ()
    #: Requests queued in front of the engine (LMDeploy's API handles): added to
    #: ``waiting`` and kept as the ``api_waiting`` field.
    api_waiting: tuple[Metric, ...] = ()
    kv_cache_usage: tuple[Source, ...] = ()
    #: The engine's own hit-rate gauge (used when no counter pair is on the page).
    prefix_cache_hit_rate: tuple[Metric, ...] = ()
    #: (hits, queries) cumulative counter pairs, preferred over the gauge.
    prefix_cache_counters: tuple[tuple[Metric, Metric], ...] = ()
    #: SGLang creates its hits counter only at the first hit: absent may mean zero.
    hits_absent_is_zero: bool = False
    #: llama.cpp's prompt counter excludes cached tokens: queries = hits + prompt.
    queries_exclude_hits: bool = False
    lora: Metric | None = None
    #: vLLM's ``engine_sleep_state``: the series labelled ``sleep_state="awake"``.
    awake: Metric | None = None
    model_labels: tuple[str, ...] = ()
    #: The page names no model (or a placeholder): the poller reads the names from the
    #: engine's /v1/models once per lease (poller/scrape/models.py).
    models_from_api: bool = False
    #: KV-cache capacity in tokens, summed over engines like ``running``.
    kv_capacity_tokens: tuple[Capacity, ...] = ()
    #: Waiting requests broken down by a reason label (vLLM): (metric, label).
    waiting_by_reason: tuple[Metric, str] | None = None
    #: (label, value of the total): where a series carries the label, only the total
    #: is read (SGLang's ``priority=""``).
    totals: tuple[tuple[str, str], ...] = ()
    #: Labels whose series repeat one batch (tensor/pipeline/expert parallel ranks).
    replicas: tuple[str, ...] = ()
    required: frozenset[str] = frozenset({"running", "waiting", "kv_cache_usage"})
    #: What a page missing required signals says the engine must run with.
    contract_hint: str = ""
    scraped: bool = True


_TRTLLM_HINT = (
    "trtllm-serve publishes trtllm_num_requests_running/_waiting and "
    "trtllm_kv_cache_utilization from 1.3.0rc12 on (early 2026), and serves "
    "/prometheus/metrics only with return_perf_metrics: true (plus enable_iter_perf_stats) "
    "in --extra_llm_api_options: upgrade, or set both"
)
_TRITON_HINT = (
    "no TensorRT-LLM backend metrics (nv_trt_llm_*): Triton's Python LLM-API model "
    "(all_models/llmapi) registers no load metrics; serve the model with the tensorrt_llm "
    "C++ backend (all_models/inflight_batcher_llm), or run trtllm-serve and use engine trtllm"
)

#: vLLM's LoRA series set within this many seconds of the newest one are read with it.
#: A busy engine sets its series at every step (tens of milliseconds; a long prefill
#: chunk, up to about a second), so each data-parallel engine's is this recent; an idle
#: engine's is older and runs no adapter. An adapter that left in the last LORA_RECENT_S
#: still counts as running: it is still loaded.
LORA_RECENT_S = 2.0

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
            awake=Metric("vllm:engine_sleep_state", (("sleep_state", "awake"),)),
            model_labels=("model_name",),
            # One series per engine; recent versions add the group-aware kv_cache_size_tokens
            # (num_gpu_blocks x block_size overcounts hybrid models).
            kv_capacity_tokens=(
                InfoTokens(
                    Metric("vllm:cache_config_info"),
                    tokens="kv_cache_size_tokens",
                    blocks="num_gpu_blocks",
                    block_size="block_size",
                ),
            ),
            # capacity + deferred = vllm:num_requests_waiting.
            waiting_by_reason=(Metric("vllm:num_requests_waiting_by_reason"), "reason"),
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
            model_labels=("model_name",),
            kv_capacity_tokens=_m("sglang:max_total_num_tokens", "sglang_max_total_num_tokens"),
            # cache_source="total" is not a total: it holds the requests without a cache
            # breakdown, beside device/host/storage_<backend> for the others (engines.md).
            totals=(("priority", ""),),
            replicas=("tp_rank", "pp_rank", "moe_ep_rank"),
        ),
        EngineSpec(
            "llamacpp",
            running=_m("llamacpp:requests_processing"),
            waiting=_m("llamacpp:requests_deferred"),
            # Removed upstream by llama.cpp PR #13660 with no replacement: optional.
            kv_cache_usage=_m("llamacpp:kv_cache_usage_ratio"),
            prefix_cache_counters=(
                (
                    Metric("llamacpp:prompt_tokens_cached_total"),
                    Metric("llamacpp:prompt_tokens_total"),
                ),
            ),
            queries_exclude_hits=True,
            models_from_api=True,
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
            models_from_api=True,  # model_name is the literal "undefined"
            kv_capacity_tokens=(
                Product(
                    Metric("trtllm_kv_cache_max_blocks"), Metric("trtllm_kv_cache_tokens_per_block")
                ),
            ),
            contract_hint=_TRTLLM_HINT,
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
            kv_capacity_tokens=(
                Product(
                    Metric("nv_trt_llm_kv_cache_block_metrics", (("kv_cache_block_type", "max"),)),
                    Metric(
                        "nv_trt_llm_kv_cache_block_metrics",
                        (("kv_cache_block_type", "tokens_per"),),
                    ),
                ),
            ),
            contract_hint=_TRITON_HINT,
        ),
        EngineSpec(
            "tgi",
            running=_m("tgi_batch_current_size"),
            waiting=_m("tgi_queue_size"),
            models_from_api=True,
            required=frozenset({"running", "waiting"}),  # TGI publishes no KV usage
        ),
        EngineSpec(
            "lmdeploy",
            # Every series carries engine="<data-parallel rank>": summed like vLLM's.
            running=_m("lmdeploy:num_requests_running"),
            waiting=_m("lmdeploy:num_requests_waiting"),
            api_waiting=_m("lmdeploy:num_api_requests_waiting"),
            kv_cache_usage=_m("lmdeploy:gpu_cache_usage_perc"),
            prefix_cache_hit_rate=_m("lmdeploy:prefix_cache_hit_rate"),
            prefix_cache_counters=(
                (Metric("lmdeploy:cached_tokens_total"), Metric("lmdeploy:prompt_tokens_total")),
            ),
            model_labels=("model_name",),
        ),
        EngineSpec("external", scraped=False, required=frozenset()),
    )
}
assert tuple(ENGINE_SPECS) == ENGINES, "registry.ENGINES and ENGINE_SPECS must agree"
