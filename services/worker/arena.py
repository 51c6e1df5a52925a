"""A worker's block arena: a file in shared memory (``worker.arena_dir``) cut into
fixed slots, named after its node, epoch and process so that a crashed predecessor's
files are told from a live process's and removed."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cpd.engines import ArenaSpec


@dataclass
class Arena:
    """The arena of one worker incarnation, and where its engine publishes KV events."""

    path: Path
    slots: np.ndarray  # (num_slots, slot_bytes) uint8, memory-mapped
    kv_events_endpoint: str

    @classmethod
    def create(cls, folder: str | os.PathLike[str], node: str, epoch: int, *,
               arena_bytes: int, slot_bytes: int) -> Arena:
        """Remove dead incarnations' files of ``node``, then map a new arena."""
        folder = Path(folder)
        remove_stale_files(folder, node)
        num_slots = max(1, arena_bytes // slot_bytes)
        path = folder / shm_name("arena", node, epoch)
        slots = np.memmap(path, dtype=np.uint8, mode="w+", shape=(num_slots, slot_bytes))
        return cls(path, slots, f"ipc://{folder / shm_name('kvevents', node, epoch)}")

    @property
    def spec(self) -> ArenaSpec:
        """What the engine's KV connector maps."""
        return ArenaSpec(str(self.path), self.slots.shape[0], self.slots.shape[1])

    def prefault(self) -> None:
        """Back every page with memory now, one write per page: a first write to a page
        costs a fault (in a virtual machine also the host's), which on the transfer path
        made a pull into fresh 1 MiB slots cost ~4 ms a block instead of ~0.5 ms
        (docs/architecture.md, "KV tiers and the data plane")."""
        flat = self.slots.reshape(-1)
        flat[::mmap.PAGESIZE] = 0

    def remove(self) -> None:
        """Free the shared memory (its files)."""
        self.path.unlink(missing_ok=True)
        Path(self.kv_events_endpoint.removeprefix("ipc://")).unlink(missing_ok=True)


def shm_name(kind: str, node: str, epoch: int) -> str:
    """The file name of one of a worker's shared-memory files. The owner's pid in the name
    tells a crashed predecessor's leftovers from a live process's files (two clusters on
    one host may reuse node ids)."""
    return f"cpd-{kind}-{node}-{epoch}-{os.getpid()}"


def remove_stale_files(folder: Path, node: str) -> None:
    """Shared memory is only freed when its file goes: remove what dead incarnations of
    ``node`` left behind, never a live process's."""
    for kind in ("arena", "kvevents"):
        for path in folder.glob(f"cpd-{kind}-{node}-*-*"):
            pid = path.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not _alive(int(pid)):
                path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
