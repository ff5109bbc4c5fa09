"""KV capacity in tokens and waiting by reason, read from engine pages.

Captured pages (tests/data/SOURCES.md) where they carry the metric; hand-written pages
whose names and labels come from the engines' source otherwise (docs/engines.md).
"""

from __future__ import annotations

import pytest

from poller.schema.stats import Signals, stats_fields
from poller.scrape.engines import mapping_for
from poller.scrape.sizing import MAX_REASONS
from tests.support.paths import DATA


def read(engine: str, page: str) -> Signals:
    return mapping_for(engine).read((DATA / page).read_bytes(), "text/plain")


def page_of(engine: str, text: str) -> Signals:
    return mapping_for(engine).read(text.encode(), "text/plain")


# page -> (engine, kv_capacity_tokens, waiting_by_reason)
CAPACITY = {
    # captured: num_gpu_blocks="7281" x block_size="16"
    "vllm-v0-0.5-datadog-opt125m.txt": ("vllm", 7281 * 16, {}),
    "vllm-datadog-mixed-v0-v1-opt125m.txt": ("vllm", 7281 * 16, {}),
    "vllm-v0-0.7-aibrix-docs-lora-info-partial.txt": ("vllm", 81767 * 16, {}),
    # two engines, each its own cache: the group-aware kv_cache_size_tokens is preferred
    # over num_gpu_blocks x block_size (1200 x 1056 overcounts the hybrid model)
    "vllm-0.33-waiting-reasons-dp2-handwritten.txt": (
        "vllm",
        2 * 316800,
        {"capacity": 4, "deferred": 2},
    ),
    # captured: a gauge in tokens
    "sglang-0.5.10-datadog-opt125m.txt": ("sglang", 430839, {}),
    # TP ranks repeat one pool (max), DP ranks each own one (sum)
    "sglang-0.5.23-priority-tp-dp-handwritten.txt": ("sglang", 500000 + 480000, {}),
    "trtllm-1.3-kv-blocks-handwritten.txt": ("trtllm", 4096 * 32, {}),
    "triton-trtllm-handwritten.txt": ("triton", 6239 * 64, {}),
    # engines or versions that do not publish them: absent
    "vllm-0.33-sleeping-dp2-handwritten.txt": ("vllm", None, {}),
    "sglang-0.4-docs-llama31-8b.txt": ("sglang", None, {}),
    "trtllm-prefixed-handwritten.txt": ("trtllm", None, {}),
    "tgi-handwritten.txt": ("tgi", None, {}),
    "lmdeploy-0.18-dp2-handwritten.txt": ("lmdeploy", None, {}),
    "llamacpp-b11434-real-idle.txt": ("llamacpp", None, {}),
}


@pytest.mark.parametrize("page", sorted(CAPACITY))
def test_each_page_gives_its_capacity_and_reasons(page: str) -> None:
    engine, capacity, reasons = CAPACITY[page]
    signals = read(engine, page)
    assert signals.kv_capacity_tokens == capacity
    assert signals.waiting_by_reason == reasons
    assert ("kv_capacity_tokens" in signals.sources) == (capacity is not None)
    fields = stats_fields(signals, prefix_cache_hit_rate=None, scrape_ms=1.0, interval_ms=1000)
    assert fields.get("kv_capacity_tokens") == (None if capacity is None else str(capacity))


def test_reasons_add_up_to_waiting_on_vllm() -> None:
    signals = read("vllm", "vllm-0.33-waiting-reasons-dp2-handwritten.txt")
    assert sum(signals.waiting_by_reason.values()) == signals.waiting
    assert signals.sources["waiting_by_reason"] == "vllm:num_requests_waiting_by_reason by reason"
    fields = stats_fields(signals, prefix_cache_hit_rate=None, scrape_ms=1.0, interval_ms=1000)
    assert fields["waiting_by_reason"] == "capacity:4,deferred:2"


VLLM_HEAD = (
    'vllm:num_requests_running{engine="0"} 1\n'
    'vllm:num_requests_waiting{engine="0"} 2\n'
    'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
)


def info(**labels: str) -> str:
    text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"vllm:cache_config_info{{{text}}} 1.0\n"


