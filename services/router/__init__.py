"""Router: admission, tokenization, hashing, the routing decision and the client API
(docs/architecture.md, "Routing"). ``policy``, ``cost``, ``admission`` and ``nodes`` hold
the decision logic without I/O; ``service`` is the process around them."""

from services.router.admission import Admission
from services.router.nodes import NodeTable
from services.router.policy import Decision, Hits, NodeLoad, PolicyConfig, Router
from services.router.service import RouterService

__all__ = ["Admission", "Decision", "Hits", "NodeLoad", "NodeTable", "PolicyConfig", "Router",
           "RouterService"]
