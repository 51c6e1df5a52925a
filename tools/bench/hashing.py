"""``cpd bench hashing``: block-hashing and lookup-encoding cost of a long prompt.

What the router pays per request before it can ask kvindex anything: hash every full
block of a 100K-token prompt and encode the lookup request. Measured side by side with
the same chain computed by the pure-Python loop (one keyed BLAKE3 call per block, what
runs where the native extension is not built) and a per-block SHA-256 chain over the same
bytes (vLLM's prefix-hash choice) as references.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import numpy as np

from cpd.protocol import hashing, wire
from cpd.protocol.hashing import ROOT_PARENT, Namespace, block_hashes
from tools.bench.registry import SettingsFactory


def _sha256_chain(tokens: np.ndarray, block_size: int) -> bytes:
    data = memoryview(tokens.astype("<u4").tobytes())
    step = block_size * 4
    prev, out = ROOT_PARENT, []
    for i in range(len(data) // step):
        prev = hashlib.sha256(prev + data[i * step:(i + 1) * step]).digest()[:16]
        out.append(prev)
    return b"".join(out)


def _median_ms(fn, repeat: int) -> tuple[float, float]:
    fn()  # warm caches
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return statistics.median(samples), samples[int(0.99 * (len(samples) - 1))]


def run(tokens: int | None = None, block_size: int = 256, repeat: int = 200) -> dict:
    """Measure; returns the JSON-able result."""
    n = tokens or 100_000
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 32_000, size=n, dtype=np.uint32)
    ns = Namespace(model_id="bench", model_revision="r1", tokenizer_hash="t",
                   kv_dtype="float32", block_size=block_size)
    hashes = block_hashes(ns, prompt)

    def encode() -> bytes:
        return wire.encode(wire.LookupRequest(request_id="bench", namespace=ns.id,
                                              block_hashes=hashes))

    hash_ms, hash_p99 = _median_ms(lambda: block_hashes(ns, prompt), repeat)
    enc_ms, _enc_p99 = _median_ms(encode, repeat)
    both_ms, both_p99 = _median_ms(
        lambda: wire.encode(wire.LookupRequest(request_id="bench", namespace=ns.id,
                                               block_hashes=block_hashes(ns, prompt))),
        repeat)
    sha_ms, _ = _median_ms(lambda: _sha256_chain(prompt, block_size), max(20, repeat // 4))
    data, step = prompt.tobytes(), block_size * 4
    py_ms, _ = _median_ms(lambda: hashing.python_chain(ns.key, data, step, ROOT_PARENT),
                          max(20, repeat // 4))
    return {
        "tokens": n,
        "block_size": block_size,
        "blocks": len(hashes) // wire.HASH_BYTES,
        "hash_ms": round(hash_ms, 4),
        "hash_p99_ms": round(hash_p99, 4),
        "lookup_request_encode_ms": round(enc_ms, 4),
        "lookup_request_bytes": len(encode()),
        "hash_plus_encode_ms": round(both_ms, 4),
        "hash_plus_encode_p99_ms": round(both_p99, 4),
        "native": hashing.NATIVE,
        "python_loop_ms": round(py_ms, 4),
        "python_loop_over_hash": round(py_ms / hash_ms, 2),
        "sha256_chain_ms": round(sha_ms, 4),
        "blake3_over_sha256": round(hash_ms / sha_ms, 3),
        "target_ms": 1.0,
        "meets_target": both_ms < 1.0,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``cpd bench hashing``'s flags. No ``--quick``: the full run takes about a second."""
    parser.add_argument("--tokens", type=int, help="prompt tokens (default 100000)")
    parser.add_argument("--block-size", type=int, default=256,
                        help="tokens per block (default 256)")
    parser.add_argument("--repeat", type=int, default=200,
                        help="timed runs per measurement (default 200)")


def run_args(args: argparse.Namespace, settings: SettingsFactory) -> dict:
    """Run from ``cpd bench hashing``'s flags; no settings needed."""
    return run(tokens=args.tokens, block_size=args.block_size, repeat=args.repeat)
