"""Router: admission, tokenization, hashing, the routing decision and the client API
(DESIGN.md §8). ``policy``, ``cost``, ``admission`` and ``nodes`` hold the decision logic
without I/O; ``service`` is the process around them."""

from .admission import Admission
from .nodes import NodeTable
from .policy import Decision, Hits, NodeLoad, PolicyConfig, Router
from .service import RouterService

__all__ = ["Admission", "Decision", "Hits", "NodeLoad", "NodeTable", "PolicyConfig", "Router",
           "RouterService"]
