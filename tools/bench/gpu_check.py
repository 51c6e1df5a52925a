"""``python -m tools.bench.gpu_check``: the prepared GPU check (``scripts/gpu_check.sh``
runs it).

Meant for one short session on a machine with a CUDA GPU (docs/benchmarks/gpu-check.md);
everything it learns goes into one JSON report, also when it stops early:

1. the environment: ``nvidia-smi``, Python, whether ``torch`` sees CUDA, whether a CUDA
   build of ``vllm`` imports, and which of CPD's own dependencies are missing. Each probe
   runs in a child process with a timeout (no CUDA context in this process before vLLM
   starts its engine process, and no probe can hang the check);
2. the ``small`` model preset, built here (deterministic, on the CPU);
3. CUDA vLLM through :class:`cpd.engines.vllm.engine.VllmEngine` without a connector
   (prefix caching off): the reference greedy outputs and the plain prefill TTFT;
4. the same engine class with CPD's KV connector and a block arena: a cold prefill that
   writes every full block through to the arena, a warm run after the engine's prefix
   cache was reset that loads the prefix from the arena, and the same prompt again (the
   engine's own prefix cache). Greedy outputs must equal the reference; TTFT per case.

Exit codes: :data:`EXIT_OK`, :data:`EXIT_CHECK_FAILED` (an output differed, a load did
not happen, an engine failed), :data:`EXIT_NO_CUDA`, :data:`EXIT_MISSING_DEPS`,
:data:`EXIT_NO_VLLM`, :data:`EXIT_TIMEOUT` (the time budget ran out; the report says in
which stage). ``--dry-run`` stops after the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_NO_CUDA = 3
EXIT_MISSING_DEPS = 4
EXIT_NO_VLLM = 5
EXIT_TIMEOUT = 6

PRESET = "small"
DTYPE = "bfloat16"
# ``--device cpu`` runs the same stages on vLLM-CPU (a self-test of this script on a
# machine without a GPU, with a short --lengths): fp32 there, as in every CPU test.
CPU_DTYPE = "float32"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
BLOCK_SIZE = 256
LENGTHS = (1024, 4096, 16384)  # plus the longest prompt the model takes
REPS = 3
MAX_TOKENS = 16  # greedy tokens compared against the reference
LIMIT_MARGIN = 12  # prompt tokens left unused below the model's limit (as the CPU tests)
TOKEN_ID_RANGE = 1900
SEED = 20261130
BUDGET_S = 480.0  # the device allows 10 minutes per command; leave room to write out
PROBE_TIMEOUT_S = 30.0
VLLM_PROBE_TIMEOUT_S = 180.0
ENGINE_START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 60.0
REPORT_NAME = "gpu_check.json"
TRACEBACK_CHARS = 3000
# What the check imports besides torch and vllm (cpd.modelbuild, the engine, the connector).
REQUIRED_MODULES = ("numpy", "msgspec", "blake3", "safetensors", "tokenizers", "xxhash",
                    "structlog", "opentelemetry.sdk", "nats")

_TORCH_PROBE = """
import json, torch
info = {"version": torch.__version__, "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available()}
if info["cuda_available"]:
    p = torch.cuda.get_device_properties(0)
    info.update(device_count=torch.cuda.device_count(), device=p.name,
                capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1))
