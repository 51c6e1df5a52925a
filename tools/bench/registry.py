"""The ``cpd bench`` registry: every benchmark's name, module and one-line help.

Each registered module declares its own command line and runs from it:

* ``add_arguments(parser)`` adds the benchmark's flags to its ``cpd bench NAME``
  subcommand (the common ``--json`` is the command line's, never a module's);
* ``run_args(args, settings) -> dict`` runs the benchmark from the parsed flags and
  returns its JSON-able result; ``settings()`` builds the settings from the common
  ``--config``/``--set``, and only benchmarks that use settings call it.

A module is imported only when its subcommand parses arguments or shows its help
(:class:`BenchParser`), so ``cpd bench hashing`` loads none of the services, UCX or vLLM
the other benchmarks need.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from cpd.ops.config import Settings

SettingsFactory = Callable[[], Settings]
"""Builds the settings from the common flags when a benchmark needs them."""


@dataclass(frozen=True)
class Benchmark:
    """One ``cpd bench`` subcommand: ``module`` declares its flags and runs it."""

    name: str
    module: str
    help: str

    def load(self) -> ModuleType:
        """The benchmark's module (imported on first use)."""
        return importlib.import_module(self.module)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the benchmark's own flags to ``parser``."""
        self.load().add_arguments(parser)

    def run(self, args: argparse.Namespace, settings: SettingsFactory) -> dict:
        """Run the benchmark from parsed flags; returns its JSON-able result."""
        return self.load().run_args(args, settings)


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("hashing", "tools.bench.hashing",
              "block hashes and the lookup request of a 100K-token prompt"),
    Benchmark("kvindex", "tools.bench.kvindex",
              "kvindex lookup throughput and latency over NATS, ingest, recovery"),
    Benchmark("transfer", "tools.bench.transfer",
              "KV blocks between two processes over UCX, against raw UCX, NATS, memcpy"),
    Benchmark("model", "tools.bench.model",
              "vLLM-CPU prefill of N tokens against copying their KV"),
    Benchmark("ttft", "tools.bench.ttft",
              "TTFT per KV path on real vLLM-CPU workers"),
    Benchmark("client", "tools.bench.client",
              "TTFT and TPOT through the gateway against monolithic vLLM-CPU"),
    Benchmark("serve", "tools.bench.serve",
              "vllm bench serve against the gateway and against monolithic vLLM-CPU"),
    Benchmark("workingset", "tools.bench.workingset",
              "reuse and TTFT as an agent working set outgrows the cache, against vLLM"),
    Benchmark("router", "tools.bench.router",
              "routing decisions for 100K-token prompts with a large kvindex"),
    Benchmark("sweep", "tools.bench.sweep",
              "CPD against P/D on simulated engines: sustainable QPS/GPU"),
    Benchmark("plan", "tools.bench.plan",
              "planner speed: the paper's protocol and a 256-node cluster, simulated"),
    Benchmark("faults", "tools.bench.faults",
              "fault scenarios under load: lost requests, wrong tokens, recovery"),
    Benchmark("soak", "tools.bench.soak",
              "long load with a fault every few rounds: memory, files, caches bounded"),
    Benchmark("fuzz", "tools.bench.fuzz",
              "hostile input on every subject a service listens on"),
)}
"""Every ``cpd bench`` subcommand by name, in the order ``cpd bench --help`` lists them."""


class BenchParser(argparse.ArgumentParser):
    """The parser of one ``cpd bench NAME``: adds the benchmark's flags the first time
    it parses or formats its usage or help, so building the whole ``cpd`` parser
    imports no benchmark module."""

    def __init__(self, *args: Any, benchmark: Benchmark, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.benchmark = benchmark
        self._loaded = False

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            self.benchmark.add_arguments(self)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        """Load the benchmark's flags, then parse. A flag the benchmark does not declare
        is an error here, so the message names this subcommand and shows its usage
        (a subcommand gets the rest of the command line: nothing is left for ``cpd``)."""
        self._load()
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras

    def format_usage(self) -> str:
        """The usage line, with the benchmark's flags."""
        self._load()
        return super().format_usage()

    def format_help(self) -> str:
        """The help, with the benchmark's flags."""
        self._load()
        return super().format_help()
