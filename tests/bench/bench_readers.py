"""Gateway scale: what 0, 1, 8 and 24 cached readers cost Redis and themselves.

Usage: python tests/bench/bench_readers.py [--endpoints 1000] [--window 8] [--json]

One ``poller run`` over N simulated vLLM endpoints at 1 s against an embedded
redis-server, then one window per reader count (reader processes); see
``lab/poller_lab/bench_readers.py`` for what each column measures. The same as
``poller bench --section readers``. Takes about 1-2 minutes; the machine is shared and
noisy, so compare runs, not single numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

from poller_lab.bench import BenchConfig, run_bench  # noqa: E402
from poller_lab.bench_readers import format_readers  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoints", type=int, default=1000)
    parser.add_argument("--window", type=float, default=8.0, help="seconds per reader count")
    parser.add_argument("--json", action="store_true", help="JSON on stdout, table on stderr")
    args = parser.parse_args(argv)
    cfg = BenchConfig(endpoints=args.endpoints, duration_s=args.window, sections=("readers",))
    result = run_bench(cfg)
    table = format_readers(result["readers"]) + f"\n(took {result['elapsed_s']} s)"
    print(table, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
