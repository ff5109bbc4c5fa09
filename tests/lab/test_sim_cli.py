"""What a user of `poller sim` meets: every engine serves chat for the model its
/v1/models lists, `--model` names that model, `--fault` starts an endpoint faulted, and
`--help` lists every fault mode with how to set one. The commands run as subprocesses."""

from __future__ import annotations

import json
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from poller.scrape.engines import mapping_for
from poller_lab.sim import ENGINES, FAULT_MODES, EndpointSpec, Simulator
from poller_lab.sim.engines import LLAMACPP_MODEL
from poller_lab.sim.faults import DESCRIPTIONS
from poller_lab.sim.pages_vllm import BUNDLED_MODEL

#: What each engine's real server lists in /v1/models by default here, and its owned_by
#: (llama-server: the model file's name; TGI: its model id, owned by the same).
LISTED = {
    "vllm": (BUNDLED_MODEL, "vllm"),
    "vllm-v0": (BUNDLED_MODEL, "vllm"),
    "sglang": (BUNDLED_MODEL, "sglang"),
    "llamacpp": (LLAMACPP_MODEL, "llamacpp"),
    "trtllm": (BUNDLED_MODEL, "tensorrt_llm"),
    "triton": ("tensorrt_llm", "Triton Inference Server"),
    "tgi": (BUNDLED_MODEL, BUNDLED_MODEL),
    "lmdeploy": (BUNDLED_MODEL, "lmdeploy"),
}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as c:
        yield c


def chat(model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return body if model is None else {**body, "model": model}


async def served(client: httpx.AsyncClient, base: str) -> tuple[str, str]:
    """The one model /v1/models lists, and its owner."""
    models = (await client.get(base + "/v1/models")).json()
    [entry] = models["data"]
    return entry["id"], entry["owned_by"]


def test_every_engine_has_a_listed_model() -> None:
    assert set(LISTED) == set(ENGINES)


@pytest.mark.parametrize("engine", list(ENGINES))
async def test_every_engine_serves_chat_and_completions_for_its_listed_model(
    engine: str, client: httpx.AsyncClient
) -> None:
    async with Simulator([EndpointSpec("e", engine, load=0.0, speed_tps=1000.0)]) as sim:
        base = sim.base_url("e")
        model, owner = await served(client, base)
        assert (model, owner) == LISTED[engine]
        reply = await client.post(base + "/v1/chat/completions", json=chat(model))
        text = await client.post(
            base + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2}
        )
        unnamed = await client.post(base + "/v1/chat/completions", json=chat(None))
        other = await client.post(base + "/v1/chat/completions", json=chat("acme/other"))
        page = await client.get(sim.metrics_url("e"))
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == model
    assert reply.json()["choices"][0]["message"]["role"] == "assistant"
    assert text.status_code == 200 and text.json()["model"] == model
    # llama-server and TGI serve their one model to a request naming none; the others
    # need the name, as their servers do.
    assert unnamed.status_code == (200 if engine in ("llamacpp", "tgi") else 400), unnamed.text
    assert other.status_code == 404 and "acme/other" in other.json()["error"]["message"]
    # Pages stay as the real engines write them: trtllm-serve's says "undefined",
    # llama.cpp's and TGI's name no model.
    signals = mapping_for(ENGINES[engine].registry_engine).read(
        page.content, page.headers["content-type"]
    )
    if engine in ("trtllm", "llamacpp", "tgi"):
        assert signals.models == ()
    if engine == "trtllm":
        assert 'model_name="undefined"' in page.text


