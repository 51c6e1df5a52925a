"""``cpd bench serve``: vLLM's own benchmark client, ``vllm bench serve``, against CPD's
gateway and against a monolithic vLLM OpenAI server of the same model folder, in one run
(docs/benchmarks/serve.md).

Each server is started as a user would (``cpd up``; ``python -m
vllm.entrypoints.openai.api_server`` with prefix caching, :mod:`tools.bench.servers`),
then the client runs every workload against it with the same seed, so both servers get
the very same requests: random prompts (Completions API), ShareGPT-style conversations
(Chat API; the file is written from the model's own corpus, as no dataset can be
downloaded) and prompts that share a few long prefixes (Completions API, where CPD's
cache pays). The result is each server's figures as the client reports them and the
CPD ÷ monolithic ratios of TTFT and throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from cpd.modelbuild import build
from cpd.modelbuild.tokenizer import CORPUS
from cpd.ops.config import Settings, load_settings
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

OUTPUT_TOKENS = 32
CONCURRENCY = 4
PROMPTS_FULL, PROMPTS_QUICK = 100, 8
ROUNDS = 2  # each server started this many times, alternately (the host drifts)
SEED = 1
CLIENT_TIMEOUT_S = 1800.0
# The client's figures kept per server and workload (vLLM's result keys).
KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput",
        "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
        "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms")
# ShareGPT-style conversations: a human turn of this many tokens (vLLM's ShareGPT
# sampler keeps prompts of at most 1,024), answered by a turn of the second range.
SHAREGPT_PROMPT_TOKENS = (64, 1000)
SHAREGPT_REPLY_TOKENS = (16, 200)


@dataclass(frozen=True)
class Workload:
    """One ``vllm bench serve`` run: its API and dataset flags."""

    name: str
    backend: str  # vLLM's: openai (Completions) or openai-chat
    dataset: tuple[str, ...]

    @property
    def endpoint(self) -> str:
        return "/v1/chat/completions" if self.backend == "openai-chat" else "/v1/completions"


def workloads(sharegpt: Path) -> list[Workload]:
    """The workloads, in the order each server runs them."""
    return [
        Workload("random", "openai", (
            "--dataset-name", "random", "--random-input-len", "2048",
            "--random-output-len", str(OUTPUT_TOKENS))),
        Workload("sharegpt", "openai-chat", (
            "--dataset-name", "sharegpt", "--dataset-path", str(sharegpt),
            "--sharegpt-output-len", str(OUTPUT_TOKENS))),
        Workload("prefix_repetition", "openai", (
            "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1536",
            "--prefix-repetition-suffix-len", "256", "--prefix-repetition-num-prefixes", "5",
            "--prefix-repetition-output-len", str(OUTPUT_TOKENS))),
    ]


def write_sharegpt(path: Path, tokenizer: Any, conversations: int, seed: int = SEED) -> None:
    """A ShareGPT-format file (``[{"id", "conversations": [{"from", "value"}, ...]}]``)
    of ``conversations`` two-turn chats cut from the model's corpus at random offsets and
    lengths, so the prompts are text the model writes like."""
    ids = tokenizer(CORPUS.read_text(), verbose=False).input_ids
    rng = random.Random(seed)
    entries = []
    for k in range(conversations):
        n, m = rng.randint(*SHAREGPT_PROMPT_TOKENS), rng.randint(*SHAREGPT_REPLY_TOKENS)
        at = rng.randrange(len(ids) - n - m)
        entries.append({"id": f"cpd-{k}", "conversations": [
            {"from": "human", "value": tokenizer.decode(ids[at:at + n])},
            {"from": "gpt", "value": tokenizer.decode(ids[at + n:at + n + m])}]})
    path.write_text(json.dumps(entries))


def client_argv(w: Workload, *, base_url: str, model: str, tokenizer: Path, prompts: int,
                concurrency: int, result: Path) -> list[str]:
    """``cpd vllm bench serve``'s command line for ``w`` against ``base_url``."""
    return [sys.executable, "-m", "tools.vllmcli", "bench", "serve",
            "--backend", w.backend, "--base-url", base_url, "--endpoint", w.endpoint,
            "--model", model, "--tokenizer", str(tokenizer), *w.dataset,
            "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
            "--request-rate", "inf", "--ignore-eos", "--temperature", "0",
            "--seed", str(SEED), "--num-warmups", "0", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(result.parent),
            "--result-filename", result.name]


