"""``cpd bench transfer``: KV block transfer bandwidth between two worker processes.

For each case (blocks per batch × block size) the same bytes move from a peer process's
arena into this process, measured in the same run four ways:

* ``cpd``: :meth:`cpd.transfer.TransferClient.pull` into a local block store — header
  exchange, zero-copy receive into arena slots, xxh3-64 check of every block, seal;
* ``raw_ucx``: plain ``ucxx`` tagged send/recv of the same buffers, same UCX settings
  and progress driver, no header or checks (the transport ceiling);
* ``nats``: the same bytes through an embedded NATS server in ≤ 900 KiB messages, copied
  into the destination (what the data plane avoids: docs/architecture.md, "Subjects");
* ``memcpy``: one thread copying the same bytes (the physical ceiling of this host).

The peer is this module run as ``python -m tools.bench.transfer --peer``; with a peer
prefix (``ssh HOST``, ``ip netns exec NS``) it runs on another host, where it advertises
``dataplane.advertise_interface``'s address, and the bytes cross the network between the
two (``dataplane.ucx_tls=tcp`` keeps UCX off shared memory where both see one
``/dev/shm``); ``nats_host`` is then an address the peer reaches.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from cpd.kvstore import BlockStore, KvStore
from cpd.ops import telemetry
from cpd.ops.config import DataPlaneSettings, load_settings
from cpd.ops.natsserver import NatsServer
from cpd.protocol import wire
from cpd.transfer import (
    TransferClient,
    TransferServer,
    active_transports,
    decode_address,
    init_ucx,
    shutdown_ucx,
    ucx_options,
)
from cpd.transfer.runtime import progress_while_busy
from tools.bench.registry import SettingsFactory

KIB, MIB = 1 << 10, 1 << 20
BATCHES = (1, 16, 256)
SIZES_FULL = (64 * KIB, 256 * KIB, 1 * MIB, 8 * MIB)
SIZES_QUICK = (64 * KIB, 1 * MIB, 8 * MIB)
CAP_FULL = 512 * MIB  # bytes per case: 256 × 8 MiB would be 2 GiB
CAP_QUICK = 64 * MIB
REPS_FULL, REPS_QUICK = 5, 3
# Each way is also repeated until it has measured this long: a small case takes well
# under a millisecond, and its first few repetitions after the warm-up still run cold.
MIN_SECONDS_FULL, MIN_SECONDS_QUICK = 0.3, 0.1
HEADLINE = (16, 1 * MIB)  # 16 blocks of the tiny model = a 4K-token prefix
NATS_CHUNK = 900 * KIB  # the bus limit, headers included (docs/architecture.md, "Subjects")
NATS_WINDOW = 16  # chunks requested at a time (flow control under the slow-consumer limit)
NATS_SUBJECT = "bench.transfer.nats"  # bench-only subject, not part of the CPD protocol
_RAW_HDR = struct.Struct("<QQ")  # blocks, bytes per block
_RAW_CTRL_TAG = 1
_NATS_REQ = struct.Struct("<QQQ")  # first chunk, chunks, bytes in the case
NAMESPACE = "bench"


def _settings(max_blocks: int) -> DataPlaneSettings:
    # The data plane as configured (CPD_DATAPLANE__* reaches the peer process too).
    dp = load_settings().dataplane
    return msgspec.structs.replace(dp, max_blocks_per_transfer=max(max_blocks,
                                                                   dp.max_blocks_per_transfer))


def _hash(size: int, i: int) -> bytes:
    return size.to_bytes(8, "big") + i.to_bytes(8, "big")


def _refs(size: int, count: int) -> list[wire.BlockRef]:
    return [wire.BlockRef(_hash(size, i), _hash(size, i - 1) if i else b"", 256)
            for i in range(count)]


# ----------------------------------------------------------------------------- the peer


async def _peer(block_bytes: int, blocks: int, nats_url: str) -> None:
    """Serve ``blocks`` random blocks three ways (CPD, raw ucxx, NATS) until stdin closes."""
    import ucxx

    from cpd.bus import connect
    from cpd.ops.config import NatsSettings

    telemetry.setup("bench-peer")
    settings = _settings(max(blocks, 1024))
    kv = KvStore(BlockStore(block_bytes, blocks, node="bench-peer"), None)
    rng = np.random.default_rng(block_bytes)
    await kv.write_blocks(NAMESPACE, _refs(block_bytes, blocks),
                          [rng.integers(0, 256, block_bytes, np.uint8) for _ in range(blocks)])
    server = await TransferServer(kv, settings).start()
    arena = kv.store.arena

    async def raw(ep: Any) -> None:
        hdr = bytearray(_RAW_HDR.size)
        try:
            while True:
                await ep.recv(hdr, tag=_RAW_CTRL_TAG)
                count, size = _RAW_HDR.unpack(hdr)
                async with progress_while_busy():
                    await asyncio.gather(*(ep.send(arena[i, :size], tag=2 + i)
                                           for i in range(count)))
        except Exception:  # the client went away: the connection is done
            return

    raw_listener = ucxx.create_listener(raw, port=0)
    nc = await connect(NatsSettings(servers=[nats_url]), "bench-transfer-peer")
    flat = arena.reshape(-1)

    async def on_nats(msg: Any) -> None:
        first, count, limit = _NATS_REQ.unpack(msg.data)
        for c in range(first, first + count):
            end = min((c + 1) * NATS_CHUNK, limit)
            await nc.publish(msg.reply, flat[c * NATS_CHUNK:end].tobytes())

    await nc.subscribe(NATS_SUBJECT, cb=on_nats)
    await nc.flush()
    print(json.dumps({"address": server.address.decode(), "raw_port": raw_listener.port}),
          flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await nc.close()
    await server.close()
    raw_listener.close()
    shutdown_ucx()


class _PeerProc:
    def __init__(self, block_bytes: int, blocks: int, nats_url: str,
                 prefix: Sequence[str] = ()) -> None:
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "tools.bench.transfer", "--peer", "--block-bytes",
             str(block_bytes), "--blocks", str(blocks), "--nats", nats_url],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            cwd=Path(__file__).resolve().parent.parent)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench peer exited with {self.proc.wait()}")
        info = json.loads(line)
        self.address = info["address"].encode()
        self.raw_port = int(info["raw_port"])

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------------------ the client


def _median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


async def _measure(fns: Sequence[Any], reps: int, min_seconds: float) -> list[list[float]]:
    """Seconds per repetition of each of ``fns``, taken in turns (one of each per round),
    so that a noisy moment of a shared host hits every way alike."""
    for fn in fns:
        await fn()  # warm-up: connections, page faults, caches
    out: list[list[float]] = [[] for _ in fns]
    while any(len(o) < reps or sum(o) < min_seconds for o in out):
        for fn, o in zip(fns, out, strict=True):
            t0 = time.perf_counter()
            await fn()
            o.append(time.perf_counter() - t0)
    return out


async def _case(peer: _PeerProc, client: TransferClient, nc: Any, size: int, count: int,
                reps: int, min_seconds: float, raw_ep: Any) -> dict[str, Any]:
    nbytes = size * count
    hashes = [_hash(size, i) for i in range(count)]
    local = KvStore(BlockStore(size, count, node="bench-client"), None)
    dests = np.empty((count, size), np.uint8)
    dests.fill(0)  # fault the pages in once, like a long-lived arena

    async def cpd_pull() -> None:
        local.store.evict(count)  # start each rep with the blocks absent
        seals = await client.pull(peer.address, hashes, local)
        assert len(seals) == count

    async def raw() -> None:
        async with progress_while_busy():
            recvs = [asyncio.ensure_future(raw_ep.recv(dests[i], tag=2 + i))
                     for i in range(count)]
            await raw_ep.send(_RAW_HDR.pack(count, size), tag=_RAW_CTRL_TAG)
            await asyncio.gather(*recvs)

    flat = dests.reshape(-1)
    chunks = -(-nbytes // NATS_CHUNK)

    async def via_nats() -> None:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        try:
            done = 0
            while done < chunks:
                window = min(NATS_WINDOW, chunks - done)
                await nc.publish(NATS_SUBJECT, _NATS_REQ.pack(done, window, nbytes),
                                 reply=inbox)
                for c in range(done, done + window):
                    msg = await sub.next_msg(timeout=30)
                    part = np.frombuffer(msg.data, np.uint8)
                    flat[c * NATS_CHUNK:c * NATS_CHUNK + part.nbytes] = part
                done += window
        finally:
            await sub.unsubscribe()

    src = np.random.default_rng(1).integers(0, 256, nbytes, np.uint8)

    async def memcpy() -> None:
        np.copyto(flat, src)

    def same_bytes(how: str) -> None:
        for i in (0, count - 1):
            if not np.array_equal(local.store.data(hashes[i]), dests[i]):
                raise AssertionError(f"CPD and {how} moved different bytes")

    cpd_s, raw_s = await _measure([cpd_pull, raw], reps, min_seconds)
    same_bytes("raw UCX")
    dests.fill(0)
    (nats_s,) = await _measure([via_nats], reps, min_seconds)
    same_bytes("NATS")
    (mem_s,) = await _measure([memcpy], reps, min_seconds)
    gbps, raw_gbps = _median_gbps(nbytes, cpd_s), _median_gbps(nbytes, raw_s)
    nats_gbps = _median_gbps(nbytes, nats_s)
    return {
        "blocks": count, "block_bytes": size, "total_bytes": nbytes,
        "gbps": _sig(gbps), "raw_ucx_gbps": _sig(raw_gbps),
        "nats_gbps": _sig(nats_gbps), "memcpy_gbps": _sig(_median_gbps(nbytes, mem_s)),
        "vs_raw_ucx": _sig(gbps / raw_gbps), "vs_nats": _sig(gbps / nats_gbps),
        "cpd_ms": round(statistics.median(cpd_s) * 1e3, 3),
    }


def _sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits: a slow case (a loaded host, a link of a
    few MB/s) keeps its precision, which fixed decimals would round away."""
    return float(f"{x:.{digits}g}")


