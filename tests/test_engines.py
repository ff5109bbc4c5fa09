from __future__ import annotations

import math
from pathlib import Path

import pytest

from poller.errors import ConfigError, ContractError, ParseError
from poller.scrape.engines import ENGINE_SPECS, mapping_for
from poller.scrape.parse import Sample, parse_all
from poller.stats import Signals, prefix_hit_rate

DATA = Path(__file__).parent / "data"
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
QWEN = "Qwen/Qwen2.5-Coder-1.5B-Instruct"


def read(engine: str, page: str, **overrides: list[str]) -> Signals:
    return mapping_for(engine, overrides).read((DATA / page).read_bytes(), "text/plain")


# page -> (engine, running, waiting, kv, gauge hit rate, hits, queries, models)
EXPECTED = {
    "vllm-v1-synthetic-61k.txt": ("vllm", 17, 3, 0.4237, None, 1.582691e6, 5.314951e6, (LLAMA,)),
    "vllm-v1-dp-lora-handwritten.txt": (
        "vllm",
        32,
        3,
        0.4237,
        None,
        1.582691e6 + 1.40113e6,
        5.314951e6 + 4.90221e6,
        (LLAMA,),
    ),
    "vllm-v0-0.5-datadog-opt125m.txt": (
        "vllm",
        0,
        0,
        0.0,
        None,
        None,
        None,
        ("facebook/opt-125m",),
    ),
    "vllm-datadog-mixed-v0-v1-opt125m.txt": (
        "vllm",
        0,
        0,
        0.0,
        None,
        64.0,
        117.0,
        ("facebook/opt-125m",),
    ),
    "vllm-v0-0.7-aibrix-docs-lora-info-partial.txt": ("vllm", 0, 0, 0.0, None, None, None, (QWEN,)),
    "vllm-v0-0.7-handwritten.txt": ("vllm", 4, 2, 0.0731, None, None, None, (QWEN,)),
    "sglang-0.4-docs-llama31-8b.txt": (
        "sglang",
        162,
        2826,
        0.28,
        0.007507552643049313,
        None,
        None,
        (LLAMA,),
    ),
    "sglang-0.5.10-datadog-opt125m.txt": (
        "sglang",
        0,
        0,
        0.25,
        None,
        1.0,
        5.0,
        ("facebook/opt-125m",),
    ),
    "sglang-0.5-ranks-handwritten.txt": (
        "sglang",
        202,
        30,
        0.31,
        None,
        61033.0,
        8.128902e6,
        (LLAMA,),
    ),
    "llamacpp-early-2025-handwritten.txt": ("llamacpp", 1, 0, 0.2314, None, None, None, ()),
    "llamacpp-late-2025-handwritten.txt": ("llamacpp", 2, 1, None, None, None, None, ()),
    "trtllm-prefixed-handwritten.txt": ("trtllm", 3, 1, 0.1939, None, 163840.0, 401233.0, ()),
    "triton-trtllm-handwritten.txt": (
        "triton",
        6,
        2,
        0.193942,
        None,
        None,
        None,
        ("tensorrt_llm",),
    ),
    "tgi-handwritten.txt": ("tgi", 12, 4, None, None, None, None, ()),
    "tgi-datadog-payload-excerpt.txt": ("tgi", 0, 0, None, None, None, None, ()),
}


@pytest.mark.parametrize("page", sorted(EXPECTED))
def test_every_page_yields_its_signals(page: str) -> None:
    engine, running, waiting, kv, gauge, hits, queries, models = EXPECTED[page]
    s = read(engine, page)
    assert (s.engine, s.running, s.waiting) == (engine, running, waiting)
    assert s.kv_cache_usage == (None if kv is None else pytest.approx(kv))
    assert s.prefix_cache_hit_rate == gauge
    assert (s.prefix_cache_hits_total, s.prefix_cache_queries_total) == (hits, queries)
    assert s.models == models


def test_every_page_in_data_is_covered() -> None:
    pages = {p.name for p in DATA.glob("*.txt")}
    assert pages - set(EXPECTED) == {"trtllm-unprefixed-handwritten.txt"}


