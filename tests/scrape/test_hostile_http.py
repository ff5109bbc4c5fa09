"""Hostile HTTP through ``Scraper.fetch`` + ``mapping.read``, and API keys that cannot be
a header: each ends in a failure reason, in bounded time and memory.

- Pages served hostile: a 1 MB line, a million series, invalid UTF-8, JSON or HTML, an
  endless body, a gzip bomb, retyped and duplicated families; the simulator's drip,
  garbage and 100 MB bodies.
- Raw bytes no HTTP library would send (an SSH banner, broken framing, a 1 MB header,
  slowloris headers).
- An API key with a newline or a non-ASCII character is a config failure that never
  shows the key.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import sys
import time
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from poller.errors import ScrapeError
from poller.schema.endpoint import Endpoint, endpoint_from_dict
from poller.scrape.engines import mapping_for
from poller.scrape.http.client import Scraper
from poller_lab.sim import EndpointSpec, Simulator
from tests.support.hostile import CAP, RUNNING, VLLM_OK, VLLM_REST, MiB, worker_owning
from tests.support.httpserver import HTTPServer, Pause, Request, answer, routes
from tests.support.paths import REPO

# --- hostile HTTP through Scraper.fetch + mapping.read -----------------------------------


#: Past a scrape's timeout, what a loaded machine may add before the scrape returns. It
#: still tells an overall timeout from a per-read one: read per read, the drip would run
#: ~25 s, the slowloris ~500 s and the endless body forever.
LATE_S = 10.0


async def scrape(
    url: str, *, timeout_s: float = 1.0, max_body_bytes: int = CAP
) -> tuple[str, str, float]:
    """(reason or "ok", detail, seconds) for one scrape as the worker does it."""
    scraper = Scraper(max_body_bytes=max_body_bytes)
    mapping = mapping_for("vllm")
    started = time.monotonic()
    try:
        fetched = await scraper.fetch(Endpoint(id="hostile", url=url), "/metrics", timeout_s)
        mapping.read(fetched.body, fetched.content_type)
    except ScrapeError as exc:
        return exc.reason, exc.detail, time.monotonic() - started
    finally:
        await scraper.aclose()
    return "ok", "", time.monotonic() - started


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunk(piece: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(piece), piece)


def million_series(wanted_at_end: bool) -> Callable[[Request], AsyncIterator[bytes]]:
    async def stream(request: Request) -> AsyncIterator[bytes]:
        yield CHUNKED_HEAD
        for start in range(0, 1_000_000, 10_000):  # generated lazily, 10k lines a write
            lines = b"".join(b'sim_series{i="%d"} 1\n' % i for i in range(start, start + 10_000))
            yield _chunk(lines)
        if wanted_at_end:
            yield _chunk(VLLM_OK)
        yield b"0\r\n\r\n"

    return stream


def endless_chunks(request: Request) -> list[bytes | Pause]:
    # A comment line every 50 ms, "forever" (~100 s): only an overall timeout ends it.
    return [
        CHUNKED_HEAD,
        *[p for _ in range(2000) for p in (_chunk(b"# still here\n"), Pause(0.05))],
    ]


def _gzip_zeros(size: int) -> bytes:
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)  # wbits 31: the gzip container
    zeros = bytes(MiB)
    return b"".join(compressor.compress(zeros) for _ in range(size // MiB)) + compressor.flush()


GZIP_BOMB = _gzip_zeros(64 * MiB)  # ~64 KB on the wire, 64 MiB decoded


ENGINES_RUNNING = b"".join(b'vllm:num_requests_running{engine="%d"} 5\n' % i for i in range(8))


def _gzip_cut(page: bytes) -> bytes:
    """``page`` gzipped, the stream stopped at a flush point after its first half: a
    writer that died mid-body. The cut ends on a line, so what arrived parses."""
    half = page.index(b"\n", len(page) // 2) + 1
    compressor = zlib.compressobj(wbits=31)
    return compressor.compress(page[:half]) + compressor.flush(zlib.Z_SYNC_FLUSH)


RETYPED = (
    b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n"
    b"# TYPE vllm:num_requests_running counter\n"
    b'vllm:num_requests_running{engine="1"} 5\n' + VLLM_REST
)
DUPLICATED = (
    b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 4\n"
    + VLLM_REST
    + b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 4\n"
)
INVALID_UTF8 = VLLM_OK + b'vllm:num_requests_running{model_name="caf\xe9"} 1\n'

STATIC: dict[str, tuple[bytes, dict[str, str]]] = {
    "single-line-junk": (b"x" * MiB, {}),  # 1 MB, no newline
    # Valid lines first, so the page passes the sniff test and the parser meets the line.
    "single-line-open-label": (VLLM_OK + b'vllm:num_requests_running{a="' + b"x" * MiB, {}),
    "invalid-utf8": (INVALID_UTF8, {}),
    "json": (b'{"num_requests_running": 3}', {"Content-Type": "application/json"}),
    "html": (b"<html><body>502 Bad Gateway</body></html>\n", {"Content-Type": "text/html"}),
    "retyped": (RETYPED, {}),
    "duplicated": (DUPLICATED, {}),
    "gzip-bomb": (GZIP_BOMB, {"Content-Encoding": "gzip"}),
    "gzip-cut": (_gzip_cut(VLLM_REST + ENGINES_RUNNING), {"Content-Encoding": "gzip"}),
}


@pytest.fixture
async def hostile() -> AsyncIterator[str]:
    """A server with one hostile page per path: ``<base>/<case>`` + /metrics."""
    table: dict[str, Any] = {
        f"/{case}/metrics": answer(200, body, headers, content_type=None)
        for case, (body, headers) in STATIC.items()
    }
    table["/million/metrics"] = million_series(wanted_at_end=False)
    table["/million-valid/metrics"] = million_series(wanted_at_end=True)
    table["/endless/metrics"] = endless_chunks
    async with HTTPServer(routes(table)) as server:
        yield server.url


@pytest.mark.parametrize(
    ("case", "reason", "detail"),
    [
        ("single-line-junk", "parse", "not Prometheus text"),
        ("single-line-open-label", "parse", "line 4: malformed label set"),
        ("million", "too_large", "cap"),
        ("invalid-utf8", "parse", f"invalid UTF-8 at byte offset {INVALID_UTF8.index(0xE9)}"),
        ("json", "parse", "application/json"),
        ("html", "parse", "not Prometheus text"),
        ("endless", "timeout", "within 1s"),
        ("gzip-bomb", "too_large", "cap"),
        ("gzip-cut", "parse", "truncated gzip body"),
    ],
)
async def test_hostile_pages_end_in_their_failure_reason(
    hostile: str, case: str, reason: str, detail: str
) -> None:
    # Generous except for the endless body, which only the timeout can end.
    timeout_s = 1.0 if case == "endless" else 5.0
    tracemalloc.start()
    try:
        got, got_detail, elapsed = await scrape(f"{hostile}/{case}", timeout_s=timeout_s)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (got, detail in got_detail) == (reason, True), got_detail
    assert elapsed < timeout_s + LATE_S  # the timeout is overall, not per read
    if case != "gzip-bomb":  # the gzip bomb has its own (failing) memory test below
        # Peak Python allocations (both ends of the connection are in this process): a few
        # times the cap at most, never the size the server would have sent.
        assert peak < 3 * CAP, peak


async def test_million_series_under_a_raised_cap_parse_within_the_timeout(hostile: str) -> None:
    # ~25 MB: with the cap raised the selector skips the million unwanted lines quickly.
    got, detail, elapsed = await scrape(
        f"{hostile}/million-valid", timeout_s=10.0, max_body_bytes=64 * MiB
    )
    assert got == "ok", detail
    assert elapsed < 10.0 + 2.0


async def test_retyped_family_is_read_like_prometheus_client(hostile: str) -> None:
    # The lax parser ignores TYPE; prometheus_client's text parser accepts the page too
    # (its OpenMetrics parser would not). Both see the same two running series.
    scraper = Scraper(max_body_bytes=CAP)
    try:
        fetched = await scraper.fetch(Endpoint(id="e", url=f"{hostile}/retyped"), "/metrics", 1)
    finally:
        await scraper.aclose()
    signals = mapping_for("vllm").read(fetched.body, fetched.content_type)
    theirs = [
        s.value
        for family in text_string_to_metric_families(RETYPED.decode())
        for s in family.samples
        if family.name == RUNNING  # it renames the samples of a counter family to _total
    ]
    assert signals.running == sum(theirs) == 6


async def test_duplicated_family_is_not_double_counted(hostile: str) -> None:
    got, _, _ = await scrape(f"{hostile}/duplicated")
    if got == "parse":
        return
    signals = mapping_for("vllm").read(DUPLICATED)
    assert signals.running == 4


async def test_unrequested_gzip_bomb_stays_within_the_cap_in_memory(hostile: str) -> None:
    cap = 1 * MiB
    tracemalloc.start()
    try:
        got, _, _ = await scrape(f"{hostile}/gzip-bomb", max_body_bytes=cap)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == "too_large"
    assert peak < 8 * cap, f"peak {peak / MiB:.0f} MiB for a {cap / MiB:.0f} MiB cap"


async def test_drip_fed_body_times_out_within_the_overall_timeout() -> None:
    # The simulator's drip: 256 bytes every 0.1 s would take ~25 s for a vLLM page.
    async with Simulator([EndpointSpec("drip", "vllm")], seed=1) as sim:
        await sim.set_fault("drip", "drip", chunk_bytes=256, interval_s=0.1)
        got, detail, elapsed = await scrape(sim.base_url("drip"), timeout_s=0.5)
    assert got == "timeout", detail
    assert elapsed < 0.5 + LATE_S


async def test_garbage_from_the_simulator_is_a_parse_failure() -> None:
    async with Simulator([EndpointSpec("junk", "vllm")], seed=1) as sim:
        for kind in ("html", "binary"):
            await sim.set_fault("junk", "garbage", kind=kind)
            got, detail, _ = await scrape(sim.base_url("junk"))
            assert got == "parse", (kind, detail)


OVERSIZED_SCRIPT = """
import asyncio, json, resource, sys, time
from poller.scrape.engines import mapping_for
from poller.errors import ScrapeError
from poller.schema.endpoint import Endpoint
from poller.scrape.http.client import Scraper
from poller_lab.sim import EndpointSpec, Simulator

