"""Packaging: the product's wheel and what it leaves to the lab.

- sdist from a clean copy of the tree, wheel from the sdist, installed into a fresh
  virtualenv and run from outside the source tree; without the service extra the reader
  imports and every command names the install;
- the lab (lab/, poller_lab) stays out of the product: not in the wheel, not in the
  service extra's requirement closure, not in the image; its pin names this version, and
  its commands join ``poller`` through entry points or say how to install it.
"""

from __future__ import annotations

import email.parser
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from poller._version import __version__
from poller.cli.app import COMMANDS_GROUP, LAB_COMMANDS
from tests.support.deploy import (
    DEPLOY,
    ENGINES,
    docker_stages,
    dockerignore_patterns,
    dockerignored,
    load_yaml,
    run_tool,
)
from tests.support.paths import REPO

#: What only the lab needs (lab/pyproject.toml): the simulator's HTTP servers and the
#: demo's Redis fallback. The product's service extra must not pull them in.
LAB_ONLY = {"aiohttp", "fakeredis"}
#: Entries of site-packages that are this checkout's own editable installs.
OWN_INSTALLS = ("llmgw_poller", "__editable__", "_llmgw_poller")


def _requires_dist(metadata_text: str, extra: str) -> set[str]:
    """The names a METADATA file's Requires-Dist installs with ``extra``."""
    message = email.parser.Parser().parsestr(metadata_text)
    names = set()
    for line in message.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": extra}):
            names.add(canonicalize_name(req.name))
    return names