print(json.dumps(info))
"""

_VLLM_PROBE = """
import json, vllm
from vllm.platforms import current_platform
print(json.dumps({"version": vllm.__version__, "device_type": current_platform.device_type}))
"""


class _Report:
    """The JSON report, written on every exit path (the watchdog's too)."""

    def __init__(self, path: Path | None, budget_s: float) -> None:
        self.path = path
        self.t0 = time.monotonic()
        self.stage = "environment"
        self.data: dict[str, Any] = {"check": "cpd gpu check", "ok": False, "exit_code": None,
                                     "reason": "", "budget_s": budget_s, "stages": {},
                                     "errors": []}
        self._lock = threading.Lock()
        self._done = False

    def enter(self, stage: str) -> float:
        self.stage = stage
        return time.monotonic()

    def timed(self, stage: str, t_start: float, **extra: Any) -> None:
        self.data["stages"][stage] = {"s": round(time.monotonic() - t_start, 2), **extra}

    def error(self, stage: str, e: BaseException) -> None:
        tb = "".join(traceback.format_exception(e))[-TRACEBACK_CHARS:]
        self.data["errors"].append({"stage": stage, "error": repr(e), "traceback": tb})

    def finish(self, code: int, reason: str) -> int:
        """Write and print the report once; returns ``code``."""
        with self._lock:
            if self._done:
                return code
            self._done = True
            self.data.update(ok=code == EXIT_OK, exit_code=code, reason=reason,
                             elapsed_s=round(time.monotonic() - self.t0, 1))
            text = json.dumps(self.data, indent=2, sort_keys=True)
            if self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.path.write_text(text + "\n")
            print(text, flush=True)
        return code


# ------------------------------------------------------------------ environment


def _run_probe(args: list[str], timeout: float) -> tuple[int | None, str, str]:
    """Run a probe; (exit code or None when it did not finish, stdout, stderr)."""
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        return None, "", str(e)
    except subprocess.TimeoutExpired:
        return None, "", f"no answer within {timeout:.0f} s"
    return p.returncode, p.stdout, p.stderr


def _nvidia_smi() -> dict:
    rc, out, err = _run_probe(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                               "--format=csv,noheader"], PROBE_TIMEOUT_S)
    if rc != 0:
        return {"ok": False, "error": (err or out).strip()[-500:]}
    gpus = [dict(zip(("name", "memory", "driver"), (x.strip() for x in line.split(",")),
                     strict=False))
            for line in out.strip().splitlines() if line.strip()]
    return {"ok": True, "gpus": gpus}


def _python_json_probe(code: str, timeout: float) -> dict:
    rc, out, err = _run_probe([sys.executable, "-c", code], timeout)
    if rc == 0:
        try:
            return {"importable": True, **json.loads(out.strip().splitlines()[-1])}
        except (ValueError, IndexError):
            pass
    return {"importable": False, "error": (err or out).strip()[-800:]}


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _module_present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package is missing
        return False


def environment(*, probe_vllm: bool) -> dict:
    """What this machine offers. With ``probe_vllm`` and a CUDA device, vLLM is imported
    in a child process (tens of seconds); otherwise only its distribution is reported."""
    torch = _python_json_probe(_TORCH_PROBE, VLLM_PROBE_TIMEOUT_S)
    env: dict[str, Any] = {
        "python": platform.python_version(), "executable": sys.executable,
        "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "nvidia_smi": _nvidia_smi(), "torch": torch,
        "cuda_available": bool(torch.get("cuda_available")),
        "missing_modules": [m for m in REQUIRED_MODULES if not _module_present(m)],
        "vllm": {"installed": _module_present("vllm"),
                 "distribution": {d: v for d in ("vllm", "vllm-cpu")
                                  if (v := _installed(d)) is not None}},
    }
    if probe_vllm and env["cuda_available"] and env["vllm"]["installed"]:
        env["vllm"].update(_python_json_probe(_VLLM_PROBE, VLLM_PROBE_TIMEOUT_S))
    env["vllm_cuda"] = env["vllm"].get("device_type") == "cuda"
    return env


# ------------------------------------------------------------------------ engines


@dataclass(frozen=True)
class _Plan:
    """What the engine stages run."""

    device: str
    preset: str
    dtype: str
    lengths: tuple[int, ...]
    reps: int
    enforce_eager: bool
    async_load: bool = False  # the connector loads off the step (decode workers do)


def _prompt_lengths(max_model_len: int, wanted: list[int] | None) -> tuple[int, ...]:
    """``wanted`` (capped at the model's limit), else 1K to the longest prompt it takes."""
    longest = max_model_len - LIMIT_MARGIN - MAX_TOKENS
    base = set(wanted) if wanted else {*LENGTHS, longest}
    return tuple(sorted({min(n, longest) for n in base}))


