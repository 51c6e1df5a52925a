"""kvindex: the single source of truth for KV block lifecycle, leases and
longest-prefix lookups (docs/architecture.md, "Lifecycle and visibility"). ``index`` holds the
rules, ``service`` the I/O."""

from services.kvindex.index import Changes, Index
from services.kvindex.service import KvIndexService, serve

__all__ = ["Changes", "Index", "KvIndexService", "serve"]
