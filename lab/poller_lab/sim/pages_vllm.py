"""vLLM's pages: the bundled 61 KB V1 page made live, and the same bulk under V0 names.

``poller/scrape/data/vllm.txt`` is a single-model V1 page (real families and buckets, made-up
values). Its gauges and counters become slots; its histograms and the process/python
collectors stay static text. V1 writes ``engine="<index>"`` on every per-engine series
(one per data-parallel rank); V0 has no such label and other names for the KV and
prefix-cache gauges (``gpu_cache_usage_perc``, ``gpu_prefix_cache_hit_rate``), plus
``num_requests_swapped`` (vllm/engine/metrics.py).
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

from poller_lab.sim.templates import families, family_name

__all__ = ["BUNDLED_MODEL", "python_collectors", "vllm_source"]

BUNDLED_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@cache
def _vllm_bulk() -> tuple[str, ...]:
    text = resources.files("poller.scrape").joinpath("data/vllm.txt").read_text(encoding="utf-8")
    return tuple(text.splitlines())


# vLLM samples whose value is live: sample name (plus finished_reason) -> RankState field.
_VLLM_LIVE = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "gen_tokens",
    'vllm:request_success_total{finished_reason="stop"': "success_stop",
    'vllm:request_success_total{finished_reason="length"': "success_length",
}
# Families V0 never had (or that V0 names differently, in _V0_HEAD).
_V0_SKIP = (
    "vllm:num_requests_",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_",
    "vllm:corrupted_requests",
    "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:request_prefill_kv_computed_tokens",
)
_V0_HEAD = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="M"} <<running>>
# HELP vllm:num_requests_swapped Number of requests swapped to CPU.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{model_name="M"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="M"} <<waiting>>
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="M"} <<kv>>
# HELP vllm:cpu_cache_usage_perc CPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:cpu_cache_usage_perc gauge
vllm:cpu_cache_usage_perc{model_name="M"} 0.0
# HELP vllm:cpu_prefix_cache_hit_rate CPU prefix cache block hit rate.
# TYPE vllm:cpu_prefix_cache_hit_rate gauge
vllm:cpu_prefix_cache_hit_rate{model_name="M"} -1.0
# HELP vllm:gpu_prefix_cache_hit_rate GPU prefix cache block hit rate.
# TYPE vllm:gpu_prefix_cache_hit_rate gauge
vllm:gpu_prefix_cache_hit_rate{model_name="M"} <<batch_hit_rate>>
# HELP vllm:avg_prompt_throughput_toks_per_s Average prefill throughput in tokens/s.
# TYPE vllm:avg_prompt_throughput_toks_per_s gauge
vllm:avg_prompt_throughput_toks_per_s{model_name="M"} <<prompt_tps>>
# HELP vllm:avg_generation_throughput_toks_per_s Average generation throughput in tokens/s.
# TYPE vllm:avg_generation_throughput_toks_per_s gauge
vllm:avg_generation_throughput_toks_per_s{model_name="M"} <<gen_tps>>"""


# vLLM 0.33's split of the waiting queue (vllm/v1/metrics/loggers.py); the simulated
# scheduler defers nothing, so every waiting request waits for capacity.
_BY_REASON = (
    "# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason. Reason "
    "labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient "
    "constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals "
    "vllm:num_requests_waiting.",
    "# TYPE vllm:num_requests_waiting_by_reason gauge",
    f'vllm:num_requests_waiting_by_reason{{<<R>>model_name="{BUNDLED_MODEL}",reason="capacity"}}'
    " <<waiting>>",
    f'vllm:num_requests_waiting_by_reason{{<<R>>model_name="{BUNDLED_MODEL}",reason="deferred"}}'
    " 0.0",
)


def _vllm_line(line: str, v0: bool) -> str:
    # V1 labels every per-engine series with engine="<index>" (data parallelism); V0 has
    # no such label. The bundled page always writes it first, before model_name.
    line = line.replace('engine="0",', "" if v0 else "<<R>>")
    if line.endswith("_created") or line.startswith("#"):
        return line
    head, _, _value = line.rpartition(" ")
    name = family_name(line) or ""
    if name.endswith("_created") or name == "process_start_time_seconds":
        return f"{head} <<start>>"
    key = _VLLM_LIVE.get(name)
    if key is None and name == "vllm:request_success_total":
        reason = re.search(r'finished_reason="(\w+)"', line)
        key = _VLLM_LIVE.get(f'{name}{{finished_reason="{reason[1] if reason else ""}"')
    return f"{head} <<{key}>>" if key else line


#: V1's sleep-mode gauge (vllm/v1/metrics/loggers.py); the values
#: follow the endpoint's sleep level (``RankState.awake`` and the two levels).
_SLEEP_STATE = """\
# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping; \
awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 \
means sleep level 2.
# TYPE vllm:engine_sleep_state gauge""" + "".join(
    f'\nvllm:engine_sleep_state{{<<R>>model_name="{BUNDLED_MODEL}",sleep_state="{state}"}} '
    f"<<{state}>>"
    for state in ("awake", "weights_offloaded", "discard_all")
)
#: The bundled page's KV pool size, replaced per endpoint (``vllm_source(kv_blocks=)``).
_GPU_BLOCKS = 'num_gpu_blocks="28642"'


def vllm_source(model: str, lora: bool, v0: bool, kv_blocks: int | None = None) -> str:
    """The page source; ``kv_blocks`` sets ``cache_config_info``'s ``num_gpu_blocks``."""
    out = [_V0_HEAD.replace('"M"', f'"{BUNDLED_MODEL}"')] if v0 else []
    for family in families(_vllm_bulk()):
        name = family_name(family[0]) or ""
        if v0 and name.startswith(_V0_SKIP):
            continue
        if name == "vllm:cache_config_info" and kv_blocks is not None:
            family = [line.replace(_GPU_BLOCKS, f'num_gpu_blocks="{kv_blocks}"') for line in family]
        if name == "vllm:kv_cache_usage_perc" and not v0:
            out.extend(_SLEEP_STATE.splitlines())  # the sleep-mode gauge, before KV usage
        if name == "vllm:lora_requests_info":
            # Only with --enable-lora; every adapter combination seen lingers as a series.
            if lora:
                out.extend([*family[:2], "<<lora>>"])
            continue
        out.extend(_vllm_line(line, v0) for line in family)
        if name == "vllm:num_requests_waiting" and not v0:
            out.extend(_BY_REASON)
    return "\n".join(out).replace(BUNDLED_MODEL, model)


def python_collectors() -> list[str]:
    """The process_*/python_* families of a Python exporter (trtllm-serve, like vLLM)."""
    keep = [f for f in families(_vllm_bulk()) if (family_name(f[0]) or "").startswith("p")]
    lines = [line for f in keep for line in f]
    return [
        f"{line.rpartition(' ')[0]} <<start>>"
        if line.startswith("process_start_time_seconds")
        else line
        for line in lines
    ]
