"""Test helpers, imported as a package: the shared vLLM cluster and reference runs
(:mod:`tests.helpers.cluster`), UCX peer processes and their harness, and the scripts that
run an engine in a process of its own."""
