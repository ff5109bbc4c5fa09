"""Page sources of SGLang, llama.cpp, trtllm-serve, Triton (TensorRT-LLM) and TGI.

Names and label layouts follow each exporter (docs/engines.md names the sources):
SGLang writes per-rank series (``dp_rank`` under data parallelism, ``tp_rank``);
llama.cpp has no labels and prints ``-nan`` before the first decode; trtllm-serve writes
``trtllm_`` names beside Python's process collectors; Triton's TensorRT-LLM backend
selects a value by label; TGI's Rust router writes counters without ``_total`` and a
blank line after every family. Histograms are static text with the engines' real buckets.
"""

from __future__ import annotations

from poller_lab.sim.pages_vllm import python_collectors
from poller_lab.sim.templates import fmt_go
from poller_lab.sim.templates import histogram as hist

__all__ = ["LLAMACPP", "sglang_source", "tgi_source", "trtllm_source", "triton_source"]


def _gauges(prefix: str, labels: str, rows: list[tuple[str, str, str, str]]) -> list[str]:
    """HELP/TYPE/sample lines for (name, type, help, value) rows sharing one label set."""
    out = []
    for name, kind, text, value in rows:
        out += [f"# HELP {prefix}{name} {text}", f"# TYPE {prefix}{name} {kind}"]
        out.append(f"{prefix}{name}{{{labels}}} {value}")
    return out


_SGLANG_TTFT: tuple[float, ...] = (
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1,
    2,
    4,
    6,
    8,
    10,
    20,
    40,
    60,
    80,
    100,
    200,
    400,
)
_SGLANG_E2E: tuple[float, ...] = (*_SGLANG_TTFT[:-1], 400, 600, 1200, 1800, 2400)
_SGLANG_ITL: tuple[float, ...] = (
    0.002,
    0.004,
    0.006,
    0.008,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.035,
    0.04,
)
_SGLANG_ITL += (0.06, 0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0)
_SGLANG_QUEUE: tuple[float, ...] = (
    0.1,
    0.2,
    0.5,
    1,
    2,
    3,
    4,
    5,
    10,
    15,
    20,
    30,
    40,
    50,
    60,
    70,
    80,
    90,
    100,
)
_SGLANG_QUEUE += (200, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800)
_TOKENS = tuple(float(2**i) for i in range(14)) + (16384.0, 32768.0, 65536.0)


def sglang_source(model: str) -> str:
    labels = f'<<R>>engine_type="unified",model_name="{model}",moe_ep_rank="0",pp_rank="0",'
    labels += 'tp_rank="0"'
    rows = [
        ("num_running_reqs", "gauge", "The number of running requests.", "<<running>>"),
        ("num_used_tokens", "gauge", "The number of used tokens.", "<<kv_used_tokens>>"),
        ("token_usage", "gauge", "The token usage.", "<<kv>>"),
        ("gen_throughput", "gauge", "The generation throughput (token/s).", "<<gen_tps>>"),
        ("num_queue_reqs", "gauge", "The number of requests in the waiting queue.", "<<waiting>>"),
        ("num_grammar_queue_reqs", "gauge", "The number of requests in the grammar queue.", "0.0"),
        ("cache_hit_rate", "gauge", "The prefix cache hit rate.", "<<batch_hit_rate>>"),
        ("spec_accept_length", "gauge", "The average acceptance length of speculative decoding.")
        + ("0.0",),
        ("max_total_num_tokens", "gauge", "Maximum total number of tokens in the KV cache pool.")
        + ("<<max_tokens>>",),
        ("num_retracted_reqs", "gauge", "The number of currently retracted requests.", "0.0"),
        ("utilization", "gauge", "The utilization.", "<<kv>>"),
        ("prompt_tokens_total", "counter", "Number of prefill tokens processed.")
        + ("<<prompt_tokens>>",),
        ("generation_tokens_total", "counter", "Number of generation tokens processed.")
        + ("<<gen_tokens>>",),
        ("cached_tokens_total", "counter", "Number of cached prompt tokens.", "<<prefix_hits>>"),
        ("num_requests_total", "counter", "Number of requests processed.", "<<admitted>>"),
        ("num_aborted_requests_total", "counter", "Number of requests aborted.", "0.0"),
    ]
    out = _gauges("sglang:", labels, rows)
    for name, text, buckets, count, typical in (
        ("time_to_first_token_seconds", "time to first token", _SGLANG_TTFT, 11008, 3.5),
        ("e2e_request_latency_seconds", "End-to-end request latency", _SGLANG_E2E, 11008, 40.0),
        ("inter_token_latency_seconds", "inter-token latency", _SGLANG_ITL, 7400757, 0.09),
        ("queue_time_seconds", "the time a request waits in the queue", _SGLANG_QUEUE, 11008, 2.0),
        ("prompt_tokens_histogram", "prompt tokens per request", _TOKENS, 11008, 700.0),
        ("generation_tokens_histogram", "generated tokens per request", _TOKENS, 11008, 650.0),
    ):
        full = f"sglang:{name}"
        out += [f"# HELP {full} Histogram of {text}.", f"# TYPE {full} histogram"]
        out += hist(full, labels + ",", buckets, count, typical, value=_go)
    return "\n".join(out)