def run_client(argv: Sequence[str], result: Path) -> dict[str, Any]:
    """Run the client; its result's figures (:data:`KEYS`)."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S,
                          cwd=Path(__file__).resolve().parents[2], check=False)
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    figures = json.loads(result.read_text())
    return {k: figures[k] for k in KEYS if k in figures}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One server's figures for one workload over its rounds: the median of each (the
    request counts summed)."""
    out: dict[str, Any] = {}
    for key in KEYS:
        values = [r[key] for r in rounds if r.get(key) is not None]
        if values:
            out[key] = sum(values) if key in ("completed", "failed") else round(
                statistics.median(values), 3)
    return out


def summarize(figures: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per workload, each server's figures (over its rounds, :func:`combine`) and the
    CPD ÷ monolithic ratios (TTFT below 1 and throughput above 1 are CPD's gains); the
    requests that failed, all told."""
    out: dict[str, Any] = {"workloads": {}, "requests_failed": 0}
    cpd, mono = figures.get("cpd", {}), figures.get("monolithic", {})
    for name in sorted(cpd.keys() | mono.keys()):
        c, m = combine(cpd.get(name, [])), combine(mono.get(name, []))
        out["workloads"][name] = {"cpd": c, "monolithic": m, "cpd_over_monolithic": {
            key: _ratio(c.get(key), m.get(key))
            for key in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                        "output_throughput", "request_throughput")}}
        out["requests_failed"] += c.get("failed", 0) + m.get("failed", 0)
    return out


async def _measure(settings: Settings, tmp: Path, quick: bool) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from cpd.engines.profile import engine_profile

    settings = msgspec.structs.replace(
        settings, model=msgspec.structs.replace(settings.model, preset=PRESET),
        worker=msgspec.structs.replace(settings.worker, engine="vllm"))
    folder = build(PRESET, settings.model_cache_dir)
    prompts = PROMPTS_QUICK if quick else PROMPTS_FULL
    sharegpt = tmp / "sharegpt.json"
    write_sharegpt(sharegpt, AutoTokenizer.from_pretrained(folder), prompts * 2)
    model = engine_profile(settings).served_model()
    name = settings.gateway.served_model_name or f"cpd-{PRESET}"
    rounds = 1 if quick else ROUNDS
    figures: dict[str, dict[str, list[dict[str, Any]]]] = {}
    timings: dict[str, list[dict[str, float]]] = {}
    load = {"start": load_average()}
    for r in range(rounds):
        # A fresh directory per start: no server sees another's (or its last) state.
        here = tmp / f"round-{r}"
        here.mkdir()
        servers: list[Server] = [CpdUpServer(here, settings),
                                 VllmServer(here, model, name, settings.cache.block_size)]
        for srv in servers:

            async def _workloads(srv: Server = srv, here: Path = here) -> None:
                for w in workloads(sharegpt):
                    result = here / f"{srv.name}-{w.name}.json"
                    argv = client_argv(w, base_url=srv.base_url.removesuffix("/v1"),
                                       model=name, tokenizer=folder, prompts=prompts,
                                       concurrency=CONCURRENCY, result=result)
                    figures.setdefault(srv.name, {}).setdefault(w.name, []).append(
                        await asyncio.to_thread(run_client, argv, result))

            _, took = await measured(srv, _workloads)
            timings.setdefault(srv.name, []).append(took)
    load["end"] = load_average()
    out = summarize(figures)
    out.update(preset=PRESET, model=model.name, prompts=prompts, concurrency=CONCURRENCY,
               output_tokens=OUTPUT_TOKENS, seed=SEED, rounds=rounds, quick=quick,
               servers=timings, per_round=figures, load_average_1m=load)
    return out


def run(settings: Settings | None = None, quick: bool = False) -> dict[str, Any]:
    """Run the benchmark; returns the JSON-able result."""
    settings = settings or load_settings()
    return run_in_tmp("cpd-bench-serve-", lambda tmp: _measure(settings, tmp, quick))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``cpd bench serve``'s flags."""
    parser.add_argument("--quick", action="store_true",
                        help=f"{PROMPTS_QUICK} prompts per workload instead of "
                             f"{PROMPTS_FULL}, one round instead of {ROUNDS} (tests, CI)")


def run_args(args: argparse.Namespace, settings: SettingsFactory) -> dict:
    """Run from ``cpd bench serve``'s flags."""
    return run(settings(), quick=args.quick)
