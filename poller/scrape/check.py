"""``poller check``: scrape one endpoint once and report what it read.

Also serves the bundled example pages on a loopback port (``--example``), so the whole
path (HTTP, parse, mapping) can be tried without an engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from poller.config import ScrapeSettings
from poller.errors import ContractError, FetchError, ScrapeError
from poller.schema.endpoint import Endpoint
from poller.schema.stats import Signals, prefix_hit_rate
from poller.scrape.engines import (
    ENGINE_SPECS,
    EngineMapping,
    mapping_for,
    mapping_for_endpoint,
)
from poller.scrape.http.client import KeyPolicy, Scraper, metrics_url
from poller.scrape.models import MODELS_PATH, read_models

__all__ = ["check_endpoint", "format_report", "serve_example"]

#: ``/v1/models`` of the example server: the model its vLLM page names.
EXAMPLE_MODELS = b'{"object": "list", "data": [{"id": "meta-llama/Llama-3.1-8B-Instruct"}]}'


@asynccontextmanager
async def serve_example(engine: str) -> AsyncIterator[str]:
    """Serve the bundled example page for ``engine`` on a loopback port, and the model
    list of ``/v1/models`` that an engine whose page names no model is asked; yields the
    base URL."""
    page = resources.files("poller.scrape").joinpath(f"data/{engine}.txt").read_bytes()
    answers = {
        ENGINE_SPECS[engine].metrics_path.encode(): (page, b"text/plain; version=0.0.4"),
        MODELS_PATH.encode(): (EXAMPLE_MODELS, b"application/json"),
    }

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await reader.readuntil(b"\r\n\r\n")
            found = answers.get(request.split(b" ", 2)[1])
            body, kind = found or (b"not found\n", b"text/plain")
            head = b"HTTP/1.1 200 OK\r\n" if found else b"HTTP/1.1 404 Not Found\r\n"
            writer.write(
                head
                + b"Content-Type: %s\r\n" % kind
                + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
                + body
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


def _signal_values(signals: Signals) -> dict[str, Any]:
    """The signals under the stats hash's field names, as JSON values (None: absent)."""
    rate = signals.prefix_cache_hit_rate
    if rate is None:
        # One scrape has no window: the lifetime ratio of the counters is what we have.
        rate = prefix_hit_rate(
            signals.prefix_cache_hits_total, signals.prefix_cache_queries_total, None, None, None
        )
    values: dict[str, Any] = {
        "running": signals.running,
        "waiting": signals.waiting,
        "kv_cache_usage": signals.kv_cache_usage,
        "prefix_cache_hit_rate": None if rate is None else round(rate, 4),
        "lora": None
        if signals.lora_max is None
        else {
            "running": list(signals.lora_running),
            "waiting": list(signals.lora_waiting),
            "max": signals.lora_max,
        },
        "models": list(signals.models) or None,
    }
    # Engine-specific fields appear only where the engine has them.
    if signals.api_waiting is not None:
        values["api_waiting"] = signals.api_waiting
    if signals.sleeping is not None:
        values["sleeping"] = signals.sleeping
    if signals.kv_capacity_tokens is not None:
        values["kv_capacity_tokens"] = signals.kv_capacity_tokens
    if signals.waiting_by_reason:
        values["waiting_by_reason"] = dict(signals.waiting_by_reason)
    return values


def _shown(name: str, value: Any) -> str:
    """A signal as the text report prints it."""
    if value is None:
        return "absent"
    if name == "lora":
        return (
            f"running=[{','.join(value['running'])}] "
            f"waiting=[{','.join(value['waiting'])}] max={value['max']}"
        )
    if name == "models":
        return ", ".join(value)
    if name == "waiting_by_reason":
        return ", ".join(f"{reason} {count}" for reason, count in value.items())
    if name == "sleeping":
        return "yes (never picked)" if value else "no"
    return str(value)