def test_vllm_lora_takes_the_newest_series() -> None:
    s = read("vllm", "vllm-v1-synthetic-61k.txt")
    assert (s.lora_running, s.lora_waiting, s.lora_max) == (("sql-lora", "chat-lora"), (), 4)
    dp = read("vllm", "vllm-v1-dp-lora-handwritten.txt")
    assert (dp.lora_running, dp.lora_waiting, dp.lora_max) == (
        ("sql-lora", "chat-lora"),
        ("math-lora",),
        4,
    )
    assert dp.sources["lora"] == "vllm:lora_requests_info"


def test_vllm_lora_disabled_means_no_adapters() -> None:
    s = read("vllm", "vllm-v0-0.7-aibrix-docs-lora-info-partial.txt")
    assert (s.lora_running, s.lora_waiting, s.lora_max) == ((), (), 0)
    assert read("vllm", "vllm-v0-0.5-datadog-opt125m.txt").lora_max is None


def test_vllm_minus_one_hit_rate_is_absent() -> None:
    s = read("vllm", "vllm-v0-0.7-handwritten.txt")
    assert s.prefix_cache_hit_rate is None and "prefix_cache_hit_rate" not in s.sources


def test_sglang_uses_its_gauge_without_counters() -> None:
    s = read("sglang", "sglang-0.4-docs-llama31-8b.txt")  # prompt tokens, no cached tokens
    assert s.prefix_cache_hits_total is None and s.sources["prefix_cache_hit_rate"] == (
        "sglang:cache_hit_rate"
    )
    page = (
        b"sglang:num_running_reqs 1\nsglang:num_queue_reqs 0\nsglang:token_usage 0.5\n"
        b'sglang:cache_hit_rate{tp_rank="0"} 0.25\nsglang:cache_hit_rate{tp_rank="1"} 0.75\n'
    )
    g = mapping_for("sglang").read(page)
    assert g.prefix_cache_hit_rate == 0.5 and g.prefix_cache_hits_total is None


def test_sglang_absent_hits_counter_means_zero() -> None:
    page = (
        b"sglang:num_running_reqs 1\nsglang:num_queue_reqs 0\nsglang:token_usage 0.5\n"
        b"sglang:prompt_tokens_total 400\n"
    )
    s = mapping_for("sglang").read(page)
    assert (s.prefix_cache_hits_total, s.prefix_cache_queries_total) == (0.0, 400.0)


def test_sglang_kv_from_token_counts_when_usage_is_missing() -> None:
    page = (
        b"sglang:num_running_reqs 1\nsglang:num_queue_reqs 0\n"
        b"sglang:num_used_tokens 250\nsglang:max_total_num_tokens 1000\n"
    )
    s = mapping_for("sglang").read(page)
    assert s.kv_cache_usage == 0.25
    assert s.sources["kv_cache_usage"] == "sglang:num_used_tokens/sglang:max_total_num_tokens"


def test_sglang_underscore_spelling() -> None:
    page = b"sglang_num_running_reqs 3\nsglang_num_queue_reqs 1\nsglang_token_usage 0.1\n"
    s = mapping_for("sglang").read(page)
    assert (s.running, s.waiting, s.kv_cache_usage) == (3, 1, 0.1)


def test_triton_falls_back_to_block_counts() -> None:
    page = (
        b'nv_trt_llm_request_metrics{request_type="scheduled"} 4\n'
        b'nv_trt_llm_request_metrics{request_type="active"} 9\n'
        b'nv_inference_pending_request_count{model="m"} 7\n'
        b'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used"} 25\n'
        b'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"} 100\n'
    )
    s = mapping_for("triton").read(page)
    assert (s.running, s.waiting, s.kv_cache_usage) == (4, 7, 0.25)


def test_trtllm_unprefixed_names_and_old_pages() -> None:
    page = b"num_requests_running 2\nnum_requests_waiting 5\nkv_cache_utilization 0.5\n"
    s = mapping_for("trtllm").read(page)
    assert (s.running, s.waiting, s.kv_cache_usage) == (2, 5, 0.5)
    # early trtllm-serve published only histograms: a contract violation, clearly named
    with pytest.raises(ContractError) as err:
        read("trtllm", "trtllm-unprefixed-handwritten.txt")
    assert err.value.missing[0] == "trtllm_num_requests_running|num_requests_running"


