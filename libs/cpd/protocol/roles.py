"""The roles a CPD worker plays (one worker service runs any of them, ``node.role``), and
the services a front-end process hosts."""

from __future__ import annotations

import enum
from typing import Final


class Role(enum.StrEnum):
    """A worker's role. Members are strings, so they compare equal to the role names that
    travel in heartbeats and subjects."""

    PREPREFILL = "preprefill"  # full prefill of cold prompts; seals every full block
    PREFILL = "prefill"  # warm prompts: load the cached prefix, compute the suffix
    DECODE = "decode"  # pulls the request's KV and generates


WORKER_ROLES: Final[tuple[Role, ...]] = tuple(Role)
"""Every worker role, in the order of the request flow."""

PREFILL_ROLES: Final[tuple[Role, ...]] = (Role.PREPREFILL, Role.PREFILL)
"""The roles that run prefills (and so send first tokens and hand off to decode)."""

FRONTEND_PARTS: Final[tuple[str, ...]] = ("kvindex", "router", "gateway")
"""The services a front-end process (``services.frontend``) hosts, in start order."""
