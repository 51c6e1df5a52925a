"""gateway: the OpenAI-compatible HTTP API of a CPD cluster (Completions and Chat
Completions, streaming or not), a thin layer over :class:`cpd.client.Client`.

``protocol`` holds the request and reply shapes, ``errors`` the HTTP error mapping,
``metrics`` the instruments, ``tenants`` and ``ratelimit`` who may ask what, ``app`` the
application (its endpoints in ``completions`` and ``ops``, a request's checks in
``admission``, its course in ``calls``, streams in ``streaming``, reply bytes in
``replies``) and ``service`` the process.
"""

from services.gateway.app import create_app
from services.gateway.service import GatewayService, serve

__all__ = ["GatewayService", "create_app", "serve"]