def _engine_class(enforce_eager: bool) -> type:
    from cpd.engines.vllm.engine import VllmEngine

    class CheckEngine(VllmEngine):
        """The production engine's arguments, plus what a short lease needs."""

        def engine_args(self) -> dict[str, Any]:
            args = super().engine_args()
            # torch.compile and CUDA-graph capture cost minutes of start-up; long
            # prefills run outside the captured batch sizes anyway.
            args["enforce_eager"] = enforce_eager
            return args

    return CheckEngine


async def _generate(engine: Any, request: Any) -> tuple[float, list[int], Any]:
    """TTFT (ms, to the first step with a token), all tokens, and the last step."""
    t0 = time.perf_counter()
    ttft = None
    tokens: list[int] = []
    last = None
    async for step in engine.generate(request):
        if step.token_ids and ttft is None:
            ttft = (time.perf_counter() - t0) * 1e3
        tokens.extend(step.token_ids)
        last = step
    if ttft is None or last is None:
        raise RuntimeError(f"request {request.request_id} produced no token")
    return ttft, tokens, last


async def _start(engine: Any) -> None:
    await asyncio.wait_for(engine.start(), ENGINE_START_TIMEOUT_S)


async def _engine_checks(report: _Report, folder: Path, prompts: dict[int, list[list[int]]],
                         plan: _Plan) -> list[dict]:
    import numpy as np

    from cpd.engines import ArenaSpec, EngineRequest
    from cpd.kvstore import checksum
    from cpd.modelbuild import PRESETS
    from cpd.protocol import wire

    engine_cls = _engine_class(plan.enforce_eager)
    greedy = wire.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    warmup = np.random.default_rng(SEED + 1).integers(0, TOKEN_ID_RANGE, 2 * BLOCK_SIZE + 7)
    warmup_tokens = warmup.tolist()
    rows: dict[int, dict[str, Any]] = {n: {"prompt_tokens": n, "ttft_ms_all": {},
                                           "identical": {}, "loads_ok": True}
                                       for n in prompts}
    report.data["raw"] = rows  # filled in place: a failed or timed-out run keeps its part

    def put(n: int, case: str, ms: float) -> None:
        rows[n]["ttft_ms_all"].setdefault(case, []).append(round(ms, 2))

    # 1. Plain vLLM: the reference outputs and the plain prefill time.
    t = report.enter("plain_engine")
    plain = engine_cls(folder, block_size=BLOCK_SIZE, arena=None, dtype=plan.dtype,
                       prefix_caching=False)
    reference: dict[tuple[int, int], list[int]] = {}
    try:
        await _start(plain)
        report.timed("plain_engine_start", t)
        t = report.enter("plain_requests")
        await _generate(plain, EngineRequest("warmup-plain", warmup_tokens, greedy))
        for n, group in prompts.items():
            for r, prompt in enumerate(group):
                ms, tokens, _ = await asyncio.wait_for(_generate(
                    plain, EngineRequest(f"plain-{n}-{r}", prompt, greedy)), REQUEST_TIMEOUT_S)
                reference[n, r] = tokens
                put(n, "plain", ms)
        report.timed("plain_requests", t)
    finally:
        await plain.stop()

    # 2. CPD's connector: cold write-through, warm load from the arena, engine cache hit.
    t = report.enter("connector_engine")
    slot_bytes = BLOCK_SIZE * PRESETS[plan.preset].kv_bytes_per_token(
        dtype_bytes=DTYPE_BYTES[plan.dtype])
    num_slots = max(prompts) // BLOCK_SIZE + 1
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    arena_path = shm / f"cpd-gpu-check-{os.getpid()}"
    arena = np.memmap(arena_path, dtype=np.uint8, mode="w+", shape=(num_slots, slot_bytes))
    engine = engine_cls(folder, block_size=BLOCK_SIZE, dtype=plan.dtype, prefix_caching=True,
                        arena=ArenaSpec(str(arena_path), num_slots, slot_bytes),
                        async_kv_load=plan.async_load)
    try:
        await _start(engine)
        report.timed("connector_engine_start", t)
        t = report.enter("connector_requests")
        await _generate(engine, EngineRequest("warmup-cold", warmup_tokens, greedy,
                                              save_slots=[0, 1]))
        for n, group in prompts.items():
            full, loadable = n // BLOCK_SIZE, (n - 1) // BLOCK_SIZE
            for r, prompt in enumerate(group):
                rid = f"{n}-{r}"
                await engine.reset_prefix_cache()  # cold means cold: no earlier prompt's blocks
                ms, tokens, last = await asyncio.wait_for(_generate(engine, EngineRequest(
                    f"cold-{rid}", prompt, greedy, save_slots=list(range(full)))),
                    REQUEST_TIMEOUT_S)
                put(n, "cold", ms)
                rows[n]["identical"].setdefault("cold", []).append(tokens == reference[n, r])
                saved_ok = last.saved_blocks == full
                if not await engine.reset_prefix_cache():
                    raise RuntimeError("the engine kept its prefix cache (requests running)")
                sums = [checksum(arena[i]) for i in range(loadable)]
                ms, tokens, last = await asyncio.wait_for(_generate(engine, EngineRequest(
                    f"warm-{rid}", prompt, greedy, load_slots=list(range(loadable)),
                    load_checksums=sums)), REQUEST_TIMEOUT_S)
                put(n, "warm_arena", ms)
                rows[n]["identical"].setdefault("warm_arena", []).append(
                    tokens == reference[n, r])
                loaded_ok = last.loaded_blocks == loadable and last.failed_blocks == 0
                ms, tokens, last = await asyncio.wait_for(_generate(engine, EngineRequest(
                    f"hit-{rid}", prompt, greedy)), REQUEST_TIMEOUT_S)
                put(n, "gpu_hit", ms)
                rows[n]["identical"].setdefault("gpu_hit", []).append(tokens == reference[n, r])
                hit_ok = last.cached_tokens >= loadable * BLOCK_SIZE
                if not (saved_ok and loaded_ok and hit_ok):
                    rows[n]["loads_ok"] = False
                    rows[n].setdefault("load_problems", []).append(
                        {"rep": r, "saved_ok": saved_ok, "loaded_ok": loaded_ok,
                         "gpu_hit_ok": hit_ok})
        report.timed("connector_requests", t)
    finally:
        await engine.stop()
        del arena
        arena_path.unlink(missing_ok=True)
    return [_row_summary(rows[n]) for n in sorted(rows)]


