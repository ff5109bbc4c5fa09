"""The systemd unit, the example config and the operations guide agree with the poller:
the unit runs `poller run` and stops it gracefully, the example config shows the
defaults, and docs/operations.md covers every failure reason, alert and topic."""

from __future__ import annotations

import re
import shlex
import shutil
import sys
import tomllib
from pathlib import Path

from poller.cli import cli
from poller.config import DEFAULT_KEY_DIR, Settings, load_settings
from poller.schema.stats import FAILURE_REASONS
from tests.support.deploy import DEPLOY, heading_anchors, k8s_objects, known_env, run_tool
from tests.support.paths import REPO


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
            assert known_env(value.partition("=")[0]), value
    for name in ("POLLER_REDIS_URL", "POLLER_ENDPOINTS_FILE"):
        assert known_env(name)
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
            assert known_env(line.partition("=")[0]), line
    verify = shutil.which("systemd-analyze")
    if verify:  # on Debian images; a structural check only where systemd is absent
        unit = (DEPLOY / "systemd" / "llmgw-poller@.service").read_text(encoding="utf-8")
        unit = unit.replace(exec_start[0], sys.executable + " -m poller")
        (tmp_path / "llmgw-poller@9464.service").write_text(unit)
        done = run_tool([verify, "verify", str(tmp_path / "llmgw-poller@9464.service")])
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
    anchors = heading_anchors(guide)
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
    for group in k8s_objects()["PrometheusRule"]["spec"]["groups"]:
        for rule in group["rules"]:
            assert rule["alert"] in guide, f"alert {rule['alert']} is not in the guide"
    assert "2-core shared" in guide
