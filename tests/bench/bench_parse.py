"""Time poller.scrape.parse against prometheus_client's full parser on one /metrics page.

Usage: python tests/bench/bench_parse.py [PAGE]   (default: the 61 KB vLLM V1 page)

Prints the median microseconds per page for each parser and the speed-up, then checks
that the wanted samples equal prometheus_client's; exits 1 on a mismatch.
"""

from __future__ import annotations

import math
import statistics
import sys
import timeit
from collections import Counter
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from poller.scrape.parse import Sample, Selector, decode_body, parse, parse_all  # noqa: E402

DEFAULT_PAGE = ROOT / "tests" / "data" / "vllm-v1-synthetic-61k.txt"
VLLM_WANTED = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_hit_rate",
    "vllm:lora_requests_info",
    "vllm:num_requests_swapped",
]
REPEATS = 7

Key = tuple[str, tuple[tuple[str, str], ...], float | str]


def median_us(fn: Callable[[], object]) -> float:
    """Median over REPEATS runs of the per-call time, each run lasting >= 0.2 s."""
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()
    return statistics.median(timer.repeat(REPEATS, number)) / number * 1e6


def key(name: str, labels: dict[str, str], value: float) -> Key:
    return (name, tuple(sorted(labels.items())), "NaN" if math.isnan(value) else float(value))


def reference(text: str, wanted: set[str], written: set[str]) -> Counter[Key]:
    """prometheus_client's wanted samples, with counters named as written on the page."""
    out: Counter[Key] = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name
            # It appends _total to counter samples whose TYPE line lacks it.
            if family.type == "counter" and name not in written and name[:-6] in written:
                name = name[:-6]
            if name in wanted:
                out[key(name, s.labels, s.value)] += 1
    return out


def main(argv: list[str]) -> int:
    page = Path(argv[1]) if len(argv) > 1 else DEFAULT_PAGE
    body = page.read_bytes()
    text = decode_body(body)
    selector = Selector(VLLM_WANTED)
    everything = parse_all(text)
    ours: list[Sample] = parse(text, selector)

    median_us(lambda: parse(text, selector))  # warm-up: the first timing ran ~30% slow
    timings = {
        "parse, Selector": median_us(lambda: parse(text, selector)),
        "parse, list of names": median_us(lambda: parse(text, VLLM_WANTED)),
        "parse_all": median_us(lambda: parse_all(text)),
        "prometheus_client": median_us(lambda: list(text_string_to_metric_families(text))),
    }
    print(f"page: {page} ({len(body)} bytes, {len(everything)} samples)")
    print(f"wanted: {len(VLLM_WANTED)} vLLM names, {len(ours)} samples found")
    for label, us in timings.items():
        print(f"  {label:<22} {us:>10.1f} us/page")
    ratio = timings["prometheus_client"] / timings["parse, Selector"]
    print(f"ratio prometheus_client / parse: {ratio:.0f}x")

    expected = reference(text, set(VLLM_WANTED), {s.name for s in everything})
    got = Counter(key(*s) for s in ours)
    if got != expected:
        print("MISMATCH against prometheus_client")
        for k in sorted(got - expected, key=repr):
            print(f"  only ours:              {k}")
        for k in sorted(expected - got, key=repr):
            print(f"  only prometheus_client: {k}")
        return 1
    print(f"values: OK ({len(ours)} samples identical to prometheus_client's)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
