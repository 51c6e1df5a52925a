"""kvindex: the single source of truth for KV block lifecycle, leases and
longest-prefix lookups (DESIGN.md §6). ``index`` holds the rules, ``service`` the I/O."""

from .index import Changes, Index
from .service import KvIndexService

__all__ = ["Changes", "Index", "KvIndexService"]
