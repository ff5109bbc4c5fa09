"""The routing benchmark: gateway replicas choosing engines on the shared view.

``fleet`` (the engines and ``RoutingConfig``), ``policies`` (the name -> factory
registry: round-robin, random, the deterministic pick, the picker with and without local
correction, the oracle), ``litellm_policies`` (LiteLLM's, opt-in), ``replica`` (one
gateway replica process), ``report`` (figures and the table), ``run``
(``run_routing``, what ``poller bench --section routing`` calls), and the family in
virtual time: ``cells`` (the engine mixes and designs) and ``family`` (``run_cell``,
``run_family``).
"""

from __future__ import annotations

# LiteLLM's strategies register themselves, opt-in (litellm is imported only when a
# replica builds one).
import poller_lab.routing.litellm_policies
import poller_lab.routing.naive  # noqa: F401 (the naive policy registers itself)
from poller_lab.routing.fleet import RoutingConfig
from poller_lab.routing.policies import POLICIES, Policy, PolicyContext, register

__all__ = ["POLICIES", "Policy", "PolicyContext", "RoutingConfig", "register"]
