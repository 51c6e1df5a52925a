"""How closely the planner's simulation agrees with the real services: the comparison of
one ``cpd plan`` against one ``cpd bench sweep`` of the same workload, preset, seed,
loads and phases (docs/benchmarks/plan.md, "Fidelity").

Pure: both sides' results in, the differences out. Per topology:

* **Sustainable QPS/GPU** — each side's, and their relative difference
  ``|plan − sweep| ÷ sweep``; ``fidelity_max_rel_diff`` is the largest over the
  topologies (target ≤ :data:`SUSTAINABLE_TOLERANCE`).
* **TTFT p50 and p90 at two loads below saturation** — the two lowest loads of the
  ladder that both sides sustained (the same requests at the same times on both), and
  the relative differences of each percentile; ``ttft_max_rel_diff`` is the largest
  (target ≤ :data:`TTFT_TOLERANCE`). A topology with fewer than two such loads compares
  those it has and says so in ``ttft_loads``.

And the services' own latency (:func:`services_latency`): the same requests at the
lowest load, the services' TTFT against a plan that charges no delay around the engines,
the median gap split into what the planner charges before the engine (``dispatch_ms``)
and after a worker's token (``relay_ms``): docs/plan.md, "What the services add".
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence

# The topologies compared, and the targets (relative differences).
TOPOLOGIES = ("2P1D pd-rr", "2P1D pd-kv", "CPD-1D")
SUSTAINABLE_TOLERANCE = 0.10
TTFT_TOLERANCE = 0.15
TTFT_LOADS = 2
_PERCENTILES = ("ttft_p50_s", "ttft_p90_s")
_SAME_LOAD = 1e-6


def rel_diff(plan: float | None, real: float | None) -> float | None:
    """``|plan − real| ÷ real``; None where either side is missing or ``real`` is 0 (a
    load neither side sustained is no difference: 0)."""
    if plan is None or real is None:
        return None
    if real == 0:
        return 0.0 if plan == 0 else None
    return round(abs(plan - real) / real, 4)


def _points(points: Iterable[Mapping]) -> dict[float, Mapping]:
    return {round(float(p["target_qps_per_gpu"]), 6): p for p in points}


def ttft_loads(sweep_points: Sequence[Mapping], plan_points: Sequence[Mapping],
               n: int = TTFT_LOADS) -> list[float]:
    """The ``n`` lowest target loads (QPS/GPU) both sides ran and sustained."""
    real, plan = _points(sweep_points), _points(plan_points)
    both = sorted(q for q in real if q in plan
                  and real[q]["sustainable"] and plan[q]["sustainable"])
    return both[:n]


def compare_topology(sweep_topology: Mapping, plan_topology: Mapping) -> dict:
    """One topology: the sweep's ``topologies[label]`` against the plan's (its first
    seed's search)."""
    search = plan_topology["seeds"][0]
    real_pts, plan_pts = sweep_topology["points"], search["points"]
    real_q = sweep_topology["sustainable_qps_per_gpu"]
    plan_q = search["sustainable_qps_per_gpu"]
    loads = ttft_loads(real_pts, plan_pts)
    real, plan = _points(real_pts), _points(plan_pts)
    at: dict[str, dict] = {}
    diffs: list[float] = []
    for q in loads:
        row: dict[str, float | None] = {}
        for key in _PERCENTILES:
            a, b = plan[q].get(key), real[q].get(key)
            d = rel_diff(a, b)
            row[f"plan_{key}"], row[f"sweep_{key}"] = a, b
            row[f"{key.removesuffix('_s')}_rel_diff"] = d
            if d is not None:
                diffs.append(d)
        at[f"{q:g}"] = row
    return {
        "sweep_sustainable_qps_per_gpu": real_q,
        "plan_sustainable_qps_per_gpu": plan_q,
        "sustainable_rel_diff": rel_diff(plan_q, real_q),
        "ttft_loads": loads,
        "ttft": at,
        "ttft_max_rel_diff": max(diffs) if diffs else None,
    }


def services_latency(sweep_requests: Mapping[str, Sequence[float | int | None]],
                     plan_requests: Mapping[str, tuple[float | None, int]]) -> dict | None:
    """The services' latency around the engines, from one load's requests on both sides.

    ``sweep_requests``: id → (TTFT s, computed prompt tokens, TTFT outside the router s)
    as the sweep's point keeps them; ``plan_requests``: id → (TTFT s, computed prompt
    tokens) of a plan with no delays. Paired where both sides have a TTFT and computed the
    same tokens (the same cache hits: the gap is the services', not the caches'). The
    gap's median is charged: ``relay_ms`` is the median part outside the router (the
    client's trips to it and back; 0 when none was timed), ``dispatch_ms`` the rest.
    None when no request pairs."""
    gaps, outside = [], []
    for rid, (ttft, computed, out) in sweep_requests.items():
        plan = plan_requests.get(rid)
        if ttft is None or plan is None or plan[0] is None or plan[1] != computed:
            continue
        gaps.append(float(ttft) - plan[0])
        if out is not None:
            outside.append(float(out))
    if not gaps:
        return None
    gap = statistics.median(gaps)
    relay = max(0.0, min(statistics.median(outside), gap)) if outside else 0.0
    return {
        "paired": len(gaps),
        "requests": len(sweep_requests),
        "gap_p50_ms": round(gap * 1e3, 2),
        "gap_mean_ms": round(statistics.fmean(gaps) * 1e3, 2),
        "dispatch_ms": round(max(0.0, gap - relay) * 1e3, 2),
        "relay_ms": round(relay * 1e3, 2),
    }


def compare(sweep: Mapping, plan: Mapping, labels: Sequence[str] = TOPOLOGIES) -> dict:
    """The sweep's result against the plan's, for every label both ran."""
    tops = {label: compare_topology(sweep["topologies"][label], plan["topologies"][label])
            for label in labels
            if label in sweep["topologies"] and label in plan["topologies"]}
    sus = [t["sustainable_rel_diff"] for t in tops.values()]
    ttft = [t["ttft_max_rel_diff"] for t in tops.values()]
    worst = None if not tops or None in sus else max(sus)
    worst_ttft = None if not tops or None in ttft else max(ttft)
    return {
        "topologies": tops,
        "fidelity_max_rel_diff": worst,
        "fidelity_target": SUSTAINABLE_TOLERANCE,
        "fidelity_met": worst is not None and worst <= SUSTAINABLE_TOLERANCE,
        "ttft_max_rel_diff": worst_ttft,
        "ttft_target": TTFT_TOLERANCE,
        "ttft_met": worst_ttft is not None and worst_ttft <= TTFT_TOLERANCE,
    }


__all__ = ["SUSTAINABLE_TOLERANCE", "TOPOLOGIES", "TTFT_TOLERANCE", "compare",
           "compare_topology", "rel_diff", "services_latency", "ttft_loads"]
