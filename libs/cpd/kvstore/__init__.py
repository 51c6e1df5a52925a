"""The KV store layer: a worker's host-DRAM block arena, the disk tier below it, and the
lifecycle events both publish into ``CPD_KV``."""

from .arena import (
    BlockEntry,
    BlockStore,
    Lease,
    as_byte_array,
    checksum,
    evicts_copies_first,
    kv_block_bytes,
)
from .copiesgate import CopiesFirstGate, LostBlocks
from .disk import DiskTier
from .events import KvEventPublisher
from .store import KvStore

__all__ = ["BlockEntry", "BlockStore", "CopiesFirstGate", "DiskTier", "KvEventPublisher",
           "KvStore", "Lease", "LostBlocks", "as_byte_array", "checksum", "evicts_copies_first",
           "kv_block_bytes"]