def _says_how_to_install_the_lab(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert done.stderr.startswith("Error: ") and "pip install -e ./lab" in done.stderr, done


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
    done = run_tool([sys.executable, "-m", "pip", "--python", python, "install", "-q", *requires])
    assert done.returncode == 0, f"cannot install the build backend {requires}:\n{done.stderr}"
    return python


def _pep517(python: str, hook: str, source: Path, out: Path) -> Path:
    """Call a setuptools PEP 517 hook in ``source``; returns the built file."""
    code = f"import sys, setuptools.build_meta as b; print(b.{hook}(sys.argv[1]))"
    done = run_tool([python, "-c", code, str(out)], cwd=source)
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
    assert {"poller/py.typed", "poller/__main__.py"} <= names
    # The lab is a distribution of its own: not one of its files is in the product's wheel.
    assert not [n for n in names if n.startswith("lab/") or "poller_lab" in n]
    assert "poller/schema/scripts/write_stats.lua" in names
    assert {"poller/service/web/static/page.js", "poller/service/web/static/page.css"} <= names
    assert not any(n.startswith("tests/") for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "poller = poller.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    wheel_metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = _requires_dist(zipfile.ZipFile(wheel).read(wheel_metadata).decode(), "service")
    assert "httpx" in requires and not requires & LAB_ONLY, requires & LAB_ONLY

    target = tmp_path / "venv"
    venv.create(target, with_pip=False)
    target_python = str(target / "bin" / "python")
    done = run_tool(
        [sys.executable, "-m", "pip", "--python", target_python, "install", "-q"]
        + ["--no-deps", "--no-index", str(wheel)]
    )
    assert done.returncode == 0, done.stderr
    site = run_tool(
        [target_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    )
    # The test environment's dependencies, less its own installs of the poller and the lab
    # (a directory of links): the venv has only the wheel of either.
    deps = tmp_path / "deps"
    deps.mkdir()
    for folder in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for entry in Path(folder).iterdir():
            if not entry.name.startswith(OWN_INSTALLS) and not (deps / entry.name).exists():
                (deps / entry.name).symlink_to(entry)
    (Path(site.stdout.strip()) / "test-deps.pth").write_text(f"{deps}\n")

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    outside = tmp_path / "elsewhere"
    outside.mkdir()

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return run_tool(list(args), cwd=outside, env=env)

    where = run(target_python, "-c", "import poller; print(poller.__file__)")
    assert where.stdout.strip().startswith(str(target)), where.stdout + where.stderr
    version = run(str(target / "bin" / "poller"), "--version")
    assert version.returncode == 0 and __version__ in version.stdout, version
    for engine in ("vllm", "trtllm"):
        check = run(str(target / "bin" / "poller"), "check", "--example", "--engine", engine)
        assert check.returncode == 0, f"{engine}: {check.stdout}\n{check.stderr}"
    # Without the lab, its commands say how to get it: one line, exit 2.
    assert run(target_python, "-c", "import poller_lab").returncode != 0
    demo = run(str(target / "bin" / "poller"), "demo", "--duration", "5")
    _says_how_to_install_the_lab(demo)

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


def _closure(name: str, extras: set[str]) -> dict[str, str]:
    """Every distribution ``name[extras]`` needs, from the installed distributions'
    metadata (name -> the distribution that first required it); one that is not
    installed is a failure."""
    needed: dict[str, str] = {canonicalize_name(name): ""}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(name, frozenset(extras))]
    while todo:
        current, wanted = todo.pop()
        if (canonicalize_name(current), wanted) in seen:
            continue
        seen.add((canonicalize_name(current), wanted))
        try:
            requires = metadata.distribution(current).requires or []
        except metadata.PackageNotFoundError:
            pytest.fail(f"{current} (needed by {needed[canonicalize_name(current)]}) is missing")
        for line in requires:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in wanted | {""}):
                needed.setdefault(canonicalize_name(req.name), current)
                todo.append((req.name, frozenset(req.extras)))
    return needed


def test_the_service_extra_pulls_in_no_lab_dependency() -> None:
    closure = _closure("llmgw-poller", {"service"})
    assert {"httpx", "redis", "click", "prometheus-client"} <= closure.keys()
    found = {n: closure[n] for n in LAB_ONLY if n in closure}
    assert not found, f"needed by the service extra (name: required by): {found}"


def _copied_from(stage: list[tuple[str, str]]) -> set[str]:
    froms = {rest.split()[0].removeprefix("--from=") for w, rest in stage if w == "COPY"}
    return {f for f in froms if not f.startswith("--")} - {""}


def test_the_image_installs_only_the_service_and_epp_extras_and_no_lab() -> None:
    """The production image (the final stage, and every stage it copies from) installs the
    service and epp extras (`poller run` and `poller epp`) and never the lab; only the
    `lab` stage, a separate `--target` for compose's simulator, does."""
    stages = docker_stages()
    final = list(stages)[-1]
    assert final != "lab", "the default target must be the production image"
    product, todo = set(), [final]
    while todo:
        name = todo.pop()
        product.add(name)
        todo += [s for s in _copied_from(stages[name]) if s in stages and s not in product]
        base = stages[name][0][1]
        if base in stages and base not in product:
            todo.append(base)
    assert "lab" not in product
    runs = " ".join(rest for name in product for word, rest in stages[name] if word == "RUN")
    assert set(re.findall(r"\[([\w,-]+)\]", runs)) == {"service,epp"}
    for name in product:
        for word, rest in stages[name]:
            assert not re.search(r"\blab\b|poller_lab", rest), f"{name}: {word} {rest}"
    lab = stages["lab"]
    assert any(w == "RUN" and "install ./lab" in rest for w, rest in lab), lab
    patterns = dockerignore_patterns()
    for rel in ("lab/pyproject.toml", "lab/poller_lab/__init__.py", "lab/poller_lab/sim/cli.py"):
        assert not dockerignored(rel, patterns), f"{rel}: the lab stage copies it"
    for rel in ("lab/tests/x.py", "lab/.venv/bin/python", "lab/poller_lab/__pycache__/x.pyc"):
        assert dockerignored(rel, patterns), f"{rel} must stay out of the build context"
    compose = load_yaml(DEPLOY / "compose.yaml")
    sim = compose["services"]["sim"]
    assert sim["build"]["target"] == "lab" and sim["image"] != "llmgw-poller:dev"
    others = [s for n, s in compose["services"].items() if n != "sim" and "build" in s]
    assert all(s["build"].get("target", final) == final for s in others)


def test_the_lab_pins_this_version_of_the_poller() -> None:
    lab = tomllib.loads((REPO / "lab" / "pyproject.toml").read_text(encoding="utf-8"))
    requirements = [Requirement(r) for r in lab["project"]["dependencies"]]
    (pin,) = [r for r in requirements if canonicalize_name(r.name) == "llmgw-poller"]
    assert pin.extras == {"service"}
    assert str(pin.specifier) == f"=={__version__}", "lab/pyproject.toml pins another poller"
    # What LAB_ONLY names are the lab's own dependencies.
    assert LAB_ONLY <= {canonicalize_name(r.name) for r in requirements}
    commands = lab["project"]["entry-points"][COMMANDS_GROUP]
    assert set(commands) == set(LAB_COMMANDS)


def test_the_lab_commands_join_poller_when_the_lab_is_installed() -> None:
    names = {point.name for point in metadata.entry_points(group=COMMANDS_GROUP)}
    assert set(LAB_COMMANDS) <= names
    done = run_tool([sys.executable, "-m", "poller", "demo", "--help"], cwd=REPO)
    assert done.returncode == 0, done
    assert "--duration" in done.stdout and "needs the lab" not in done.stdout, done.stdout


#: `poller` as it starts where no distribution adds commands (the lab is not installed).
WITHOUT_THE_LAB = """
import importlib.metadata as m, sys
real, group = m.entry_points, sys.argv[1]
def entry_points(**kw):
    return m.EntryPoints(()) if kw.get("group") == group else real(**kw)
m.entry_points = entry_points
sys.argv = ["poller", *sys.argv[2:]]
from poller.cli import main
main()
"""


@pytest.mark.parametrize("command", sorted(LAB_COMMANDS))
def test_without_the_lab_its_commands_say_how_to_install_it(command: str) -> None:
    run = [sys.executable, "-c", WITHOUT_THE_LAB, COMMANDS_GROUP, command, "--some-flag", "x"]
    _says_how_to_install_the_lab(run_tool(run, cwd=REPO))


def test_without_the_lab_its_commands_are_listed_and_their_help_says_so() -> None:
    run = [sys.executable, "-c", WITHOUT_THE_LAB, COMMANDS_GROUP]
    listed = run_tool([*run, "--help"], cwd=REPO)
    assert listed.returncode == 0 and set(LAB_COMMANDS) <= set(listed.stdout.split()), listed
    helped = run_tool([*run, "demo", "--help"], cwd=REPO)
    assert helped.returncode == 0 and "needs the lab" in " ".join(helped.stdout.split()), helped


#: `poller` as it starts where the lab's entry point is there but its module fails to load.
WITH_A_BROKEN_LAB = """
import importlib.metadata as m, sys
real, group = m.entry_points, sys.argv[1]
broken = m.EntryPoint("demo", "poller_lab_missing_module:demo", group)
def entry_points(**kw):
    return m.EntryPoints((broken,)) if kw.get("group") == group else real(**kw)
m.entry_points = entry_points
sys.argv = ["poller", *sys.argv[2:]]
from poller.cli import main
main()
"""


def test_a_lab_that_fails_to_load_leaves_the_other_commands_working() -> None:
    run = [sys.executable, "-c", WITH_A_BROKEN_LAB, COMMANDS_GROUP]
    status = run_tool([*run, "status", "--help"], cwd=REPO)
    assert status.returncode == 0 and "--state" in status.stdout, status
    demo = run_tool([*run, "demo"], cwd=REPO)
    assert demo.returncode == 2, demo
    [line] = demo.stderr.splitlines()
    assert line.startswith("Error: poller demo is part of the lab, which did not load "), line
    assert "ModuleNotFoundError" in line and "pip install -e ./lab" in line, line


GATEWAY = """\
from poller import StatsReader
from poller.reader.load.local import LocalLoad
from poller.reader.legacy import Picker


async def main() -> None:
    picker, local = Picker(), LocalLoad()
    async with StatsReader.from_url("redis://127.0.0.1:6379/0") as reader:
        async with reader.router() as router:
            cache = router.cache
            endpoint: str | None = picker.pick(cache, "m", local=local)
            print(endpoint)
"""


@pytest.mark.slow
@pytest.mark.parametrize("project", ["", "lab"])
def test_the_editable_install_is_a_plain_path_and_says_nothing(
    tmp_path: Path, project: str
) -> None:
    """`make install`'s editable installs, as setuptools builds them by default: a .pth
    naming the project's folder (type checkers follow a path, not an import hook), and
    no warning (compat mode, asked for before, printed 30 lines of them)."""
    source = REPO / project
    python = _backend_python(tmp_path)
    code = "import sys, setuptools.build_meta as b; print(b.build_editable(sys.argv[1]))"
    done = run_tool([python, "-W", "always", "-c", code, str(tmp_path)], cwd=source)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Warning" not in done.stderr, done.stderr[-3000:]
    wheel = tmp_path / done.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as built:
        [pth] = [n for n in built.namelist() if n.endswith(".pth")]
        assert built.read(pth).decode().split() == [str(source)]
        assert not [n for n in built.namelist() if n.endswith("_finder.py")]


@pytest.mark.slow
def test_a_gateway_type_checks_against_the_installed_poller(tmp_path: Path) -> None:
    """A gateway's own code, outside this checkout, type-checks with mypy --strict
    against the poller as `make install` installed it (an editable install that type
    checkers can follow, and the package's py.typed)."""
    (tmp_path / "gateway.py").write_text(GATEWAY, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "gateway.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,  # only a hang ends it
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success: no issues found in 1 source file" in done.stdout
