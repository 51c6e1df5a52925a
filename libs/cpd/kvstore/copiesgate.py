"""Whether a decode arena evicts copies first, decided from what the cluster lost (pure).

Every prefill-side arena evicts blocks with a copy elsewhere before its policy's victims,
so the cluster's arenas pool their capacity. A decode arena holds each hand-off's blocks,
which are copies of what the prefill side computed: evicting them first keeps the pool's
capacity distinct, but the decode node then pulls its sessions' earlier turns again at
every hand-off, and at high load its inbound link is what saturates. Which costs more
depends on whether the pool is short, and that shows in one number kvindex counts: the
blocks that lookups ask for right past their match and that the cluster had evicted from
every copy, arenas, disk tiers and engine caches alike (``BlockCopies.misses``). Blocks
lost and never asked for again (ended sessions) cost nothing; blocks lost and asked for
are recomputed because the pool was short. While there are none the decode arena keeps
its sessions by its policy; while there are, it gives the pool its capacity and evicts
copies first (docs/plan.md, "Decode arenas").

:class:`CopiesFirstGate` starts with copies first, the safe side: a pool that keeps its
capacity loses little whatever the traffic. Whether keeping to the policy would cost
anything shows only once it does, so the gate tries it: after ``PROBE_AFTER`` hand-offs in
a row whose mean misses stayed below ``OFF_BELOW`` blocks, it switches copies first off;
if the misses then climb past ``ON_ABOVE`` per hand-off it switches back on and waits
twice as long before the next try. The mean is exponentially weighted per hand-off. The
workers and the planner both run it.
"""

from __future__ import annotations

from collections.abc import Hashable

from cpd.ops.config import DecodeCopiesFirst
from cpd.protocol.roles import Role

from .arena import evicts_copies_first

ALPHA = 0.05
"""Weight of one hand-off's misses in the mean (about the last 20 hand-offs count)."""

ON_ABOVE = 1.0
"""Mean missed blocks per hand-off above which a try ends: copies first again."""

OFF_BELOW = 0.5
"""Mean below which a hand-off counts as quiet."""

PROBE_AFTER = 256
"""Quiet hand-offs in a row after which the gate first tries copies first off."""

MAX_PROBE_AFTER = 1 << 16
"""The longest wait between two tries."""

LOST_BLOCKS = 1 << 18
"""How many of the most recently lost blocks kvindex (and the planner) remember to
recognise a lookup's miss (about 20 MiB of hashes)."""


class LostBlocks(dict[Hashable, None]):
    """The most recently lost blocks, at most ``limit``, oldest first: what kvindex and
    the planner recognise a lookup's miss by. A dict, so that membership, removal (a
    block held again: ``pop``) and iteration cost what a dict's do."""

    def __init__(self, limit: int = LOST_BLOCKS) -> None:
        super().__init__()
        self.limit = limit

    def add(self, block: Hashable) -> None:
        """``block`` was lost; past ``limit`` the oldest is forgotten."""
        self[block] = None
        if len(self) > self.limit:
            del self[next(iter(self))]


class CopiesFirstGate:
    """Whether one decode arena evicts copies first, updated at each hand-off."""

    def __init__(self, mode: DecodeCopiesFirst = "adaptive") -> None:
        self.mode: DecodeCopiesFirst = mode
        self.on = evicts_copies_first(Role.DECODE, mode)
        self.mean = 0.0
        self.quiet = 0  # hand-offs in a row with the mean below OFF_BELOW, while on
        self.probe_after = PROBE_AFTER
        self._counts: dict[str, int] = {}
        self._pending = 0

    def observe(self, replica: str, misses: int) -> None:
        """A kvindex replica's running count of missed blocks. Each replica answers its
        share of the lookups and counts its own, so the growth of every replica's count
        adds up; a count lower than the last one seen is a restarted replica's."""
        last = self._counts.get(replica)
        self._counts[replica] = misses
        if last is not None:
            self._pending += misses - last if misses >= last else misses

    def handoff(self) -> bool:
        """One hand-off arrives: fold the misses since the previous one into the mean;
        returns whether the arena evicts copies first now."""
        if self.mode != "adaptive":
            return self.on
        missed, self._pending = self._pending, 0
        self.mean += ALPHA * (missed - self.mean)
        if self.on:
            self.quiet = self.quiet + 1 if self.mean < OFF_BELOW else 0
            if self.quiet >= self.probe_after:
                self.on = False  # try keeping to the policy
        elif self.mean > ON_ABOVE:  # the try cost the pool: back, and wait longer
            self.on, self.quiet = True, 0
            self.probe_after = min(2 * self.probe_after, MAX_PROBE_AFTER)
        return self.on
