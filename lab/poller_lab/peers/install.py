"""The peers' installer: each router at its pinned version, in a virtual environment of its
own, on demand.

The pins are ``constraints/peers.txt`` (``LAB_PEERS_CONSTRAINTS`` names another file):
one ``name==version`` a line, comments after ``#``. A line that is not an exact pin, or
a package it does not pin, is refused with the line named: the comparison's figures are
only worth their versions. A package goes into ``<root>/<name>-<version>`` with the
package index's ordinary client (``python -m pip``), never into the bench's own
environment; a finished install leaves a stamp, so the next run under the same root
reuses it (``LAB_PEERS_DIR`` keeps one root between runs; by default it is the bench's
work dir, removed at the end).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from poller.errors import ConfigError

__all__ = ["constraints_file", "install", "read_pins"]

_PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.+!-]*)")
_STAMP = ".installed"
#: A pip install of a router wheel and its dependencies: minutes on a slow index.
INSTALL_TIMEOUT_S = 600


def constraints_file() -> Path:
    given = os.environ.get("LAB_PEERS_CONSTRAINTS")
    if given:
        return Path(given)
    # The checkout's constraints/ (the lab is installed editable from it).
    return Path(__file__).resolve().parents[3] / "constraints" / "peers.txt"


def read_pins(path: Path) -> dict[str, str]:
    """package name (normalised) -> version; every line an exact pin or refused."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the peers' pins {path}: {exc.strerror}") from None
    pins: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _PIN.fullmatch(line)
        if match is None:
            raise ConfigError(
                f"{path}:{number}: {line!r} is not an exact pin (name==version): "
                "the peers run only at pinned versions"
            )
        pins[_normal(match[1])] = match[2]
    return pins


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def install(package: str, root: Path, pins_path: Path | None = None) -> Path:
    """The virtual environment holding ``package`` at its pin (installed if missing)."""
    path = pins_path or constraints_file()
    pins = read_pins(path)
    version = pins.get(_normal(package))
    if version is None:
        raise ConfigError(f"{package} is not pinned in {path}: add {package}==<version>")
    venv = root / f"{_normal(package)}-{version}"
    if (venv / _STAMP).exists():
        return venv
    root.mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(venv)],
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         f"{package}=={version}"],
    ]  # fmt: skip
    for step in steps:
        done = subprocess.run(
            step, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False
        )
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"installing {package}=={version} failed: {tail[0]}")
    (venv / _STAMP).write_text(f"{package}=={version}\n", encoding="utf-8")
    return venv
