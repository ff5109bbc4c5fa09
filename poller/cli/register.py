"""What ``endpoints add``/``sync`` (and ``run --endpoints-file``) refuse before writing:
mistakes the registry's own validation cannot see, because they depend on the engine's
metrics path and on the pollers' key rules.

A URL ending in the metrics path would be scraped at ``/metrics/metrics``, one ending in
``/v1`` at ``/v1/metrics`` (a 404 at every scrape); a key variable or file outside the key
rules (``scrape.key_env_prefix``, ``scrape.key_dir``) would fail on every poller. All are
refused here, naming the fix.
The key rules are this shell's settings (``--config``, ``POLLER_SCRAPE__*``): the same
file and variables as the pollers' give the same answer. ``settings_and_file`` loads the
settings and a registry file together and reports every problem of both at once.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from poller.cli.common import option_env_names
from poller.cli.oneline import BadInput
from poller.config import ScrapeSettings, Settings, key_directory, load_settings
from poller.config.load import read_toml
from poller.config.registry_file import endpoints_from_file
from poller.errors import ConfigError
from poller.schema.endpoint import Endpoint
from poller.scrape.specs import ENGINE_SPECS

__all__ = ["entry_problems", "registration_problems", "settings_and_file", "url_problem"]


def _metrics_path(endpoint: Endpoint, scrape: ScrapeSettings) -> str | None:
    engine = endpoint.engine or scrape.default_engine
    spec = ENGINE_SPECS.get(engine)
    if spec is None or not spec.scraped:
        return None  # external: never scraped
    configured = scrape.engines.get(engine)
    path = endpoint.metrics_path or (configured and configured.metrics_path) or spec.metrics_path
    return path.partition("?")[0].rstrip("/")


def url_problem(endpoint: Endpoint, scrape: ScrapeSettings) -> str | None:
    """A URL the pollers would scrape at the wrong path: one ending in the metrics path
    (``/metrics/metrics``) or in ``/v1`` (an OpenAI-compatible API base, LiteLLM's
    ``api_base``: ``/v1/metrics``). Refused, naming the base URL to register."""
    path = _metrics_path(endpoint, scrape)
    if not path:
        return None
    parts = urlsplit(endpoint.url)
    own = parts.path.rstrip("/")
    # The engine's path, or the usual /metrics under an engine whose path differs (a trtllm
    # entry at http://h:8000/metrics would be scraped at /metrics/prometheus/metrics).
    found = next((p for p in (path, "/metrics") if own.endswith(p)), None)
    if found is not None:
        base = parts._replace(path=own.removesuffix(found)).geturl()
        return (
            f"url {endpoint.url} ends in the metrics path {found}, while the pollers append "
            f"{path}: register the base URL {base}"
        )
    if own.endswith("/v1"):
        base = parts._replace(path=own.removesuffix("/v1")).geturl()
        return (
            f"url {endpoint.url} ends in /v1, the OpenAI API's path, while the pollers append "
            f"{path} to the engine's base URL: register {base} (an engine serving its "
            f"metrics under /v1 takes --metrics-path /v1{path})"
        )
    return None


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


def entry_problems(
    endpoint: Endpoint, scrape: ScrapeSettings, environ: Mapping[str, str] | None = None
) -> list[str]:
    """The problems of one entry, each a line that does not name the entry."""
    env = os.environ if environ is None else environ
    found = (url_problem(endpoint, scrape), _key_problem(endpoint, scrape, env))
    return [problem for problem in found if problem]


def registration_problems(
    entries: Iterable[Endpoint],
    scrape: ScrapeSettings,
    environ: Mapping[str, str] | None = None,
    where: str = "",
) -> list[str]:
    """One line per problem of every entry, each naming the entry; empty when all pass."""
    return [
        f"{where}endpoint {endpoint.id!r}: {problem}"
        for endpoint in entries
        for problem in entry_problems(endpoint, scrape, environ)
    ]


def _file_setting(config_file: str | None) -> str | None:
    """``endpoints_file`` of a settings file that did not load as a whole, if readable."""
    if config_file is None:
        return None
    try:
        value = read_toml(config_file).get("endpoints_file")
    except ConfigError:
        return None
    return value if isinstance(value, str) else None


def settings_and_file(
    config_file: str | None,
    overrides: dict[str, Any],
    file: str | None = None,
    origins: dict[str, str] | None = None,
) -> tuple[Settings, dict[str, Endpoint] | None]:
    """The settings and the registry file's entries (``file``, else the settings'
    ``endpoints_file``), every problem of the flags, variables, settings file and
    registry file found in one pass: ``BadInput`` with one line each (``origins``: where
    each override came from, ``common.sources``)."""
    problems: list[str] = []
    settings: Settings | None = None
    try:
        settings = load_settings(
            config_file, overrides, flat_env=option_env_names(), sources=origins
        )
    except ConfigError as exc:
        problems += str(exc).splitlines()
    if file is None:
        if settings is not None:
            file = settings.endpoints_file
        else:
            file = overrides.get("endpoints_file") or _file_setting(config_file)
    entries = None
    if file:
        # Settings that did not load: the entries are checked with the default key rules.
        scrape = settings.scrape if settings is not None else ScrapeSettings()
        try:
            entries = endpoints_from_file(file, check=lambda e: entry_problems(e, scrape))
        except ConfigError as exc:
            problems += str(exc).splitlines()
    if problems or settings is None:
        raise BadInput("\n".join(problems))
    return settings, entries
