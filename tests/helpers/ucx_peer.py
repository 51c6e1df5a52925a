"""A worker's data plane in its own process, for tests/test_transfer.py and the benchmark.

It fills a block store with deterministic blocks (contents derived from ``--seed`` and
the block index, so the test can check every byte without being told them), serves them
with a real :class:`cpd.transfer.TransferServer`, prints one JSON line
(``{"address": ..., "pid": ...}``) and runs until its stdin closes.

Misbehaviours real peers have, on request:

* ``--corrupt I,J``: flip a byte of blocks I, J *after* they were sealed (memory corruption);
* ``--forge I,J``: the same, and vouch for the forged bytes: the seals it serves carry
  their checksum (a compromised peer; only what the writer sealed, as kvindex recorded
  it, gives it away);
* ``--stall-after K``: stop sending after K block messages (a coalesced run is one),
  without closing anything (a hung peer: the test then kills or pauses the process);
* ``--legacy``: serve gets as builds before coalescing did (``BlockGet.runs`` ignored);
* ``--foreign``: reply to gets naming another namespace than the blocks'.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import xxhash

from cpd.kvstore import BlockStore, KvStore, checksum
from cpd.ops import telemetry
from cpd.ops.config import DataPlaneSettings
from cpd.protocol import wire
from cpd.protocol.capability import Keyring
from cpd.transfer import TransferServer, shutdown_ucx

NAMESPACE = "ns-test"


def block_hash(seed: int, index: int) -> bytes:
    """The 16-byte hash of test block ``index`` of ``seed``."""
    return xxhash.xxh3_128_digest(f"{seed}:{index}".encode())


def block_payload(seed: int, index: int, nbytes: int) -> np.ndarray:
    """The bytes of test block ``index`` of ``seed``."""
    return np.random.default_rng([seed, index]).integers(0, 256, nbytes, dtype=np.uint8)


def block_refs(seed: int, count: int, tokens: int = 256) -> list[wire.BlockRef]:
    """A single chain of ``count`` blocks."""
    return [wire.BlockRef(block_hash(seed, i), block_hash(seed, i - 1) if i else b"", tokens)
            for i in range(count)]


def parse_sizes(spec: str) -> list[int]:
    """``"65536x16,4097x3"`` → sixteen 65536s and three 4097s."""
    out: list[int] = []
    for part in spec.split(","):
        size, _, count = part.partition("x")
        out += [int(size)] * int(count or 1)
    return out


class LegacyServer(TransferServer):
    """A server of a build before coalesced gets: it does not know ``BlockGet.runs``."""

    async def _handle_get(self, ep: Any, conn_id: int, req: wire.BlockGet) -> int:
        return await super()._handle_get(ep, conn_id, msgspec.structs.replace(req, runs=[]))


class ForeignServer(TransferServer):
    """Answers a get with the blocks asked for, but says they are of another namespace."""

    async def _send_get(self, ep: Any, xfer_id: int, namespace: str, entries: list[Any],
                        runs: list[tuple[int, int]]) -> None:
        await super()._send_get(ep, xfer_id, "f" * 32, entries, runs)


class StallingServer(TransferServer):
    """Sends ``stall_after`` block messages in total, then never posts another."""

    def __init__(self, *args: Any, stall_after: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stall_after = stall_after
        self.sent = 0

    def _post_block(self, batch: Any, tag: int, view: np.ndarray,
                    then: Callable[[], None] | None = None) -> None:
        self.sent += 1
        if self.sent <= self.stall_after:
            super()._post_block(batch, tag, view, then)
        elif self.sent == self.stall_after + 1:
            # Never posted: the client waits for it until the test kills or pauses us.
            print(json.dumps({"stalled": True}), flush=True)


async def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sizes", default="65536x4", help="block sizes, e.g. 65536x16,4097x3")
    p.add_argument("--slot-bytes", type=int, default=0, help="default: the largest size")
    p.add_argument("--slots", type=int, default=0, help="default: one per block")
    p.add_argument("--corrupt", default="", help="indices of blocks to corrupt after sealing")
    p.add_argument("--forge", default="",
                   help="indices of blocks to corrupt and re-checksum after sealing")
    p.add_argument("--stall-after", type=int, default=-1)
    p.add_argument("--legacy", action="store_true", help="ignore coalesced layouts")
    p.add_argument("--foreign", action="store_true", help="reply with another namespace")
    p.add_argument("--coalesce-message-bytes", type=int, default=-1,
                   help="dataplane.coalesce_message_bytes (default: the setting's)")
    p.add_argument("--secret", default="",
                   help="hex: enforce capabilities (cpd.protocol.capability) of a keyring "
                        "with this secret, node 'peer', epoch 1")
    args = p.parse_args(argv)
    telemetry.setup("ucx-peer")  # logs to stderr; stdout carries only our JSON lines

    sizes = parse_sizes(args.sizes)
    slot_bytes = args.slot_bytes or max(sizes)
    store = BlockStore(slot_bytes, args.slots or len(sizes), node="peer")
    kv = KvStore(store, None)  # no kvindex here: lifecycle events are dropped
    refs = block_refs(args.seed, len(sizes))
    await kv.write_blocks(NAMESPACE, refs,
                          [block_payload(args.seed, i, n) for i, n in enumerate(sizes)])
    for i in filter(None, args.corrupt.split(",")):
        store.data(refs[int(i)].hash)[0] ^= 0xFF
    for i in filter(None, args.forge.split(",")):
        h = refs[int(i)].hash
        store.data(h)[0] ^= 0xFF
        entry = store.get(h)
        assert entry is not None
        entry.checksum = checksum(store.data(h)[:entry.nbytes])

    settings = DataPlaneSettings(max_blocks_per_transfer=max(1024, len(sizes)))
    if args.coalesce_message_bytes >= 0:
        settings = msgspec.structs.replace(
            settings, coalesce_message_bytes=args.coalesce_message_bytes)
    keyring = Keyring("peer", 1, bytes.fromhex(args.secret)) if args.secret else None
    if args.stall_after >= 0:
        server: TransferServer = StallingServer(kv, settings, stall_after=args.stall_after,
                                                keyring=keyring)
    elif args.legacy:
        server = LegacyServer(kv, settings, keyring=keyring)
    elif args.foreign:
        server = ForeignServer(kv, settings, keyring=keyring)
    else:
        server = TransferServer(kv, settings, keyring=keyring)
    await server.start()
    print(json.dumps({"address": server.address.decode(), "pid": os.getpid()}), flush=True)
    # Run until the parent closes our stdin (or kills us).
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.close()
    shutdown_ucx()


if __name__ == "__main__":
    asyncio.run(main())
