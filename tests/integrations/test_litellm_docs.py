"""docs/litellm.md's proxy config.yaml and SDK example, run as they are written: a real
litellm proxy process with the filter, and the example as a script, against simulated
engines a real poller scrapes. The saturated, failing and sleeping endpoints receive
nothing."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from poller_lab.embedded import free_port
from tests.support.litellm_fleet import HELD, NS, Fleet, fleet, litellm_proxy
from tests.support.paths import REPO
from tests.support.procs import until

# A proxy starts in 12-30 s on a loaded 2-core machine: far from the default 120 s bound.
pytestmark = [pytest.mark.slow, pytest.mark.redis_server, pytest.mark.timeout(600)]
in_fleet_loop = pytest.mark.asyncio(loop_scope="module")

DOC = REPO / "docs" / "litellm.md"
OK = ("vllm-0", "vllm-1")
BAD = ("vllm-2", "vllm-3", "vllm-4")  # saturated, failing, asleep; the doc names vllm-4
MASTER_KEY = "sk-llmgw-test"
#: The proxy answered its health check after 12-30 s on a loaded 2-core machine.
PROXY_START_S = 240


def doc_block(marker: str, language: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    found = re.search(
        rf"<!-- tested: {re.escape(marker)} -->\n```{language}\n(.*?)\n```", text, re.S
    )
    assert found, f"docs/litellm.md has no {language} block marked {marker!r}"
    return found.group(1) + "\n"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def f(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Fleet]:
    async with fleet(tmp_path_factory.mktemp("litellm-docs"), OK, BAD) as running:
        yield running


def env_for(f: Fleet) -> dict[str, str]:
    engines = {f"ENGINE_{i}_URL": f.api_base(e) for i, e in enumerate((*OK, *BAD))}
    return {
        **engines,
        "ENGINE_API_KEY": "unused",
        "ENGINE_URLS": ",".join(engines.values()),
        "POLLER_REDIS_URL": f.redis_url,
        "POLLER_NAMESPACE": NS,
        "LITELLM_MASTER_KEY": MASTER_KEY,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        # LiteLLM looks for a Hugging Face tokenizer of a model it does not know, and an
        # offline machine waits for each lookup to time out.
        "HF_HUB_OFFLINE": "1",
        "NO_PROXY": "*",
    }


def test_the_doc_config_names_the_filter_and_an_endpoint_id() -> None:
    config = doc_block("proxy config.yaml", "yaml")
    assert "callbacks: poller.integrations.litellm.load_aware_filter" in config
    assert "llmgw_endpoint: vllm-4" in config


@pytest.mark.litellm_proxy
@in_fleet_loop
async def test_proxy_with_the_doc_config_sends_nothing_to_the_three(
    f: Fleet, tmp_path: Path
) -> None:
    (tmp_path / "config.yaml").write_text(doc_block("proxy config.yaml", "yaml"))
    port = free_port()
    proc = litellm_proxy(tmp_path / "config.yaml", port, tmp_path / "proxy.log", env_for(f))
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(timeout=60.0, trust_env=False) as http:

            async def alive() -> bool:
                assert proc.alive(), (tmp_path / "proxy.log").read_text()[-3000:]
                try:
                    return (await http.get(base + "/health/liveliness")).status_code == 200
                except httpx.TransportError:
                    return False

            await until(alive, PROXY_START_S, "the litellm proxy's health endpoint", 0.5)
            auth = {"Authorization": f"Bearer {MASTER_KEY}"}
            bases = []
            for i in range(16):
                body = {
                    "model": "chat",
                    "messages": [{"role": "user", "content": f"q{i}"}],
                    "max_tokens": 4,
                    "stream": i % 4 == 0,
                }
                reply = await http.post(base + "/v1/chat/completions", json=body, headers=auth)
                assert reply.status_code == 200, reply.text
                bases.append(reply.headers["x-litellm-model-api-base"])
        # No request failed (none reached the failing or sleeping endpoint), none went to
        # the saturated one's queue, every one went to an eligible endpoint.
        assert set(bases) <= {f.api_base(e) for e in OK}, bases
        assert (await f.served())[BAD[0]] == HELD
        log = (tmp_path / "proxy.log").read_text(errors="replace")
        assert "the shared view cannot be read" not in log
    finally:
        proc.stop()


def _run_example(script: Path, env: dict[str, str]) -> tuple[int | None, str, str]:
    """Run the example: (its exit code, stdout, stderr); the code is None when it hung,
    and then stderr holds every thread's stack (``-X faulthandler``, SIGABRT)."""
    proc = subprocess.Popen(
        [sys.executable, "-X", "faulthandler", str(script)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        finally:
            proc.kill()
        return None, stdout, stderr


@in_fleet_loop
async def test_the_doc_sdk_example_routes_only_to_eligible_endpoints(
    f: Fleet, tmp_path: Path
) -> None:
    script = tmp_path / "example.py"
    script.write_text(doc_block("SDK example", "python"))
    code, stdout, stderr = await asyncio.to_thread(
        _run_example, script, {**os.environ, **env_for(f)}
    )
    if code is None:  # what it printed, where it is stuck, where the engines stand
        said = f"stdout {stdout!r:.1500}\nstderr (the stacks) {stderr[-6000:]}"
        raise AssertionError(f"the example hung; {said}; queues {await f.queues()}")
    assert code == 0, stderr[-3000:]
    bases = stdout.split()
    assert len(bases) == 10, stdout
    assert set(bases) <= {f.api_base(e) for e in OK}, bases
    assert (await f.served())[BAD[0]] == HELD
