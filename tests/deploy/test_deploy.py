"""Deployment artifacts (deploy/, .dockerignore, docs/operations.md) agree with the package.

Everything here runs offline. What checks what:

- packaging: sdist from a copy of the tree, wheel from the sdist, installed into a fresh
  virtualenv, run from outside the source tree;
- the Dockerfile against pyproject.toml, the CLI, the default health port and
  .dockerignore (no engine is needed: nothing is built);
- compose.yaml against the Compose specification (the schema vendored by
  check-jsonschema) and against the simulator's flags, the CLI and users.acl;
- Kubernetes manifests against kubernetes-validate's schemas, raw and after kustomize
  rendering (``kubectl kustomize``; skipped, saying so, when neither kubectl nor kustomize
  is installed); the Prometheus Operator objects structurally;
- the alerts with promtool (skipped, saying so, when the prometheus package is missing),
  and every metric the alerts and the dashboard query against poller/metrics.py;
- users.acl and every Redis config loaded by the real redis-server, a poller and a reader
  run as the ACL users;
- the systemd unit, the example config and the operations guide.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import sysconfig
import tarfile
import time
import tomllib
import venv
import zipfile
from collections.abc import Iterator
from importlib import metadata, resources
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
import yaml
from click.testing import CliRunner
from packaging.requirements import Requirement

from poller._version import __version__
from poller.cli import cli
from poller.config import DEFAULT_KEY_DIR, HealthSettings, ScrapeSettings, Settings, load_settings
from poller.config.registry_file import endpoints_from_file
from poller.schema.stats import FAILURE_REASONS
from poller.service.metrics import PollerMetrics
from poller_lab.sim.cli import DEFAULT_KEY_ENV
from tests.support.paths import REPO
from tests.support.redisproc import free_cluster_port, free_port, redis_server_binary, wait_until

DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
ACL_FILE = DEPLOY / "redis" / "users.acl"
ENGINES = ("vllm", "sglang", "llamacpp", "trtllm", "triton", "tgi", "lmdeploy")
# The example passwords documented in deploy/redis/README.md.
ADMIN = ("admin", "admin-example-password")
POLLER = ("poller", "poller-example-password")
GATEWAY = ("gateway", "gateway-example-password")
PROMTOOL_HINT = "promtool not installed: apt-get install prometheus (it ships promtool)"
KUSTOMIZE_HINT = (
    "neither kubectl nor kustomize is installed: install kubectl (it embeds kustomize) or "
    "kustomize; the raw manifests are still validated by the other tests"
)


def _require(module: str, pip_name: str) -> Any:
    """Import a validation dependency, failing (never skipping) with the install hint."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        pytest.fail(f"{module} is missing: pip install {pip_name} (a test dependency)")


