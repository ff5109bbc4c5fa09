from __future__ import annotations

import math

import pytest

from poller.config import ScrapeSettings, load_settings
from poller.errors import ConfigError, ContractError, ParseError
from poller.schema.endpoint import endpoint_from_dict
from poller.schema.stats import Signals, prefix_hit_rate
from poller.scrape.engines import ENGINE_SPECS, mapping_for, mapping_for_endpoint
from poller.scrape.http.client import metrics_url
from poller.scrape.parse import Sample, parse_all
from tests.support.paths import DATA

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
    # priority="" totals only, tp_rank max, dp_rank summed; every cache_source summed
    "sglang-0.5.23-priority-tp-dp-handwritten.txt": (
        "sglang",
        7,
        4,
        0.41,
        None,
        5500.0,
        20000.0,
        ("Qwen/Qwen3-8B",),
    ),
    # waiting = engine queue (1 + 2) + API queue (2 + 0); gauge mean of the two engines
    "lmdeploy-0.18-dp2-handwritten.txt": (
        "lmdeploy",
        8,
        5,
        0.62,
        0.3,
        None,
        None,
        ("internlm/internlm3-8b-instruct",),
    ),
    "vllm-0.33-sleeping-dp2-handwritten.txt": (
        "vllm",
        0,
        0,
        0.0,
        None,
        30720.0,
        122880.0,
        ("Qwen/Qwen3-8B",),
    ),
    # waiting is the total; the breakdown by reason is read beside it (test_sizing.py)
    "vllm-0.33-waiting-reasons-dp2-handwritten.txt": (
        "vllm",
        14,
        6,
        0.71,
        None,
        24576.0,
        98304.0,
        ("Qwen/Qwen3-Next-80B-A3B-Instruct",),
    ),
    "trtllm-1.3-kv-blocks-handwritten.txt": ("trtllm", 5, 2, 0.25, 0.5, None, None, ()),
    # queries = cached + prompt (prompt_tokens_total excludes cached tokens now)
    "llamacpp-b11434-busy-handwritten.txt": ("llamacpp", 3, 2, None, None, 3600.0, 4800.0, ()),
    "llamacpp-b11434-real-idle.txt": ("llamacpp", 0, 0, None, None, 0.0, 0.0, ()),
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
    assert pages - set(EXPECTED) == set(CONTRACT_FAILURES)


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


def test_vllm_lora_reads_every_data_parallel_engines_series() -> None:
    # Each engine sets its own combination at every step, on one family without an engine
    # label: engine 0 runs a, engine 1 runs b and waits for c, 10 ms apart. A combination
    # last set 5 s before the newest is no engine's now.
    page = "\n".join(
        [
            *(f'vllm:num_requests_running{{engine="{e}"}} 2' for e in "01"),
            *(f'vllm:num_requests_waiting{{engine="{e}"}} 0' for e in "01"),
            *(f'vllm:kv_cache_usage_perc{{engine="{e}"}} 0.1' for e in "01"),
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",'
            'waiting_lora_adapters=""} 1761200060.0',
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a",'
            'waiting_lora_adapters=""} 1761200065.00',
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="b",'
            'waiting_lora_adapters="c"} 1761200065.01',
        ]
    )
    s = mapping_for("vllm").read((page + "\n").encode())
    assert (s.lora_running, s.lora_waiting, s.lora_max) == (("b", "a"), ("c",), 4)


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


# --- engines as they ship today ------------------------------------------------------------

# Pages that fail the contract by design: page -> (engine, words the detail must carry).
CONTRACT_FAILURES = {
    "trtllm-unprefixed-handwritten.txt": ("trtllm", ("1.3.0rc12", "return_perf_metrics")),
    "triton-llmapi-handwritten.txt": ("triton", ("llmapi", "registers no load metrics")),
}


@pytest.mark.parametrize("page", sorted(CONTRACT_FAILURES))
def test_contract_failure_says_what_the_engine_must_run_with(page: str) -> None:
    engine, words = CONTRACT_FAILURES[page]
    with pytest.raises(ContractError) as err:
        read(engine, page)
    for word in words:
        assert word in err.value.detail
    assert err.value.hint and err.value.detail.startswith(f"{engine} page lacks required")