def _go(value: float) -> str:
    return fmt_go(value).decode()


LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total <<prompt_tokens>>
# HELP llamacpp:prompt_seconds_total Prompt process time
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total <<prompt_seconds>>
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total <<gen_tokens>>
# HELP llamacpp:tokens_predicted_seconds_total Predict process time
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total <<gen_seconds>>
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total <<decodes>>
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode counter
llamacpp:n_busy_slots_per_decode <<busy_per_decode>>
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s.
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds <<prompt_tps>>
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s.
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds <<gen_tps>>
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio <<kv>>
# HELP llamacpp:kv_cache_tokens KV-cache tokens.
# TYPE llamacpp:kv_cache_tokens gauge
llamacpp:kv_cache_tokens <<kv_used_tokens>>
# HELP llamacpp:requests_processing Number of request processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing <<running>>
# HELP llamacpp:requests_deferred Number of request deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred <<waiting>>
# HELP llamacpp:n_tokens_max Largest observed n_tokens.
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max 4096"""

_TRTLLM_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)


def trtllm_source(model: str) -> str:
    labels = f'engine_type="undefined",model_name="{model}"'
    rows = [
        ("num_requests_running", "gauge", "Number of active requests", "<<running>>"),
        ("num_requests_waiting", "gauge", "Number of queued requests", "<<waiting>>"),
        ("kv_cache_utilization", "gauge", "KV cache utilization", "<<kv>>"),
        ("kv_cache_hit_rate", "gauge", "KV cache hit rate", "<<batch_hit_rate>>"),
        ("kv_cache_max_blocks", "gauge", "Maximum number of KV cache blocks", "<<kv_max_blocks>>"),
        ("kv_cache_used_blocks", "gauge", "Number of used KV cache blocks", "<<kv_used_blocks>>"),
        ("kv_cache_tokens_per_block", "gauge", "Number of tokens per KV cache block", "16"),
    ]
    out = _gauges("trtllm_", labels + ',pid="412"', rows)
    rows = [
        ("kv_cache_reused_blocks_total", "counter", "Cumulative number of KV cache blocks")
        + ("<<reused_blocks>>",),
        ("kv_cache_missed_blocks_total", "counter", "Cumulative number of KV cache misses")
        + ("<<missed_blocks>>",),
        ("prompt_tokens_total", "counter", "Cumulative number of prompt (input) tokens processed.")
        + ("<<prompt_tokens>>",),
        ("prompt_cached_tokens_total", "counter", "Process-lifetime prompt tokens from KV cache.")
        + ("<<prefix_hits>>",),
        ("generation_tokens_total", "counter", "Cumulative number of generation tokens.")
        + ("<<gen_tokens>>",),
    ]
    out += _gauges("trtllm_", labels, rows)
    out += [
        "# HELP trtllm_request_success_total Count of successfully processed requests.",
        "# TYPE trtllm_request_success_total counter",
        f'trtllm_request_success_total{{engine_type="undefined",finished_reason="stop",'
        f'model_name="{model}"}} <<success_stop>>',
        f'trtllm_request_success_total{{engine_type="undefined",finished_reason="length",'
        f'model_name="{model}"}} <<success_length>>',
    ]
    for name, text, typical in (
        ("e2e_request_latency_seconds", "end to end request latency in seconds", 9.0),
        ("time_to_first_token_seconds", "time to first token in seconds", 0.4),
        ("time_per_output_token_seconds", "time per output token in seconds", 0.03),
        ("request_queue_time_seconds", "time spent in WAITING phase for request", 0.2),
    ):
        full = f"trtllm_{name}"
        out += [f"# HELP {full} Histogram of {text}.", f"# TYPE {full} histogram"]
        out += hist(full, labels + ",", _TRTLLM_BUCKETS, 4812, typical, value=_go)
    return "\n".join([*out, "", *python_collectors()])


_TRITON_MODELS = ("ensemble", "preprocessing", "MODEL", "postprocessing")
_TRITON_COUNTERS = (
    ("request_success", "Number of successful inference requests, all batch sizes", "<<success>>"),
    ("request_failure", "Number of failed inference requests, all batch sizes", "0"),
    ("count", "Number of inferences performed (does not include cached requests)", "<<success>>"),
    ("exec_count", "Number of model executions performed", "<<decodes>>"),
    ("request_duration_us", "Cumulative inference request duration in microseconds", "9421377"),
    ("queue_duration_us", "Cumulative inference queuing duration in microseconds", "10744"),
    ("compute_input_duration_us", "Cumulative compute input duration in microseconds", "31245"),
    (
        "compute_infer_duration_us",
        "Cumulative compute inference duration in microseconds",
        "9342861",
    ),
    ("compute_output_duration_us", "Cumulative inference compute output duration in microseconds")
    + ("12887",),
)
# The TensorRT-LLM backend's custom metrics (custom_metrics_reporter.cc): the label selects.
_TRITON_TRT = """\
# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="MODEL",request_type="waiting",version="1"} <<waiting>>
nv_trt_llm_request_metrics{model="MODEL",request_type="context",version="1"} 0
nv_trt_llm_request_metrics{model="MODEL",request_type="scheduled",version="1"} <<running>>
nv_trt_llm_request_metrics{model="MODEL",request_type="max",version="1"} <<capacity>>
nv_trt_llm_request_metrics{model="MODEL",request_type="active",version="1"} <<active>>
# HELP nv_trt_llm_runtime_memory_metrics TRT LLM runtime memory metrics
# TYPE nv_trt_llm_runtime_memory_metrics gauge
nv_trt_llm_runtime_memory_metrics{memory_type="pinned",model="MODEL",version="1"} 0
nv_trt_llm_runtime_memory_metrics{memory_type="gpu",model="MODEL",version="1"} 1610895360
nv_trt_llm_runtime_memory_metrics{memory_type="cpu",model="MODEL",version="1"} 0
# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="MODEL",version="1"} <<kv>>
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="reused",model="MODEL",version="1"} \
<<reused_blocks>>
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="MODEL",version="1"} 16
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="MODEL",version="1"} \
<<kv_used_blocks>>
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free",model="MODEL",version="1"} \
<<kv_free_blocks>>
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="MODEL",version="1"} \
<<kv_max_blocks>>
# HELP nv_trt_llm_inflight_batcher_metrics TRT LLM inflight batcher metrics
# TYPE nv_trt_llm_inflight_batcher_metrics gauge
nv_trt_llm_inflight_batcher_metrics{inflight_batcher_specific_metric="micro_batch_id",\
model="MODEL",version="1"} 0
nv_trt_llm_inflight_batcher_metrics{inflight_batcher_specific_metric="generation_requests",\
model="MODEL",version="1"} <<running>>
nv_trt_llm_inflight_batcher_metrics{inflight_batcher_specific_metric="total_context_tokens",\
model="MODEL",version="1"} 0
# HELP nv_trt_llm_general_metrics General TRT LLM metrics
# TYPE nv_trt_llm_general_metrics gauge
nv_trt_llm_general_metrics{general_type="iteration_counter",model="MODEL",version="1"} <<decodes>>
nv_trt_llm_general_metrics{general_type="timestamp",model="MODEL",version="1"} <<start>>"""
_TRITON_HOST = (
    ("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", "<<kv>>", True),
    ("nv_gpu_memory_total_bytes", "GPU total memory, in bytes", "85899345920", True),
    ("nv_gpu_memory_used_bytes", "GPU used memory, in bytes", "77309411328", True),
    ("nv_gpu_power_usage", "GPU power usage in watts", "312.47", True),
    ("nv_gpu_power_limit", "GPU power management limit in watts", "700", True),
    ("nv_energy_consumption", "GPU energy consumption in joules since the start", "93841552", True),
    ("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", "0.0412", False),
    ("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", "2164113653760", False),
    ("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", "93451292672", False),
)


_TRITON_GPU = 'gpu_uuid="GPU-5a1c7bd3-24f6-8b3e-9f3c-0d1e9b7c2a41"'


def triton_source(model: str) -> str:
    out = []
    for name, text, value in _TRITON_COUNTERS:
        full = f"nv_inference_{name}"
        out += [f"# HELP {full} {text}", f"# TYPE {full} counter"]
        reason = 'reason="OTHER",' if name == "request_failure" else ""
        for m in _TRITON_MODELS:
            # Only the ensemble and the TRT-LLM model count live; the rest stay as written.
            live = value if m in ("ensemble", "MODEL") or "<<" not in value else "0"
            out.append(f'{full}{{{reason}model="{m}",version="1"}} {live}')
    out += [
        "# HELP nv_inference_pending_request_count Instantaneous number of pending requests "
        "awaiting execution per-model.",
        "# TYPE nv_inference_pending_request_count gauge",
        *(
            f'nv_inference_pending_request_count{{model="{m}",version="1"}} '
            + ("<<waiting>>" if m == "MODEL" else "0")
            for m in _TRITON_MODELS
        ),
        _TRITON_TRT.replace("\\\n", ""),
    ]
    for name, text, value, gpu in _TRITON_HOST:
        kind = "counter" if name == "nv_energy_consumption" else "gauge"
        out += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        out.append(f"{name}{{{_TRITON_GPU}}} {value}" if gpu else f"{name} {value}")
    return "\n".join(out).replace("MODEL", model)


_TRITON_GPU = 'gpu_uuid="GPU-5a1c7bd3-24f6-8b3e-9f3c-0d1e9b7c2a41"'


def _rust_int(value: float) -> str:
    return str(round(value))


def _tgi_duration_buckets() -> list[float]:
    # router/src/server.rs: 35 buckets from 0.0001 * 1.5, each 1.5 times the last.
    buckets, value = [], 0.0001
    for _ in range(35):
        value *= 1.5
        buckets.append(value)
    return buckets


_TGI_LIVE = (
    ("tgi_request_count", "counter", "Total number of requests", "<<admitted>>"),
    ("tgi_request_success", "counter", "Number of successful requests", "<<success>>"),
    ("tgi_request_failure", "counter", "", '{err="validation"} 2'),
    ("tgi_queue_size", "gauge", "Current queue size", "<<waiting>>"),
    ("tgi_batch_current_size", "gauge", "Current batch size", "<<running>>"),
    ("tgi_batch_current_max_tokens", "gauge", "Maximum tokens for the current batch")
    + ("<<kv_used_tokens>>",),
    ("tgi_request_input_count", "counter", "Total number of input tokens") + ("<<prompt_tokens>>",),
    ("tgi_request_generated_tokens_count", "counter", "Total number of generated tokens")
    + ("<<gen_tokens>>",),
)


def tgi_source(max_input: int = 511, max_total: int = 512) -> str:
    """TGI's router page: blank line after every family, counters without ``_total``."""
    blocks: list[list[str]] = []
    for name, kind, text, value in _TGI_LIVE:
        lines = [f"# HELP {name} {text}"] if text else []
        sample = f"{name}{value}" if value.startswith("{") else f"{name} {value}"
        blocks.append([*lines, f"# TYPE {name} {kind}", sample])
    blocks.append(
        [
            "# HELP tgi_batch_inference_count Inference calls per method (prefill or decode)",
            "# TYPE tgi_batch_inference_count counter",
            'tgi_batch_inference_count{method="decode"} <<decodes>>',
            'tgi_batch_inference_count{method="prefill"} <<admitted>>',
        ]
    )
    sized = (
        ("tgi_request_input_length", "Input token length per request", max_input / 100, 100),
        ("tgi_request_max_new_tokens", "Maximum new tokens per request", max_total / 100, 100),
        ("tgi_request_generated_tokens", "Generated tokens per request", max_total / 100, 100),
        ("tgi_batch_next_size", "Batch size of the next batch", 1.0, 1024),
    )
    for name, text, step, n in sized:
        buckets = [round(step * (i + 1), 10) for i in range(n)]
        lines = hist(name, "", buckets, 4109, step * n / 3, value=_rust_int, sum_value=repr)
        blocks.append([f"# HELP {name} {text}", f"# TYPE {name} histogram", *lines])
    durations = _tgi_duration_buckets()
    for name, text, methods, typical in (
        ("tgi_request_duration", "Request duration", ("",), 2.4),
        ("tgi_request_validation_duration", "Request validation duration", ("",), 0.0004),
        ("tgi_request_queue_duration", "Request queue duration", ("",), 0.02),
        ("tgi_request_inference_duration", "Request inference duration", ("",), 2.2),
        ("tgi_request_mean_time_per_token_duration", "Mean time per token", ("",), 0.02),
        ("tgi_batch_forward_duration", "Batch forward duration", ("decode", "prefill"), 0.02),
        ("tgi_batch_decode_duration", "Batch decode duration", ("decode", "prefill"), 0.0003),
        ("tgi_batch_filter_duration", "Batch filter duration", ("decode", "prefill"), 0.0002),
        ("tgi_batch_inference_duration", "Batch inference duration", ("decode", "prefill"), 0.03),
    ):
        lines = [f"# HELP {name} {text}", f"# TYPE {name} histogram"]
        for method in methods:
            labels = f'method="{method}",' if method else ""
            lines += hist(name, labels, durations, 4109, typical, value=_rust_int, sum_value=repr)
        blocks.append(lines)
    return "\n\n".join("\n".join(b) for b in blocks) + "\n"
