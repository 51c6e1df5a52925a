"""The lifecycle of one block at one location (docs/architecture.md, "Lifecycle and visibility").

``ALLOCATED → WRITING → SEALED → VISIBLE → EVICTED``. Writers report the first three;
only kvindex makes a location VISIBLE; eviction (or failure) ends it. ``ALLOCATED →
SEALED`` is allowed (a writer may skip reporting WRITING), and any live state may end in
EVICTED (eviction, failure, lease expiry). Nothing comes back from EVICTED: a new
allocation of the same block at the same place starts a new life.
"""

from __future__ import annotations

import enum


class BlockState(enum.IntEnum):
    """Where one block is in its lifecycle at one location: the worker's store holds the
    first three, kvindex all five."""

    ALLOCATED = 1
    WRITING = 2
    SEALED = 3
    VISIBLE = 4
    EVICTED = 5


_ALLOWED: dict[BlockState, frozenset[BlockState]] = {
    BlockState.ALLOCATED: frozenset({BlockState.WRITING, BlockState.SEALED, BlockState.EVICTED}),
    BlockState.WRITING: frozenset({BlockState.SEALED, BlockState.EVICTED}),
    BlockState.SEALED: frozenset({BlockState.VISIBLE, BlockState.EVICTED}),
    BlockState.VISIBLE: frozenset({BlockState.EVICTED}),
    BlockState.EVICTED: frozenset(),
}

PENDING: frozenset[BlockState] = frozenset({BlockState.ALLOCATED, BlockState.WRITING,
                                            BlockState.SEALED})
"""States of a block being produced: not readable yet, but coming."""


def can_transition(old: BlockState, new: BlockState) -> bool:
    """Whether ``old → new`` is a legal step."""
    return new in _ALLOWED[old]