def test_triton_llmapi_page_still_has_a_pending_count() -> None:
    with pytest.raises(ContractError) as err:
        read("triton", "triton-llmapi-handwritten.txt")
    # waiting fell back to nv_inference_pending_request_count: only running and KV miss
    assert [m.split("{")[0] for m in err.value.missing] == [
        "nv_trt_llm_request_metrics",
        "nv_trt_llm_kv_cache_block_metrics",
    ]


def test_engines_without_a_hint_keep_the_plain_detail() -> None:
    with pytest.raises(ContractError) as err:
        mapping_for("vllm").read(b"vllm:num_requests_running 1\n")
    assert err.value.hint == "" and err.value.detail.endswith("vllm:gpu_cache_usage_perc")


def _sglang(lines: list[str]) -> Signals:
    return mapping_for("sglang").read(("\n".join(lines) + "\n").encode())


def test_sglang_priority_breakdown_is_not_added_to_its_total() -> None:
    s = _sglang(
        [
            'sglang:num_running_reqs{priority=""} 5',
            'sglang:num_running_reqs{priority="0"} 3',
            'sglang:num_running_reqs{priority="1"} 2',
            'sglang:num_queue_reqs{priority=""} 4',
            'sglang:num_queue_reqs{priority="7"} 4',
            "sglang:token_usage 0.5",
        ]
    )
    assert (s.running, s.waiting) == (5, 4)  # summing every series read 10 and 8


def test_sglang_cache_sources_are_disjoint_and_summed() -> None:
    # "total" holds the requests that came without a breakdown, the others are split by
    # where their cached tokens were: no request is in two series.
    s = _sglang(
        [
            "sglang:num_running_reqs 1",
            "sglang:num_queue_reqs 0",
            "sglang:token_usage 0.5",
            "sglang:prompt_tokens_total 100",
            'sglang:cached_tokens_total{cache_source="total"} 40',
            'sglang:cached_tokens_total{cache_source="device"} 20',
            'sglang:cached_tokens_total{cache_source="storage_mooncake"} 5',
        ]
    )
    assert (s.prefix_cache_hits_total, s.prefix_cache_queries_total) == (65.0, 100.0)


def test_sglang_breakdown_without_its_total_is_summed() -> None:
    s = _sglang(
        [
            'sglang:num_running_reqs{priority="0"} 3',
            'sglang:num_running_reqs{priority="1"} 2',
            "sglang:num_queue_reqs 1",
            "sglang:token_usage 0.5",
            'sglang:prompt_tokens_total{tp_rank="0"} 100',
            'sglang:cached_tokens_total{cache_source="device",tp_rank="0"} 20',
            'sglang:cached_tokens_total{cache_source="host",tp_rank="0"} 10',
        ]
    )
    assert s.running == 5
    assert (s.prefix_cache_hits_total, s.prefix_cache_queries_total) == (30.0, 100.0)


def test_sglang_tensor_parallel_ranks_repeat_one_batch() -> None:
    # --enable-metrics-for-all-schedulers: every TP/PP/EP rank publishes the same batch
    lines = ["sglang:token_usage 0.5"]
    for dp, running in (("0", 6), ("1", 2)):
        for tp in ("0", "1", "2", "3"):
            labels = f'dp_rank="{dp}",moe_ep_rank="{tp}",pp_rank="0",tp_rank="{tp}"'
            lines += [
                f"sglang:num_running_reqs{{{labels}}} {running}",
                f"sglang:num_queue_reqs{{{labels}}} 1",
            ]
    s = _sglang(lines)
    assert (s.running, s.waiting) == (8, 2)  # max over TP ranks, sum over DP ranks


def test_sglang_token_ratio_takes_one_rank_per_batch() -> None:
    s = _sglang(
        [
            "sglang:num_running_reqs 1",
            "sglang:num_queue_reqs 0",
            'sglang:num_used_tokens{tp_rank="0"} 250',
            'sglang:num_used_tokens{tp_rank="1"} 250',
            'sglang:max_total_num_tokens{tp_rank="0"} 1000',
            'sglang:max_total_num_tokens{tp_rank="1"} 1000',
        ]
    )
    assert s.kv_cache_usage == 0.25


