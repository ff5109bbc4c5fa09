"""What the deployment tests (tests/deploy/) share: where deploy/ is, the example ACL
users, YAML and tool helpers, the Dockerfile and .dockerignore read as Docker reads
them, the Kubernetes base objects, and the checks of environment variables and Redis URLs
against the poller and users.acl. ``promtool_binary()`` is the one way to promtool (a test
using it is marked ``promtool``: tests/support/markers.py)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from poller.cli import cli
from poller.config import ScrapeSettings, Settings
from tests.support.markers import require
from tests.support.paths import REPO

__all__ = [
    "ACL_FILE",
    "ADMIN",
    "DEPLOY",
    "ENGINES",
    "GATEWAY",
    "K8S",
    "POLLER",
    "acl_users",
    "check_redis_url",
    "docker_stages",
    "dockerfile",
    "dockerignore_patterns",
    "dockerignored",
    "heading_anchors",
    "k8s_objects",
    "known_env",
    "load_yaml",
    "promtool_binary",
    "require_module",
    "run_tool",
    "yaml_docs",
]

DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
ACL_FILE = DEPLOY / "redis" / "users.acl"
ENGINES = ("vllm", "sglang", "llamacpp", "trtllm", "triton", "tgi", "lmdeploy")
# The example passwords documented in deploy/redis/README.md.
ADMIN = ("admin", "admin-example-password")
POLLER = ("poller", "poller-example-password")
GATEWAY = ("gateway", "gateway-example-password")


def require_module(module: str, pip_name: str) -> Any:
    """Import a validation dependency, failing (never skipping) with the install hint."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        pytest.fail(f"{module} is missing: pip install {pip_name} (a test dependency)")


def yaml_docs(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def run_tool(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    kwargs.setdefault("timeout", 120)
    return subprocess.run(args, capture_output=True, text=True, **kwargs)


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in (DEPLOY / "Dockerfile").read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def docker_stages() -> dict[str, list[tuple[str, str]]]:
    args: dict[str, str] = {}
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for word, rest in dockerfile():
        if word == "ARG" and current is None:
            name, _, default = rest.partition("=")
            args[name] = default
        elif word == "FROM":
            image, *alias = rest.split(" AS ") if " AS " in rest else (rest,)
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image.strip())
            current = [("IMAGE", image)]
            stages[alias[0].strip() if alias else str(len(stages))] = current
        else:
            assert current is not None, f"{word} before FROM"
            current.append((word, rest))
    return stages


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or a parent wins."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.removeprefix("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        regex = regex.replace(r"\?", "[^/]").replace(r"\[", "[").replace(r"\]", "]")
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not negate
    return excluded


def dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def acl_users() -> dict[str, str]:
    """user -> sha256 password hash, from users.acl."""
    users = {}
    for line in ACL_FILE.read_text(encoding="utf-8").splitlines():
        words = line.split()
        hashes = [w[1:] for w in words if w.startswith("#")]
        users[words[1]] = hashes[0] if hashes else ""
    return users


def env_names(command: Any) -> set[str]:
    return {p.envvar for p in command.params if isinstance(p.envvar, str)}


def known_env(name: str) -> bool:
    """A POLLER_* variable the poller reads (a flag's envvar or a settings path), or an
    engine key it may send (scrape.key_env_prefix)."""
    if name.startswith(ScrapeSettings().key_env_prefix):
        return True
    if name in env_names(cli.commands["run"]) | env_names(
        cli.commands["endpoints"].commands["sync"]
    ):
        return True
    if not name.startswith("POLLER_") or "__" not in name:
        return False
    model: Any = Settings
    for part in name.removeprefix("POLLER_").lower().split("__"):
        if part not in model.model_fields:
            return False
        model = model.model_fields[part].annotation
    return True


def check_redis_url(url: str, user: tuple[str, str] | None = None) -> None:
    parts = urlsplit(url)
    users = acl_users()
    assert parts.username in users, f"{url}: no ACL user {parts.username}"
    digest = hashlib.sha256((parts.password or "").encode()).hexdigest()
    assert users[parts.username] == digest, f"{url}: password does not match users.acl"
    if user is not None:
        assert (parts.username, parts.password) == user


def k8s_objects() -> dict[str, dict[str, Any]]:
    """The objects of the base and of the monitoring component, by kind."""
    base, monitoring = K8S / "base", K8S / "components" / "monitoring"
    files = [base / "deployment.yaml", base / "service.yaml", base / "pdb.yaml"]
    files += [monitoring / "servicemonitor.yaml", monitoring / "prometheusrule.yaml"]
    return {d["kind"]: d for f in files for d in yaml_docs(f)}


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors."""
    anchors = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def promtool_binary() -> str | None:
    """promtool from PATH (None when missing); only a test marked ``promtool`` may ask.
    Under ``make test``, which installs it (``LLMGW_TOOLS_REQUIRED=1``), missing fails."""
    require("promtool", "promtool")
    found = shutil.which("promtool")
    if found is None and os.environ.get("LLMGW_TOOLS_REQUIRED") == "1":
        pytest.fail("promtool not found although `make test` installs it (make promtool)")
    return found
