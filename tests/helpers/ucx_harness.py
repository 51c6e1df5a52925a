"""Shared harness of the UCX tests: peer processes (tests/helpers/ucx_peer.py) and clients."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from cpd.kvstore import BlockStore, KvStore
from cpd.ops.config import DataPlaneSettings
from cpd.transfer import TransferClient
from tests.helpers.ucx_peer import block_hash, block_payload, parse_sizes

PEER = Path(__file__).with_name("ucx_peer.py")
MIXED = "1x1,4097x3,65536x8,1048576x6,8388608x2"  # 20 blocks, 1 B .. 8 MiB


# Tests that run UCX use the thread timeout method: a wait stuck inside UCX's C code never
# returns to Python, so the default SIGALRM method could not end it.


class Peer:
    """One ucx_peer.py process."""

    def __init__(self, *args: str, seed: int, sizes: str) -> None:
        self.seed = seed
        self.sizes = parse_sizes(sizes)
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), "--seed", str(seed), "--sizes", sizes, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited with {self.proc.wait()}")
        self.address = json.loads(line)["address"].encode()

    def hashes(self, idx: list[int] | range) -> list[bytes]:
        return [block_hash(self.seed, i) for i in idx]

    def expected(self, i: int) -> np.ndarray:
        return block_payload(self.seed, i, self.sizes[i])

    async def next_line(self) -> dict:
        assert self.proc.stdout is not None
        line = await asyncio.get_running_loop().run_in_executor(None, self.proc.stdout.readline)
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait(5)


@contextlib.contextmanager
def peer(*args: str, seed: int, sizes: str) -> Iterator[Peer]:
    p = Peer(*args, seed=seed, sizes=sizes)
    try:
        yield p
    finally:
        p.stop()


async def new_client() -> TransferClient:
    """A client with a small concurrency cap (the tests check the cap holds)."""
    return TransferClient(DataPlaneSettings(max_concurrent_transfers=4))


def local_store(slots: int, slot_bytes: int = 8 << 20) -> KvStore:
    return KvStore(BlockStore(slot_bytes, slots, node="me"), None)
