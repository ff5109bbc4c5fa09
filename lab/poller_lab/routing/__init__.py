"""The routing benchmark: gateway replicas choosing engines on the shared view.

``fleet`` (the one-fleet bench's engines and ``RoutingConfig``), ``policies`` (the name
-> factory registry: round-robin, random, the deterministic pick, the picker with and
without local correction, the oracle; ``UNDER_TEST``), ``naive`` (least shared in flight
per slot), ``litellm_policies`` (LiteLLM's, opt-in), ``envoy_policy`` (through Envoy and
``poller epp`` replicas, opt-in), ``replica`` (one gateway replica process), ``report``
(figures and the table), ``run`` (``run_routing``: ``poller bench --section routing
--single-fleet``); the family in virtual time: ``cells`` (the engine mixes and designs),
``script`` (the share script played in memory) and ``family`` (``run_cell``,
``run_family``); the family on real processes: ``fleets`` (its fleets, cells and
arrivals), ``cellrun`` (one policy on one cell), ``family_real`` (``run_real_family``:
``poller bench --section routing``) and ``compare`` (virtual time against real
processes, cell by cell).
"""

from __future__ import annotations

# LiteLLM's strategies register themselves, opt-in (litellm is imported only when a
# replica builds one).
import poller_lab.routing.envoy_policy
import poller_lab.routing.litellm_policies
import poller_lab.routing.naive  # noqa: F401 (the naive policy registers itself)
from poller_lab.routing.fleet import RoutingConfig
from poller_lab.routing.policies import POLICIES, Policy, PolicyContext, register

__all__ = ["POLICIES", "Policy", "PolicyContext", "RoutingConfig", "register"]
