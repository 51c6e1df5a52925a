"""Workloads for the paper's experiment (the seed article §6) and for trace replay.

Every generator is pure and deterministic by seed, and emits :class:`WorkloadRequest`
items sorted by arrival time. A prompt is a list of **content block ids**, each standing
for ``block_tokens`` token ids derived from the id alone (:func:`block_token_ids`), so
identical ids give identical tokens (and identical prefixes hit the same KV), and a 200K-
token prompt costs a few hundred integers until :meth:`WorkloadRequest.token_ids` makes
it concrete.

1. :func:`coding_agent` - the paper's coding-agent scenario: each session works on a
   repository context of 45K-200K tokens, in multi-turn sessions whose prompt grows by
   the previous answer and new tool output every turn; a session's first request is
   cold (its repository context was never seen), later ones are warm (the previous
   prompt is their prefix). Sessions start in bursts. Parameters: :class:`CodingAgentConfig`.
2. :func:`mooncake` - replay of a Mooncake JSONL trace (``timestamp`` ms,
   ``input_length``, ``output_length``, ``hash_ids`` of 512-token blocks) with time scaling.
3. :func:`poisson` - open-loop Poisson arrivals at a target QPS over any request mix.
4. :func:`wave` - a burst of fresh prompts over a window, merged into another workload
   (:func:`merge`): the sudden load an elastic split must absorb.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

DEFAULT_VOCAB = 32_000
MOONCAKE_BLOCK_TOKENS = 512
# Content-id spaces, so a trace's hash ids never collide with generated content.
_SPACE_SHIFT = 40
SPACE_MOONCAKE = 1
SPACE_AGENT = 2
SPACE_POISSON = 3
SPACE_WAVE = 4

# The coding-agent generator rescales its session rate until the post-ramp request rate
# is within this share of the target (a few rounds: the count is nearly linear in it).
_CALIBRATION_ROUNDS = 8
_CALIBRATION_TOLERANCE = 0.02
# Independent random streams of one seed (numpy seeds with [seed, stream, ...]).
_STREAM_BURSTS = 0
_STREAM_SESSIONS = 1
_STREAM_KERNEL = 2
# The session start rate is piecewise constant over bins of this width (seconds).
_RATE_BIN_S = 2.0
# Sessions drawn to measure how a session's turns spread over time.
_KERNEL_SESSIONS = 4_000
# A bin's rate floor: keeps the cumulative rate strictly increasing for its inverse.
_MIN_RATE = 1e-9

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


class WorkloadRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One request of a workload."""

    request_id: str
    arrival_s: float
    session_id: str
    prompt_len: int
    block_ids: tuple[int, ...]   # content ids, ``block_tokens`` tokens each
    block_tokens: int
    output_len: int
    turn: int = 0                # 0: a session's first request

    def token_ids(self, vocab: int = DEFAULT_VOCAB) -> np.ndarray:
        """The prompt's token ids (uint32)."""
        return block_token_ids(self.block_ids, self.block_tokens, vocab)[:self.prompt_len]


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def block_token_ids(block_ids: Sequence[int], block_tokens: int,
                    vocab: int = DEFAULT_VOCAB) -> np.ndarray:
    """The tokens of consecutive content blocks: token j of block b is a hash of (b, j),
    so any block id always expands to the same tokens, wherever it appears."""
    ids = np.asarray(block_ids, dtype=np.uint64)
    pos = np.arange(block_tokens, dtype=np.uint64)
    keys = (ids[:, None] << np.uint64(20)) ^ pos[None, :]
    return (_splitmix64(keys) % np.uint64(vocab)).astype(np.uint32).reshape(-1)


def _space(space: int, n: int) -> int:
    return (space << _SPACE_SHIFT) | n


# ---------------------------------------------------------------------------------
# 1. Coding agent


