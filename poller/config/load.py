"""Reading settings: the TOML file, ``POLLER_*`` environment variables, flags, and the
merge of the three into one tree for the root model."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from poller.errors import ConfigError
from poller.util.messages import closest, locate_unknown, not_utf8

__all__ = [
    "FLAT_ENV",
    "env_overrides",
    "flag_overrides",
    "merge",
    "read_toml",
    "unknown_env",
]

#: ``POLLER_*`` variables without ``__``: the command-line options' (``poller run``,
#: ``status``, ``endpoints``, ``epp``), which click reads. Any other ``POLLER_`` name without
#: ``__`` is a typo, reported rather than silently ignored. (``POLLER_PAGE_SCREENSHOT``
#: is the page test's switch to rewrite the README's screenshot.)
FLAT_ENV = frozenset(
    {
        "POLLER_CONFIG",
        "POLLER_REDIS_URL",
        "POLLER_NAMESPACE",
        "POLLER_ID",
        "POLLER_INTERVAL",
        "POLLER_TIMEOUT",
        "POLLER_HEALTH_PORT",
        "POLLER_ENDPOINTS_FILE",
        "POLLER_DISCOVER",
        "POLLER_LOG_FORMAT",
        "POLLER_LOG_LEVEL",
        "POLLER_PAGE_SCREENSHOT",
        "POLLER_GRPC_PORT",
        "POLLER_GRPC_HEALTH_PORT",
        "POLLER_METRICS_PORT",
        "POLLER_REPLICA_ID",
        "POLLER_FALLBACKS",
        "POLLER_WHEN_SATURATED",
        "POLLER_MAX_BODY_BYTES",
    }
)


def read_toml(config_file: str | Path) -> dict[str, Any]:
    path = Path(config_file)
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} {not_utf8(exc)}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for key in path[:-1]:
        node = tree.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(path)}: {key} is not a section")
        tree = node
    tree[path[-1]] = value


def _env_path(name: str) -> list[str]:
    return name.removeprefix("POLLER_").lower().split("__")


def _env_name(path: list[str]) -> str:
    return "POLLER_" + "__".join(path).upper()


def _nested_names(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[str]:
    """Every ``POLLER_<SECTION>__<KEY>`` the model takes (dict-valued sections excluded)."""
    names = []
    for field, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            names += _nested_names(annotation, (*prefix, field))
        elif prefix:
            names.append(_env_name([*prefix, field]))
    return names


def unknown_env(
    environ: dict[str, str], model: type[BaseModel], flat: frozenset[str] = FLAT_ENV
) -> list[str]:
    """One line per ``POLLER_*`` variable that names no setting and no option, with the
    closest real name when one is close."""
    problems = []
    known = sorted(flat | set(_nested_names(model)))
    for name in sorted(environ):
        if not name.startswith("POLLER_") or name in flat:
            continue
        if "__" in name and locate_unknown(model, _env_path(name)) is None:
            continue
        # compared without the shared prefix, which would make every name look close
        guess = closest(name.removeprefix("POLLER_"), [k.removeprefix("POLLER_") for k in known])
        hint = f" (did you mean POLLER_{guess}?)" if guess else " (see docs/operations.md)"
        problems.append(f"unknown environment variable {name}{hint}")
    return problems


def env_overrides(environ: dict[str, str], model: type[BaseModel]) -> dict[str, Any]:
    """``POLLER_SCRAPE__TIMEOUT_S=0.5`` -> {"scrape": {"timeout_s": "0.5"}}; variables
    that name no setting are left out (``unknown_env`` reports them)."""
    tree: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith("POLLER_") or "__" not in name:
            continue
        path = _env_path(name)
        if locate_unknown(model, path) is None:
            _set_path(tree, path, value)
    return tree


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def flag_overrides(overrides: dict[str, Any] | None) -> dict[str, Any]:
    """``{"scrape.interval_s": 2}`` -> {"scrape": {"interval_s": 2}}; None values dropped."""
    flat: dict[str, Any] = {}
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_path(flat, dotted.split("."), value)
    return flat
