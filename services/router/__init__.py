"""Router: admission, tokenization, hashing, the routing decision and the client API
(docs/architecture.md, "Routing"). ``policy``, ``cost``, ``admission``, ``nodes`` and
``waiters`` hold the decision logic without I/O; ``service`` is the process around
them."""

from services.router.admission import Admission
from services.router.hits import Hits
from services.router.nodes import NodeTable
from services.router.policy import Decision, NodeLoad, PolicyConfig, Router, Wait
from services.router.service import RouterService, serve
from services.router.waiters import PrefixWaiters

__all__ = ["Admission", "Decision", "Hits", "NodeLoad", "NodeTable", "PolicyConfig",
           "PrefixWaiters", "Router", "RouterService", "Wait", "serve"]
