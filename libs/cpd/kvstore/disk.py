"""A worker's local disk tier: sealed blocks written behind to files, read back into the
arena when a reader asks for them, and found again after a restart.

Each block is one file, ``<folder>/<hash[:2]>/<hash>.kvb``: a fixed prefix (magic, format
version, header length), a msgpack header (namespace, hash, parent, tokens, bytes,
checksum) and the block's bytes. A file is written under a temporary name and renamed
into place, so no reader ever opens a half-written one; a file cut short or altered
afterwards (a crash before the page cache reached the device, a torn sector, a hand)
fails its size or checksum when read and is dropped, never served.

The bookkeeping — capacity, the lifecycle events of tier ``DISK`` kvindex indexes, pins
while a file is read, prefix-closed eviction in ``dataplane.eviction``'s order — is a
:class:`~cpd.kvstore.arena.BlockStore` without bytes whose slots count the tier's
capacity in blocks. The file methods block (run them in a thread); the rest is pure.
"""

from __future__ import annotations

import os
import struct
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import msgspec
import numpy as np

from cpd.protocol import wire
from cpd.protocol.errors import ArenaFull
from cpd.protocol.lifecycle import BlockState

from .arena import BlockEntry, BlockStore, checksum

_MAGIC = b"CPDKVB"
_VERSION = 1
_PREFIX = struct.Struct("<6sHI")  # magic, format version, header length
_SUFFIX = ".kvb"
_TMP = ".tmp"
_MAX_HEADER = 1 << 16
_REGISTER_BATCH = 256
_READ_EWMA = 0.2  # weight of the latest batch in the measured read rate


class _Header(msgspec.Struct, array_like=True):
    namespace: str
    hash: bytes
    parent: bytes
    num_tokens: int
    nbytes: int
    checksum: int


@dataclass(frozen=True, slots=True)
class DiskBlock:
    """A block file found by :meth:`DiskTier.scan`."""

    namespace: str
    ref: wire.BlockRef
    nbytes: int
    checksum: int