def test_lmdeploy_keeps_the_api_queue_as_its_own_field() -> None:
    s = read("lmdeploy", "lmdeploy-0.18-dp2-handwritten.txt")
    assert (s.waiting, s.api_waiting) == (5, 2)
    assert s.sources["api_waiting"] == "lmdeploy:num_api_requests_waiting"
    assert s.sources["waiting"] == (
        "lmdeploy:num_requests_waiting+lmdeploy:num_api_requests_waiting"
    )
    assert ENGINE_SPECS["lmdeploy"].metrics_path == "/metrics"


def test_lmdeploy_prefers_token_counters_over_its_gauge() -> None:
    page = (
        b'lmdeploy:num_requests_running{engine="0"} 1\n'
        b'lmdeploy:num_requests_waiting{engine="0"} 0\n'
        b'lmdeploy:gpu_cache_usage_perc{engine="0"} 0.1\n'
        b'lmdeploy:prefix_cache_hit_rate{engine="0"} 0.9\n'
        b'lmdeploy:cached_tokens_total{engine="0"} 30\n'
        b'lmdeploy:cached_tokens_total{engine="1"} 10\n'
        b'lmdeploy:prompt_tokens_total{engine="0"} 100\n'
        b'lmdeploy:prompt_tokens_total{engine="1"} 60\n'
    )
    s = mapping_for("lmdeploy").read(page)
    assert (s.prefix_cache_hits_total, s.prefix_cache_queries_total) == (40.0, 160.0)
    assert s.prefix_cache_hit_rate is None and s.api_waiting is None and s.waiting == 0


def _vllm_sleep(states: list[tuple[str, str, float]]) -> Signals:
    page = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n"
    for engine, state, value in states:
        page += f'vllm:engine_sleep_state{{engine="{engine}",sleep_state="{state}"}} {value}\n'
    return mapping_for("vllm").read(page.encode())


def test_vllm_sleeping_means_no_engine_is_awake() -> None:
    assert read("vllm", "vllm-0.33-sleeping-dp2-handwritten.txt").sleeping is True
    assert read("vllm", "vllm-datadog-mixed-v0-v1-opt125m.txt").sleeping is False
    one_awake = [("0", "awake", 0.0), ("0", "discard_all", 1.0), ("1", "awake", 1.0)]
    assert _vllm_sleep(one_awake).sleeping is False
    assert _vllm_sleep([("0", "awake", 0.0), ("0", "weights_offloaded", 1.0)]).sleeping is True
    # the page does not say: unknown, never "awake"
    assert _vllm_sleep([("0", "weights_offloaded", 0.0)]).sleeping is None
    assert read("vllm", "vllm-v1-synthetic-61k.txt").sleeping is None
    assert _vllm_sleep([("0", "awake", math.nan)]).sleeping is None


def test_llamacpp_hit_rate_counts_cached_prompt_tokens() -> None:
    s = read("llamacpp", "llamacpp-b11434-busy-handwritten.txt")
    assert (
        prefix_hit_rate(s.prefix_cache_hits_total, s.prefix_cache_queries_total, None, None, None)
        == 0.75
    )
    old = read("llamacpp", "llamacpp-late-2025-handwritten.txt")  # no cached counter yet
    assert old.prefix_cache_hits_total is None and "prefix_cache_hit_rate" not in old.sources


def test_stats_hash_carries_sleeping_and_api_waiting() -> None:
    from poller.schema.stats import EndpointStats, stats_fields

    for page, engine, field, text, value in (
        ("vllm-0.33-sleeping-dp2-handwritten.txt", "vllm", "sleeping", "1", True),
        ("vllm-datadog-mixed-v0-v1-opt125m.txt", "vllm", "sleeping", "0", False),
        ("lmdeploy-0.18-dp2-handwritten.txt", "lmdeploy", "api_waiting", "2", 2),
    ):
        fields = stats_fields(
            read(engine, page), prefix_cache_hit_rate=None, scrape_ms=1.0, interval_ms=1000
        )
        assert fields[field] == text
        h = {**fields, "scraped_at_ms": "1", "poller": "p", "token": "1", "seq": "1"}
        assert getattr(EndpointStats.from_hash(h), field) == value
    fields = stats_fields(
        read("tgi", "tgi-handwritten.txt"),
        prefix_cache_hit_rate=None,
        scrape_ms=1.0,
        interval_ms=1000,
    )
    assert "sleeping" not in fields and "api_waiting" not in fields
    with pytest.raises(ValueError, match="0 or 1"):
        EndpointStats.from_hash({**fields, "scraped_at_ms": "1", "sleeping": "yes"})


