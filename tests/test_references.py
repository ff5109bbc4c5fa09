"""Comments and docs name what the repository has: its own files, its own methods.

Checked over the package's code (``poller/``), the Makefile and docs/operations.md: every
repository path they name exists, every ``*.py`` a comment names is a module of the
repository, every ``Class.member`` a docstring names is a member of that class, and no
file cites a document the repository does not ship.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from tests.support.paths import REPO

PACKAGE = REPO / "poller"


def _ours(path: Path) -> bool:
    """A file of the repository's own, not of a virtualenv or a build inside it."""
    rel = path.relative_to(REPO).parts
    return not any(part.startswith(".") or part in ("build", "dist") for part in rel)


#: Documents that name other repositories' files: the changelog (history: what was), the
#: captured pages' provenance (the engines' own source paths).
_FOREIGN = ("CHANGELOG.md", "SOURCES.md")
#: The texts whose paths are checked, besides the package's modules: every document
#: (the changelog is history and names what was), the lab, the tests and the build files.
TEXTS = (
    REPO / "Makefile",
    REPO / "pyproject.toml",
    *sorted(p for p in (REPO / "deploy").rglob("*.y*ml") if _ours(p)),
    *sorted(p for p in REPO.glob("**/*.md") if _ours(p) and p.name not in _FOREIGN),
    *sorted(p for p in (REPO / "lab").rglob("*.py") if _ours(p)),
    *sorted(p for p in (REPO / "tests").rglob("*.py") if _ours(p)),
)
#: Top-level folders of the repository: a path starting with one is a path of ours.
TOPS = ("poller", "lab", "tests", "docs", "deploy", "constraints")
_PATH = re.compile(rf"(?<![\w/.-])((?:{'|'.join(TOPS)})/[\w./*@-]*[\w*])")
#: Names that look like paths and are not: kubectl's Deployment ``deploy/llmgw-poller``,
#: and the files the packaging tests make up to check what the ignore files leave out.
NOT_PATHS = {
    "deploy/llmgw-poller",
    "poller/__pycache__/x.pyc",
    "lab/tests/x.py",
    "lab/.venv/bin/python",
    "lab/poller_lab/__pycache__/x.pyc",
}
_MODULE = re.compile(r"(?<![\w/.-])([a-z_][a-z0-9_]*\.py)\b")
_MEMBER = re.compile(r"``([A-Z][A-Za-z0-9_]*)\.([a-z_][A-Za-z0-9_]*)(?:\([^`]*\))?``")
#: Documents that are not in the repository (named without their extension here, so
#: that this file does not cite them either).
_ABSENT = re.compile(r"\b(?:DESIGN|STYLE|PERFORMANCE)\.md\b")


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _texts() -> Iterator[tuple[Path, str]]:
    for path in [*_modules(), *TEXTS]:
        yield path, path.read_text(encoding="utf-8")


def _exists(named: str) -> bool:
    named = named.split("::")[0].split("#")[0].rstrip(".")
    if "*" in named:
        return any(REPO.glob(named))
    return (REPO / named).exists() or (REPO / f"{named}.py").exists()  # a module, by path


def test_no_file_cites_a_document_the_repository_does_not_have() -> None:
    cited = []
    for folder in ("poller", "lab", "tests"):
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix in (".py", ".md", ".toml", ".txt", ".sh") and path.is_file():
                text = path.read_text(encoding="utf-8", errors="replace")
                cited += [f"{path.relative_to(REPO)}: {m}" for m in _ABSENT.findall(text)]
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    cited += [f"Makefile: {m}" for m in _ABSENT.findall(makefile)]
    assert cited == []


def test_every_repository_path_named_exists() -> None:
    missing = [
        f"{path.relative_to(REPO)}: {named}"
        for path, text in _texts()
        for named in _PATH.findall(text)
        if named not in NOT_PATHS and not _exists(named)
    ]
    assert missing == []


def test_every_module_a_comment_names_is_one_of_the_repository() -> None:
    names = {p.name for folder in ("poller", "lab", "tests") for p in (REPO / folder).rglob("*.py")}
    missing = [
        f"{path.relative_to(REPO)}: {named}"
        for path in _modules()
        for named in _MODULE.findall(path.read_text(encoding="utf-8"))
        if named not in names
    ]
    assert missing == []


def _members() -> dict[str, tuple[set[str], list[str]]]:
    """Class name -> (what its body defines or assigns on self/cls, its base names)."""
    found: dict[str, tuple[set[str], list[str]]] = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            names, bases = found.setdefault(node.name, (set(), []))
            bases += [b.id for b in node.bases if isinstance(b, ast.Name)]
            for inner in ast.walk(node):
                if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(inner.name)
                elif isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
                    names.add(inner.id)
                elif (
                    isinstance(inner, ast.Attribute)
                    and isinstance(inner.value, ast.Name)
                    and inner.value.id in ("self", "cls")
                ):
                    names.add(inner.attr)
    return found


def test_every_class_member_a_docstring_names_exists() -> None:
    classes = _members()

    def has(cls: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
        names, bases = classes[cls]
        return member in names or any(
            has(b, member, seen | {cls}) for b in bases if b in classes and b not in seen
        )

    missing = [
        f"{path.relative_to(REPO)}: {cls}.{member}"
        for path in _modules()
        for cls, member in _MEMBER.findall(path.read_text(encoding="utf-8"))
        if cls in classes and not has(cls, member)
    ]
    assert missing == []