class DiskTier:
    """Sealed blocks of one worker as files under ``folder``, at most ``capacity_bytes``.

    ``slot_bytes`` is the arena's slot (a block file holds at most that many bytes);
    ``capability`` and ``eviction`` as for :class:`~cpd.kvstore.arena.BlockStore`;
    ``fsync`` flushes each file to the device before it is named (durable across a power
    loss; without it a crash of the machine may lose recent blocks, never serve them torn).
    """

    def __init__(self, folder: str | os.PathLike[str], capacity_bytes: int, slot_bytes: int,
                 *, node: str, capability: Callable[[str], bytes] | None = None,
                 eviction: str = "lru", fsync: bool = False) -> None:
        if capacity_bytes < slot_bytes:
            raise ValueError(f"a disk tier of {capacity_bytes} bytes holds no block of "
                             f"{slot_bytes}")
        self.folder = Path(folder)
        self.fsync = fsync
        self.index = BlockStore(slot_bytes, capacity_bytes // slot_bytes, node=node,
                                tier=wire.Tier.DISK, capability=capability,
                                eviction=eviction, backed=False, on_removed=self._unlink)
        self.written = 0       # blocks written to files
        self.read = 0          # blocks read back intact
        self.dropped = 0       # files found torn, altered or unreadable
        self.read_gbps = 0.0   # measured read rate (EWMA of :meth:`measured` batches)

    def path(self, block_hash: bytes) -> Path:
        """The file of ``block_hash``."""
        name = block_hash.hex()
        return self.folder / name[:2] / f"{name}{_SUFFIX}"

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.index

    def sealed(self, block_hash: bytes) -> BlockEntry | None:
        """The entry of ``block_hash`` if its file is complete (sealed), else ``None``."""
        entry = self.index.get(block_hash)
        return entry if entry is not None and entry.state is BlockState.SEALED else None

    @property
    def used_bytes(self) -> int:
        return self.index.used_bytes

    @property
    def total_bytes(self) -> int:
        return self.index.total_bytes

    # ------------------------------------------------------------- files (blocking)

    def write(self, namespace: str, ref: wire.BlockRef, data: np.ndarray, digest: int) -> bool:
        """Write one block's file (``data``: its sealed bytes, ``digest`` their checksum)
        under a temporary name, then name it; ``False`` if the write failed."""
        path = self.path(ref.hash)
        tmp = path.with_name(path.name + _TMP)
        header = msgspec.msgpack.encode(_Header(namespace, ref.hash, ref.parent,
                                                ref.num_tokens, data.nbytes, digest))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(_PREFIX.pack(_MAGIC, _VERSION, len(header)))
                f.write(header)
                f.write(memoryview(data))
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            return False
        self.written += 1
        return True

    def read_into(self, entry: BlockEntry, dest: np.ndarray) -> bool:
        """Read ``entry``'s bytes into ``dest`` (a slot); ``False`` unless the file holds
        exactly that block, whole, with the checksum it was sealed with."""
        try:
            with open(self.path(entry.hash), "rb") as f:
                header = _read_header(f)
                if header is None or (header.hash, header.namespace, header.nbytes) != (
                        entry.hash, entry.namespace, entry.nbytes):
                    return False
                view = dest[:entry.nbytes]
                if f.readinto(memoryview(view)) != entry.nbytes or f.read(1):
                    return False
        except OSError:
            return False
        if checksum(view) != entry.checksum:
            return False
        self.read += 1
        return True

    def measured(self, nbytes: int, seconds: float) -> None:
        """Fold one batch of reads (``nbytes`` in ``seconds``, checks included) into
        :attr:`read_gbps`, which the router prices disk loads with."""
        if nbytes <= 0 or seconds <= 0:
            return
        gbps = nbytes / seconds / 1e9
        self.read_gbps = gbps if not self.read_gbps else \
            self.read_gbps + _READ_EWMA * (gbps - self.read_gbps)

    def scan(self) -> list[DiskBlock]:
        """Every complete-looking block file under the folder; temporary files (a write a
        crash interrupted) and files whose header or size is wrong are removed. Bytes are
        checked when a block is read, not here."""
        found: list[DiskBlock] = []
        if not self.folder.is_dir():
            return found
        for path in self.folder.glob(f"??/*{_SUFFIX}*"):
            block = None if path.name.endswith(_TMP) else _scan_file(path)
            if block is None:
                path.unlink(missing_ok=True)
                self.dropped += not path.name.endswith(_TMP)
                continue
            found.append(block)
        return found

    # ----------------------------------------------------------------- bookkeeping

    def register(self, blocks: Sequence[DiskBlock]) -> int:
        """Hold the files :meth:`scan` found (sealed, as written); what exceeds the
        capacity is evicted in policy order and its files removed. Returns how many are
        held."""
        by_ns: dict[str, list[DiskBlock]] = defaultdict(list)
        for b in blocks:
            by_ns[b.namespace].append(b)
        step = min(_REGISTER_BATCH, self.index.num_slots)
        for ns, group in by_ns.items():
            for i in range(0, len(group), step):
                batch = group[i:i + step]
                try:
                    entries = self.index.allocate(ns, [b.ref for b in batch])
                except ArenaFull:
                    for b in batch:
                        self.path(b.ref.hash).unlink(missing_ok=True)
                    continue
                new = [(e, b) for e, b in zip(entries, batch, strict=True) if e is not None]
                self.index.begin_write([e.hash for e, _ in new])
                self.index.seal([(e.hash, b.nbytes, None, b.checksum) for e, b in new])
        return len(self.index)

    def drop(self, hashes: Iterable[bytes]) -> list[bytes]:
        """Forget blocks whose files turned out bad (their files go too)."""
        dropped = self.index.discard(hashes)
        self.dropped += len(dropped)
        return dropped

    def _unlink(self, entries: Iterable[BlockEntry]) -> None:
        # Called synchronously as the index lets blocks go, so a later write of the same
        # hash can never lose its file to a removal that was still queued.
        for entry in entries:
            self.path(entry.hash).unlink(missing_ok=True)


def _read_header(f: BinaryIO) -> _Header | None:
    prefix = f.read(_PREFIX.size)
    if len(prefix) != _PREFIX.size:
        return None
    magic, version, size = _PREFIX.unpack(prefix)
    if magic != _MAGIC or version != _VERSION or not 0 < size <= _MAX_HEADER:
        return None
    raw = f.read(size)
    try:
        header = msgspec.msgpack.decode(raw, type=_Header)
    except msgspec.DecodeError:
        return None
    if len(header.hash) != wire.HASH_BYTES or header.nbytes < 0:
        return None
    return header


def _scan_file(path: Path) -> DiskBlock | None:
    try:
        with open(path, "rb") as f:
            header = _read_header(f)
            if header is None or path.name != f"{header.hash.hex()}{_SUFFIX}":
                return None
            end = f.tell() + header.nbytes
            if os.fstat(f.fileno()).st_size != end:
                return None
    except OSError:
        return None
    return DiskBlock(header.namespace, wire.BlockRef(header.hash, header.parent,
                                                     header.num_tokens),
                     header.nbytes, header.checksum)
