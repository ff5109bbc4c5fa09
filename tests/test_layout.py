"""The package layout keeps its promises: one-way imports, no cycles, a light reader."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "poller"

#: Which top-level parts of the package each part may import (module-level imports).
LEAVES = {
    "errors", "config", "config_redis", "config_scrape", "config_load", "config_errors",
    "allowlist", "sources", "registry", "stats", "logs", "backoff", "_version",
}  # fmt: skip
ALLOWED = {
    "leaf": set(),
    "root": {"reader"},  # poller/__init__.py re-exports the reader API
    "scrape": {"scrape"},
    "redis": {"redis"},
    "reader": {"reader", "redis.keys", "redis.lua", "redis.connection", "redis.errors"},
    "service": {"scrape", "redis", "reader", "service"},
    "cli": {"scrape", "redis", "reader", "service", "cli", "lab"},
    "lab": {"scrape", "redis", "reader", "service", "cli", "lab", "integrations"},
    "integrations": {"reader", "integrations"},
    "__main__": {"cli"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(("poller", *parts))] = path
    return out


def _imports(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("poller"):
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("poller"))
    modules = _modules()
    return {m for m in found if m in modules}


def _part(module: str) -> str:
    rest = module.removeprefix("poller").lstrip(".")
    head = rest.split(".")[0]
    if not rest:
        return "root"
    return "leaf" if head in LEAVES else head


def test_each_part_imports_only_what_it_may() -> None:
    wrong = []
    for module, path in _modules().items():
        part = _part(module)
        for target in _imports(path, top_level_only=False):
            rest = target.removeprefix("poller.")
            if _part(target) == "leaf":
                continue
            allowed = ALLOWED[part]
            if not any(rest == a or rest.startswith(a + ".") for a in allowed):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycles_at_module_level() -> None:
    graph = {m: _imports(p, top_level_only=True) for m, p in _modules().items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, ()):
            # A package's __init__ importing its own submodules is not a cycle.
            if node.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for module in graph:
        if module not in state:
            visit(module)


def test_the_reader_loads_no_scraping_or_scheduling_stack() -> None:
    code = (
        "import sys, poller, poller.reader\n"
        "heavy = ('httpx', 'aiohttp', 'apscheduler', 'click', 'rich', 'prometheus_client',\n"
        "         'poller.scrape', 'poller.service', 'poller.cli', 'poller.lab',\n"
        "         'poller.redis.store', 'poller.redis.batch')\n"
        "print(sorted(m for m in sys.modules if m.startswith(heavy)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


#: Modules that may name redis-py's exception classes: the mapping point, and the batcher,
#: which keeps one command's error reply as that command's result (a value, not a failure).
REDIS_ERROR_MODULES = {"poller.redis.errors", "poller.redis.batch"}


def test_redis_py_errors_are_mapped_in_one_place() -> None:
    """Everyone else catches ``StoreError`` and below (or ``REDIS_ERRORS`` from the mapping
    module, then maps): no ``redis.exceptions`` import, no ``RedisError`` by name."""
    wrong = []
    for module, path in _modules().items():
        if module in REDIS_ERROR_MODULES:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "redis.exceptions"
            ):
                wrong.append(f"{module}:{node.lineno} imports from redis.exceptions")
            elif isinstance(node, ast.Import) and any(
                a.name.startswith("redis.exceptions") for a in node.names
            ):
                wrong.append(f"{module}:{node.lineno} imports redis.exceptions")
            elif isinstance(node, ast.Attribute) and node.attr.endswith(
                ("RedisError", "ResponseError", "AuthenticationError", "NoPermissionError")
            ):
                wrong.append(f"{module}:{node.lineno} names redis-py's {node.attr}")
    assert not wrong, "\n".join(sorted(wrong))
