"""Fixtures for the opt-in engine tests (``make test-engines``): a real llama-server.

The binary and the llama.cpp tree come from ``tests/engines/build_llama_server.sh``
(cached under ``.engines/``, or ``$LLMGW_ENGINES_DIR``). Without them the tests are
skipped, unless ``LLMGW_ENGINES_REQUIRED=1`` (set by ``make test-engines``) makes that a
failure. These files are named ``engine_*.py`` so the default ``pytest`` run never
collects them.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.redisproc import free_port

REPO = Path(__file__).resolve().parents[2]
ENGINES_DIR = Path(os.environ.get("LLMGW_ENGINES_DIR", REPO / ".engines"))


def _missing(what: str) -> None:
    message = f"{what}: run `make test-engines` (it builds llama-server into {ENGINES_DIR})"
    if os.environ.get("LLMGW_ENGINES_REQUIRED") == "1":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    binary = ENGINES_DIR / "llama-server"
    if not os.access(binary, os.X_OK):
        _missing(f"no llama-server at {binary}")
    return binary


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = ENGINES_DIR / "src" / "llama.cpp"
    if not (tree / "models" / "ggml-vocab-llama-spm.gguf").is_file():
        _missing(f"no llama.cpp tree at {tree}")
    try:
        import numpy  # noqa: F401  (gguf-py needs it; make test-engines installs it)
    except ImportError:
        _missing("numpy is not installed (gguf-py needs it)")
    from tests.engines.tiny_model import write_tiny_llama

    return write_tiny_llama(tree, tmp_path_factory.mktemp("model") / "tiny-llama.gguf")


class LlamaServer:
    """One llama-server process on a free loopback port; stopped by its pid."""

    def __init__(self, binary: Path, model: Path, log: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        # -np 2: two slots, so a third concurrent request is deferred (waiting).
        command = [str(binary), "-m", str(model), "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "-c", "16384", "-np", "2", "-t", "2", *args]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def wait_ready(self, timeout_s: float = 120) -> LlamaServer:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"llama-server exited: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"llama-server not healthy within {timeout_s}s")

    def get(self, path: str, key: str | None = None) -> tuple[int, bytes]:
        request = urllib.request.Request(f"{self.url}{path}")
        if key:
            request.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def complete(self, n_predict: int, key: str | None = None, timeout_s: float = 110) -> Any:
        body = json.dumps(
            {
                "prompt": "The quick brown fox",
                "n_predict": n_predict,
                "ignore_eos": True,
                "cache_prompt": False,
                "temperature": 1.0,
            }
        ).encode()
        request = urllib.request.Request(
            f"{self.url}/completion", data=body, headers={"Content-Type": "application/json"}
        )
        if key:
            request.add_header("Authorization", f"Bearer {key}")
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def llama(llama_server_bin: Path, tiny_model: Path, tmp_path: Path) -> Iterator[Any]:
    """``llama(*args)`` starts a llama-server with extra arguments; all stop at the end."""
    servers: list[LlamaServer] = []

    def start(*args: str) -> LlamaServer:
        log = tmp_path / f"llama-server-{len(servers)}.log"
        server = LlamaServer(llama_server_bin, tiny_model, log, *args)
        servers.append(server)
        return server.wait_ready()

    yield start
    for server in servers:
        server.stop()
