"""Who is asking, and what they may ask: API keys and per-tenant limits (pure logic).

* No tenants configured (``gateway.tenants`` empty): the gateway stays open, every
  request belongs to the ``default`` tenant with no limits of its own (a local cluster).
* Tenants configured: every request needs ``Authorization: Bearer <key>`` with a key
  whose SHA-256 digest one tenant lists; a missing or unknown key is a 401. The tenant's
  name then goes into the request (``GenerateRequest.tenant``), which puts its KV blocks in
  its own namespace (docs/architecture.md, "Block identity").

Configured in TOML (digests from ``cpd.ops.config.api_key_digest(key)``, e.g.
``python -c "import hashlib; print(hashlib.sha256(b'sk-...').hexdigest())"``)::

    [gateway.tenants.acme]
    api_key_sha256 = ["<64 hex digits>"]
    rate_per_s = 5          # token bucket: sustained requests per second
    burst = 10              # ... and how many at once
    max_request_bytes = 4000000
    max_prompt_tokens = 100000
    max_tokens = 4096       # an explicit larger max_tokens is a 400; a default is clamped

The router keeps no tenant list of its own: it sits on the trusted bus behind the
gateway, and a tenant name only ever selects a namespace salt, so an unknown name can
reach nothing but its own, empty, namespace.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from http import HTTPStatus

from cpd.ops.config import GatewaySettings, TenantSettings
from cpd.protocol import wire
from services.gateway.errors import ApiError

DEFAULT_TENANT = wire.DEFAULT_TENANT
"""The tenant of every request when no tenants are configured (the base namespace)."""

_BEARER = "bearer "


@dataclass(frozen=True)
class Tenant:
    """One authenticated tenant and its limits (0 = none)."""

    name: str
    max_prompt_tokens: int = 0
    max_request_bytes: int = 0
    max_tokens: int = 0


class AuthError(ApiError):
    """A 401 in OpenAI's shape (the SDKs raise ``AuthenticationError``)."""

    def __init__(self, message: str) -> None:
        super().__init__(HTTPStatus.UNAUTHORIZED, message, code="invalid_api_key",
                         headers={"WWW-Authenticate": "Bearer"})


class TenantTable:
    """API-key digests → tenants."""

    def __init__(self, tenants: dict[str, TenantSettings]) -> None:
        self.open = not tenants
        self._by_digest: dict[str, Tenant] = {}
        self.limits: dict[str, tuple[float, int]] = {}
        for name, t in tenants.items():
            tenant = Tenant(name, t.max_prompt_tokens, t.max_request_bytes, t.max_tokens)
            for digest in t.api_key_sha256:
                self._by_digest[digest] = tenant
            self.limits[name] = (t.rate_per_s, t.burst)

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> TenantTable:
        return cls(settings.tenants)

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization`` header, or :class:`AuthError`."""
        if self.open:
            return Tenant(DEFAULT_TENANT)
        if not authorization or not authorization.lower().startswith(_BEARER):
            raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
        key = authorization[len(_BEARER):].strip()
        # Looked up by digest: the table holds no key, and a dict probe on a SHA-256
        # digest tells a timing observer nothing about the key itself.
        tenant = self._by_digest.get(hashlib.sha256(key.encode()).hexdigest()) if key else None
        if tenant is None:
            raise AuthError("invalid API key")
        return tenant