@dataclass(frozen=True)
class CodingAgentConfig:
    """The coding-agent scenario. Defaults: see docs/sim.md ("Workload")."""

    qps: float = 9.0                 # target mean request rate (all sessions together)
    duration_s: float = 630.0        # arrivals in [0, duration_s)
    ramp_s: float = 30.0             # session starts ramp linearly up to full rate
    seed: int = 0
    block_tokens: int = 256          # tokens per content block (engine block size)
    system_tokens: int = 2_048       # system prompt + tool specs, shared by all sessions
    repo_min_tokens: int = 45_000    # repository context, log-uniform in [min, max]
    repo_max_tokens: int = 200_000
    shared_repo_prob: float = 0.0    # a new session reuses an earlier session's repo
    mean_turns: float = 20.0         # turns per session (geometric, >= 1)
    step_min_tokens: int = 512       # new tool output / user text per turn, log-uniform
    step_max_tokens: int = 4_096
    output_min_tokens: int = 32      # answer length, log-uniform
    output_max_tokens: int = 256
    think_mean_s: float = 4.0        # tool execution between turns (exponential) ...
    think_min_s: float = 1.0         # ... plus this floor
    burst_mean: float = 2.0          # sessions per burst (geometric, >= 1)
    burst_spread_s: float = 2.0      # a burst's session starts spread over this window
    max_context_tokens: int = 240_000  # a session ends before its prompt outgrows this

    @property
    def expected_prompt_tokens_first(self) -> float:
        """Mean first-turn prompt (system + repository + first step)."""
        return (self.system_tokens + _loguniform_mean(self.repo_min_tokens, self.repo_max_tokens)
                + _loguniform_mean(self.step_min_tokens, self.step_max_tokens))


def _loguniform_mean(lo: float, hi: float) -> float:
    return lo if hi <= lo else (hi - lo) / math.log(hi / lo)


def _loguniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return lo if hi <= lo else float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


class _Content:
    """Allocates fresh content ids in one id space."""

    def __init__(self, space: int) -> None:
        self.space = space
        self.next = 0

    def fresh(self) -> int:
        self.next += 1
        return _space(self.space, self.next)


def _extend(blocks: list[int], length: int, add: int, bt: int, content: _Content) -> int:
    """Append ``add`` fresh tokens to a block stream of ``length`` tokens."""
    new_len = length + add
    while len(blocks) * bt < new_len:
        blocks.append(content.fresh())
    return new_len


def coding_agent(cfg: CodingAgentConfig) -> list[WorkloadRequest]:
    """The coding-agent workload (see the module doc and :class:`CodingAgentConfig`).

    Session starts are a compound Poisson process (bursts of ``burst_mean`` sessions on
    average). A session's turn ``k+1`` arrives ``think`` seconds after turn ``k`` (open
    loop: it does not wait for the answer) with prompt = turn ``k``'s prompt + a
    stand-in for its answer (``output_len`` tokens) + new tool output.

    A session sends its turns over ~100 s, so a constant session start rate would make
    the request rate build up for that long: a 200 s steady phase then ran at half its
    target first and ~1.4 times it at the end. The session start rate therefore follows
    the profile (:func:`_session_start_rates`) whose *expected request rate* ramps
    linearly over ``ramp_s`` and is flat at ``qps`` after it; a last rescaling of the
    whole profile (same draws) makes the requests that arrive after the ramp come at
    ``qps`` in this realisation too.
    """
    if cfg.qps <= 0 or cfg.mean_turns < 1:
        raise ValueError("qps must be > 0 and mean_turns >= 1")
    bins = _session_start_rates(cfg)
    scale = 1.0
    reqs = _coding_agent(cfg, bins)
    start = min(cfg.ramp_s, cfg.duration_s / 2)
    for _ in range(_CALIBRATION_ROUNDS):
        got = sum(r.arrival_s >= start for r in reqs) / (cfg.duration_s - start)
        if got <= 0 or abs(got / cfg.qps - 1) <= _CALIBRATION_TOLERANCE:
            break
        scale *= cfg.qps / got
        reqs = _coding_agent(cfg, bins * scale)
    return reqs


