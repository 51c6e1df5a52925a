"""Prefill worker: loads a warm prompt's cached prefix and computes the suffix
(DESIGN.md §2). Built by the workers issue."""