async def check_endpoint(
    endpoint: Endpoint,
    engine: str | None,
    timeout_s: float,
    max_bytes: int,
    settings: ScrapeSettings | None = None,
) -> dict[str, Any]:
    """Scrape once; the report is JSON-ready (numbers are numbers, absent is None).

    ``engine`` None: the page says which engine it is. It is fetched at the default
    engine's path (``settings.default_engine``, else vLLM) and read with the first engine
    whose contract it satisfies (``page_engines``), the default first; the report's
    ``detected`` is then True, or False where no page satisfied one (or none was read):
    the report is the default engine's. With ``settings``, its ``[scrape.engines.<engine>]`` path
    and overrides apply below the entry's own, as in ``poller run``.
    """
    detect = engine is None
    chosen = engine or (settings.default_engine if settings is not None else "vllm")
    mapping = _mapping(endpoint, chosen, settings)
    url = metrics_url(endpoint, mapping.metrics_path)
    report: dict[str, Any] = {"url": url, "engine": chosen, "ok": False}
    if detect:
        report["detected"] = False  # until a page satisfies an engine's contract
    # The operator names their own variable or file here: the registry's key rules
    # (scrape.key_env_prefix, scrape.key_dir) do not apply (docs/operations.md).
    scraper = Scraper(max_body_bytes=max_bytes, key_policy=KeyPolicy.unrestricted())
    started = time.perf_counter()
    try:
        fetched = await scraper.fetch(endpoint, mapping.metrics_path, timeout_s)
        report |= {"status": fetched.status, "bytes": len(fetched.body)}
        parse_started = time.perf_counter()
        try:
            signals = mapping.read(fetched.body, fetched.content_type)
        except ContractError as exc:
            if not (detect and exc.looks_like):
                raise
            # The page is another engine's: read it as that one.
            report["engine"] = exc.looks_like[0]
            mapping = _mapping(endpoint, exc.looks_like[0], settings)
            signals = mapping.read(fetched.body, fetched.content_type)
        report["parse_us"] = round((time.perf_counter() - parse_started) * 1e6, 1)
        report |= {"ok": True, "missing": [], "signals": _signal_values(signals)}
        if detect:
            report["detected"] = True
        report["sources"] = dict(signals.sources)
        if not signals.models and mapping.spec.models_from_api:
            await _models_from_api(report, scraper, endpoint, timeout_s)
    except ScrapeError as exc:
        report |= {"reason": exc.reason, "detail": exc.detail}
        report["missing"] = list(getattr(exc, "missing", ()))
        if isinstance(exc, FetchError) and exc.status is not None:
            report |= {"status": exc.status, "body": exc.body}
        if isinstance(exc, ContractError):
            report["looks_like"] = list(exc.looks_like)
            if exc.looks_like:  # the report's own line says which engine to try
                report["detail"] = exc.lacks
    finally:
        await scraper.aclose()
    report["elapsed_ms"] = round((time.perf_counter() - started) * 1000, 2)
    return report


async def _models_from_api(
    report: dict[str, Any], scraper: Scraper, endpoint: Endpoint, timeout_s: float
) -> None:
    """The names the engine lists on /v1/models, as ``poller run`` adds them for an
    engine whose page names no model (poller/service/names.py)."""
    try:
        names = await read_models(scraper, endpoint, timeout_s)
    except ScrapeError as exc:
        report["sources"]["models"] = f"{MODELS_PATH} not read: {exc.reason}: {exc.detail}"
        return
    report["signals"]["models"] = list(names) or None
    report["sources"]["models"] = MODELS_PATH


def _mapping(endpoint: Endpoint, engine: str, settings: ScrapeSettings | None) -> EngineMapping:
    if settings is not None:
        return mapping_for_endpoint(endpoint.model_copy(update={"engine": engine}), settings)
    return mapping_for(engine, endpoint.overrides)


def format_report(report: dict[str, Any]) -> str:
    lines: list[str] = []
    out = lines.append
    size = f"{report['bytes'] / 1024:.1f} KB" if "bytes" in report else "-"
    out(
        f"GET {report['url']}  status={report.get('status', '-')}  {size}  "
        f"in {report['elapsed_ms']} ms"
        + (f" (parse {report['parse_us']} us)" if "parse_us" in report else "")
    )
    engine = report["engine"]
    if report.get("detected"):
        out(f"engine: {engine} (detected from the page)")
    elif "detected" not in report:
        out(f"engine: {engine}")
    elif "looks_like" in report:  # a page was read: it satisfies no engine's contract
        out(f"engine: {engine} (the default: the page satisfies no engine's contract)")
    else:
        out(f"engine: {engine} (the default: no page was read to tell it from)")
    for name, value in report.get("signals", {}).items():
        source = report["sources"].get(name, "")
        out(f"  {name:<22} {_shown(name, value):<40} {source}")
    if report["ok"]:
        out(f"OK: the page satisfies the {report['engine']} contract")
    else:
        if report.get("missing"):
            out("missing: " + ", ".join(report["missing"]))
        out(f"FAILED: {report['reason']}: {report['detail']}")
        if report.get("looks_like"):
            names = " or ".join(report["looks_like"])
            out(f"the page looks like {names}'s: try --engine {report['looks_like'][0]}")
        elif "looks_like" in report:
            if report.get("missing"):
                out(f"no other engine's contract fits either: the page lacks what {engine} needs")
            elif "detected" in report:
                out("the page satisfies no engine's contract: name one with --engine")
            else:
                out("the page satisfies no other engine's contract either")
    return "\n".join(lines)
