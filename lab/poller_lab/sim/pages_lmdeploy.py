"""LMDeploy's page: ``lmdeploy serve api_server ... --enable-metrics``.

Names, help texts and buckets follow ``lmdeploy/metrics/loggers.py``
(``PrometheusStatLogger``): one logger per data-parallel rank, every series labelled
``model_name`` and ``engine`` (the rank), written by prometheus_client with created
samples disabled. The API-handle queue is empty in the simulation (requests the model
admits go straight to the engine).
"""

from __future__ import annotations

from poller_lab.sim.templates import fmt_go
from poller_lab.sim.templates import histogram as hist

__all__ = ["lmdeploy_source"]

# (name, help, value) of the gauges the scheduler stats set.
_GAUGES = (
    ("num_requests_succeeded", "Number of current succeeded requests.", "<<success>>"),
    ("num_requests_failed", "Number of current failed requests.", "0.0"),
    ("num_api_requests_routed", "Number of requests routed to request handles.", "<<active>>"),
    ("num_api_requests_waiting", "Number of requests waiting for free request handles.", "0.0"),
    ("num_requests_running", "Number of requests in model execution batches.", "<<running>>"),
    ("num_requests_waiting", "Number of requests waiting to be processed.", "<<waiting>>"),
    ("gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", "<<kv>>"),
    ("prefix_cache_hit_rate", "Prefix cache hit rate.", "<<batch_hit_rate>>"),
)
_COUNTERS = (
    ("prompt_tokens_total", "Number of prefill tokens processed.", "<<prompt_tokens>>"),
    ("generation_tokens_total", "Number of generation tokens processed.", "<<gen_tokens>>"),
)
_TTFT: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
_TTFT += (7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
_TPOT += (5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY: tuple[float, ...] = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
)
_LATENCY += (60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def _go(value: float) -> str:
    return fmt_go(value).decode()


def lmdeploy_source(model: str) -> str:
    labels = f'<<R>>model_name="{model}"'
    out: list[str] = []
    for name, text, value in _GAUGES:
        full = f"lmdeploy:{name}"
        out += [f"# HELP {full} {text}", f"# TYPE {full} gauge", f"{full}{{{labels}}} {value}"]
    for name, text, value in _COUNTERS:
        family = f"lmdeploy:{name.removesuffix('_total')}"
        out += [f"# HELP {family} {text}", f"# TYPE {family} counter"]
        out.append(f"lmdeploy:{name}{{{labels}}} {value}")
    for name, text, buckets, typical in (
        ("time_to_first_token_seconds", "time to first token in seconds", _TTFT, 0.4),
        ("time_per_output_token_seconds", "time per output token in seconds", _TPOT, 0.03),
        ("e2e_request_latency_seconds", "e2e request latency in seconds", _LATENCY, 9.0),
        ("request_queue_time_seconds", "time spent in WAITING phase for request", _LATENCY, 0.5),
    ):
        full = f"lmdeploy:{name}"
        out += [f"# HELP {full} Histogram of {text}.", f"# TYPE {full} histogram"]
        out += hist(full, labels + ",", buckets, 4812, typical, value=_go)
    return "\n".join(out)
