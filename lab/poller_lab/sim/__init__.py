"""Engine simulator: what the poller's integration tests and benchmarks run against.

One asyncio process serves many virtual engine endpoints (vLLM V1 and V0, SGLang,
llama.cpp, trtllm-serve, Triton, TGI, LMDeploy) with pages as large as real ones, a load that
evolves plausibly and deterministically from a seed, faults switchable at runtime, and
OpenAI-compatible completions that hold running slots and show on the pages::

    async with Simulator(fleet(6), seed=1) as sim:
        url = sim.base_url("vllm-0")            # what a registry entry's url is
        await sim.set_fault("vllm-0", "slow", delay_s=3)
        assert sim.hits("vllm-0") == 0

Modules: ``model`` (the load), ``templates`` + ``pages_*`` + ``engines`` (the pages),
``faults``, ``spec`` (``EndpointSpec``, ``fleet``), ``serving`` (slots and queue of the
served requests), ``prefix`` (an engine's prefix cache), ``openai`` (request and
response shapes, vLLM's sleep routes),
``endpoint`` and ``serve`` (one endpoint's state and answers), ``server`` (``Simulator``),
``admin`` (the JSON admin API) and ``cli`` (``python -m poller_lab.sim``). The reference
is docs/simulator.md.
"""

from __future__ import annotations

from poller_lab.sim.cli import main, run_sim
from poller_lab.sim.endpoint import Snapshot
from poller_lab.sim.engines import ENGINES
from poller_lab.sim.faults import FAULT_MODES, Fault
from poller_lab.sim.server import Simulator
from poller_lab.sim.spec import EndpointSpec, fleet

__all__ = [
    "ENGINES",
    "FAULT_MODES",
    "EndpointSpec",
    "Fault",
    "Simulator",
    "Snapshot",
    "fleet",
    "main",
    "run_sim",
]