async def test_llamacpp_lists_its_model_in_both_shapes(client: httpx.AsyncClient) -> None:
    async with Simulator([EndpointSpec("l", "llamacpp", model="qwen3-8b.gguf")]) as sim:
        models = (await client.get(sim.base_url("l") + "/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["qwen3-8b.gguf"]
    assert [m["name"] for m in models["models"]] == ["qwen3-8b.gguf"]


# --- the command --------------------------------------------------------------------------


def sim_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "poller", "sim", "--log-level", "WARNING", *args]


@pytest.fixture
def running() -> Iterator[list[subprocess.Popen[str]]]:
    """Simulator processes a test starts; stopped by pid (SIGKILL) if the test failed."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)  # and close its pipes


def start(running: list[subprocess.Popen[str]], *args: str) -> list[dict[str, str]]:
    """Start `poller sim ARGS`; the registry it prints (once it prints it, it serves)."""
    proc = subprocess.Popen(
        sim_command(*args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    running.append(proc)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # the registry is a JSON list: its last line is "]"
        lines.append(line)
        if line.rstrip() == "]":
            break
    else:
        raise AssertionError(f"no registry; stderr: {proc.communicate()[1]}")
    entries: list[dict[str, str]] = json.loads("".join(lines))
    return entries


def stop(proc: subprocess.Popen[str]) -> int:
    """SIGINT, as Ctrl-C: the simulator stops; its exit status."""
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    return proc.returncode


async def test_model_flag_names_the_model_every_endpoint_serves(
    running: list[subprocess.Popen[str]], client: httpx.AsyncClient, tmp_path: Path
) -> None:
    # No background load: a request never waits for a slot the load holds.
    specs = [{"id": e, "engine": e, "load": 0, "speed_tps": 1000} for e in ENGINES]
    specs.append({"id": "own", "engine": "vllm", "load": 0, "model": "acme/own"})
    (tmp_path / "specs.json").write_text(json.dumps(specs))
    entries = start(running, "--spec-file", str(tmp_path / "specs.json"), "--model", "qwen3-8b")
    assert len(entries) == len(ENGINES) + 1
    for entry in entries:
        base, model = entry["url"], "acme/own" if entry["id"] == "own" else "qwen3-8b"
        assert (await served(client, base))[0] == model, entry
        reply = await client.post(base + "/v1/chat/completions", json=chat(model))
        assert reply.status_code == 200, (entry, reply.text)
        assert reply.json()["model"] == model
    vllm = next(e for e in entries if e["id"] == "vllm")
    page = (await client.get(vllm["url"] + "/metrics")).text
    assert 'model_name="qwen3-8b"' in page  # a page that carries a model name shows it
    assert stop(running[0]) == 0


async def test_fault_flag_starts_an_endpoint_faulted(
    running: list[subprocess.Popen[str]], client: httpx.AsyncClient
) -> None:
    entries = start(
        running, "--endpoints", "2", "--engines", "vllm,tgi", "--fault", "tgi-1=http500"
    )
    urls = {e["id"]: e["url"] for e in entries}
    assert (await client.get(urls["vllm-0"] + "/metrics")).status_code == 200
    assert (await client.get(urls["tgi-1"] + "/metrics")).status_code == 500
    assert stop(running[0]) == 0


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["--fault", "nope=slow"],
            "error: --fault 'nope=slow': no endpoint 'nope' (endpoints: llamacpp-2, "
            "sglang-1, tgi-5, triton-4, trtllm-3, vllm-0)",
        ),
        (
            ["--fault", "vllm-0=slow,delay=3"],
            "error: --fault 'vllm-0=slow,delay=3': fault 'slow' takes no ['delay']; "
            "accepted: delay_s",
        ),
        (
            ["--fault", "vllm-0=sideways"],
            "error: --fault 'vllm-0=sideways': unknown fault mode 'sideways'; accepted: "
            + ", ".join(FAULT_MODES),
        ),
        (
            ["--engines", "vlm,sglang"],
            "error: engines: unknown engine 'vlm' (did you mean 'vllm'?); accepted: "
            + ", ".join(ENGINES),
        ),
        (["--engines", ","], "error: engines: name at least one engine"),
        (
            ["--model", 'bad"name'],
            "error: endpoint 'vllm-0': model name 'bad\"name' has unsupported characters",
        ),
    ],
)
def test_bad_model_or_fault_is_one_line_and_exit_2(args: list[str], line: str) -> None:
    result = subprocess.run(
        sim_command(*args), capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )
    assert (result.returncode, result.stderr.splitlines()) == (2, [line])
    assert result.stdout == ""


def test_help_lists_every_fault_mode_and_how_to_set_one() -> None:
    result = subprocess.run(sim_command("--help"), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "fault modes (what a client of the endpoint sees):" in lines
    width = max(len(m) for m in FAULT_MODES)
    for mode in FAULT_MODES:
        assert f"  {mode:<{width}}  {DESCRIPTIONS[mode]}" in lines, mode
    assert f"  {'':<{width}}    parameters: delay_s=2.0" in lines  # slow's, with its default
    assert "set one at start:  --fault vllm-0=slow,delay_s=3   (repeat for more endpoints)" in (
        lines
    )
    assert "or while it runs:  curl -X POST <admin>/admin/endpoints/vllm-0/fault \\" in lines
    assert any("--model NAME" in line for line in lines)


@pytest.mark.parametrize("flag", ["--port", "--admin-port"])
def test_a_port_in_use_is_one_line_and_exit_1(flag: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            sim_command("--endpoints", "1", flag, str(port)),
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
    assert result.returncode == 1, result.stderr
    [line] = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert f"{port}" in line and "address already in use" in line, line
    assert line.endswith("(a simulator still running? --port 0 and --admin-port 0 take free ports)")
    assert "Traceback" not in result.stderr


def test_a_registry_file_that_cannot_be_written_is_named(tmp_path: Path) -> None:
    out = tmp_path / "no-such-folder" / "endpoints.json"
    result = subprocess.run(
        sim_command("--endpoints", "1", "--registry-out", str(out)),
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 1, result.stderr
    assert f"error: {out}: No such file or directory" in result.stderr.splitlines()
    assert "Traceback" not in result.stderr


def test_the_readmes_wait_for_the_simulator_ends_when_it_fails(tmp_path: Path) -> None:
    """README, "Trying it by hand": the loop that waits for the registry file spun forever
    when `poller sim` failed (its port taken); it ends now, with the simulator's error."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    [wait] = [line for line in readme.splitlines() if line.startswith("until [ -s ")]
    registry = tmp_path / "sim-endpoints.json"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        sim = shlex.join(sim_command("--endpoints", "1", "--port", str(port)))
        script = (
            f"{sim} --registry-out {shlex.quote(str(registry))} > /dev/null &\n"
            + wait.replace("/tmp/sim-endpoints.json", str(registry))
        )
        # The timeout only ends a hang: the loop ends as soon as the simulator exits.
        result = subprocess.run(
            ["bash", "-c", script], capture_output=True, text=True, timeout=60,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "address already in use" in result.stderr and not registry.exists()
