"""Hostile-input corpus for every message family CPD decodes (docs/security.md, "Hostile input").

Pure and deterministic: :func:`cases` gives the same bytes for the same family, count,
seed and :class:`FuzzContext`. Each case mixes one of:

* ``random``: random bytes (mostly short, some long);
* ``bytes``: truncations, bit flips, insertions, deletions and trailing garbage of a
  valid encoding;
* ``struct``: valid msgpack with the wrong or unknown schema version ``v``, a wrong or
  unknown ``kind``, a missing field, a type-confused field, extra fields, deep nesting,
  a top level that is not a map;
* ``hostile``: the right structure with hostile values (token ids past the vocabulary,
  prompts past the model limit, NaN/negative sampling, unknown namespaces, hashes of the
  wrong length, huge block lists, unknown node ids, deadlines in the past, non-UTF-8
  strings...);
* ``oversized``: over the NATS max payload (the client must refuse it) or just under it;
* ``valid``: an untouched template (the service's happy path must still be taken).

The messages are packed by a small msgpack writer of its own, so that a case can hold
what ``msgspec`` refuses to write: strings that are not UTF-8, out-of-range integers
next to NaN floats, duplicate keys.

Templates never name the cluster's real nodes (``FuzzContext.fake_nodes`` only): a
spoofed heartbeat or ``NodeCleared`` for a real node is a legitimate message whose
effect (forgetting the node) is not a robustness failure.
"""

from __future__ import annotations

import math
import random
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cpd.protocol import wire
from cpd.protocol.roles import WORKER_ROLES

__all__ = ["FAMILIES", "Case", "FuzzContext", "RawStr", "cases", "pack"]


# ------------------------------------------------------------------ msgpack writer


class RawStr(bytes):
    """Bytes written as a msgpack *str* (so they can be invalid UTF-8)."""


def pack(obj: Any) -> bytes:
    """msgpack of ``obj`` (None, bool, int, float, str, RawStr, bytes, list, tuple, dict;
    a dict given as a list of pairs keeps duplicate keys)."""
    out = bytearray()
    _pack(obj, out)
    return bytes(out)


class Raw(bytes):
    """Already-encoded msgpack, spliced in verbatim (e.g. nesting too deep to build)."""


class Pairs(list):
    """A map as a list of (key, value) pairs: duplicate keys survive."""


def _pack(o: Any, out: bytearray) -> None:
    if isinstance(o, Raw):
        out += o
    elif o is None:
        out.append(0xC0)
    elif o is True:
        out.append(0xC3)
    elif o is False:
        out.append(0xC2)
    elif isinstance(o, int):
        _pack_int(o, out)
    elif isinstance(o, float):
        out.append(0xCB)
        out += struct.pack(">d", o)
    elif isinstance(o, RawStr):
        _pack_len(len(o), out, fix=(0xA0, 31), codes=(0xD9, 0xDA, 0xDB))
        out += o
    elif isinstance(o, str):
        b = o.encode("utf-8", "surrogatepass")
        _pack_len(len(b), out, fix=(0xA0, 31), codes=(0xD9, 0xDA, 0xDB))
        out += b
    elif isinstance(o, bytes | bytearray | memoryview):
        b = bytes(o)
        _pack_len(len(b), out, fix=None, codes=(0xC4, 0xC5, 0xC6))
        out += b
    elif isinstance(o, Pairs):
        _pack_len(len(o), out, fix=(0x80, 15), codes=(None, 0xDE, 0xDF))
        for k, v in o:
            _pack(k, out)
            _pack(v, out)
    elif isinstance(o, dict):
        _pack(Pairs(o.items()), out)
    elif isinstance(o, list | tuple):
        _pack_len(len(o), out, fix=(0x90, 15), codes=(None, 0xDC, 0xDD))
        for v in o:
            _pack(v, out)
    else:
        raise TypeError(f"cannot pack {type(o).__name__}")


def _pack_int(i: int, out: bytearray) -> None:
    if 0 <= i <= 0x7F:
        out.append(i)
    elif -32 <= i < 0:
        out += struct.pack(">b", i)
    elif 0 <= i < 1 << 64:
        out.append(0xCF)
        out += struct.pack(">Q", i)
    elif -(1 << 63) <= i < 0:
        out.append(0xD3)
        out += struct.pack(">q", i)
    else:  # out of msgpack's range: a float stands in (what a JSON-minded client sends)
        out.append(0xCB)
        out += struct.pack(">d", float(i))


def _pack_len(n: int, out: bytearray, *, fix: tuple[int, int] | None,
              codes: tuple[int | None, int, int]) -> None:
    if fix is not None and n <= fix[1]:
        out.append(fix[0] | n)
    elif codes[0] is not None and n < 1 << 8:
        out += bytes([codes[0], n])
    elif n < 1 << 16:
        out.append(codes[1])
        out += struct.pack(">H", n)
    else:
        out.append(codes[2])
        out += struct.pack(">I", n)