def _yaml_docs(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _run(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    kwargs.setdefault("timeout", 120)
    return subprocess.run(args, capture_output=True, text=True, **kwargs)


# --- packaging ------------------------------------------------------------------------------


def _satisfied(requirement: str) -> bool:
    req = Requirement(requirement)
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return False
    return req.specifier.contains(version, prereleases=True)


def _backend_python(tmp_path: Path) -> str:
    """A Python with pyproject's [build-system] requirements.

    The test interpreter when it has them (offline: add them to the test extra); else a
    throwaway venv that pip fills from its configured index and cache.
    """
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    requires = pyproject["build-system"]["requires"]
    if all(_satisfied(r) for r in requires):
        return sys.executable
    env_dir = tmp_path / "build-env"
    venv.create(env_dir, with_pip=False)
    python = str(env_dir / "bin" / "python")
    done = _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", *requires])
    assert done.returncode == 0, f"cannot install the build backend {requires}:\n{done.stderr}"
    return python


def _pep517(python: str, hook: str, source: Path, out: Path) -> Path:
    """Call a setuptools PEP 517 hook in ``source``; returns the built file."""
    code = f"import sys, setuptools.build_meta as b; print(b.{hook}(sys.argv[1]))"
    done = _run([python, "-c", code, str(out)], cwd=source)
    assert done.returncode == 0, f"{hook} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return out / done.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_sdist_and_wheel_install_and_run_outside_the_source_tree(tmp_path: Path) -> None:
    """sdist from a clean copy, wheel from the sdist, installed into a fresh venv.

    The venv gets the wheel with --no-deps and reaches the already installed dependencies
    through a .pth line naming the test environment's site-packages (a path line runs no
    .pth file there, so the editable install of the source tree stays out of sight). This
    stays offline and takes seconds; the assertions below prove the code ran from the wheel.
    """
    source = tmp_path / "src"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"
        ),
    )
    dist = tmp_path / "dist"
    dist.mkdir()
    python = _backend_python(tmp_path)
    sdist = _pep517(python, "build_sdist", source, dist)
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    wheel = _pep517(python, "build_wheel", unpacked, dist)

    names = set(zipfile.ZipFile(wheel).namelist())
    for engine in ENGINES:
        assert f"poller/scrape/data/{engine}.txt" in names, f"bundled page {engine}.txt missing"
    assert {"poller/py.typed", "lab/poller_lab/sim/__main__.py", "poller/__main__.py"} <= names
    assert "poller/schema/scripts/write_stats.lua" in names
    assert {"poller/service/web/static/page.js", "poller/service/web/static/page.css"} <= names
    assert not any(n.startswith("tests/") for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "poller = poller.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()

    target = tmp_path / "venv"
    venv.create(target, with_pip=False)
    target_python = str(target / "bin" / "python")
    done = _run(
        [sys.executable, "-m", "pip", "--python", target_python, "install", "-q"]
        + ["--no-deps", "--no-index", str(wheel)]
    )
    assert done.returncode == 0, done.stderr
    site = _run([target_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site.stdout.strip()) / "test-deps.pth").write_text("\n".join(sorted(deps)) + "\n")

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    outside = tmp_path / "elsewhere"
    outside.mkdir()

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return _run(list(args), cwd=outside, env=env)

    where = run(target_python, "-c", "import poller; print(poller.__file__)")
    assert where.stdout.strip().startswith(str(target)), where.stdout + where.stderr
    version = run(str(target / "bin" / "poller"), "--version")
    assert version.returncode == 0 and __version__ in version.stdout, version
    for engine in ("vllm", "trtllm"):
        check = run(str(target / "bin" / "poller"), "check", "--example", "--engine", engine)
        assert check.returncode == 0, f"{engine}: {check.stdout}\n{check.stderr}"
    assert run(target_python, "-m", "poller_lab.sim", "--help").returncode == 0

    # Without the service extra (a gateway's install: redis and pydantic only), the reader
    # imports and every command exits 2 with one line naming the install command.
    minimal = tmp_path / "minimal-deps"
    minimal.mkdir()
    for name in _READER_DEPS:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, name
        origin = Path(spec.origin)
        source_path = origin.parent if origin.name == "__init__.py" else origin
        (minimal / source_path.name).symlink_to(source_path)
    (Path(site.stdout.strip()) / "test-deps.pth").write_text(f"{minimal}\n")
    reader = run(target_python, "-c", "from poller import StatsReader, pick; print('ok')")
    assert reader.returncode == 0 and reader.stdout.strip() == "ok", reader.stderr
    for args in (["--version"], ["run"], ["status"], ["check", "--example"], []):
        bare = run(str(target / "bin" / "poller"), *args)
        assert bare.returncode == 2, (args, bare)
        assert "Traceback" not in bare.stderr, bare.stderr
        assert bare.stderr.strip().count("\n") == 0, bare.stderr
        assert "pip install 'llmgw-poller[service]'" in bare.stderr, bare.stderr


#: What a gateway's install brings (the package's own dependencies, no extras).
_READER_DEPS = (
    "redis",
    "hiredis",
    "pydantic",
    "pydantic_core",
    "annotated_types",
    "typing_extensions",
    "typing_inspection",
)


# --- every file parses ---------------------------------------------------------------------


def test_every_yaml_and_json_file_under_deploy_parses() -> None:
    files = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml", ".json"))
    assert len(files) >= 15
    for path in files:
        if path.suffix == ".json":
            assert isinstance(json.loads(path.read_text(encoding="utf-8")), dict), path
        else:
            assert _yaml_docs(path), f"{path} is empty"


# --- Dockerfile and .dockerignore ----------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
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


def _stages() -> dict[str, list[tuple[str, str]]]:
    args: dict[str, str] = {}
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for word, rest in _dockerfile():
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


def _ignored(path: str, patterns: list[str]) -> bool:
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


def _dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_dockerfile_matches_the_package() -> None:
    stages = _stages()
    assert len(stages) >= 2, "multi-stage build expected"
    *builders, (_, final) = stages.items()
    image = final[0][1]
    assert "slim" in image, f"final stage base {image!r} is not a slim image"
    words = [w for w, _ in final]

    # Non-root, with the uid the Kubernetes securityContext asks for.
    user = [rest for w, rest in final if w == "USER"][-1]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {user} must be a numeric non-root uid"
    deployment = _yaml(K8S / "base" / "deployment.yaml")
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(uid)

    port = HealthSettings().port
    assert [rest for w, rest in final if w == "EXPOSE"] == [str(port)]
    env = " ".join(rest for w, rest in final if w == "ENV")
    assert f"POLLER_HEALTH_PORT={port}" in env
    healthcheck = " ".join(rest for w, rest in final if w == "HEALTHCHECK")
    assert "/healthz" in healthcheck and "POLLER_HEALTH_PORT" in healthcheck
    probe = json.loads(healthcheck[healthcheck.index("CMD") + 3 :])
    assert probe[:2] == ["python", "-c"]
    compile(probe[2], "HEALTHCHECK", "exec")

    # ENTRYPOINT is the console script; CMD one of its commands.
    entrypoint = json.loads([rest for w, rest in final if w == "ENTRYPOINT"][-1])
    command = json.loads([rest for w, rest in final if w == "CMD"][-1])
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert entrypoint == ["poller"] and entrypoint[0] in pyproject["project"]["scripts"]
    assert command[0] in cli.commands

    # The runtime stage only copies the venv from a build stage: no compiler, no pip run.
    build_names = {name for name, _ in builders}
    for word, rest in final:
        if word == "COPY":
            assert rest.startswith("--from="), f"runtime stage copies from the context: {rest}"
            assert rest.split()[0].removeprefix("--from=") in build_names
        if word == "RUN":
            assert not re.search(r"pip |apt-get install|gcc|build-essential", rest), rest
    assert "USER" in words and words.index("USER") < words.index("ENTRYPOINT")

    # The build stage installs the wheel with the service extra, from existing sources.
    build = dict(builders)[next(iter(build_names))]
    assert any("[service]" in rest for w, rest in build if w == "RUN")
    assert "service" in pyproject["project"]["optional-dependencies"]
    patterns = _dockerignore()
    for word, rest in build:
        if word != "COPY" or rest.startswith("--from="):
            continue
        *sources, _dest = rest.split()
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: no such path in the repository"
            files = [REPO / source] if (REPO / source).is_file() else (REPO / source).rglob("*")
            for path in files:
                rel = path.relative_to(REPO).as_posix()
                if path.is_file() and "__pycache__" not in rel:
                    assert not _ignored(rel, patterns), f"{rel} is copied but .dockerignored"


def test_dockerignore_keeps_the_context_to_what_the_build_needs() -> None:
    patterns = _dockerignore()
    needed = ["pyproject.toml", "README.md", "poller/cli/__init__.py", "poller/py.typed"]
    needed += [f"poller/scrape/data/{e}.txt" for e in ENGINES]
    needed += ["poller/schema/scripts/write_stats.lua", "poller/service/web/static/page.js"]
    for rel in needed:
        assert not _ignored(rel, patterns), f"{rel} must be in the build context"
    for rel in ["tests/test_cli.py", ".git/HEAD", ".venv/bin/python", "poller/__pycache__/x.pyc"]:
        assert _ignored(rel, patterns), f"{rel} must stay out of the build context"


# --- compose ----------------------------------------------------------------------------------


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = _yaml(DEPLOY / "compose.yaml")
    return data


def test_compose_validates_against_the_compose_specification() -> None:
    jsonschema = _require("jsonschema", "jsonschema")
    _require("check_jsonschema", "check-jsonschema")
    vendor = resources.files("check_jsonschema.builtin_schemas.vendor")
    schema = json.loads(vendor.joinpath("compose-spec.json").read_text(encoding="utf-8"))
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(_compose())]
    assert not errors, "\n".join(errors)


