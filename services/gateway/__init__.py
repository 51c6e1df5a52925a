"""gateway: the OpenAI-compatible HTTP API of a CPD cluster (Completions and Chat
Completions, streaming or not), a thin layer over :class:`cpd.client.Client`.

``protocol`` holds the request and reply shapes, ``errors`` the HTTP error mapping,
``metrics`` the instruments, ``app`` the endpoints and ``service`` the process.
"""

from services.gateway.app import create_app
from services.gateway.service import GatewayService, serve

__all__ = ["GatewayService", "create_app", "serve"]
