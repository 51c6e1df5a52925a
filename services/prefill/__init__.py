"""Prefill worker: loads a warm prompt's cached prefix and computes the suffix
(docs/architecture.md, "Services")."""
