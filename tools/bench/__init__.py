"""Benchmarks (``cpd bench ...``); results and commands in docs/benchmarks/."""
