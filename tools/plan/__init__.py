"""``cpd plan``: the capacity planner in simulated time (docs/plan.md): the services'
own routing policy, engine scheduler and cache rules in a discrete-event simulation of
one process, sizing the pre-prefill, prefill and decode pools from a workload or trace."""

from tools.plan.cluster import ClusterConfig, NodeSpec, SimResult, simulate
from tools.plan.planner import Verdict, run, verdict
from tools.plan.search import PlanConfig, within_budget

__all__ = ["ClusterConfig", "NodeSpec", "PlanConfig", "SimResult", "Verdict", "run", "simulate",
           "verdict", "within_budget"]
