"""What a worker holds and how busy it is: the prefills it holds (loading their prefix
or in the engine), the requests in its engine, and its load report to the routers."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cpd.kvstore import KvStore
from cpd.protocol import wire


@dataclass
class HeldPrefill:
    """A prefill this worker holds, as its load report lists it."""

    new_tokens: int
    context_tokens: int
    engine_start: float = 0.0  # perf_counter when it entered the engine; 0 while loading


class WorkerLoad:
    """One worker's load; ``on_change`` is called when a report should go out now."""

    def __init__(self, *, on_change: Callable[[], None]) -> None:
        self._prefills: dict[int, HeldPrefill] = {}
        self._ids = itertools.count()
        self._on_change = on_change
        self.in_flight = 0

    @contextlib.contextmanager
    def holding(self, new_tokens: int, context_tokens: int) -> Iterator[HeldPrefill]:
        """A prefill held for the duration of the block (reported at once, both ways)."""
        key = next(self._ids)
        held = self._prefills[key] = HeldPrefill(new_tokens, context_tokens)
        self._on_change()
        try:
            yield held
        finally:
            del self._prefills[key]
            self._on_change()

    @contextlib.contextmanager
    def running(self, *, report: bool = False) -> Iterator[None]:
        """A request in the engine for the duration of the block (``report``: the change
        is reported at once, as decode's must be: decode is chosen by load)."""
        self.in_flight += 1
        if report:
            self._on_change()
        try:
            yield
        finally:
            self.in_flight -= 1
            if report:
                self._on_change()

    @property
    def waiting(self) -> int:
        """Prefills held here."""
        return len(self._prefills)

    @property
    def queued_tokens(self) -> int:
        """New tokens of the held prefills, as the router planned them."""
        return sum(p.new_tokens for p in self._prefills.values())

    def prefill_work(self) -> list[wire.PrefillWork]:
        """The held prefills, oldest first, as the load report lists them."""
        now = time.perf_counter()
        return [wire.PrefillWork(new_tokens=p.new_tokens, context_tokens=p.context_tokens,
                                 elapsed_ms=(now - p.engine_start) * 1e3
                                 if p.engine_start else 0.0)
                for p in list(self._prefills.values())[:wire.MAX_REPORTED_PREFILLS]]

    def report(self, node: str, role: str, kv: KvStore, *, kv_bandwidth_gbps: float,
               prefill_token_cap: int) -> wire.LoadReport:
        """The load report of ``node``."""
        store, disk = kv.store, kv.disk
        return wire.LoadReport(
            node=node, role=role, queue_depth=self.waiting,  # type: ignore[arg-type]
            queued_new_tokens=self.queued_tokens, in_flight=self.in_flight,
            dram_used_bytes=store.used_bytes, dram_total_bytes=store.total_bytes,
            kv_bandwidth_gbps=kv_bandwidth_gbps, prefills=self.prefill_work(),
            prefill_token_cap=prefill_token_cap,
            disk_used_bytes=disk.used_bytes if disk else 0,
            disk_total_bytes=disk.total_bytes if disk else 0,
            disk_read_gbps=disk.read_gbps if disk else 0.0)
