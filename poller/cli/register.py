"""What ``endpoints add``/``sync`` (and ``run --endpoints-file``) refuse before writing:
mistakes the registry's own validation cannot see, because they depend on the engine's
metrics path and on the pollers' key rules.

A URL ending in the metrics path would be scraped at ``/metrics/metrics`` (a 404 at every
scrape); a key variable or file outside the key rules (``scrape.key_env_prefix``,
``scrape.key_dir``) would fail on every poller. Both are refused here, naming the fix.
The key rules are this shell's settings (``--config``, ``POLLER_SCRAPE__*``): the same
file and variables as the pollers' give the same answer.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from poller.config import ScrapeSettings, key_directory
from poller.schema.endpoint import Endpoint
from poller.scrape.specs import ENGINE_SPECS

__all__ = ["registration_problems"]


def _metrics_path(endpoint: Endpoint, scrape: ScrapeSettings) -> str | None:
    engine = endpoint.engine or scrape.default_engine
    spec = ENGINE_SPECS.get(engine)
    if spec is None or not spec.scraped:
        return None  # external: never scraped
    configured = scrape.engines.get(engine)
    path = endpoint.metrics_path or (configured and configured.metrics_path) or spec.metrics_path
    return path.partition("?")[0].rstrip("/")


def _url_problem(endpoint: Endpoint, scrape: ScrapeSettings) -> str | None:
    path = _metrics_path(endpoint, scrape)
    if not path:
        return None
    parts = urlsplit(endpoint.url)
    own = parts.path.rstrip("/")
    # The engine's path, or the usual /metrics under an engine whose path differs (a trtllm
    # entry at http://h:8000/metrics would be scraped at /metrics/prometheus/metrics).
    found = next((p for p in (path, "/metrics") if own.endswith(p)), None)
    if found is None:
        return None
    base = parts._replace(path=own.removesuffix(found)).geturl()
    return (
        f"url {endpoint.url} ends in the metrics path {found}, while the pollers append "
        f"{path}: register the base URL {base}"
    )


def _key_problem(endpoint: Endpoint, scrape: ScrapeSettings, env: Mapping[str, str]) -> str | None:
    name = endpoint.api_key_env
    if name and not name.startswith(scrape.key_env_prefix):
        return (
            f"api_key_env {name} does not start with {scrape.key_env_prefix}: the pollers "
            f"read keys only from such variables (scrape.key_env_prefix), e.g. "
            f"{scrape.key_env_prefix}{name.upper()}"
        )
    file = endpoint.api_key_file
    if file:
        # Lexical: the file is on the pollers, not necessarily on this machine.
        root = os.path.normpath(key_directory(scrape, env))
        path = os.path.normpath(os.path.join(root, file))
        if os.path.commonpath([root, path]) != root or path == root:
            return (
                f"api_key_file {file} is not inside the key directory {root}: the pollers "
                "read keys only from files there (scrape.key_dir)"
            )
    return None


def registration_problems(
    entries: Iterable[Endpoint],
    scrape: ScrapeSettings,
    environ: Mapping[str, str] | None = None,
    where: str = "",
) -> list[str]:
    """One line per problem of every entry, each naming the entry; empty when all pass."""
    env = os.environ if environ is None else environ
    lines = []
    for endpoint in entries:
        for problem in (_url_problem(endpoint, scrape), _key_problem(endpoint, scrape, env)):
            if problem:
                lines.append(f"{where}endpoint {endpoint.id!r}: {problem}")
    return lines
