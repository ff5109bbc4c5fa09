"""The simulated engines: paths, content types, defaults and compiled page templates."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from poller_lab.sim.model import STEP_S, EndpointLoad, RankState
from poller_lab.sim.pages_lmdeploy import lmdeploy_source
from poller_lab.sim.pages_other import (
    LLAMACPP,
    sglang_source,
    tgi_source,
    triton_source,
    trtllm_source,
)
from poller_lab.sim.pages_vllm import BUNDLED_MODEL, vllm_source
from poller_lab.sim.templates import Formatter, Template, compile_page, fmt_go, fmt_plain

__all__ = [
    "ENGINES",
    "LLAMACPP_MODEL",
    "SAFE_LABEL",
    "EngineDef",
    "iteration_stats",
    "template_for",
]

#: prometheus_client's content type (vLLM, SGLang and trtllm-serve use it).
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
#: Model and adapter names go into label values unescaped: keep them to plain characters.
SAFE_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}")
#: What a llama-server started with ``-m Llama-3.1-8B-Instruct-Q4_K_M.gguf`` lists.
LLAMACPP_MODEL = "Llama-3.1-8B-Instruct-Q4_K_M.gguf"


@dataclass(frozen=True, slots=True)
class EngineDef:
    name: str
    #: The engine name a poller registry entry uses (``vllm-v0`` is scraped as ``vllm``).
    registry_engine: str
    #: (model name, has LoRA adapters, KV blocks) -> page source
    source: Callable[[str, bool, int], str]
    formatter: Formatter
    #: What ``missing`` drops by default: a required signal, with its fallbacks.
    required: tuple[str, ...]
    text_path: str = "/metrics"
    json_path: str | None = None
    content_type: str = PROMETHEUS_TEXT
    #: The model an endpoint serves unless its spec names one: what ``/v1/models`` lists
    #: and requests name. Whether the page carries it is the page source's business.
    model: str = BUNDLED_MODEL
    #: ``owned_by`` of the engine's ``/v1/models`` entries (None: the model id, as TGI).
    owned_by: str | None = "vllm"
    #: The engine's server takes requests without a ``model`` (llama-server, TGI).
    model_optional: bool = False
    capacity: int = 64
    #: (rank, ranks) -> label text for the ``<<R>>`` marker; None: one rank only.
    rank_label: Callable[[int, int], str] | None = None
    lora: bool = False


def _vllm_rank(rank: int, ranks: int) -> str:
    return f'engine="{rank}",'


def _lmdeploy_rank(rank: int, ranks: int) -> str:
    # One PrometheusStatLogger per data-parallel rank, labelled engine="<rank>".
    return f'engine="{rank}",'


def _sglang_rank(rank: int, ranks: int) -> str:
    # SGLang adds dp_rank only under data parallelism (PR sgl-project/sglang#7597).
    return f'dp_rank="{rank}",' if ranks > 1 else ""


ENGINES: dict[str, EngineDef] = {
    e.name: e
    for e in (
        EngineDef(
            "vllm",
            "vllm",
            lambda model, lora, blocks: vllm_source(model, lora, v0=False, kv_blocks=blocks),
            fmt_go,
            required=("vllm:kv_cache_usage_perc",),
            capacity=256,  # max_num_seqs
            rank_label=_vllm_rank,
            lora=True,
        ),
        EngineDef(
            "vllm-v0",
            "vllm",
            lambda model, lora, blocks: vllm_source(model, lora, v0=True, kv_blocks=blocks),
            fmt_go,
            required=("vllm:gpu_cache_usage_perc",),
            capacity=256,
            lora=True,
        ),
        EngineDef(
            "sglang",
            "sglang",
            lambda model, lora, blocks: sglang_source(model),
            fmt_go,
            required=("sglang:token_usage", "sglang:num_used_tokens"),
            rank_label=_sglang_rank,
            owned_by="sglang",
        ),
        EngineDef(
            "llamacpp",
            "llamacpp",
            lambda model, lora, blocks: LLAMACPP,
            fmt_plain,
            # KV usage is optional for llama.cpp (removed upstream): drop a required gauge.
            required=("llamacpp:requests_deferred",),
            content_type="text/plain; version=0.0.4",
            # llama-server lists its --alias, else the model file's name; its page
            # names no model.
            model=LLAMACPP_MODEL,
            capacity=4,  # --parallel
            owned_by="llamacpp",
            model_optional=True,
        ),
        EngineDef(
            "trtllm",
            "trtllm",
            # trtllm-serve labels its page model_name="undefined" whatever it serves;
            # /v1/models lists the model it was started with.
            lambda model, lora, blocks: trtllm_source("undefined"),
            fmt_go,
            required=("trtllm_kv_cache_utilization",),
            text_path="/prometheus/metrics",
            json_path="/metrics",
            owned_by="tensorrt_llm",
        ),
        EngineDef(
            "triton",
            "triton",
            lambda model, lora, blocks: triton_source(model),
            fmt_plain,
            required=("nv_trt_llm_kv_cache_block_metrics",),
            content_type="text/plain; charset=utf-8",
            model="tensorrt_llm",
            owned_by="Triton Inference Server",
        ),
        EngineDef(
            "tgi",
            "tgi",
            lambda model, lora, blocks: tgi_source(),
            fmt_plain,
            required=("tgi_queue_size",),
            content_type="text/plain; charset=utf-8",
            # TGI lists its --model-id (owned_by the same); its page names no model.
            capacity=32,
            owned_by=None,
            model_optional=True,
        ),
        EngineDef(
            "lmdeploy",
            "lmdeploy",
            lambda model, lora, blocks: lmdeploy_source(model),
            fmt_go,
            required=("lmdeploy:gpu_cache_usage_perc",),
            capacity=128,  # --max-batch-size
            rank_label=_lmdeploy_rank,
            owned_by="lmdeploy",
        ),
    )
}


@lru_cache(maxsize=256)
def template_for(
    engine: str,
    model: str,
    ranks: int,
    lora: bool,
    drop: frozenset[str] = frozenset(),
    kv_blocks: int = 28642,
) -> Template:
    """The compiled page of one shape; endpoints of the same shape share it."""
    spec = ENGINES[engine]
    return compile_page(
        spec.source(model, lora, kv_blocks),
        ranks=ranks,
        rank_label=lambda rank: spec.rank_label(rank, ranks) if spec.rank_label else "",
        formatter=spec.formatter,
        drop=drop,
    )


def iteration_stats(
    load: EndpointLoad, wall_offset: float, states: Sequence[RankState] | None = None
) -> bytes:
    """trtllm-serve's plain ``/metrics``: a JSON list of per-iteration stats, not a page."""
    s = (states or load.states)[0]
    stats = {
        "cpuMemUsage": 0,
        "gpuMemUsage": 21474836480,
        "pinnedMemUsage": 0,
        "iter": s.decodes,
        "iterLatencyMS": 14.2,
        "maxNumActiveRequests": s.capacity,
        "numActiveRequests": s.running,
        "numQueuedRequests": s.waiting,
        "numCompletedRequests": s.success,
        "timestamp": fmt_go(load.t0 + load.step * STEP_S + wall_offset).decode(),
        "kvCacheStats": {
            "cacheHitRate": round(s.batch_hit_rate, 4),
            "freeNumBlocks": s.kv_free_blocks,
            "maxNumBlocks": s.kv_max_blocks,
            "missedBlocks": s.missed_blocks,
            "reusedBlocks": s.reused_blocks,
            "tokensPerBlock": 16,
            "usedNumBlocks": s.kv_used_blocks,
        },
        "inflightBatchingStats": {
            "microBatchId": 0,
            "numContextRequests": 0,
            "numCtxTokens": 0,
            "numGenRequests": s.running,
            "numPausedRequests": 0,
            "numScheduledRequests": s.running,
        },
    }
    return json.dumps([stats]).encode()