def test_vllm_capacity_from_blocks_when_the_token_label_is_not_a_number() -> None:
    # before the KV cache is sized vLLM writes "None"; an older page has no such label
    page = VLLM_HEAD + info(block_size="16", num_gpu_blocks="100", kv_cache_size_tokens="None")
    assert page_of("vllm", page).kv_capacity_tokens == 1600
    for blocks in ("None", "", "-5", "1e3", "٣"):
        page = VLLM_HEAD + info(block_size="16", num_gpu_blocks=blocks)
        assert page_of("vllm", page).kv_capacity_tokens is None, blocks
    # zero blocks cannot serve: unknown, not a capacity of 0
    assert (
        page_of("vllm", VLLM_HEAD + info(block_size="16", num_gpu_blocks="0")).kv_capacity_tokens
        is None
    )
    # a product past 2**53 is not a number readers can hold exactly
    huge = info(block_size="9999999999999999", num_gpu_blocks="9999999999999999")
    assert page_of("vllm", VLLM_HEAD + huge).kv_capacity_tokens is None


def test_odd_reason_labels_are_left_out_and_their_number_capped() -> None:
    lines = [
        f'vllm:num_requests_waiting_by_reason{{engine="0",reason="{reason}"}} 1\n'
        for reason in ("ok", "with space", "a,b", "c:d", "", "x" * 65)
    ]
    lines.append('vllm:num_requests_waiting_by_reason{engine="0"} 1\n')  # no reason label
    lines.append('vllm:num_requests_waiting_by_reason{engine="0",reason="nan"} NaN\n')
    assert page_of("vllm", VLLM_HEAD + "".join(lines)).waiting_by_reason == {"ok": 1}
    many = "".join(
        f'vllm:num_requests_waiting_by_reason{{engine="0",reason="r{n:02d}"}} {n}\n'
        for n in range(40)
    )
    got = page_of("vllm", VLLM_HEAD + many).waiting_by_reason
    assert list(got) == [f"r{n:02d}" for n in range(MAX_REASONS)]


def test_trtllm_capacity_needs_both_gauges() -> None:
    head = (
        "trtllm_num_requests_running 1\ntrtllm_num_requests_waiting 0\n"
        "trtllm_kv_cache_utilization 0.1\n"
    )
    assert page_of("trtllm", head + "trtllm_kv_cache_max_blocks 10\n").kv_capacity_tokens is None
    both = head + "trtllm_kv_cache_max_blocks 10\ntrtllm_kv_cache_tokens_per_block 64\n"
    assert page_of("trtllm", both).kv_capacity_tokens == 640


def test_sgl_router_spelling_is_read_too() -> None:
    page = (
        "sglang_num_running_reqs 1\nsglang_num_queue_reqs 0\nsglang_token_usage 0.1\n"
        "sglang_max_total_num_tokens 4096\n"
    )
    assert page_of("sglang", page).kv_capacity_tokens == 4096


@pytest.mark.parametrize(
    ("engine", "ranks"), [("vllm", 2), ("sglang", 2), ("trtllm", 1), ("triton", 1)]
)
def test_simulated_pages_publish_them(engine: str, ranks: int) -> None:
    from poller_lab.sim.engines import ENGINES, template_for
    from poller_lab.sim.model import EndpointLoad, LoadParams
    from poller_lab.sim.templates import render

    load = EndpointLoad(LoadParams(capacity=8, load=1.5), seed="s", t0=0.0, ranks=ranks)
    load.advance_to(300.0)
    page = render(template_for(engine, ENGINES[engine].model, ranks, False), load, 0.0)
    signals = mapping_for(ENGINES[engine].registry_engine).read(page, "text/plain")
    # the bundled vLLM page's cache_config_info: num_gpu_blocks="28642", block_size="16"
    assert signals.kv_capacity_tokens == ranks * 28642 * 16
    if engine == "vllm":
        waiting = sum(s.waiting for s in load.states)
        assert waiting > 0 and signals.waiting_by_reason == {"capacity": waiting, "deferred": 0}
    else:
        assert signals.waiting_by_reason == {}
