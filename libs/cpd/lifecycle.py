"""The lifecycle of one block at one location (DESIGN.md §6).

``ALLOCATED → WRITING → SEALED → VISIBLE → EVICTED``. Writers report the first three;
only kvindex makes a location VISIBLE; eviction (or failure) ends it. ``ALLOCATED →
SEALED`` is allowed (a writer may skip reporting WRITING), and any live state may end in
EVICTED (eviction, failure, lease expiry). Nothing comes back from EVICTED: a new
allocation of the same block at the same place starts a new life.
"""

from __future__ import annotations

import enum


class State(enum.IntEnum):
    ALLOCATED = 1
    WRITING = 2
    SEALED = 3
    VISIBLE = 4
    EVICTED = 5


_ALLOWED: dict[State, frozenset[State]] = {
    State.ALLOCATED: frozenset({State.WRITING, State.SEALED, State.EVICTED}),
    State.WRITING: frozenset({State.SEALED, State.EVICTED}),
    State.SEALED: frozenset({State.VISIBLE, State.EVICTED}),
    State.VISIBLE: frozenset({State.EVICTED}),
    State.EVICTED: frozenset(),
}

PENDING: frozenset[State] = frozenset({State.ALLOCATED, State.WRITING, State.SEALED})
"""States of a block being produced: not readable yet, but coming."""


def can_transition(old: State, new: State) -> bool:
    """Whether ``old → new`` is a legal step."""
    return new in _ALLOWED[old]


class IllegalTransition(ValueError):
    """A lifecycle step the state machine forbids (logged and counted, never applied)."""

    def __init__(self, old: State | None, new: State, what: str = "") -> None:
        name = old.name if old is not None else "ABSENT"
        super().__init__(f"illegal transition {name} → {new.name}{f' ({what})' if what else ''}")
        self.old, self.new = old, new
