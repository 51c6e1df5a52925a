"""kvindex: the single source of truth for KV block lifecycle, leases and
longest-prefix lookups (DESIGN.md §6)."""
