"""The map from a vLLM engine's GPU blocks to CPD chain blocks.

The engine reports its blocks by its own hashes and block size; CPD names a block by its
chain hash over a namespace's (larger or equal) block size. Each engine block is recorded
with where it sits in the CPD chain (:class:`~services.kvindex.records.EngineBlock`), so a
later event that continues the chain, or removes the block, maps without the tokens again.
This module only maps; the index applies the CPD blocks it yields to its locations.
"""

from __future__ import annotations

from typing import Any

from cpd.protocol import wire
from cpd.protocol.hashing import ROOT_PARENT, Namespace, block_hashes
from services.kvindex.records import Changes, EngineBlock, engine_key


def removed_blocks(ev: wire.GpuBlocksRemoved, engine: dict[Any, EngineBlock]
                   ) -> list[tuple[str, bytes]]:
    """Forget the engine blocks ``ev`` removes from ``engine``; returns the (namespace, CPD
    hash) of each that had completed a CPD block, in event order."""
    out: list[tuple[str, bytes]] = []
    for eh in ev.engine_hashes:
        eb = engine.pop(engine_key(eh), None)
        if eb is not None and eb.cpd_hash:
            out.append((eb.ns, eb.cpd_hash))
    return out


def stored_blocks(ev: wire.GpuBlocksStored, spec: Namespace, engine: dict[Any, EngineBlock],
                  ch: Changes) -> list[wire.BlockRef]:
    """Record the engine blocks ``ev`` stores in ``engine``; returns the CPD blocks they
    complete in chain order (parent ``b""`` for a chain's first block).

    An event that cannot be mapped (engine block size not dividing the namespace's, parent
    engine block unknown) counts its blocks in ``ch.unmapped``; one whose tokens do not
    match its blocks is illegal. Either records nothing.
    """
    bs = ev.engine_block_size
    if bs <= 0 or spec.block_size % bs:
        ch.unmapped += len(ev.engine_hashes)
        return []
    step = bs * wire.TOKEN_DTYPE.itemsize
    if len(ev.tokens) != step * len(ev.engine_hashes):
        ch.illegal.append(f"{ev.node}: gpu_stored token count does not match its blocks")
        return []
    if ev.parent_engine_hash is None:
        parent, acc = ROOT_PARENT, b""
    else:
        prev = engine.get(engine_key(ev.parent_engine_hash))
        if prev is None:
            ch.unmapped += len(ev.engine_hashes)  # its chain is unknown to us
            return []
        parent = prev.cpd_hash or prev.cpd_parent
        acc = b"" if prev.cpd_hash else prev.tokens
    want = spec.block_size * wire.TOKEN_DTYPE.itemsize
    out: list[wire.BlockRef] = []
    for i, eh in enumerate(ev.engine_hashes):
        acc += ev.tokens[i * step:(i + 1) * step]
        done = b""
        if len(acc) == want:
            done = block_hashes(spec, acc, parent=parent)
            out.append(wire.BlockRef(done, b"" if parent == ROOT_PARENT else parent,
                                     spec.block_size))
        engine[engine_key(eh)] = EngineBlock(spec.id, parent, b"" if done else acc, done)
        if done:
            parent, acc = done, b""
    return out