# ----------------------------------------------------------------------- context


@dataclass(frozen=True)
class FuzzContext:
    """What the corpus knows of the cluster under test (limits, ids to use or avoid)."""

    vocab_size: int = 32_000
    max_model_len: int = 8192
    block_size: int = 16
    namespace: str = "0" * 32
    max_payload: int = 1 << 20
    max_lookup_blocks: int = 8192
    max_blocks_per_transfer: int = 1024
    fake_nodes: tuple[str, ...] = ("fz0", "fz1", "fz2", "fz3")
    reply_prefix: str = "_INBOX.fuzz"
    namespace_spec: bytes = b""


@dataclass(frozen=True)
class Case:
    """One hostile message: its bytes and how it was made."""

    data: bytes
    category: str
    note: str = ""


# --------------------------------------------------------------- hostile values

NAN, INF = math.nan, math.inf
BAD_UTF8 = RawStr(b"\xff\xfe\xc3(")
# Values of the wrong type for any field.
CONFUSED: tuple[Any, ...] = (
    None, True, False, 0, -1, (1 << 64) - 1, -(1 << 63), 1 << 70, 1.5, NAN, INF, -INF,
    "", "s", BAD_UTF8, b"", b"\x00" * 17, [], [1, "a", None], {}, {"a": 1}, [[[]]],
)
SUBJECT_INJECTIONS = ("", " ", "a b", "x\r\nPUB evil 1\r\nx", ">", "*", "a..b", ".a",
                      "a.", "a.>.b", "\x00", "é", "x" * 5000)


def _hostile_ints(lo_ok: int = 0) -> list[Any]:
    return [-1, -(1 << 63), (1 << 64) - 1, 1 << 70, lo_ok - 1, NAN, "1", None]


def _hostile_sampling(ctx: FuzzContext, rng: random.Random) -> dict[str, Any]:
    s: dict[str, Any] = {"max_tokens": rng.choice([1, 2, 4])}
    field_, values = rng.choice([
        ("max_tokens", [0, -1, 1_000_001, 1 << 40, (1 << 64) - 1, NAN, ctx.max_model_len]),
        ("temperature", [NAN, INF, -INF, -1.0, -0.0, 100.0001, 1e308, "hot"]),
        ("top_p", [0.0, NAN, -0.5, 1.0000001, INF, None]),
        ("top_k", [-2, -(1 << 63), (1 << 64) - 1, 1.5]),
        ("seed", [-1, (1 << 64) - 1, 1 << 70, NAN, "7"]),
        ("stop_token_ids", [[-1], [1 << 40], [ctx.vocab_size], list(range(5000)), ["a"], 5]),
        ("ignore_eos", ["yes", 2, None]),
        ("n", [0, -1, wire.MAX_CHOICES + 1, 1 << 40, NAN, "2", None]),
    ])
    s[field_] = rng.choice(values)
    return s


def _tokens(rng: random.Random, ctx: FuzzContext, n: int) -> bytes:
    return wire.pack_tokens([rng.randrange(ctx.vocab_size) for _ in range(n)])


def _hostile_tokens(ctx: FuzzContext, rng: random.Random) -> Any:
    return rng.choice([
        lambda: wire.pack_tokens([ctx.vocab_size]),
        lambda: wire.pack_tokens([0xFFFFFFFF, 1, 2]),
        lambda: wire.pack_tokens([1] * (ctx.max_model_len + 1)),
        lambda: b"\x01\x02\x03",
        lambda: b"",
        lambda: "not bytes",
        lambda: [1, 2, 3],
    ])()


def _hashes(rng: random.Random, n: int) -> bytes:
    return rng.randbytes(wire.HASH_BYTES * n)


def _hostile_hashes(ctx: FuzzContext, rng: random.Random) -> Any:
    return rng.choice([
        lambda: b"\x00" * (wire.HASH_BYTES - 1),
        lambda: b"\x00" * (wire.HASH_BYTES + 1),
        lambda: _hashes(rng, ctx.max_lookup_blocks + 1),
        lambda: b"",
        lambda: [b"\x00" * wire.HASH_BYTES],
        lambda: RawStr(b"\x00" * wire.HASH_BYTES),
    ])()


def _hostile_namespace(ctx: FuzzContext, rng: random.Random) -> Any:
    return rng.choice(["", "0" * 31, "g" * 32, ctx.namespace.upper(), rng.randbytes(16).hex(),
                       BAD_UTF8, "x" * 20_000, "../" * 20, 7])


def _hostile_node(ctx: FuzzContext, rng: random.Random) -> Any:
    return rng.choice(["", "a.b", "*", ">", "x" * 65, "x" * 10_000, BAD_UTF8, "fz\r\nPUB",
                       "fzunknown", 3])


