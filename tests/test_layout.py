"""The package layout keeps its promises: one-way imports, no cycles, a light reader.

The rules, drawn as docs/architecture.md draws them (an arrow: "may import"):

    util, errors, _version                 <- everyone
    schema    -> util                        the Redis contract both sides share
    redis     -> util                        plumbing: settings, connections, error mapping
    config    -> schema, redis.settings      the service's settings
    store     -> schema, redis               the writer side
    reader    -> schema, redis               what a gateway imports
    scrape    -> schema, config
    service   -> config, schema, redis, store, reader, scrape
    cli       -> config, schema, redis, store, reader, scrape, service, integrations
    integrations -> reader, schema           one package per gateway
    poller_lab -> anything in poller          the lab; nothing in poller imports it

Inside the reader, in the order data flows (``READER``): the view imports nothing of
what shares or routes; the load and the placements nothing of the exchange that carries
them; the Router sits above them all. A cycle counts imports under ``TYPE_CHECKING``
too: a circle hidden from the interpreter is still one in the design.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO

PACKAGES = {"poller": REPO / "poller", "poller_lab": REPO / "lab" / "poller_lab"}

#: Modules every part may import: the error tree, the version, small pure helpers.
BASE = {"errors", "_version", "util"}
#: What each part of ``poller`` (its first dotted name below ``poller``) may import, besides
#: itself and ``BASE``.
ALLOWED: dict[str, set[str]] = {
    "util": set(),
    "errors": set(),
    "_version": set(),
    "schema": set(),
    "redis": set(),
    "config": {"schema", "redis.settings"},
    "store": {"schema", "redis"},
    "reader": {"schema", "redis"},
    "scrape": {"schema", "config"},
    "service": {"config", "schema", "redis", "store", "reader", "scrape"},
    "cli": {"config", "schema", "redis", "store", "reader", "scrape", "service", "integrations"},
    "integrations": {"reader", "schema"},
    "root": {"reader", "schema"},  # poller/__init__.py: the public API
    "__main__": {"cli"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for top, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((top, *parts))] = path
    return out


def _module_level(tree: ast.Module) -> list[ast.stmt]:
    """The statements that run when the module is imported, and those under ``if
    TYPE_CHECKING:`` (or any module-level ``if``/``try``): not inside a def or class."""
    out: list[ast.stmt] = []
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If | ast.Try):
            todo += [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
            for handler in getattr(node, "handlers", []):
                todo += handler.body
    return out


def _imports(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = _module_level(tree) if top_level_only else list(ast.walk(tree))
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
    if module.startswith("poller_lab"):
        return "lab"
    rest = module.removeprefix("poller").lstrip(".")
    return rest.split(".")[0] if rest else "root"


def test_each_part_imports_only_what_it_may() -> None:
    wrong = []
    for module, path in _modules().items():
        part = _part(module)
        if part == "lab":
            continue  # the lab may use anything of the poller
        allowed = ALLOWED[part] | BASE | {part}
        for target in _imports(path, top_level_only=False):
            if target.startswith("poller_lab"):
                wrong.append(f"{module} imports the lab ({target})")
                continue
            rest = target.removeprefix("poller").lstrip(".") or "root"
            if not any(rest == a or rest.startswith(a + ".") for a in allowed):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_every_part_has_a_rule() -> None:
    """A new folder or top-level module is placed in the rules above, not let through."""
    parts = {_part(m) for m in _modules()} - {"lab"}
    assert parts <= set(ALLOWED), sorted(parts - set(ALLOWED))


#: What each part of ``poller.reader`` (its first name below it) may import of the
#: reader, besides itself: the view at the bottom, the Router above the rest, the readers
#: and the earlier API on top.
READER: dict[str, set[str]] = {
    "view": set(),
    "load": set(),
    "prefix": set(),
    "exchange": {"view", "load", "prefix"},
    "routing": {"view", "load", "prefix"},
    "ticket": {"view", "load"},
    "router": {"view", "load", "prefix", "exchange", "routing", "ticket"},
    "legacy": {"view", "load", "prefix", "exchange", "routing", "ticket", "router"},
    "base": {"view", "load", "prefix", "exchange", "routing", "ticket", "router", "legacy"},
    "reader": {"view", "load", "prefix", "exchange", "routing", "router", "legacy", "base"},
    "sync": {"view", "load", "prefix", "exchange", "routing", "router", "legacy", "base"},
}


def test_the_reader_s_parts_import_in_the_order_data_flows() -> None:
    wrong = []
    parts = {m: m.split(".")[2] for m in _modules() if m.startswith("poller.reader.")}
    assert set(parts.values()) <= set(READER), sorted(set(parts.values()) - set(READER))
    for module, part in parts.items():
        for target in _imports(_modules()[module], top_level_only=False):
            if target.startswith("poller.reader."):
                other = target.split(".")[2]
                if other != part and other not in READER[part]:
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


def _loaded_after(statement: str, prefixes: tuple[str, ...]) -> list[str]:
    code = (
        f"import sys\n{statement}\n"
        f"print(sorted(m for m in sys.modules if m.startswith({prefixes!r})))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return list(ast.literal_eval(done.stdout.strip()))


def test_the_reader_loads_no_scraping_scheduling_or_settings_stack() -> None:
    heavy = (
        "httpx", "httptools", "aiohttp", "apscheduler", "click", "rich", "prometheus_client",
        "yaml", "dns", "fakeredis", "litellm",
        "poller.scrape", "poller.service", "poller.cli", "poller.config", "poller.store",
        "poller.integrations", "poller_lab",
    )  # fmt: skip
    assert _loaded_after("import poller, poller.reader", heavy) == []


def test_the_service_loads_no_lab() -> None:
    """`poller run`'s modules never load the lab; the CLI loads only the lab's command
    definitions (their entry points), none of its code or dependencies."""
    lab = ("poller_lab", "aiohttp", "fakeredis")
    assert _loaded_after("import poller.service.serve", lab) == []
    assert _loaded_after("import poller.cli.app", lab) in ([], ["poller_lab", "poller_lab.cli"])


#: Modules that may name redis-py's exception classes: the mapping point, and the batcher,
#: which keeps one command's error reply as that command's result (a value, not a failure).
REDIS_ERROR_MODULES = {"poller.redis.errors", "poller.store.batch"}


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