def peak_kb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

async def main(cap, timeout_s):
    mapping = mapping_for("vllm")
    scraper = Scraper(max_body_bytes=cap)
    out = {}
    specs = [EndpointSpec("streamed", "vllm"), EndpointSpec("declared", "vllm")]
    async with Simulator(specs) as sim:
        async def once(endpoint_id):
            started = time.monotonic()
            endpoint = Endpoint(id=endpoint_id, url=sim.base_url(endpoint_id))
            try:
                fetched = await scraper.fetch(endpoint, "/metrics", timeout_s)
                mapping.read(fetched.body, fetched.content_type)
                return "ok", time.monotonic() - started
            except ScrapeError as exc:
                return exc.reason, time.monotonic() - started
        out["warmup"] = await once("streamed")  # imports, session, page template
        await sim.set_fault("streamed", "oversized", mb=100.0)
        await sim.set_fault("declared", "oversized", mb=100.0, declare_length=True)
        before = peak_kb()
        out["streamed"] = await once("streamed")
        out["declared"] = await once("declared")
        out["growth_kb"] = peak_kb() - before
    await scraper.aclose()
    print(json.dumps(out))

asyncio.run(main(int(sys.argv[1]), float(sys.argv[2])))
"""


async def test_hundred_mb_body_is_cut_at_the_cap_with_bounded_rss() -> None:
    # In a process of its own, so that ru_maxrss (peak RSS) measures this scrape only.
    timeout_s = 5.0
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        OVERSIZED_SCRIPT,
        str(CAP),
        str(timeout_s),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-2000:]
    result = json.loads(out)
    assert result["warmup"][0] == "ok"
    for case in ("streamed", "declared"):
        reason, elapsed = result[case]
        assert reason == "too_large", result
        assert elapsed < timeout_s + LATE_S, result
    # 100 MB offered, 8 MiB cap: the peak RSS may grow by the cap and change, not the body.
    assert result["growth_kb"] < 40 * 1024, result


# Raw bytes no HTTP library would send: status line, framing and header abuse.
SSH_BANNER = b"SSH-2.0-OpenSSH_9.6p1 Ubuntu-3ubuntu13\r\n"  # a URL pointing at the wrong port
RAW_RESPONSES: dict[str, bytes] = {
    "ssh-banner": SSH_BANNER,
    "http09-body-only": VLLM_OK,
    "bad-content-length": b"HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\n" + VLLM_OK,
    "two-content-lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 90\r\n\r\n"
    + VLLM_OK,
    "bad-chunk-size": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    + b"zz\r\nhello\r\n0\r\n\r\n",
    "1mb-header": b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * MiB + b"\r\n\r\n" + VLLM_OK,
    "nul-in-header": b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 90\r\n\r\n" + VLLM_OK,
    "cut-mid-body": b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n" + VLLM_OK,
    "closed-at-once": b"",
}


# A valid status line, one byte every 50 ms, and never the end of headers.
SLOWLORIS = [
    p for b in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"z" * 10_000 for p in (bytes([b]), Pause(0.05))
]


@asynccontextmanager
async def raw_http() -> AsyncIterator[str]:
    """A server answering ``GET /<case>/...`` with RAW_RESPONSES[case], then closing."""
    table: dict[str, Any] = {f"/{c}/metrics": [raw, None] for c, raw in RAW_RESPONSES.items()}
    table["/slowloris/metrics"] = SLOWLORIS
    async with HTTPServer(routes(table)) as server:
        yield server.url


async def test_slowloris_headers_time_out_within_the_overall_timeout() -> None:
    async with raw_http() as url:
        got, detail, elapsed = await scrape(f"{url}/slowloris", timeout_s=0.5)
    assert got == "timeout", detail
    assert elapsed < 0.5 + LATE_S


@pytest.mark.parametrize("case", list(RAW_RESPONSES))
async def test_malformed_http_ends_in_a_failure_reason(case: str) -> None:
    async with raw_http() as url:
        got, detail, _ = await scrape(f"{url}/{case}")
    # The engine is not serving HTTP we can use: unreachable (or, had a body arrived, parse).
    assert got in ("unreachable", "parse"), (got, detail)


async def test_scrape_once_records_a_failure_for_a_non_http_port() -> None:
    async with raw_http() as url, worker_owning(f"{url}/ssh-banner") as worker:
        await worker.scrape_once("e1")
        failure = await worker.store.read_failure("e1")
        assert failure.get("reason") == "unreachable", failure


# --- API keys that cannot be a header ------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "template"),
    # A key with a newline (a PEM-like file, or api_key_file=/proc/self/environ) or a
    # non-ASCII character cannot be a header, and an HTTP library's error could quote it:
    # it must end as a config failure that never shows it.
    [("file", "{key}\nsecond line\n"), ("env", "{key}-cl\u00e9")],
    ids=["newline", "non-ascii"],
)
async def test_unusable_api_key_is_a_config_failure_that_never_shows_the_key(
    source: str,
    template: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = "sk-" + secrets.token_hex(16)
    value = template.format(key=key)
    entry: dict[str, str] = {}
    if source == "file":
        (tmp_path / "key").write_text(value)
        entry["api_key_file"] = str(tmp_path / "key")
        monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))  # the key directory
    else:
        monkeypatch.setenv("LLMGW_KEY_HOSTILE_TEST", value)
        entry["api_key_env"] = "LLMGW_KEY_HOSTILE_TEST"
    async with raw_http() as url:
        endpoint = endpoint_from_dict("e", {"url": f"{url}/closed-at-once", **entry})
        scraper = Scraper(max_body_bytes=CAP)
        try:
            with pytest.raises(ScrapeError) as caught:
                await scraper.fetch(endpoint, "/metrics", 1.0)
        finally:
            await scraper.aclose()
    assert key not in str(caught.value) and key[3:15] not in str(caught.value), caught.value
    assert caught.value.reason == "config", caught.value
