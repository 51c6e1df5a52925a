"""Whether a decode arena evicts copies first, decided from the cluster's losses (pure).

Every prefill-side arena evicts blocks with a copy elsewhere before its policy's victims,
so the cluster's arenas pool their capacity. A decode arena holds each hand-off's blocks,
which are copies of what the prefill side computed: evicting them first keeps the pool's
capacity distinct, but the decode node then pulls its sessions' earlier turns again at
every hand-off, and at high load its inbound link is what saturates. Which of the two
costs more depends on whether the pool is short, and that shows in one number kvindex
counts: last copies evicted anywhere in the cluster (``BlockCopies.last_evicted``). A
pool that loses none holds the working set, and the decode arena keeps its sessions by
its policy; a pool that loses last copies needs the decode arena's capacity, which it
then evicts copies first (docs/plan.md, "Decode arenas").

:class:`CopiesFirstGate` follows the losses per hand-off as an exponentially weighted
mean, with hysteresis so that a rate near the threshold does not flip the arena at every
hand-off (each switch on re-offers the arena's shared blocks). The workers and the
planner both run it.
"""

from __future__ import annotations

from cpd.ops.config import DecodeCopiesFirst

ALPHA = 0.05
"""Weight of one hand-off's losses in the mean (about the last 20 hand-offs count)."""

ON_ABOVE = 1.0
"""Mean last copies lost per hand-off above which the decode arena evicts copies first."""

OFF_BELOW = 0.5
"""Mean below which it keeps to its policy again."""


class CopiesFirstGate:
    """Whether one decode arena evicts copies first, updated at each hand-off."""

    def __init__(self, mode: DecodeCopiesFirst = "adaptive") -> None:
        self.mode: DecodeCopiesFirst = mode
        self.on = mode == "always"
        self.mean = 0.0
        self._seen = 0
        self._at_handoff: int | None = None

    def observe(self, last_evicted: int) -> None:
        """kvindex's running count of last copies evicted in the cluster. Replicas may
        send it a little apart; the highest count seen is the one that holds."""
        if last_evicted > self._seen:
            self._seen = last_evicted

    def handoff(self) -> bool:
        """One hand-off arrives: fold the losses since the previous one into the mean;
        returns whether the arena evicts copies first now."""
        if self.mode != "adaptive":
            return self.on
        lost = 0 if self._at_handoff is None else self._seen - self._at_handoff
        self._at_handoff = self._seen
        self.mean += ALPHA * (lost - self.mean)
        if self.on and self.mean < OFF_BELOW:
            self.on = False
        elif not self.on and self.mean > ON_ABOVE:
            self.on = True
        return self.on