def _acl_users() -> dict[str, str]:
    """user -> sha256 password hash, from users.acl."""
    users = {}
    for line in ACL_FILE.read_text(encoding="utf-8").splitlines():
        words = line.split()
        hashes = [w[1:] for w in words if w.startswith("#")]
        users[words[1]] = hashes[0] if hashes else ""
    return users


def _env_names(command: Any) -> set[str]:
    return {p.envvar for p in command.params if isinstance(p.envvar, str)}


def _known_env(name: str) -> bool:
    """A POLLER_* variable the poller reads (a flag's envvar or a settings path), or an
    engine key it may send (scrape.key_env_prefix)."""
    if name.startswith(ScrapeSettings().key_env_prefix):
        return True
    if name in _env_names(cli.commands["run"]) | _env_names(
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


def _check_redis_url(url: str, user: tuple[str, str] | None = None) -> None:
    parts = urlsplit(url)
    users = _acl_users()
    assert parts.username in users, f"{url}: no ACL user {parts.username}"
    digest = hashlib.sha256((parts.password or "").encode()).hexdigest()
    assert users[parts.username] == digest, f"{url}: password does not match users.acl"
    if user is not None:
        assert (parts.username, parts.password) == user


def test_compose_wires_the_simulator_the_registry_sync_and_three_pollers() -> None:
    compose = _compose()
    services = compose["services"]
    pollers = {n: s for n, s in services.items() if n.startswith("poller-")}
    assert len(pollers) == 3
    for service in services.values():
        if "build" in service:
            assert (DEPLOY / service["build"]["context"] / service["build"]["dockerfile"]).is_file()

    # Simulator: every flag exists, a dozen endpoints over every engine, a registry file.
    sim = services["sim"]
    assert sim["entrypoint"] == ["python", "-m", "poller_lab.sim"]
    help_text = _run([sys.executable, "-m", "poller_lab.sim", "--help"]).stdout
    args = sim["command"]
    for flag in (a for a in args if a.startswith("--")):
        assert re.search(rf"(^|\s){re.escape(flag)}\b", help_text), f"simulator has no {flag}"
    opts = dict(zip(args[::2], args[1::2], strict=True))
    check = sim["healthcheck"]["test"]
    assert check[:3] == ["CMD", "python", "-c"]
    compile(check[3], "sim healthcheck", "exec")
    assert opts["--registry-out"] in check[3], "the healthcheck waits for the registry file"
    assert int(opts["--endpoints"]) == 12
    assert set(opts["--engines"].split(",")) == set(ENGINES)
    registry_file = opts["--registry-out"]

    # The one-shot sync reads that file from the shared volume, through the real CLI.
    sync = services["registry-sync"]
    assert sync["command"] == ["endpoints", "sync", registry_file]
    assert "sync" in cli.commands["endpoints"].commands
    assert sync["restart"] == "no"
    for service in (sim, sync):
        volume, mount = service["volumes"][0].split(":")[:2]
        assert volume in compose["volumes"] and registry_file.startswith(mount + "/")
    _check_redis_url(sync["environment"]["POLLER_REDIS_URL"], POLLER)

    # Pollers: the real `run` command, distinct ids and health ports, all published.
    published = {int(p.split(":")[-1]) for p in sim["ports"]}
    ids, ports = set(), set()
    for service in pollers.values():
        assert service["command"] == ["run"] and "run" in cli.commands
        environment = service["environment"]
        for name in environment:
            assert _known_env(name), f"{name} is not read by the poller"
        ids.add(environment["POLLER_ID"])
        ports.add(int(environment["POLLER_HEALTH_PORT"]))
        _check_redis_url(environment["POLLER_REDIS_URL"], POLLER)
        # The simulator's keyed (llama.cpp) entries name DEFAULT_KEY_ENV: every poller has
        # it, with the key the simulator wants, under the key prefix.
        assert environment[DEFAULT_KEY_ENV] == opts["--api-key"]
        assert DEFAULT_KEY_ENV.startswith(ScrapeSettings().key_env_prefix)
        assert service["network_mode"] == "service:sim"
        grace = float(service["stop_grace_period"].removesuffix("s"))
        assert grace > 5
    assert len(ids) == 3 and len(ports) == 3 and ports <= published

    # Redis runs with the ACL file of deploy/redis.
    redis_service = services["redis"]
    mounts = dict(v.split(":")[:2] for v in redis_service["volumes"])
    acl_mount = redis_service["command"][redis_service["command"].index("--aclfile") + 1]
    assert (DEPLOY / next(s for s, m in mounts.items() if m == acl_mount)).resolve() == ACL_FILE


# --- Kubernetes --------------------------------------------------------------------------------


def _kustomizations() -> list[Path]:
    return sorted(K8S.rglob("kustomization.yaml"))


def _kustomize_refs(path: Path) -> dict[str, list[Path]]:
    """Files a kustomization names, by role: resources (dirs or manifests), data, patches."""
    data = _yaml(path)
    base = path.parent
    refs: dict[str, list[Path]] = {"resources": [], "data": [], "patches": []}
    for key in ("resources", "components"):
        refs["resources"] += [base / r for r in data.get(key, [])]
    for key in ("configMapGenerator", "secretGenerator"):
        for generator in data.get(key, []):
            for item in generator.get("files", []):
                refs["data"].append(base / item.rpartition("=")[2])
    for patch in data.get("patches", []):
        if "path" in patch:
            refs["patches"].append(base / patch["path"])
    return refs


def test_kustomizations_reference_existing_files() -> None:
    kustomizations = _kustomizations()
    assert {p.parent.relative_to(K8S).as_posix() for p in kustomizations} >= {
        "base",
        "components/monitoring",
        "overlays/example",
        "overlays/production",
    }
    for path in kustomizations:
        for role, refs in _kustomize_refs(path).items():
            for ref in refs:
                assert ref.exists(), f"{path}: {role} {ref} does not exist"
                if ref.is_dir():
                    assert (ref / "kustomization.yaml").is_file(), f"{ref} is no kustomization"
                elif ref.name == "endpoints.yaml":
                    assert endpoints_from_file(ref), f"{ref} has no endpoints"


def _validate_k8s(docs: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """Built-in kinds against the Kubernetes schemas (strict); returns the CRD objects."""
    kv = _require("kubernetes_validate", "kubernetes-validate")
    crds = []
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            crds.append(doc)
            continue
        for version in ("1.29.0", kv.latest_version()):
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as exc:
                pytest.fail(f"{where}: {doc['kind']} {doc['metadata']['name']} ({version}): {exc}")
    return crds


def test_raw_manifests_validate_against_the_kubernetes_schemas() -> None:
    seen = set()
    for path in _kustomizations():
        for ref in _kustomize_refs(path)["resources"]:
            if ref.is_file():
                seen.add(ref.name)
                _validate_k8s(_yaml_docs(ref), str(ref.relative_to(REPO)))
    assert {"deployment.yaml", "service.yaml", "pdb.yaml", "servicemonitor.yaml"} <= seen


def _kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.mark.parametrize("overlay", ["example", "production"])
def test_rendered_overlays_validate(overlay: str) -> None:
    command = _kustomize_command()
    if command is None:
        pytest.skip(KUSTOMIZE_HINT)
    done = _run([*command, str(K8S / "overlays" / overlay)])
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    crds = _validate_k8s(docs, f"overlays/{overlay}")
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "PodDisruptionBudget", "ConfigMap"} <= kinds
    assert {d["kind"] for d in crds} == {"ServiceMonitor", "PrometheusRule"}
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"llmgw"}
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert "/" in pod["containers"][0]["image"], "overlay sets the image's registry"
    if overlay == "example":
        # Every Secret the pod needs is generated, under its hashed name where referenced.
        secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
        container = pod["containers"][0]
        refs = {
            e["valueFrom"]["secretKeyRef"]["name"]
            for e in container["env"]
            if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]
        }
        refs |= {e["secretRef"]["name"] for e in container.get("envFrom", [])}
        refs |= {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        assert refs <= secrets, refs - secrets
        for doc in docs:
            if doc["kind"] == "Secret" and "url" in doc.get("data", {}):
                _check_redis_url(base64.b64decode(doc["data"]["url"]).decode(), POLLER)
    else:
        anti = pod["affinity"]["podAntiAffinity"]
        assert "requiredDuringSchedulingIgnoredDuringExecution" in anti
        assert "preferredDuringSchedulingIgnoredDuringExecution" not in anti


def _base() -> dict[str, dict[str, Any]]:
    """The objects of the base and of the monitoring component, by kind."""
    base, monitoring = K8S / "base", K8S / "components" / "monitoring"
    files = [base / "deployment.yaml", base / "service.yaml", base / "pdb.yaml"]
    files += [monitoring / "servicemonitor.yaml", monitoring / "prometheusrule.yaml"]
    return {d["kind"]: d for f in files for d in _yaml_docs(f)}


def test_deployment_is_wired_to_the_poller() -> None:
    objs = _base()
    deployment = objs["Deployment"]
    spec = deployment["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["replicas"] == 3
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= labels.items()
    # The stop (leases released, member left, connections closed) takes at most ~3-5 s.
    assert pod["terminationGracePeriodSeconds"] > 5

    env = {e["name"]: e for e in container["env"]}
    for name in env:
        assert _known_env(name), f"{name} is not read by the poller"
    assert env["POLLER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POLLER_REDIS_URL"]["valueFrom"]["secretKeyRef"]["key"] == "url"
    assert container["args"][0] == "run"

    # Probes on the named health port, which is the poller's default port.
    port = next(p for p in container["ports"] if p["name"] == "health")
    assert port["containerPort"] == HealthSettings().port == int(env["POLLER_HEALTH_PORT"]["value"])
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= container["resources"][kind].keys()

    # The registry file lives in the mounted ConfigMap, as a directory (never a subPath).
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert all("subPath" not in m for m in mounts.values())
    endpoints_path = Path(env["POLLER_ENDPOINTS_FILE"]["value"])
    mount = next(m for m in mounts.values() if Path(m["mountPath"]) == endpoints_path.parent)
    configmap = volumes[mount["name"]]["configMap"]["name"]
    generator = next(
        g
        for g in _yaml(K8S / "base" / "kustomization.yaml")["configMapGenerator"]
        if g["name"] == configmap
    )
    assert endpoints_path.name in generator["files"]
    entries = endpoints_from_file(K8S / "base" / endpoints_path.name)

    # Keys: api_key_file under a mounted Secret, api_key_env from a Secret's variables,
    # and both within the pollers' key rules (scrape.key_dir, scrape.key_env_prefix).
    secret_dirs = [Path(mounts[n]["mountPath"]) for n, v in volumes.items() if "secret" in v]
    env_from = [e["secretRef"] for e in container.get("envFrom", []) if "secretRef" in e]
    files = [e.api_key_file for e in entries.values() if e.api_key_file]
    variables = [e.api_key_env for e in entries.values() if e.api_key_env]
    assert files and variables, "the example registry shows both kinds of key"
    assert secret_dirs == [Path(DEFAULT_KEY_DIR)], "the key Secret is mounted at the key dir"
    for file in files:
        assert Path(DEFAULT_KEY_DIR, file).parent == Path(DEFAULT_KEY_DIR), file
    assert env_from, f"{variables} need an envFrom Secret"
    prefix = ScrapeSettings().key_env_prefix
    assert all(v.startswith(prefix) for v in variables), variables
    example = _yaml(K8S / "overlays" / "example" / "kustomization.yaml")
    env_secret = next(g for g in example["secretGenerator"] if g["name"] == env_from[0]["name"])
    named = {literal.partition("=")[0] for literal in env_secret["literals"]}
    assert set(variables) <= named and all(n.startswith(prefix) for n in named), named
    key_secret = next(
        g
        for g in example["secretGenerator"]
        if g["name"] == next(v["secret"]["secretName"] for v in volumes.values() if "secret" in v)
    )
    assert {Path(f).name for f in files} <= {
        literal.partition("=")[0] for literal in key_secret["literals"]
    }

    service, pdb = objs["Service"], objs["PodDisruptionBudget"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["ports"][0]["targetPort"] == "health"
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1


# --- monitoring: ServiceMonitor, PrometheusRule, dashboard ----------------------------------


def _exported_metrics() -> dict[str, set[str]]:
    """Every series name the poller exports -> its label names."""
    names: dict[str, set[str]] = {}
    metrics = PollerMetrics()
    for family in metrics.exposition.collect():
        collector = next(
            (c for c in vars(metrics).values() if getattr(c, "_name", None) == family.name), None
        )
        if collector is None:  # build info, process and platform collectors: as exposed
            for sample in family.samples:
                names.setdefault(sample.name, set()).update(sample.labels)
            continue
        labels = set(collector._labelnames)
        suffixes = {"counter": ["_total"], "gauge": [""]}.get(
            family.type, ["_bucket", "_count", "_sum"]
        )
        for suffix in suffixes:
            names[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return names


# Labels Prometheus adds to every scraped series (target labels of the ServiceMonitor).
TARGET_LABELS = {"job", "namespace", "pod", "instance", "service", "endpoint", "container"}


def _check_promql(expr: str, exported: dict[str, set[str]], where: str) -> None:
    metrics = set(re.findall(r"\b(poller_[a-z_]+)\b", expr))
    assert metrics or "up{" in expr, f"{where}: no metric in {expr!r}"
    allowed = TARGET_LABELS | {"le"}
    for metric in metrics:
        assert metric in exported, f"{where}: the poller exports no {metric}"
        allowed |= exported[metric]
    used = set(re.findall(r"\b(?:by|on|ignoring)\s*\(([^)]*)\)", expr))
    used_names = {n.strip() for group in used for n in group.split(",") if n.strip()}
    used_names |= set(re.findall(r"[{,]\s*([a-z_]+)\s*(?:=~|!=|!~|=)", expr))
    assert used_names <= allowed, f"{where}: unknown labels {used_names - allowed}"


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors."""
    anchors = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_servicemonitor_and_rules_are_structurally_sound() -> None:
    objs = _base()
    service, monitor, rules = objs["Service"], objs["ServiceMonitor"], objs["PrometheusRule"]
    assert monitor["apiVersion"] == rules["apiVersion"] == "monitoring.coreos.com/v1"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout"}
        assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
    # The job label is the Service name; every alert selects it.
    job = service["metadata"]["name"]

    exported = _exported_metrics()
    anchors = _anchors((REPO / "docs" / "operations.md").read_text(encoding="utf-8"))
    groups = rules["spec"]["groups"]
    assert len({g["name"] for g in groups}) == len(groups)
    alerts = [rule for group in groups for rule in group["rules"]]
    assert len({r["alert"] for r in alerts}) == len(alerts) >= 10
    for rule in alerts:
        where = rule["alert"]
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, where
        assert re.fullmatch(r"Llmgw[A-Za-z]+", rule["alert"]), where
        assert re.fullmatch(r"\d+[smh]", rule["for"]), where
        assert rule["labels"]["severity"] in ("critical", "warning"), where
        assert {"summary", "description", "runbook"} <= rule["annotations"].keys(), where
        page, _, anchor = rule["annotations"]["runbook"].partition("#")
        assert page == "docs/operations.md" and anchor in anchors, f"{where}: runbook {anchor}"
        assert f'job="{job}"' in rule["expr"], where
        _check_promql(rule["expr"], exported, where)


def test_alert_expressions_are_valid_promql_and_fire_as_tested(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(PROMTOOL_HINT)
    rules = _base()["PrometheusRule"]["spec"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rules["groups"]}))
    shutil.copy(K8S / "components" / "monitoring" / "alerts.test.yaml", tmp_path)
    checked = _run([promtool, "check", "rules", "rules.yaml"], cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = _run([promtool, "test", "rules", "alerts.test.yaml"], cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_grafana_dashboard_queries_only_exported_metrics() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "llmgw-poller.json").read_text(encoding="utf-8"))
    exported = _exported_metrics()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(set(ids)) == len(ids) >= 8
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            _check_promql(target["expr"], exported, panel["title"])


# --- Redis: users.acl and the configs, with the real redis-server ---------------------------


class _Redis:
    """A redis-server started with extra arguments; its clients log in as ACL users."""

    def __init__(
        self, args: list[str], cwd: Path, *, sentinel: bool = False, cluster: bool = False
    ) -> None:
        # A cluster node also binds port + 10000 for its bus.
        self.port = free_cluster_port() if cluster else free_port()
        self.cwd = cwd
        self._clients: dict[tuple[str, str] | None, redis.Redis] = {}
        cwd.mkdir(parents=True, exist_ok=True)
        command = [redis_server_binary(), *args, "--port", str(self.port), "--bind", "127.0.0.1"]
        if sentinel:
            command.append("--sentinel")
        command += ["--logfile", str(cwd / "redis.log")]
        self.proc = subprocess.Popen(
            command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

        def up() -> bool:
            if self.proc.poll() is not None:
                return True
            try:  # any answer will do: with the ACL file, PING wants a user first
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    return conn.recv(64).startswith((b"+PONG", b"-NOAUTH"))
            except OSError:
                return False

        wait_until(up, 60, what=f"redis-server {args[:1]}")  # seconds on a loaded machine
        if self.proc.poll() is not None:
            log = (cwd / "redis.log").read_text(errors="replace")[-2000:]
            raise AssertionError(f"redis-server {args} exited at start:\n{log}")

    def client(self, user: tuple[str, str] | None = ADMIN) -> redis.Redis:
        """One client per user, closed by stop()."""
        if user not in self._clients:
            username, password = user if user else (None, None)
            self._clients[user] = redis.Redis(
                port=self.port,
                username=username,
                password=password,
                decode_responses=True,
                socket_timeout=5,
            )
        return self._clients[user]

    def url(self, user: tuple[str, str]) -> str:
        return f"redis://{user[0]}:{user[1]}@127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        for client in self._clients.values():
            client.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[_Redis]:
    server = _Redis(
        ["--save", "", "--appendonly", "no", "--aclfile", str(ACL_FILE)], tmp_path / "acl"
    )
    try:
        yield server
    finally:
        server.stop()


def _dryrun(client: redis.Redis, user: str, *command: str) -> bool:
    return bool(client.execute_command("ACL", "DRYRUN", user, *command) == "OK")


def test_acl_file_loads_and_each_user_gets_exactly_its_commands(acl_redis: _Redis) -> None:
    admin = acl_redis.client()
    listed = {line.split()[1]: line for line in admin.execute_command("ACL", "LIST")}
    assert set(listed) == {
        "default",
        "admin",
        "poller",
        "gateway",
        "replica",
        "sentinel",
        "monitor",
    }
    assert " off " in listed["default"] + " "
    key = "{llmgw}:x"
    ev, up, sha = "{llmgw}:events", "{llmgw}:updates", "0" * 40
    poller_may = [
        ("GET", key), ("SET", key, "1"), ("INCR", key), ("DEL", key), ("MGET", key),
        ("HSET", key, "f", "v"), ("HGET", key, "f"), ("HGETALL", key), ("HDEL", key, "f"),
        ("HEXISTS", key, "f"), ("PEXPIRE", key, "1"), ("PTTL", key), ("ZADD", key, "1", "m"),
        ("ZREM", key, "m"), ("ZRANGEBYSCORE", key, "0", "1"), ("ZRANGE", key, "0", "-1"),
        ("ZREMRANGEBYSCORE", key, "0", "1"), ("TIME",), ("PUBLISH", ev, "x"), ("SUBSCRIBE", ev),
        ("EVALSHA", sha, "1", key), ("EVAL", "return 1", "1", key), ("SCRIPT", "LOAD", "return 1"),
        ("PING",), ("MULTI",), ("EXEC",), ("SPUBLISH", up, "x"),
    ]  # fmt: skip
    for command in poller_may:
        assert _dryrun(admin, "poller", *command), f"poller may not {command}"
    gateway_may = [
        ("GET", key), ("MGET", key), ("HGET", key, "f"), ("HGETALL", key), ("HEXISTS", key, "f"),
        ("ZRANGE", key, "0", "-1"), ("ZRANGEBYSCORE", key, "0", "1"), ("TIME",), ("PING",),
        ("SUBSCRIBE", ev), ("EVALSHA", sha, "1", key), ("EVALSHA_RO", sha, "1", key),
        ("SCRIPT", "LOAD", "return 1"), ("MULTI",), ("EXEC",), ("SSUBSCRIBE", up),
    ]  # fmt: skip
    for command in gateway_may:
        assert _dryrun(admin, "gateway", *command), f"gateway may not {command}"
    for user, command in [
        ("poller", ("SET", "other", "1")),
        ("poller", ("FLUSHALL",)),
        ("poller", ("KEYS", "*")),
        ("poller", ("CONFIG", "GET", "*")),
        ("poller", ("PUBLISH", "other", "x")),
        ("gateway", ("SET", key, "1")),
        ("gateway", ("HSET", key, "f", "v")),
        ("gateway", ("DEL", key)),
        ("gateway", ("PUBLISH", "{llmgw}:events", "x")),
        ("gateway", ("SPUBLISH", "{llmgw}:updates", "x")),
        ("poller", ("SPUBLISH", "other", "x")),
        ("gateway", ("EVAL", "return 1", "0")),
        ("gateway", ("GET", "other")),
    ]:
        assert not _dryrun(admin, user, *command), f"{user} may {command}"


def test_a_poller_and_a_reader_run_as_the_acl_users(acl_redis: _Redis, tmp_path: Path) -> None:
    """The real code paths, not a list: registry sync, poller run, gateway reads."""
    from poller.reader import StatsReader, SyncStatsReader
    from poller.scrape.check import serve_example
    from poller.service.worker import Worker

    async def scenario() -> None:
        async with serve_example("vllm") as base:
            registry = tmp_path / "endpoints.yaml"
            registry.write_text(
                yaml.safe_dump({"endpoints": [{"id": "acl-vllm", "url": base, "engine": "vllm"}]})
            )
            sync = await asyncio.to_thread(
                CliRunner().invoke,
                cli,
                ["endpoints", "sync", str(registry), "--redis-url", acl_redis.url(POLLER)],
            )
            assert sync.exit_code == 0, sync.output
            settings = load_settings(
                None,
                {"redis.url": acl_redis.url(POLLER), "id": "acl-poller", "health.port": 0},
                environ={},
            )
            worker = Worker(settings)
            reader = StatsReader.from_url(acl_redis.url(GATEWAY))
            await worker.start()
            try:
                deadline = time.monotonic() + 30  # start-up: ample for a loaded machine
                while True:
                    view = (await reader.snapshot()).to_dict()
                    states = {e["id"]: e["state"] for e in view["endpoints"]}
                    if states.get("acl-vllm") == "fresh":
                        break
                    assert time.monotonic() < deadline, f"never fresh: {view}"
                    await asyncio.sleep(0.1)
                async with reader.cached() as cache:  # SSUBSCRIBE P:updates, probes
                    seq = cache.get("acl-vllm").stats.seq  # type: ignore[union-attr]
                    while (e := cache.get("acl-vllm")) is None or e.stats.seq <= seq + 1:  # type: ignore[union-attr]
                        assert time.monotonic() < deadline + 10, "no update reached the cache"
                        await asyncio.sleep(0.05)
                    assert cache.healthy
                # Drain as the poller user: the CLI's request and wait, the undo, and the
                # poller writing its own request (SIGUSR1).
                drain = ["drain", "acl-poller", "--redis-url", acl_redis.url(POLLER)]
                invoke = CliRunner().invoke
                drained = await asyncio.to_thread(invoke, cli, [*drain, "--force", "--wait", "60"])
                assert drained.exit_code == 0 and "holds no lease" in drained.output, drained.output
                undone = await asyncio.to_thread(invoke, cli, [*drain, "--undo"])
                assert undone.exit_code == 0, undone.output
                worker.drain.request()
                while not worker.draining:
                    assert time.monotonic() < deadline + 30, "the poller's own drain request"
                    await asyncio.sleep(0.05)
            finally:
                await worker.stop()
                await reader.aclose()

    asyncio.run(scenario())
    sync_reader = SyncStatsReader.from_url(acl_redis.url(GATEWAY))
    try:
        assert sync_reader.get("acl-vllm") is not None
        sync_reader.live_pollers()
    finally:
        sync_reader.close()
    status = CliRunner().invoke(cli, ["status", "--json", "--redis-url", acl_redis.url(GATEWAY)])
    assert status.exit_code == 0, status.output

    admin = acl_redis.client()
    denied = admin.execute_command("ACL", "LOG")
    assert not denied, f"commands refused to the ACL users: {denied}"
    # The gateway cannot write, not even through a script it loads itself.
    gateway = acl_redis.client(GATEWAY)
    script = gateway.register_script("return redis.call('SET', KEYS[1], 'x')")
    with pytest.raises(redis.ResponseError, match="can't run this command"):
        script(keys=["{llmgw}:schema"])


def test_every_redis_config_starts_and_replication_and_sentinel_authenticate(
    tmp_path: Path,
) -> None:
    configs = DEPLOY / "redis"
    acl = ["--aclfile", str(ACL_FILE)]
    started: list[_Redis] = []
    try:
        single = _Redis([str(configs / "single" / "redis.conf"), *acl], tmp_path / "single")
        started.append(single)
        assert single.client().config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}

        node = _Redis(
            [str(configs / "cluster" / "redis.conf"), *acl], tmp_path / "cluster", cluster=True
        )
        started.append(node)
        assert node.client().info("cluster")["cluster_enabled"] == 1

        # Sentinel rewrites the files it manages: work on copies.
        conf = tmp_path / "sentinel-redis.conf"
        shutil.copy(configs / "sentinel" / "redis.conf", conf)
        primary = _Redis([str(conf), *acl], tmp_path / "primary")
        started.append(primary)
        shutil.copy(configs / "sentinel" / "redis.conf", tmp_path / "replica.conf")
        replica = _Redis(
            [str(tmp_path / "replica.conf"), *acl, "--replicaof", "127.0.0.1", str(primary.port)],
            tmp_path / "replica",
        )
        started.append(replica)
        wait_until(
            lambda: replica.client().info("replication").get("master_link_status") == "up",
            60,
            what="the replica to sync as the `replica` user",
        )
        text = (configs / "sentinel" / "sentinel.conf").read_text(encoding="utf-8")
        monitor = re.search(r"^sentinel monitor (\S+) (\S+) (\d+) (\d+)$", text, re.M)
        assert monitor is not None
        name = monitor.group(1)
        text = text.replace(monitor.group(0), f"sentinel monitor {name} 127.0.0.1 {primary.port} 1")
        (tmp_path / "sentinel.conf").write_text(text)
        sentinel = _Redis([str(tmp_path / "sentinel.conf")], tmp_path / "sentinel", sentinel=True)
        started.append(sentinel)

        def watched() -> bool:
            state = sentinel.client(None).sentinel_master(name)
            return bool(state["flags"] == "master" and state["num-slaves"] >= 1)

        wait_until(watched, 60, what="Sentinel to see the primary and its replica")
        for server in (primary, replica):
            assert not server.client().execute_command("ACL", "LOG"), "Sentinel or replica refused"
    finally:
        for server in started:
            server.stop()


# --- systemd, example config, operations guide -----------------------------------------------


def _unit() -> list[tuple[str, str, str]]:
    entries, section = [], ""
    path = DEPLOY / "systemd" / "llmgw-poller@.service"
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        entries.append((section, key, value))
    return entries


def test_systemd_unit_runs_the_poller_and_stops_it_gracefully(tmp_path: Path) -> None:
    entries = _unit()
    service = {k: v for s, k, v in entries if s == "Service"}
    assert {s for s, _, _ in entries} == {"Unit", "Service", "Install"}
    exec_start = shlex.split(service["ExecStart"])
    assert Path(exec_start[0]).name == "poller" and exec_start[1] == "run"
    flags = {opt for p in cli.commands["run"].params for opt in p.opts}
    assert {a for a in exec_start[2:] if a.startswith("--")} <= flags
    assert service["KillSignal"] == "SIGTERM" and int(service["TimeoutStopSec"]) > 5
    assert service["User"] not in ("root", "0") and service["RestartPreventExitStatus"] == "2"
    for _section, key, value in entries:
        if key == "Environment":
            assert _known_env(value.partition("=")[0]), value
    for name in ("POLLER_REDIS_URL", "POLLER_ENDPOINTS_FILE"):
        assert _known_env(name)
    # Key files reach the poller as systemd credentials ($CREDENTIALS_DIRECTORY, the key
    # directory when set), loaded from /etc/llmgw-poller/keys.
    credentials = [v for s, k, v in entries if s == "Service" and k == "LoadCredential"]
    assert credentials, "the unit shows how key files are loaded"
    for credential in credentials:
        name, _, source = credential.partition(":")
        assert Path(source).parent == Path(DEFAULT_KEY_DIR) and Path(source).name == name
    env_example = (DEPLOY / "systemd" / "poller.env.example").read_text(encoding="utf-8")
    for line in env_example.splitlines():
        if line and not line.startswith("#"):
            assert _known_env(line.partition("=")[0]), line
    verify = shutil.which("systemd-analyze")
    if verify:  # on Debian images; a structural check only where systemd is absent
        unit = (DEPLOY / "systemd" / "llmgw-poller@.service").read_text(encoding="utf-8")
        unit = unit.replace(exec_start[0], sys.executable + " -m poller")
        (tmp_path / "llmgw-poller@9464.service").write_text(unit)
        done = _run([verify, "verify", str(tmp_path / "llmgw-poller@9464.service")])
        complaints = [
            line
            for line in done.stderr.splitlines()
            if re.search(r"Unknown|Invalid|Failed|not a valid|Ignoring|ignoring", line)
        ]
        assert not complaints, "\n".join(complaints)


def test_example_config_loads_and_shows_the_defaults() -> None:
    path = DEPLOY / "config.example.toml"
    settings = load_settings(path, environ={})
    defaults = Settings(id=settings.id)
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    for key, value in data.items():
        if isinstance(value, dict):
            for sub, sub_value in value.items():
                assert getattr(getattr(defaults, key), sub) == sub_value, f"{key}.{sub}"
        elif key != "log_format":
            assert getattr(defaults, key) == value, key


def test_operations_guide_covers_every_reason_alert_and_topic() -> None:
    guide = (REPO / "docs" / "operations.md").read_text(encoding="utf-8")
    anchors = _anchors(guide)
    for anchor in (
        "sizing",
        "intervals-timeouts-and-ttls",
        "failure-reasons",
        "roll-out-and-roll-back",
        "upgrading-the-schema",
        "several-gateways-on-one-redis",
        "monitoring",
        "what-happens-when",
    ):
        assert anchor in anchors, f"docs/operations.md lacks a section #{anchor}"
    for reason in FAILURE_REASONS:
        assert f"| `{reason}` |" in guide, f"failure reason {reason} is not explained"
    for group in _base()["PrometheusRule"]["spec"]["groups"]:
        for rule in group["rules"]:
            assert rule["alert"] in guide, f"alert {rule['alert']} is not in the guide"
    assert "2-core shared" in guide