def test_trtllm_json_metrics_is_a_parse_error() -> None:
    with pytest.raises(ParseError, match="application/json"):
        mapping_for("trtllm").read(b'[{"numActiveRequests": 3}]', "application/json")
    with pytest.raises(ParseError, match="not Prometheus text"):
        mapping_for("trtllm").read(b'[{"numActiveRequests": 3}]', "text/plain")
    assert ENGINE_SPECS["trtllm"].metrics_path == "/prometheus/metrics"


def test_missing_required_metrics_are_listed() -> None:
    page = b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n"
    with pytest.raises(ContractError) as err:
        mapping_for("vllm").read(page)
    assert err.value.missing == (
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc|vllm:gpu_cache_usage_perc",
    )
    assert err.value.reason == "contract"
    assert "vllm:num_requests_waiting" in str(err.value)


def test_nan_values_count_as_missing() -> None:
    page = b"llamacpp:requests_processing NaN\nllamacpp:requests_deferred 0\n"
    with pytest.raises(ContractError) as err:
        mapping_for("llamacpp").read(page)
    assert err.value.missing == ("llamacpp:requests_processing",)


def test_usage_takes_the_max_and_is_capped() -> None:
    page = (
        b'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_running{engine="1"} 2\n'
        b'vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc{engine="0"} 0.2\n'
        b'vllm:kv_cache_usage_perc{engine="1"} 1.0000001\n'
    )
    s = mapping_for("vllm").read(page)
    assert (s.running, s.kv_cache_usage) == (3, 1.0)


def test_overrides_replace_a_renamed_metric() -> None:
    page = (
        b"my_running 5\nvllm:num_requests_waiting 1\nvllm:kv_cache_usage_perc 0.1\n"
        b"my_hits_total 10\nmy_queries_total 40\n"
    )
    m = mapping_for(
        "vllm",
        {
            "running": ["my_running"],
            "prefix_cache_hits": ["my_hits_total"],
            "prefix_cache_queries": ["my_queries_total"],
        },
    )
    assert "my_running" in m.wanted and "vllm:num_requests_running" not in m.wanted
    s = m.read(page)
    assert (s.running, s.prefix_cache_hits_total, s.prefix_cache_queries_total) == (5, 10, 40)
    assert s.sources["running"] == "my_running"
    with pytest.raises(ConfigError, match="override both"):
        mapping_for("tgi", {"prefix_cache_hits": ["x"]})
    with pytest.raises(KeyError):
        mapping_for("nope")


def test_mappings_are_cached() -> None:
    assert mapping_for("vllm") is mapping_for("vllm", {})


def test_external_is_never_scraped() -> None:
    assert not ENGINE_SPECS["external"].scraped
    assert all(spec.scraped for name, spec in ENGINE_SPECS.items() if name != "external")


def test_extract_works_on_samples() -> None:
    samples = [Sample("tgi_queue_size", {}, 2.0), Sample("tgi_batch_current_size", {}, 1.0)]
    s = mapping_for("tgi").extract(samples)
    assert (s.running, s.waiting) == (1, 2)


@pytest.mark.parametrize("page", sorted(EXPECTED))
def test_extraction_agrees_with_the_full_parse(page: str) -> None:
    """The fast path (parse only wanted names) equals extracting from every sample."""
    engine = EXPECTED[page][0]
    m = mapping_for(engine)
    text = (DATA / page).read_text()
    assert m.extract(parse_all(text)) == m.read(text.encode())


# --- windowed prefix-cache hit rate from counters ---------------------------------------------


def test_hit_rate_over_the_window() -> None:
    assert prefix_hit_rate(150, 300, 100, 200, None) == 0.5
    assert prefix_hit_rate(100, 200, None, None, None) == 0.5  # no previous: lifetime
    assert prefix_hit_rate(100, 200, 100, 200, 0.3) == 0.3  # idle window keeps the rate
    assert prefix_hit_rate(10, 20, 100, 200, 0.3) == 0.5  # counter reset: since restart
    assert prefix_hit_rate(0, 0, None, None, None) is None
    assert prefix_hit_rate(None, None, 1, 2, 0.5) is None
    assert not math.isnan(prefix_hit_rate(5, 10, 5, 10, None) or 0.0)
