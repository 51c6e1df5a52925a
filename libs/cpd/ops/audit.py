"""The block audit trail of a worker (``worker.audit_dir``; off by default).

With the setting on, every worker appends one JSON line per data-plane event to
``<audit_dir>/audit-<node>.jsonl``:

* ``serve`` — its UCX server sends blocks to a peer: the hashes, how many of them were not
  sealed and how many no longer matched their seal's checksum at that moment;
* ``pull`` — it fetched blocks from a peer: the source node, why (``prefix``: a cached
  prefix the router planned from a kvindex lookup; ``handoff``: the blocks a prefill node
  handed to this decode node), when the request reached this worker, and the outcome;
* ``load`` — its engine was given blocks from its own store: unsealed / corrupt counts.

It is the evidence the fault harness (``tools/bench/faults.py``, docs/reliability.md) checks
its block invariants against. Lines are written and flushed one by one, so a process
killed with SIGKILL loses at most the line it was writing; readers skip a torn line.
Wall-clock times (``time.time()``) so lines of different processes on one host compare.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import msgspec

from cpd.ops import telemetry

log = telemetry.get_logger("cpd.audit")
_encoder = msgspec.json.Encoder()


class AuditLog:
    """Append-only JSONL audit of one node's block reads and loads."""

    def __init__(self, folder: str | Path, node: str) -> None:
        self.node = node
        self.path = Path(folder).expanduser() / f"audit-{node}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[bytes] | None = open(self.path, "ab")  # noqa: SIM115 - long-lived

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        record["t"] = time.time()
        record["node"] = self.node
        try:
            self._file.write(_encoder.encode(record) + b"\n")
            self._file.flush()
        except (OSError, ValueError) as e:  # a full disk must not fail a transfer
            log.warning("audit.write_failed", error=repr(e))

    def served(self, namespace: str, hashes: Sequence[bytes], unsealed: int,
               corrupt: int) -> None:
        """Blocks this node's UCX server is about to send to a peer."""
        self._write({"op": "serve", "ns": namespace, "hashes": [h.hex() for h in hashes],
                     "unsealed": unsealed, "corrupt": corrupt})

    def pulled(self, purpose: str, source: str, namespace: str, hashes: Sequence[bytes],
               received_at: float, error: str = "") -> None:
        """A pull from ``source`` ended (``error`` empty when it succeeded)."""
        self._write({"op": "pull", "purpose": purpose, "src": source, "ns": namespace,
                     "hashes": [h.hex() for h in hashes], "t_recv": received_at,
                     "error": error})

    def loaded(self, namespace: str, hashes: Sequence[bytes], unsealed: int,
               corrupt: int) -> None:
        """Blocks of this node's store handed to its engine."""
        self._write({"op": "load", "ns": namespace, "hashes": [h.hex() for h in hashes],
                     "unsealed": unsealed, "corrupt": corrupt})

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


def read_audit(folder: str | Path) -> Iterator[dict[str, Any]]:
    """Every record of every node's audit file under ``folder`` (torn lines skipped)."""
    for path in sorted(Path(folder).glob("audit-*.jsonl")):
        with open(path, "rb") as f:
            for line in f:
                with contextlib.suppress(msgspec.DecodeError):
                    yield msgspec.json.decode(line)


__all__ = ["AuditLog", "read_audit"]
