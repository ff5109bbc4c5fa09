"""The answer parser's cost per 61 KB page: ``h1.Connection`` fed as a socket would feed it.

Usage: python tests/bench/bench_h1.py [--reads 65536] [--rounds 2000] [--other FILE]

Each round is one exchange on one connection: the request "written" to a transport that
drops it, the answer handed to ``data_received`` in reads of ``--reads`` bytes, and the
reply taken. Two answers: the vLLM test page with a Content-Length, and the same page
chunked in 4 KiB chunks (as a server that streams it would send). ``--other FILE`` times
another module with the same ``Connection`` API next to ours, e.g. an earlier parser:
``git show <commit>:poller/scrape/http/h1.py > /tmp/h1_then.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from poller.scrape.http import h1  # noqa: E402

PAGE = (ROOT / "tests" / "data" / "vllm-v1-synthetic-61k.txt").read_bytes()
WIRE = b"GET /metrics HTTP/1.1\r\nHost: e\r\n\r\n"


def answers() -> dict[str, bytes]:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(PAGE[i : i + 4096]), PAGE[i : i + 4096])
        for i in range(0, len(PAGE), 4096)
    )
    return {
        "content-length": head + b"Content-Length: %d\r\n\r\n" % len(PAGE) + PAGE,
        "chunked": head + b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n",
    }


class _Transport(asyncio.Transport):
    def write(self, data: Any) -> None:
        pass

    def is_closing(self) -> bool:
        return False


def one_round(conn: Any, reads: list[bytes]) -> bytes:
    """One exchange, the coroutine driven by hand (no task, no loop iteration)."""
    coro = conn.exchange(WIRE, None)
    coro.send(None)  # up to the await on the reply
    for data in reads:
        conn.data_received(data)
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value[3]  # type: ignore[no-any-return]
    raise AssertionError("no reply")


def time_module(module: ModuleType, read_size: int, rounds: int) -> dict[str, float]:
    out = {}
    for name, answer in answers().items():
        reads = [answer[i : i + read_size] for i in range(0, len(answer), read_size)]
        conn = module.Connection(8 * 1024 * 1024)
        conn.connection_made(_Transport())
        assert one_round(conn, reads) == PAGE, name
        samples = []
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(rounds):
                one_round(conn, reads)
            samples.append((time.perf_counter() - started) / rounds * 1e6)
        out[name] = statistics.median(samples)
    return out


def load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("h1_other", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def main(args: argparse.Namespace) -> None:
    modules = {"llhttp (poller/scrape/http/h1.py)": h1}
    if args.other:
        modules[f"other ({args.other})"] = load(args.other)
    print(f"us per 61 KB answer, reads of {args.reads} bytes, median of 5 x {args.rounds}")
    for label, module in modules.items():
        figures = time_module(module, args.reads, args.rounds)
        print(f"  {label}: " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reads", type=int, default=65536)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--other")
    asyncio.run(main(parser.parse_args()))
