"""What the ``poller`` commands share: settings loading and ``--config``, the Redis
options, store commands."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, NoReturn, TypeVar

import click
from click.core import ParameterSource

from poller.cli.oneline import BadInput, env_names
from poller.config import FLAT_ENV, Settings, load_settings
from poller.errors import ConfigError, StoreAuthError, StoreError
from poller.redis.settings import RedisSettings
from poller.store.store import RedisStore
from poller.util.urls import redact_url

F = TypeVar("F", bound=Callable[..., Any])


def option_env_names() -> frozenset[str]:
    """Every variable an option of the running ``poller`` reads: known, not a typo."""
    ctx = click.get_current_context(silent=True)
    return FLAT_ENV if ctx is None else env_names(ctx.find_root().command)


def sources(params: dict[str, str]) -> dict[str, str]:
    """dotted settings key -> the flag or variable that set it for this command
    (``--timeout``, ``POLLER_TIMEOUT``), from ``params`` (dotted key -> the option's
    parameter name), for the key's error line; options left unset are left out."""
    ctx = click.get_current_context()
    by_name = {param.name: param for param in ctx.command.params}
    found = {}
    for key, name in params.items():
        param, source = by_name[name], ctx.get_parameter_source(name)
        if source is ParameterSource.COMMANDLINE:
            found[key] = max(param.opts, key=len)
        elif source is ParameterSource.ENVIRONMENT and isinstance(param.envvar, str):
            found[key] = param.envvar
    return found


def load(config: str | None, overrides: dict[str, Any]) -> Settings:
    """The settings, or exit 2 with one line per problem (every problem at once)."""
    try:
        return load_settings(config, overrides, flat_env=option_env_names())
    except ConfigError as exc:
        raise BadInput(str(exc)) from None


def config_option(purpose: str) -> Callable[[F], F]:
    """``--config FILE`` (or ``POLLER_CONFIG``): the pollers' TOML settings file, as every
    command reads it; ``purpose`` says what this command takes from it."""
    return click.option(
        "--config",
        "config_file",
        envvar="POLLER_CONFIG",
        show_envvar=True,
        metavar="FILE",
        type=click.Path(dir_okay=False),
        help=purpose,
    )


REDIS_URL = click.option(
    "--redis-url",
    envvar="POLLER_REDIS_URL",
    show_envvar=True,
    show_default="redis://127.0.0.1:6379/0",
    metavar="URL",
    help="redis://HOST:PORT/DB, rediss://, unix:///PATH or "
    "redis+sentinel://HOST:PORT[,...]/MASTER[/DB]; user and password may be in it.",
)
NAMESPACE = click.option(
    "--namespace",
    envvar="POLLER_NAMESPACE",
    show_envvar=True,
    show_default="llmgw",
    metavar="NS",
    help="Key namespace: every key starts with {NS}.",
)

#: How a long-running command logs (``poller run``, ``poller epp``).
LOG_FORMAT = click.option(
    "--log-format",
    envvar="POLLER_LOG_FORMAT",
    show_envvar=True,
    show_default="text",
    type=click.Choice(["text", "json"]),
    help="text: key=value lines for a terminal or journal; json: one object per line.",
)
LOG_LEVEL = click.option(
    "--log-level",
    envvar="POLLER_LOG_LEVEL",
    show_envvar=True,
    show_default="INFO",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    help="Least severe level logged; INFO logs each change of state once.",
)


def redis_line(settings: RedisSettings) -> str:
    """The Redis and the namespace a command reads, as its first line says them
    (``redis://127.0.0.1:6379/0 namespace llmgw``; the password redacted)."""
    return f"{redact_url(settings.url)} namespace {settings.namespace}"


def redis_json(settings: RedisSettings) -> dict[str, str]:
    """``redis_line`` for ``--json``: ``{"redis": URL, "namespace": NS}``."""
    return {"redis": redact_url(settings.url), "namespace": settings.namespace}


@asynccontextmanager
async def store_session(
    redis_url: str | None,
    namespace: str | None,
    config: str | None = None,
    *,
    claim: bool = True,
) -> AsyncIterator[RedisStore]:
    """The store of the settings. A command that adds to the registry claims the schema
    version first (``ensure_schema``); with ``claim`` False (reads, and commands that act
    only on what is there: a removal, a drain, a dry run) it is only checked, so a
    refused command leaves a namespace nothing wrote as it was, and a read runs as a
    read-only ACL user (deploy/redis/users.acl: ``gateway``)."""
    settings = load(config, {"redis.url": redis_url, "redis.namespace": namespace})
    store = RedisStore.from_settings(settings.redis)
    try:
        if claim:
            await store.ensure_schema()
        else:
            await store.check_schema()
        yield store
    finally:
        await store.close()


def run_store_command(coro: Any) -> Any:
    try:
        return asyncio.run(coro)
    except StoreError as exc:
        store_failure(exc)


def store_failure(exc: StoreError) -> NoReturn:
    """A Redis error as the one line a command ends with. Credentials or an ACL that
    Redis refused are a mistake in the settings (exit 2, as for a bad option); a schema
    mismatch exits 1 as click's errors do; Redis unreachable or failing exits 1."""
    click.echo(f"Error: {exc}", err=True)
    sys.exit(2 if isinstance(exc, StoreAuthError) else 1)
