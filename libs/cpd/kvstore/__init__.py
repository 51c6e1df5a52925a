"""The KV store layer: a worker's host-DRAM block arena and the lifecycle events it
publishes into ``CPD_KV``."""

from .arena import BlockEntry, BlockStore, Lease, as_byte_array, checksum, kv_block_bytes
from .events import KvEventPublisher
from .store import KvStore

__all__ = ["BlockEntry", "BlockStore", "KvEventPublisher", "KvStore", "Lease", "as_byte_array",
           "checksum", "kv_block_bytes"]