# ---------------------------------------------------------------------- templates
# Each family: a template builder (a valid message as a dict) and hostile substitutions
# (field -> value maker). Templates only ever name fake nodes.

Template = Callable[[FuzzContext, random.Random], dict[str, Any]]
Hostile = dict[str, Callable[[FuzzContext, random.Random], Any]]


def _fake(ctx: FuzzContext, rng: random.Random) -> str:
    return rng.choice(ctx.fake_nodes)


def _generate(ctx: FuzzContext, rng: random.Random) -> dict[str, Any]:
    # A 1 ms deadline: a template that reaches the router's happy path ends fast.
    return {"kind": "generate", "v": 1, "request_id": f"fz-{rng.getrandbits(32):x}",
            "tokens": _tokens(rng, ctx, rng.randint(1, 48)),
            "sampling": {"max_tokens": rng.randint(1, 4)}, "timeout_ms": 1}


_GENERATE_HOSTILE: Hostile = {
    "tokens": _hostile_tokens,
    "prompt": lambda c, r: r.choice(["", "x" * (c.max_model_len * 8), BAD_UTF8, 5]),
    "sampling": _hostile_sampling,
    "model": lambda c, r: r.choice(["no-such-model", BAD_UTF8, "x" * 10_000]),
    "tenant": lambda c, r: r.choice(["", "t" * 10_000, "../..", BAD_UTF8, 1]),
    "cache_salt": lambda c, r: r.choice(["s" * 20_000, BAD_UTF8]),
    "priority": lambda c, r: r.choice(_hostile_ints()),
    "timeout_ms": lambda c, r: r.choice([-1, (1 << 64) - 1, 1 << 70, NAN]),
    "request_id": lambda c, r: r.choice(["", "x" * 20_000, BAD_UTF8, *SUBJECT_INJECTIONS]),
}


def _status(ctx: FuzzContext, rng: random.Random) -> dict[str, Any]:
    return {"kind": "status", "v": 1}


def _lookup(ctx: FuzzContext, rng: random.Random) -> dict[str, Any]:
    ns = ctx.namespace if rng.random() < 0.5 else rng.randbytes(16).hex()
    return {"kind": "lookup", "v": 1, "request_id": f"fz-{rng.getrandbits(32):x}",
            "namespace": ns, "block_hashes": _hashes(rng, rng.randint(0, 32))}


_LOOKUP_HOSTILE: Hostile = {
    "namespace": _hostile_namespace,
    "block_hashes": _hostile_hashes,
    "include_pending": lambda c, r: r.choice(["true", 2, None]),
    "request_id": lambda c, r: r.choice([BAD_UTF8, "x" * 20_000, 5]),
}


def _checksums(ctx: FuzzContext, rng: random.Random) -> dict[str, Any]:
    ns = ctx.namespace if rng.random() < 0.5 else rng.randbytes(16).hex()
    return {"kind": "checksums", "v": 1, "request_id": f"fz-{rng.getrandbits(32):x}",
            "namespace": ns, "node": rng.choice(ctx.fake_nodes),
            "block_hashes": _hashes(rng, rng.randint(0, 32))}


_CHECKSUMS_HOSTILE: Hostile = {
    "namespace": _hostile_namespace,
    "block_hashes": _hostile_hashes,
    "node": _hostile_node,
    "request_id": lambda c, r: r.choice([BAD_UTF8, "x" * 20_000, 5]),
}


def _heartbeat(ctx: FuzzContext, rng: random.Random) -> dict[str, Any]:
    # Worker roles only with a 1 ms lease: a router never routes to a fuzz node.
    role = rng.choice(["router", "kvindex", "prefill", "decode", "preprefill"])
    ttl = 1 if role in WORKER_ROLES else rng.randint(1, 60_000)
    return {"kind": "heartbeat", "v": 1, "node": _fake(ctx, rng), "role": role,
            "started_unix_ms": rng.randint(0, 1 << 41), "lease_ttl_ms": ttl,
            "namespace": ctx.namespace, "namespace_spec": ctx.namespace_spec}


