"""The container files: deploy/Dockerfile against pyproject.toml, the CLI, the default
health port and .dockerignore (nothing is built: no engine is needed), and compose.yaml
against the Compose specification (the schema vendored by check-jsonschema), the
simulator's flags, the CLI and users.acl."""

from __future__ import annotations

import json
import re
import sys
import tomllib
from importlib import resources
from typing import Any

from poller.cli import cli
from poller.config import HealthSettings, ScrapeSettings
from poller_lab.sim.cli import DEFAULT_KEY_ENV
from tests.support.deploy import (
    ACL_FILE,
    DEPLOY,
    ENGINES,
    K8S,
    POLLER,
    check_redis_url,
    docker_stages,
    dockerignore_patterns,
    dockerignored,
    known_env,
    load_yaml,
    require_module,
    run_tool,
)
from tests.support.paths import REPO


def test_dockerfile_matches_the_package() -> None:
    stages = docker_stages()
    assert len(stages) >= 2, "multi-stage build expected"
    *builders, (_, final) = stages.items()
    image = final[0][1]
    assert "slim" in image, f"final stage base {image!r} is not a slim image"
    words = [w for w, _ in final]

    # Non-root, with the uid the Kubernetes securityContext asks for.
    user = [rest for w, rest in final if w == "USER"][-1]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {user} must be a numeric non-root uid"
    deployment = load_yaml(K8S / "base" / "deployment.yaml")
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

    # The stage the runtime copies from installs the wheel with the service and epp
    # extras: one image for `poller run` and `poller epp` (deploy/k8s/components/epp).
    [source] = {rest.split()[0].removeprefix("--from=") for w, rest in final if w == "COPY"}
    build = dict(builders)[source]
    assert any("[service,epp]" in rest for w, rest in build if w == "RUN")
    assert {"service", "epp"} <= set(pyproject["project"]["optional-dependencies"])
    patterns = dockerignore_patterns()
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
                    assert not dockerignored(rel, patterns), f"{rel} is copied but .dockerignored"


def test_dockerignore_keeps_the_context_to_what_the_build_needs() -> None:
    patterns = dockerignore_patterns()
    needed = ["pyproject.toml", "README.md", "poller/cli/__init__.py", "poller/py.typed"]
    needed += [f"poller/scrape/data/{e}.txt" for e in ENGINES]
    needed += ["poller/schema/scripts/write_stats.lua", "poller/service/web/static/page.js"]
    for rel in needed:
        assert not dockerignored(rel, patterns), f"{rel} must be in the build context"
    for rel in [
        "tests/cli/test_cli.py",
        ".git/HEAD",
        ".venv/bin/python",
        "poller/__pycache__/x.pyc",
    ]:
        assert dockerignored(rel, patterns), f"{rel} must stay out of the build context"


# --- compose ----------------------------------------------------------------------------------


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = load_yaml(DEPLOY / "compose.yaml")
    return data


def test_compose_validates_against_the_compose_specification() -> None:
    jsonschema = require_module("jsonschema", "jsonschema")
    require_module("check_jsonschema", "check-jsonschema")
    vendor = resources.files("check_jsonschema.builtin_schemas.vendor")
    schema = json.loads(vendor.joinpath("compose-spec.json").read_text(encoding="utf-8"))
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(_compose())]
    assert not errors, "\n".join(errors)


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
    help_text = run_tool([sys.executable, "-m", "poller_lab.sim", "--help"]).stdout
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
    check_redis_url(sync["environment"]["POLLER_REDIS_URL"], POLLER)

    # Pollers: the real `run` command, distinct ids and health ports, all published.
    published = {int(p.split(":")[-1]) for p in sim["ports"]}
    ids, ports = set(), set()
    for service in pollers.values():
        assert service["command"] == ["run"] and "run" in cli.commands
        environment = service["environment"]
        for name in environment:
            assert known_env(name), f"{name} is not read by the poller"
        ids.add(environment["POLLER_ID"])
        ports.add(int(environment["POLLER_HEALTH_PORT"]))
        check_redis_url(environment["POLLER_REDIS_URL"], POLLER)
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