async def _run(quick: bool, peer_prefix: Sequence[str], nats_host: str) -> dict[str, Any]:
    import ucxx

    from cpd.bus import connect
    from cpd.ops.config import NatsSettings

    telemetry.setup("bench", None)
    sizes = SIZES_QUICK if quick else SIZES_FULL
    cap = CAP_QUICK if quick else CAP_FULL
    reps = REPS_QUICK if quick else REPS_FULL
    min_seconds = MIN_SECONDS_QUICK if quick else MIN_SECONDS_FULL
    settings = _settings(max(BATCHES))
    init_ucx(settings)
    cases: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cpd-bench-transfer-") as tmp, \
            NatsServer(host=nats_host, store_dir=Path(tmp) / "nats", jetstream=False) as server:
        nc = await connect(NatsSettings(servers=[server.url]), "bench-transfer",
                           pending_size=256 * MIB)
        client = TransferClient(settings)
        try:
            for size in sizes:
                counts = sorted({max(1, min(b, cap // size)) for b in BATCHES})
                peer = _PeerProc(size, max(counts), server.url, peer_prefix)
                try:
                    host, _ = decode_address(peer.address)
                    raw_ep = await ucxx.create_endpoint(host, peer.raw_port)
                    for count in counts:
                        cases.append(await _case(peer, client, nc, size, count, reps,
                                                   min_seconds, raw_ep))
                        print(json.dumps(cases[-1]), file=sys.stderr, flush=True)
                    await raw_ep.close()
                finally:
                    await client.close()
                    peer.stop()
        finally:
            await nc.close()
            shutdown_ucx()
    head = next(c for c in cases if (c["blocks"], c["block_bytes"]) == HEADLINE)
    return {
        "benchmark": "transfer",
        "quick": quick,
        "headline_case": {"blocks": HEADLINE[0], "block_bytes": HEADLINE[1]},
        **{k: head[k] for k in ("gbps", "raw_ucx_gbps", "nats_gbps", "memcpy_gbps",
                                "vs_raw_ucx", "vs_nats")},
        "min_vs_raw_ucx_at_1mib_plus": min(c["vs_raw_ucx"] for c in cases
                                           if c["block_bytes"] >= MIB),
        "cases": cases,
        "ucx": {"options": ucx_options(settings), "progress_mode": settings.ucx_progress_mode,
                "active_transports": sorted(active_transports()),
                "version": ".".join(map(str, ucxx.get_ucx_version()))},
        "reps": reps, "min_seconds_per_way": min_seconds, "cap_bytes_per_case": cap,
        "nats_chunk_bytes": NATS_CHUNK,
        "peer_host": host,
        "seconds": round(time.perf_counter() - t_start, 1),
        "host_cpus": os.cpu_count(),
    }


def run(quick: bool = False, *, peer_prefix: Sequence[str] = (),
        nats_host: str = "127.0.0.1") -> dict[str, Any]:
    """Run the benchmark; returns the JSON-able result. ``peer_prefix`` runs the serving
    peer under a command that execs it elsewhere (``ssh HOST``, ``ip netns exec NS``)."""
    return asyncio.run(_run(quick, tuple(peer_prefix), nats_host))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.transfer")
    p.add_argument("--peer", action="store_true", help="run as the serving peer")
    p.add_argument("--block-bytes", type=int, default=MIB)
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--nats", default="")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.peer:
        asyncio.run(_peer(args.block_bytes, args.blocks, args.nats))
    else:
        print(json.dumps(run(args.quick), indent=2))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``cpd bench transfer``'s flags."""
    parser.add_argument("--quick", action="store_true",
                        help="64 KiB, 1 MiB and 8 MiB blocks (tests, CI)")
    parser.add_argument("--peer-prefix",
                        help="command that runs the serving peer on another host, "
                             "e.g. 'ssh gpu2' or 'ip netns exec h2' (default: this host)")
    parser.add_argument("--nats-host", default="127.0.0.1",
                        help="address of the bench's NATS server (one the peer reaches)")


def run_args(args: argparse.Namespace, settings: SettingsFactory) -> dict:
    """Run from ``cpd bench transfer``'s flags; the peer prefix is split as a shell
    would split it."""
    return run(quick=args.quick, peer_prefix=shlex.split(args.peer_prefix or ""),
               nats_host=args.nats_host)


if __name__ == "__main__":
    main()