_HEARTBEAT_HOSTILE: Hostile = {
    "node": _hostile_node,
    "role": lambda c, r: r.choice(["bogus", "", "PREFILL", BAD_UTF8, 1]),
    "started_unix_ms": lambda c, r: r.choice(_hostile_ints()),
    "lease_ttl_ms": lambda c, r: r.choice([0, -1, NAN, (1 << 64) - 1, 1 << 70]),
    "ucx_address": lambda c, r: r.choice([r.randbytes(40), b"not-an-address", "str", b""]),
    "capacity_blocks": lambda c, r: r.choice(_hostile_ints()),
    "namespace": _hostile_namespace,
    "namespace_spec": lambda c, r: r.choice([
        r.randbytes(r.randint(1, 64)), pack({"a": 1}), pack([1, 2, 3]), pack(None),
        c.namespace_spec[: len(c.namespace_spec) // 2], c.namespace_spec + b"\x00",
        pack({"block_size": -1, "model": BAD_UTF8}), b"\x91" * 5000 + b"\x00"]),
}


def _load(ctx: FuzzContext, rng: random.Random) -> dict[str, Any]:
    return {"kind": "load", "v": 1, "node": _fake(ctx, rng),
            "role": rng.choice(["prefill", "decode", "preprefill"]),
            "queue_depth": rng.randint(0, 10),
            "prefills": [[rng.randint(0, 5000), rng.randint(0, 100_000), rng.random() * 100]
                         for _ in range(rng.randint(0, 4))]}


_LOAD_HOSTILE: Hostile = {
    "node": _hostile_node,
    "role": lambda c, r: r.choice(["router", "bogus", BAD_UTF8]),
    "queue_depth": lambda c, r: r.choice(_hostile_ints()),
    "queued_new_tokens": lambda c, r: r.choice(_hostile_ints()),
    "prefills": lambda c, r: r.choice([
        None, "x", [[-1, 0, 0.0]], [[1, 2, NAN]], [[1, 2, -INF]], [[1]], [[1, 2, 3.0, 4]],
        [{"new_tokens": 1}], [[0, 0, 0.0]] * (wire.MAX_REPORTED_PREFILLS + 1)]),
    "in_flight": lambda c, r: r.choice(_hostile_ints()),
    "dram_used_bytes": lambda c, r: r.choice(_hostile_ints()),
    "kv_bandwidth_gbps": lambda c, r: r.choice([NAN, -INF, -0.5]),
}


_EVENT_KINDS = ("kv_allocated", "kv_writing", "kv_sealed", "kv_evicted", "kv_failed",
                "kv_cleared", "kv_lease_expired", "gpu_stored", "gpu_removed")


def _kv_event(ctx: FuzzContext, rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(_EVENT_KINDS)
    ns = ctx.namespace if rng.random() < 0.5 else rng.randbytes(16).hex()
    ev: dict[str, Any] = {"kind": kind, "v": 1, "node": _fake(ctx, rng),
                          "seq": rng.randint(0, 50), "namespace": ns,
                          "tier": rng.choice(["gpu", "dram"]),
                          "epoch": rng.randint(0, 1 << 41)}
    n = rng.randint(0, 4)
    hashes = [rng.randbytes(wire.HASH_BYTES) for _ in range(n)]
    if kind == "kv_allocated":
        ev["blocks"] = [[h, hashes[i - 1] if i else b"", ctx.block_size]
                        for i, h in enumerate(hashes)]
    elif kind == "kv_sealed":
        ev["seals"] = [[h, 4096, rng.getrandbits(63)] for h in hashes]
    elif kind in ("kv_writing", "kv_evicted", "kv_failed"):
        ev["hashes"] = hashes
    elif kind == "gpu_stored":
        ev["engine_hashes"] = [rng.getrandbits(63) for _ in range(n)]
        ev["tokens"] = _tokens(rng, ctx, n * ctx.block_size)
        ev["engine_block_size"] = ctx.block_size
    elif kind == "gpu_removed":
        ev["engine_hashes"] = [rng.getrandbits(63) for _ in range(n)]
    return ev


_EVENT_HOSTILE: Hostile = {
    "node": _hostile_node,
    "seq": lambda c, r: r.choice(_hostile_ints()),
    "namespace": _hostile_namespace,
    "tier": lambda c, r: r.choice(["nvme", "", "GPU", None, 1]),
    "epoch": lambda c, r: r.choice(_hostile_ints()),
    "trace": lambda c, r: r.choice(["00-zz-zz-01", BAD_UTF8, "x" * 10_000]),
    "hashes": lambda c, r: r.choice([[b"\x00"], [b"\x00" * 17], [r.randbytes(16)] * 5000,
                                     [None], b"\x00" * 16]),
    "blocks": lambda c, r: r.choice([[[b"\x00" * 16]], [[b"\x00" * 16, b"", -1]],
                                     [[b"\x01" * 16, b"\x02" * 3, 16]], [{"hash": 1}],
                                     [[r.randbytes(16), b"", 16]] * 5000]),
    "seals": lambda c, r: r.choice([[[b"\x00" * 16, -1, 0]], [[b"\x00" * 16, 1, 1 << 70]],
                                    [[b"\x00" * 5, 1, 1]], [[]]]),
    "engine_hashes": lambda c, r: r.choice([[None], [-1], [1 << 70], [[1, 2]], [1.5],
                                            [b"\x00" * 40]]),
    "tokens": lambda c, r: r.choice([b"\x01\x02\x03", wire.pack_tokens([c.vocab_size] * 16),
                                     b"\x00" * 4 * 1000]),
    "engine_block_size": lambda c, r: r.choice([0, -1, 1 << 40, 3]),
    "parent_engine_hash": lambda c, r: r.choice([-1, 1 << 70, "x", [1]]),
}


def _sources(ctx: FuzzContext, rng: random.Random) -> list[dict[str, Any]]:
    return [{"node": _fake(ctx, rng), "tier": "dram", "first_block": 0,
             "num_blocks": rng.randint(0, 2)}]


def _deadline(rng: random.Random) -> int:
    # Mostly long past (refused before any work); sometimes none, so that hostile values
    # elsewhere reach the work itself (kept cheap: a few tokens, fake peers).
    return 0 if rng.random() < 0.2 else 1


def _prefill(ctx: FuzzContext, rng: random.Random) -> dict[str, Any]:
    nblocks = rng.randint(0, 2)
    ntok = nblocks * ctx.block_size + rng.randint(1, ctx.block_size - 1)
    return {"kind": "prefill", "v": 1, "request_id": f"fz-{rng.getrandbits(32):x}",
            "reply_to": f"{ctx.reply_prefix}.{rng.getrandbits(32):x}",
            "tokens": _tokens(rng, ctx, ntok), "sampling": {"max_tokens": rng.randint(1, 3)},
            "namespace": rng.randbytes(16).hex(), "block_hashes": _hashes(rng, nblocks),
            "decode_node": _fake(ctx, rng), "deadline_unix_ms": _deadline(rng),
            "sources": _sources(ctx, rng) if rng.random() < 0.3 else []}


_WORKER_HOSTILE: Hostile = {
    "reply_to": lambda c, r: r.choice(SUBJECT_INJECTIONS),
    "tokens": _hostile_tokens,
    "sampling": _hostile_sampling,
    "namespace": _hostile_namespace,
    "block_hashes": _hostile_hashes,
    "deadline_unix_ms": lambda c, r: r.choice([-1, (1 << 64) - 1, 1 << 70, NAN, "now"]),
    "request_id": lambda c, r: r.choice(["", "x" * 20_000, BAD_UTF8, 1]),
    "trace": lambda c, r: r.choice([BAD_UTF8, "00-00-00-00", 1]),
    "route": lambda c, r: r.choice([{"path": "sideways"}, {"tokens": {"gpu": -1}}, [], "r"]),
}
_PREFILL_HOSTILE: Hostile = {
    **_WORKER_HOSTILE,
    "decode_node": _hostile_node,
    "sources": lambda c, r: r.choice([
        [{"node": "fz0", "tier": "dram", "first_block": 1 << 40, "num_blocks": 1 << 40}],
        [{"node": _hostile_node(c, r), "tier": "dram", "first_block": 0, "num_blocks": 1}],
        [{"node": "fz0", "tier": "tape", "first_block": 0, "num_blocks": 1}],
        [{"node": "fz0", "tier": "dram", "first_block": -1, "num_blocks": 1}],
        [{"node": "fz0", "tier": "dram", "first_block": 0, "num_blocks": 2,
          "checksums": r.choice([b"\x00" * 7, b"\x00" * 8, b"\x00" * 24, "c", 5])}],
        [{}] * 1000, "s"]),
}


def _decode(ctx: FuzzContext, rng: random.Random) -> dict[str, Any]:
    nblocks = rng.randint(0, 2)
    ntok = nblocks * ctx.block_size + rng.randint(1, ctx.block_size - 1)
    return {"kind": "decode", "v": 1, "request_id": f"fz-{rng.getrandbits(32):x}",
            "reply_to": f"{ctx.reply_prefix}.{rng.getrandbits(32):x}",
            "tokens": _tokens(rng, ctx, ntok), "first_token": rng.randrange(ctx.vocab_size),
            "sampling": {"max_tokens": rng.randint(2, 4)},
            "namespace": rng.randbytes(16).hex(), "block_hashes": _hashes(rng, nblocks),
            "source_node": _fake(ctx, rng), "lease_id": f"fz-lease-{rng.getrandbits(16)}",
            "deadline_unix_ms": _deadline(rng)}


_DECODE_HOSTILE: Hostile = {
    **_WORKER_HOSTILE,
    "first_token": lambda c, r: r.choice([-1, c.vocab_size, 1 << 40, (1 << 64) - 1, NAN]),
    "source_node": _hostile_node,
    "lease_id": lambda c, r: r.choice(["", BAD_UTF8, "x" * 20_000]),
    "seq_start": lambda c, r: r.choice(_hostile_ints()),
    "timings": lambda c, r: r.choice([{"ttft_ms": -1.0}, {"ttft_ms": NAN}, 1]),
}


def _reset(ctx: FuzzContext, rng: random.Random) -> dict[str, Any]:
    return {"kind": "reset_cache", "v": 1, "reason": "fuzz"}


_RESET_HOSTILE: Hostile = {"reason": lambda c, r: r.choice([BAD_UTF8, 1, None, "r" * 20_000])}


def _pull_ack(ctx: FuzzContext, rng: random.Random) -> dict[str, Any]:
    return {"kind": "pull_ack", "v": 1, "request_id": f"fz-{rng.getrandbits(32):x}",
            "lease_id": f"fz-lease-{rng.getrandbits(16)}", "ok": rng.random() < 0.5}


_PULL_ACK_HOSTILE: Hostile = {
    "lease_id": lambda c, r: r.choice(["", BAD_UTF8, None, 1, "x" * 20_000]),
    "ok": lambda c, r: r.choice(["no", 2, None]),
}


def _cancel(ctx: FuzzContext, rng: random.Random) -> dict[str, Any]:
    return {"kind": "cancel", "v": 1, "request_id": f"fz-{rng.getrandbits(32):x}"}


_CANCEL_HOSTILE: Hostile = {
    "request_id": lambda c, r: r.choice(["", BAD_UTF8, None, 1, "x" * 20_000]),
}


def _cancel_generate(ctx: FuzzContext, rng: random.Random) -> dict[str, Any]:
    return {"kind": "cancel_generate", "v": 1, "request_id": f"fz-{rng.getrandbits(32):x}",
            "reply_to": f"_INBOX.fz{rng.getrandbits(32):x}"}


_CANCEL_GENERATE_HOSTILE: Hostile = {
    "request_id": lambda c, r: r.choice(["", BAD_UTF8, None, 1, "x" * 20_000]),
    "reply_to": lambda c, r: r.choice(["", "a b", None, 7, "x" * 20_000]),
}


def _supersede_generate(ctx: FuzzContext, rng: random.Random) -> dict[str, Any]:
    return {"kind": "supersede_generate", "v": 1,
            "request_id": f"fz-{rng.getrandbits(32):x}", "tenant": "default",
            "resumed_tokens": rng.randint(0, 64)}


_SUPERSEDE_GENERATE_HOSTILE: Hostile = {
    "request_id": lambda c, r: r.choice(["", BAD_UTF8, None, 1, "x" * 20_000]),
    "tenant": lambda c, r: r.choice(["", BAD_UTF8, None, 3, "x" * 20_000]),
    "resumed_tokens": lambda c, r: r.choice([-1, None, "7", 1 << 70]),
}


def _reannounce(ctx: FuzzContext, rng: random.Random) -> dict[str, Any]:
    return {"kind": "reannounce", "v": 1, "from_seq": rng.randint(0, 100), "reason": "fuzz"}


_REANNOUNCE_HOSTILE: Hostile = {
    "from_seq": lambda c, r: r.choice(_hostile_ints()),
    "reason": lambda c, r: r.choice([BAD_UTF8, 1, "r" * 20_000]),
}


def _copies(ctx: FuzzContext, rng: random.Random) -> dict[str, Any]:
    return {"kind": "kv_copies", "v": 1, "namespace": ctx.namespace,
            "shared": _hashes(rng, rng.randint(0, 4)), "last": _hashes(rng, rng.randint(0, 4))}


_COPIES_HOSTILE: Hostile = {
    "namespace": _hostile_namespace,
    "shared": lambda c, r: r.choice([b"\x00" * 15, b"\x00" * 17, "text", None, 7]),
    "last": lambda c, r: r.choice([b"\x00" * 31, "text", None, [1, 2]]),
}


def _ucx_header(ctx: FuzzContext, rng: random.Random) -> dict[str, Any]:
    n = rng.randint(1, 4)
    if rng.random() < 0.5:
        return {"kind": "blk_get", "v": 1, "xfer_id": rng.getrandbits(20),
                "hashes": _hashes(rng, n), "namespace": ctx.namespace, "timeout_ms": 200}
    hashes = [rng.randbytes(wire.HASH_BYTES) for _ in range(n)]
    return {"kind": "blk_put", "v": 1, "xfer_id": rng.getrandbits(20),
            "namespace": ctx.namespace,
            "blocks": [[h, hashes[i - 1] if i else b"", ctx.block_size]
                       for i, h in enumerate(hashes)],
            "seals": [[h, 4096, rng.getrandbits(63)] for h in hashes], "timeout_ms": 200}


_UCX_HOSTILE: Hostile = {
    "xfer_id": lambda c, r: r.choice(_hostile_ints()),
    "hashes": lambda c, r: r.choice([b"\x00" * 15, b"", _hashes(r, c.max_blocks_per_transfer + 1)]),
    "namespace": _hostile_namespace,
    "timeout_ms": lambda c, r: r.choice([-1, (1 << 64) - 1, NAN]),
    "blocks": _EVENT_HOSTILE["blocks"],
    "seals": _EVENT_HOSTILE["seals"],
    # A get's coalescing layout: counts that do not add up, zero or huge runs.
    "runs": lambda c, r: r.choice([[0], [1, 0, 1], [(1 << 32) - 1], [1] * 3,
                                   [c.max_blocks_per_transfer + 1], [-1]]),
}


def _visible(ctx: FuzzContext, rng: random.Random) -> dict[str, Any]:
    return {"kind": "kv_visible", "v": 1, "namespace": ctx.namespace,
            "node": rng.choice(ctx.fake_nodes), "tier": "dram",
            "block_hashes": _hashes(rng, rng.randint(1, 4))}


def _invalidated(ctx: FuzzContext, rng: random.Random) -> dict[str, Any]:
    return {"kind": "kv_invalidated", "v": 1, "namespace": ctx.namespace,
            "node": rng.choice(ctx.fake_nodes), "tier": "dram",
            "block_hashes": _hashes(rng, rng.randint(0, 4)), "reason": "fuzz"}


_VISIBILITY_HOSTILE: Hostile = {
    "node": _hostile_node,
    "namespace": _hostile_namespace,
    "tier": lambda c, r: r.choice(["tape", 3, None, BAD_UTF8]),
    "block_hashes": lambda c, r: r.choice([b"\x00" * 15, b"\x00" * 17, "text", None]),
}


@dataclass(frozen=True)
class Family:
    """A message family: its wire kind, a valid template and hostile substitutions."""

    kind: type[wire.Message]
    template: Template
    hostile: Hostile = field(default_factory=dict)
    # The field an oversized case blows up (bytes field, or str).
    big_field: str = ""


FAMILIES: dict[str, Family] = {
    "generate": Family(wire.GenerateRequest, _generate, _GENERATE_HOSTILE, "tokens"),
    "status": Family(wire.StatusRequest, _status, {}, "pad"),
    "lookup": Family(wire.LookupRequest, _lookup, _LOOKUP_HOSTILE, "block_hashes"),
    "checksums": Family(wire.ChecksumsRequest, _checksums, _CHECKSUMS_HOSTILE,
                        "block_hashes"),
    "heartbeat": Family(wire.Heartbeat, _heartbeat, _HEARTBEAT_HOSTILE, "ucx_address"),
    "load": Family(wire.LoadReport, _load, _LOAD_HOSTILE, "pad"),
    "kv_event": Family(wire.KvEvent, _kv_event, _EVENT_HOSTILE, "trace"),
    "prefill": Family(wire.PrefillRequest, _prefill, _PREFILL_HOSTILE, "tokens"),
    "decode": Family(wire.DecodeRequest, _decode, _DECODE_HOSTILE, "tokens"),
    "reset": Family(wire.ResetCache, _reset, _RESET_HOSTILE, "reason"),
    "pull_ack": Family(wire.PullAck, _pull_ack, _PULL_ACK_HOSTILE, "lease_id"),
    "reannounce": Family(wire.Reannounce, _reannounce, _REANNOUNCE_HOSTILE, "reason"),
    "copies": Family(wire.BlockCopies, _copies, _COPIES_HOSTILE, "shared"),
    "cancel": Family(wire.Cancel, _cancel, _CANCEL_HOSTILE, "request_id"),
    "cancel_generate": Family(wire.CancelGenerate, _cancel_generate, _CANCEL_GENERATE_HOSTILE,
                              "reply_to"),
    "supersede_generate": Family(wire.SupersedeGenerate, _supersede_generate,
                                 _SUPERSEDE_GENERATE_HOSTILE, "request_id"),
    "visible": Family(wire.BlocksVisible, _visible, _VISIBILITY_HOSTILE, "block_hashes"),
    "invalidated": Family(wire.BlocksInvalidated, _invalidated, _VISIBILITY_HOSTILE,
                          "block_hashes"),
    "ucx_header": Family(wire.Message, _ucx_header, _UCX_HOSTILE, "hashes"),
}


# ---------------------------------------------------------------------- mutators

_KINDS = sorted(wire.KINDS)
# Share of cases per category (the rest are "valid").
_WEIGHTS = (("random", 15), ("bytes", 30), ("struct", 24), ("hostile", 26.8),
            ("oversized", 0.2), ("valid", 4))


def _random_bytes(rng: random.Random) -> bytes:
    n = rng.choice((0, 1, 2, 3, rng.randint(4, 64), rng.randint(64, 512),
                    rng.randint(512, 8192)))
    return rng.randbytes(n)


def _byte_mutation(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    b = bytearray(data)
    op = rng.choice(("truncate", "flip", "flip", "insert", "delete", "append", "splice"))
    if op == "truncate" or not b:
        return bytes(b[: rng.randrange(max(1, len(b)))]), "truncate"
    if op == "flip":
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif op == "insert":
        i = rng.randrange(len(b) + 1)
        b[i:i] = rng.randbytes(rng.randint(1, 8))
    elif op == "delete":
        i = rng.randrange(len(b))
        del b[i:i + rng.randint(1, 8)]
    elif op == "append":
        b += rng.randbytes(rng.randint(1, 16))
    else:
        i = rng.randrange(len(b))
        b[i:] = rng.randbytes(rng.randint(0, 32))
    return bytes(b), op


def _struct_mutation(msg: dict[str, Any], rng: random.Random) -> tuple[Any, str]:
    op = rng.choice(("version", "version", "kind", "kind", "missing", "confuse", "confuse",
                     "confuse", "extra", "dup", "nest", "toplevel"))
    m = dict(msg)
    keys = [k for k in m if k not in ("kind", "v")]
    if op == "version":
        m["v"] = rng.choice([0, 2, 99, -1, 1 << 63, (1 << 64) - 1, "1", None, 1.0, NAN])
    elif op == "kind":
        choice = rng.random()
        if choice < 0.5:
            m["kind"] = rng.choice(_KINDS)
        elif choice < 0.9:
            m["kind"] = rng.choice(["nope", "", "GENERATE", BAD_UTF8, 1, None, "x" * 300])
        else:
            m.pop("kind")
    elif op == "missing" and keys:
        m.pop(rng.choice(keys))
    elif op == "confuse" and keys:
        m[rng.choice(keys)] = rng.choice(CONFUSED)
    elif op == "extra":
        for _ in range(rng.randint(1, 5)):
            m[f"zz{rng.getrandbits(16)}"] = rng.choice(CONFUSED)
    elif op == "dup":
        pairs = Pairs(m.items())
        k = rng.choice(list(m))
        pairs.append((k, rng.choice(CONFUSED)))
        return pairs, op
    elif op == "nest":
        depth = rng.choice((50, 500, 5000))
        m[rng.choice(keys) if keys else "kind"] = Raw(b"\x91" * depth + b"\x00")
    else:
        return rng.choice([[m.get("kind"), 1], 7, "generate", None, b"\x00", [], NAN]), op
    return m, op


def _hostile(fam: Family, msg: dict[str, Any], ctx: FuzzContext,
             rng: random.Random) -> tuple[dict[str, Any], str]:
    m = dict(msg)
    if not fam.hostile:
        m[f"zz{rng.getrandbits(8)}"] = rng.choice(CONFUSED)
        return m, "extra"
    names = rng.sample(sorted(fam.hostile), k=min(len(fam.hostile), rng.choice((1, 1, 2, 3))))
    for name in names:
        m[name] = fam.hostile[name](ctx, rng)
    return m, "+".join(names)


def _oversized(fam: Family, msg: dict[str, Any], ctx: FuzzContext,
               rng: random.Random) -> tuple[dict[str, Any], str]:
    m = dict(msg)
    over = rng.random() < 0.5
    size = ctx.max_payload + rng.randint(1, 4096) if over else ctx.max_payload - 4096
    pad = b"\x00" * size
    m[fam.big_field] = pad.decode() if fam.big_field in ("reason", "lease_id", "trace") else pad
    return m, "over" if over else "under"


def cases(family: str, n: int, seed: int = 0,
          ctx: FuzzContext | None = None) -> list[Case]:
    """``n`` hostile cases for ``family`` (a key of :data:`FAMILIES`), the same for the
    same arguments."""
    fam = FAMILIES[family]
    ctx = ctx or FuzzContext()
    rng = random.Random(seed * 1_000_003 + zlib.crc32(family.encode()))
    names = [c for c, _ in _WEIGHTS]
    weights = [w for _, w in _WEIGHTS]
    out: list[Case] = []
    for _ in range(n):
        category = rng.choices(names, weights)[0]
        if category == "random":
            out.append(Case(_random_bytes(rng), category))
            continue
        msg = fam.template(ctx, rng)
        if category == "bytes":
            data, note = _byte_mutation(pack(msg), rng)
            out.append(Case(data, category, note))
        elif category == "struct":
            obj, note = _struct_mutation(msg, rng)
            out.append(Case(pack(obj), category, note))
        elif category == "hostile":
            obj, note = _hostile(fam, msg, ctx, rng)
            out.append(Case(pack(obj), category, note))
        elif category == "oversized":
            obj, note = _oversized(fam, msg, ctx, rng)
            out.append(Case(pack(obj), category, note))
        else:
            out.append(Case(pack(msg), category))
    return out
