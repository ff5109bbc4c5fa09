"""Engine simulator: what the poller's integration tests and benchmarks run against.

One asyncio process serves many virtual engine endpoints (vLLM V1 and V0, SGLang,
llama.cpp, trtllm-serve, Triton, TGI) with pages as large as real ones, a load that
evolves plausibly and deterministically from a seed, and faults switchable at runtime::

    async with Simulator(fleet(6), seed=1) as sim:
        url = sim.base_url("vllm-0")            # what a registry entry's url is
        await sim.set_fault("vllm-0", "slow", delay_s=3)
        assert sim.hits("vllm-0") == 0

Modules: ``model`` (the load), ``templates`` + ``pages_*`` + ``engines`` (the pages),
``faults``, ``spec`` (``EndpointSpec``, ``fleet``), ``server`` (``Simulator``), ``admin``
(the JSON admin API) and ``cli`` (``python -m poller.sim``).
"""

from __future__ import annotations

from .cli import main, run_sim
from .endpoint import Snapshot
from .engines import ENGINES
from .faults import FAULT_MODES, Fault
from .server import Simulator
from .spec import EndpointSpec, fleet

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
