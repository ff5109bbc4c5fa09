"""Reading settings: the TOML file, ``POLLER_*`` environment variables, flags, and the
merge of the three into one tree for the root model."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from poller.errors import ConfigError

__all__ = ["env_overrides", "flag_overrides", "merge", "read_toml"]


def read_toml(config_file: str | Path) -> dict[str, Any]:
    path = Path(config_file)
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for key in path[:-1]:
        node = tree.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(path)}: {key} is not a section")
        tree = node
    tree[path[-1]] = value


def env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    """``POLLER_SCRAPE__TIMEOUT_S=0.5`` -> {"scrape": {"timeout_s": "0.5"}}."""
    tree: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith("POLLER_") or "__" not in name:
            continue
        path = name.removeprefix("POLLER_").lower().split("__")
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
