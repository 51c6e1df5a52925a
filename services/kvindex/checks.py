"""What kvindex refuses before it reads a message: queries it cannot answer, events a
node may not publish."""

from __future__ import annotations

from cpd.protocol import subjects, wire
from cpd.protocol.errors import ForgedSender, InvalidRequest
from services.kvindex.index import valid_namespace


def check_query(namespace: str, block_hashes: bytes, max_blocks: int) -> None:
    """Refuse, typed, a query's malformed namespace or hash array, or more than
    ``max_blocks`` blocks."""
    if not valid_namespace(namespace):
        raise InvalidRequest(f"namespace {namespace!r} is not a 32-hex-digit id")
    n, rest = divmod(len(block_hashes), wire.HASH_BYTES)
    if rest:
        raise InvalidRequest(f"block_hashes is {len(block_hashes)} bytes, "
                             f"not a multiple of {wire.HASH_BYTES}")
    if n > max_blocks:
        raise InvalidRequest(f"{n} blocks in one lookup; the limit is {max_blocks}")


def check_event_sender(subject: str, ev: wire.KvEvent) -> None:
    """A node publishes only its own blocks' events; kvindex's pseudo node (whose
    subject only kvindex may publish on) only lease expiries, naming the node whose
    lease ran out."""
    if subject == subjects.kv_events(subjects.KVINDEX_EVENTS_NODE):
        if not isinstance(ev, wire.LeaseExpired):
            raise ForgedSender(f"a {type(ev).__name__} came on kvindex's own subject")
        return
    wire.check_sender(subject, ev)