def _row_summary(row: dict) -> dict:
    """Medians per case and ratios to cold for one prompt length."""
    med = {c: round(statistics.median(xs), 2) for c, xs in row["ttft_ms_all"].items()}
    cold = med.get("cold")
    out = {**row, "ttft_ms": med,
           "identical": {c: all(v) for c, v in row["identical"].items()}}
    for case in ("warm_arena", "gpu_hit"):
        out[f"{case}_over_cold"] = (round(med[case] / cold, 3)
                                    if cold and case in med else None)
    out["cold_over_plain"] = round(cold / med["plain"], 3) if cold and med.get("plain") else None
    return out


# --------------------------------------------------------------------------- main


def _default_report_path() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / REPORT_NAME if out else Path("out") / REPORT_NAME


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.bench.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="report the environment only")
    p.add_argument("--json", type=Path, default=None,
                   help=f"report path (default: $OUT/{REPORT_NAME}, else out/{REPORT_NAME})")
    p.add_argument("--budget", type=float, default=BUDGET_S,
                   help="seconds before the check gives up and reports (default %(default)s)")
    p.add_argument("--cache-dir", type=Path,
                   default=Path(tempfile.gettempdir()) / "cpd-models",
                   help="where the model is built (default %(default)s)")
    p.add_argument("--reps", type=int, default=REPS, help="prompts per length")
    p.add_argument("--lengths", type=lambda v: [int(x) for x in v.split(",")],
                   help="prompt lengths, comma-separated (default: 1K to the model's limit)")
    p.add_argument("--preset", default=PRESET, help="model preset (default %(default)s)")
    p.add_argument("--compile", action="store_true",
                   help="let vLLM compile and capture CUDA graphs (slower start)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: run the stages on vLLM-CPU, to test this script without a GPU")
    p.add_argument("--async-load", action="store_true",
                   help="the connector loads the warm prefix off the step (a loader thread "
                        "and a side CUDA stream), as decode workers do by default")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns the exit code (the report says why)."""
    args = _parser().parse_args(argv)
    report = _Report(args.json or _default_report_path(), args.budget)

    def out_of_time() -> None:
        code = report.finish(EXIT_TIMEOUT, f"the {args.budget:.0f} s budget ran out in stage "
                                           f"{report.stage!r}")
        os._exit(code)  # engine threads and processes must not keep the command alive

    watchdog = threading.Timer(args.budget, out_of_time)
    watchdog.daemon = True
    watchdog.start()
    try:
        return _check(args, report)
    except Exception as e:
        report.error(report.stage, e)
        return report.finish(EXIT_CHECK_FAILED, f"stage {report.stage!r} failed: {e!r}")
    finally:
        watchdog.cancel()


def _check(args: argparse.Namespace, report: _Report) -> int:
    t = report.enter("environment")
    env = report.data["environment"] = environment(probe_vllm=not args.dry_run)
    report.timed("environment", t)
    from_cpu = args.device == "cpu"
    report.data["config"] = {"device": args.device, "preset": args.preset,
                             "dtype": CPU_DTYPE if from_cpu else DTYPE,
                             "block_size": BLOCK_SIZE, "reps": args.reps,
                             "max_tokens": MAX_TOKENS, "enforce_eager": not args.compile}
    if not env["torch"]["importable"]:
        return report.finish(EXIT_NO_CUDA, "no CUDA: torch does not import with "
                                           f"{sys.executable} (environment.torch.error)")
    if not env["cuda_available"] and not from_cpu:
        return report.finish(EXIT_NO_CUDA, f"no CUDA device: torch {env['torch']['version']} "
                                           "says torch.cuda.is_available() is False "
                                           "(environment.nvidia_smi)")
    if env["missing_modules"]:
        return report.finish(EXIT_MISSING_DEPS, "missing Python modules "
                                                f"{env['missing_modules']}: carry their wheels "
                                                "(scripts/gpu_check.sh --fetch-wheels)")
    if args.dry_run:
        return report.finish(EXIT_OK, "dry run: environment only")
    if not (env["vllm_cuda"] or (from_cpu and env["vllm"]["installed"])):
        return report.finish(EXIT_NO_VLLM, "no CUDA build of vLLM imports here "
                                            "(environment.vllm says what there is)")

    import numpy as np

    from cpd.modelbuild import PRESETS, build

    t = report.enter("build")
    folder = build(args.preset, args.cache_dir)
    report.timed("build", t, folder=str(folder))
    plan = _Plan(device=args.device, preset=args.preset, dtype=report.data["config"]["dtype"],
                 lengths=_prompt_lengths(PRESETS[args.preset].max_position_embeddings,
                                         args.lengths),
                 reps=args.reps, enforce_eager=not args.compile,
                 async_load=args.async_load)
    report.data["config"] = asdict(plan) | {"block_size": BLOCK_SIZE, "max_tokens": MAX_TOKENS}
    rng = np.random.default_rng(SEED)
    prompts = {n: [rng.integers(0, TOKEN_ID_RANGE, n).tolist() for _ in range(plan.reps)]
               for n in plan.lengths}
    rows = asyncio.run(_engine_checks(report, folder, prompts, plan))
    report.data.pop("raw", None)  # summarized in results
    report.data["results"] = rows
    if rows:
        top = rows[-1]
        report.data.update(max_prompt_tokens=top["prompt_tokens"],
                           warm_arena_over_cold_at_max=top["warm_arena_over_cold"],
                           gpu_hit_over_cold_at_max=top["gpu_hit_over_cold"])
    bad = [f"{r['prompt_tokens']} tokens: " + ", ".join(
        [f"{c} output differs" for c, same in r["identical"].items() if not same]
        + ([] if r["loads_ok"] else ["blocks not saved/loaded as planned"]))
        for r in rows if not (all(r["identical"].values()) and r["loads_ok"])]
    if bad:
        return report.finish(EXIT_CHECK_FAILED, "; ".join(bad))
    return report.finish(EXIT_OK, "greedy outputs identical on every path; "
                                  "TTFT per case in results")


if __name__ == "__main__":
    sys.exit(main())