# --- settings below the entry (the Go poller's Mapping and Path) -------------------------------


def _settings(engines: dict[str, object]) -> ScrapeSettings:
    return load_settings(overrides={"scrape.engines": engines}, environ={}).scrape


def test_settings_sit_between_the_engine_and_the_entry() -> None:
    settings = _settings(
        {
            "vllm": {
                "metrics_path": "/engine/metrics",
                "overrides": {"running": ["site_running"], "waiting": ["site_waiting"]},
            }
        }
    )
    entry = endpoint_from_dict("a", {"url": "http://e:8000", "overrides": {"waiting": ["mine"]}})
    m = mapping_for_endpoint(entry, settings)
    assert m.metrics_path == "/engine/metrics"
    assert [str(x) for x in m.running] == ["site_running"]  # settings over the engine
    assert [str(x) for x in m.waiting] == ["mine"]  # the entry over the settings
    assert [str(x) for x in m.kv_cache_usage][0] == "vllm:kv_cache_usage_perc"  # engine default
    assert metrics_url(entry, m.metrics_path) == "http://e:8000/engine/metrics"
    own = endpoint_from_dict("b", {"url": "http://e:8000", "metrics_path": "/own"})
    assert metrics_url(own, mapping_for_endpoint(own, settings).metrics_path) == "http://e:8000/own"
    # another engine, or no settings for it: the engine's own names and path
    tgi = endpoint_from_dict("c", {"url": "http://e:8000", "engine": "trtllm"})
    assert mapping_for_endpoint(tgi, settings) is mapping_for("trtllm")
    assert mapping_for_endpoint(tgi, settings).metrics_path == "/prometheus/metrics"
    # the default engine applies to entries naming none
    default_sglang = load_settings(
        overrides={
            "scrape.default_engine": "sglang",
            "scrape.engines": {"sglang": {"metrics_path": "/m"}},
        },
        environ={},
    ).scrape
    assert mapping_for_endpoint(entry, default_sglang).engine == "sglang"
    assert mapping_for_endpoint(entry, default_sglang).metrics_path == "/m"


@pytest.mark.parametrize(
    ("engines", "message"),
    [
        ({"vllmx": {}}, "unknown engine 'vllmx'"),
        ({"external": {}}, "unknown engine 'external'"),
        ({"vllm": {"overrides": {"runing": ["x"]}}}, "unknown signal 'runing'"),
        ({"vllm": {"overrides": {"running": []}}}, "names no metric"),
        ({"vllm": {"overrides": {"running": ["bad name"]}}}, "not a metric name"),
        ({"vllm": {"metrics_path": "metrics"}}, "must start with '/'"),
        ({"vllm": {"path": "/m"}}, "unknown key `scrape.engines.vllm.path`"),
    ],
)
def test_engine_settings_are_validated(engines: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        _settings(engines)
    assert "scrape.engines" in str(err.value)


@pytest.mark.parametrize(
    "path",
    ["/metrics?model=qwen3-8b", "/metrics?model=Qwen%2FQwen3-8B", "/v1/metrics", "/m?a=1&b=2"],
)
def test_metrics_path_may_carry_a_query(path: str) -> None:
    entry = endpoint_from_dict(
        "a", {"url": "http://e:8080", "engine": "llamacpp", "metrics_path": path}
    )
    assert metrics_url(entry, "/metrics") == "http://e:8080" + path


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("metrics", "must start with '/'"),
        ("/metrics#x", "must start with '/'"),
        ("/met rics", "must start with '/'"),
        ("/metrics?model", "name=value pairs"),
        ("/metrics?model=a b", "name=value pairs"),
        ("/metrics?=x", "name=value pairs"),
        ("/metrics?model=a&", "name=value pairs"),
        ("/metrics?model=%zz", "two hex digits"),
    ],
)
def test_bad_metrics_paths_are_refused(path: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        endpoint_from_dict("a", {"url": "http://e:8080", "metrics_path": path})
