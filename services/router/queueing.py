"""How long a new prefill waits behind the prefills a worker already holds (pure).

Workers report each prefill they hold (:class:`cpd.protocol.wire.PrefillWork`): its new tokens,
its cached context and how long it has been in the engine. The router prices them with
the same :class:`~services.router.cost.PrefillCost` it prices the new request with, so
queue and compute estimates are in one unit and one model.

Two engine regimes, told apart by the worker's ``prefill_token_cap``
(``long_prefill_token_threshold``):

* **FCFS** (no cap, vLLM's default): a running prefill takes the whole step budget until
  it is done, so a new request waits for all the work ahead of it; only the oldest
  prefill has made progress.
* **Shared steps** (cap > 0): while others are eligible, no prefill computes more than
  the cap per step, so prefills progress side by side like processor sharing. A new
  request of ``own`` ms is then delayed by each held prefill by at most ``own`` (a
  2K-token warm suffix behind a 100K-token cold prompt is done in about twice its own
  time, not after the cold one) and each held prefill has progressed by its time in the
  engine divided by the number sharing it.
"""

from __future__ import annotations

from collections.abc import Sequence

from cpd.protocol.wire import PrefillWork
from services.router.cost import PrefillCost


def remaining_ms(works: Sequence[PrefillWork], cost: PrefillCost,
                 shares_steps: bool) -> list[float]:
    """Estimated ms of compute each held prefill still needs (never negative)."""
    started = [w for w in works if w.elapsed_ms > 0]
    oldest = max(started, key=lambda w: w.elapsed_ms, default=None)
    out = []
    for w in works:
        total = cost.ms(w.new_tokens, w.context_tokens)
        if shares_steps:
            done = w.elapsed_ms / len(started) if started else 0.0
        else:
            done = w.elapsed_ms if w is oldest else 0.0
        out.append(max(total - done, 0.0))
    return out


def ahead_ms(works: Sequence[PrefillWork], dispatched_ms: Sequence[float],
             cost: PrefillCost, shares_steps: bool) -> list[float]:
    """The work ahead of a new prefill on a node (ms each): what its held prefills still
    need, then what the router dispatched there since the node's last report."""
    return [*remaining_ms(works, cost, shares_steps), *dispatched_ms]


def wait_ms(ahead: Sequence[float], own_ms: float, shares_steps: bool) -> float:
    """Delay a new prefill of ``own_ms`` sees from the work ``ahead`` (ms each): all of
    it first-come first-served; at most ``own_ms`` from each when steps are shared."""
    if shares_steps:
        return sum(min(r, own_ms) for r in ahead)
    return sum(ahead)