def _turns(rng: np.random.Generator, cfg: CodingAgentConfig,
           length: int) -> Iterator[tuple[float, int, int]]:
    """A session's turns from a prompt of ``length`` tokens: (seconds after the session
    start, new tokens, answer tokens), until its turns run out or its prompt would
    outgrow ``max_context_tokens``."""
    offset = 0.0
    for _ in range(int(rng.geometric(1.0 / cfg.mean_turns))):
        step = int(_loguniform(rng, cfg.step_min_tokens, cfg.step_max_tokens))
        if length + step >= cfg.max_context_tokens:
            return
        output = int(_loguniform(rng, cfg.output_min_tokens, cfg.output_max_tokens))
        yield offset, step, output
        length += step + output
        offset += cfg.think_min_s + float(rng.exponential(cfg.think_mean_s))


def _session_start_rates(cfg: CodingAgentConfig) -> np.ndarray:
    """Session starts per second in each ``_RATE_BIN_S`` bin of the run, such that the
    expected request rate is ``qps · min(t / ramp_s, 1)``.

    The requests a session sends in the bins after its start (the kernel) are measured
    on sessions drawn from their own stream; the rates then follow by causal
    deconvolution: each bin's starts make up what the earlier bins' sessions leave
    short of that bin's target. (With a memoryless session length this gives ~3-4
    times the steady start rate during the ramp, then the steady one.)"""
    w = _RATE_BIN_S
    n = max(1, math.ceil(cfg.duration_s / w))
    rng = np.random.default_rng([cfg.seed, _STREAM_KERNEL])
    kernel = np.zeros(n)
    system = -(-cfg.system_tokens // cfg.block_tokens) * cfg.block_tokens
    for _ in range(_KERNEL_SESSIONS):
        first = rng.uniform(0, w)
        length = system + int(_loguniform(rng, cfg.repo_min_tokens, cfg.repo_max_tokens))
        for offset, _, _ in _turns(rng, cfg, length):
            m = int((first + offset) // w)
            if m >= n:
                break
            kernel[m] += 1
    kernel /= _KERNEL_SESSIONS
    if kernel[0] <= 0:
        raise ValueError("no session's first turn fits max_context_tokens")
    mid = (np.arange(n) + 0.5) * w
    target = cfg.qps * w * (np.minimum(mid / cfg.ramp_s, 1.0) if cfg.ramp_s > 0 else 1.0)
    starts = np.zeros(n)  # expected session starts per bin
    for i in range(n):
        earlier = float(starts[:i] @ kernel[i:0:-1]) if i else 0.0
        starts[i] = max(target[i] - earlier, 0.0) / kernel[0]
    return starts / w


def _coding_agent(cfg: CodingAgentConfig, rates: np.ndarray) -> list[WorkloadRequest]:
    bt = cfg.block_tokens
    content = _Content(SPACE_AGENT)
    # The shared system prompt: whole blocks, so every session starts with the same ones.
    system = [content.fresh() for _ in range(-(-cfg.system_tokens // bt))]
    system_len = len(system) * bt
    repos: list[tuple[list[int], int]] = []
    # Burst k draws the same numbers at every rate (only its time moves), and session j
    # of burst k has its own generator: a higher rate moves the same sessions earlier
    # and adds more, so the calibration's request count grows smoothly with the rate
    # instead of reshuffling every session. Burst times invert the cumulative burst
    # rate of the piecewise-constant profile.
    edges = np.arange(len(rates) + 1) * _RATE_BIN_S
    cum = np.concatenate(([0.0], np.cumsum(np.maximum(rates, _MIN_RATE) * _RATE_BIN_S)))
    cum /= cfg.burst_mean
    bursts = np.random.default_rng([cfg.seed, _STREAM_BURSTS])
    starts: list[tuple[float, int, int]] = []
    unit = 0.0
    for k in itertools.count():
        unit += float(bursts.standard_exponential())
        size = int(bursts.geometric(1.0 / cfg.burst_mean))
        spread = bursts.uniform(0, cfg.burst_spread_s, size)
        if unit >= cum[-1]:
            break
        t = float(np.interp(unit, cum, edges))
        starts.extend((t + float(spread[j]), k, j) for j in range(size))
    out: list[WorkloadRequest] = []
    for n, (start, k, j) in enumerate(sorted(starts)):
        if start >= cfg.duration_s:
            continue
        rng = np.random.default_rng([cfg.seed, _STREAM_SESSIONS, k, j])
        if repos and rng.uniform() < cfg.shared_repo_prob:
            repo_blocks, repo_len = repos[int(rng.integers(len(repos)))]
        else:
            repo_len = int(_loguniform(rng, cfg.repo_min_tokens, cfg.repo_max_tokens))
            repo_len -= repo_len % bt  # a repository context is whole blocks (files)
            repo_blocks = [content.fresh() for _ in range(repo_len // bt)]
            repos.append((repo_blocks, repo_len))
        sid = f"s{n}"
        blocks, length = system + repo_blocks, system_len + repo_len
        for turn, (offset, step, output) in enumerate(_turns(rng, cfg, length)):
            if start + offset >= cfg.duration_s:
                break
            # Fresh blocks for the new content: the last block of the previous prompt
            # is partial and its content id continues (same id = same tokens).
            length = _extend(blocks, length, step, bt, content)
            out.append(WorkloadRequest(
                request_id=f"{sid}-t{turn}", arrival_s=start + offset, session_id=sid,
                prompt_len=length, block_ids=tuple(blocks[:-(-length // bt)]),
                block_tokens=bt, output_len=output, turn=turn))
            # The answer becomes part of the next prompt (a stand-in for its tokens).
            length = _extend(blocks, length, output, bt, content)
    out.sort(key=lambda r: (r.arrival_s, r.request_id))
    return out


# ---------------------------------------------------------------------------------
# 2. Mooncake trace replay


def mooncake(path: str | Path, *, time_scale: float = 1.0, block_tokens: int = 512,
             limit: int | None = None, start_s: float = 0.0,
             end_s: float | None = None) -> list[WorkloadRequest]:
    """Replay a Mooncake JSONL trace. ``time_scale`` divides the gaps (2.0 = twice the
    rate); ``block_tokens`` is the trace's block size (each hash id stands for that many
    tokens; Mooncake publishes 512). Requests with ``start_s <= t < end_s`` (trace
    seconds) are kept, re-based to start at 0."""
    if time_scale <= 0:
        raise ValueError("time_scale must be > 0")
    out: list[WorkloadRequest] = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            row = json.loads(line)
            t = row["timestamp"] / 1e3
            if t < start_s or (end_s is not None and t >= end_s):
                continue
            length = int(row["input_length"])
            ids = tuple(_space(SPACE_MOONCAKE, int(h)) for h in row["hash_ids"])
            if len(ids) * block_tokens < length:
                raise ValueError(f"line {i + 1}: {len(ids)} hash ids of {block_tokens} "
                                 f"tokens cannot cover {length} tokens")
            out.append(WorkloadRequest(
                request_id=f"mc{i}", arrival_s=(t - start_s) / time_scale,
                session_id=f"mc{i}", prompt_len=length, block_ids=ids,
                block_tokens=block_tokens, output_len=max(int(row["output_length"]), 1)))
            if limit is not None and len(out) >= limit:
                break
    out.sort(key=lambda r: (r.arrival_s, r.request_id))
    return out


# ---------------------------------------------------------------------------------
# 3. Open-loop Poisson


def poisson_arrivals(qps: float, duration_s: float, seed: int = 0) -> np.ndarray:
    """Arrival times of a Poisson process at ``qps`` over ``[0, duration_s)``."""
    if qps <= 0:
        raise ValueError("qps must be > 0")
    rng = np.random.default_rng(seed)
    times: list[float] = []
    t = float(rng.exponential(1.0 / qps))
    while t < duration_s:
        times.append(t)
        t += float(rng.exponential(1.0 / qps))
    return np.asarray(times)


def poisson(qps: float, duration_s: float, requests: Iterable[WorkloadRequest] | None = None,
            *, seed: int = 0, prompt_len: int = 8_192, output_len: int = 128,
            block_tokens: int = 256) -> list[WorkloadRequest]:
    """Open-loop Poisson arrivals at ``qps``. With ``requests``, their prompts are
    re-timed in order (cycling if there are fewer than arrivals); without, each arrival
    is a fresh prompt of ``prompt_len`` tokens (no shared prefix)."""
    times = poisson_arrivals(qps, duration_s, seed)
    if requests is not None:
        pool = list(requests)
        if not pool:
            raise ValueError("empty request mix")
        return [replace_arrival(pool[i % len(pool)], float(t), f"p{i}")
                for i, t in enumerate(times)]
    return _fresh(times, "p", SPACE_POISSON, prompt_len, output_len, block_tokens)


def _fresh(times: Iterable[float], prefix: str, space: int, prompt_len: int,
           output_len: int, block_tokens: int) -> list[WorkloadRequest]:
    """A first turn at each of ``times`` (ids ``<prefix><i>``), none sharing a block
    with another: its content is numbered in ``space``."""
    nblocks = -(-prompt_len // block_tokens)
    return [WorkloadRequest(
        request_id=f"{prefix}{i}", arrival_s=float(t), session_id=f"{prefix}{i}",
        prompt_len=prompt_len,
        block_ids=tuple(_space(space, i * nblocks + b) for b in range(nblocks)),
        block_tokens=block_tokens, output_len=output_len) for i, t in enumerate(times)]


# ---------------------------------------------------------------------------------
# 4. Waves


@dataclass(frozen=True)
class Wave:
    """A burst of fresh prompts: Poisson arrivals at ``qps`` in ``[start_s, end_s)``,
    each a first turn that shares no block with any other request (a wave of new
    sessions, or of long answers with ``output_len``)."""

    start_s: float
    end_s: float
    qps: float
    prompt_len: int
    output_len: int
    seed: int = 0


def wave(w: Wave, block_tokens: int = 256) -> list[WorkloadRequest]:
    """The requests of ``w``: ids ``w<i>``, content in an id space of their own."""
    if w.end_s <= w.start_s or w.prompt_len < 1 or w.output_len < 1:
        raise ValueError("a wave needs end_s > start_s and positive lengths")
    times = poisson_arrivals(w.qps, w.end_s - w.start_s, w.seed) + w.start_s
    return _fresh(times, "w", SPACE_WAVE, w.prompt_len, w.output_len, block_tokens)


def merge(*workloads: Iterable[WorkloadRequest]) -> list[WorkloadRequest]:
    """Several workloads as one, sorted by arrival; request ids must not collide."""
    out = sorted(itertools.chain(*workloads), key=lambda r: r.arrival_s)
    if len({r.request_id for r in out}) != len(out):
        raise ValueError("the merged workloads share request ids")
    return out


def replace_arrival(req: WorkloadRequest, arrival_s: float, request_id: str) -> WorkloadRequest:
    """The same prompt at another time under another id."""
    return msgspec.structs.replace(req, arrival_s=arrival_s, request_id=request_id)


def iter_window(requests: Iterable[WorkloadRequest], start_s: float,
                end_s: float) -> Iterator[WorkloadRequest]:
    """Requests arriving in ``[start_s, end_s)``."""
    return (r for r in requests if start_s <= r.arrival_s < end_s)


__all__ = ["CodingAgentConfig", "Wave", "WorkloadRequest", "block_token_ids", "coding_agent",
           "iter_window", "merge", "mooncake", "poisson", "poisson_arrivals",
           "replace_arrival", "wave"]
