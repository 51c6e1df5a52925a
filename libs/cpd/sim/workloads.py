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
"""

from __future__ import annotations

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

# The coding-agent generator rescales its session rate until the post-ramp request rate
# is within this share of the target (a few rounds: the count is nearly linear in it).
_CALIBRATION_ROUNDS = 4
_CALIBRATION_TOLERANCE = 0.02

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


@dataclass
class _Session:
    sid: str
    blocks: list[int]
    length: int
    turns_left: int
    next_s: float
    turn: int = 0


def _extend(blocks: list[int], length: int, add: int, bt: int, content: _Content) -> int:
    """Append ``add`` fresh tokens to a block stream of ``length`` tokens."""
    new_len = length + add
    while len(blocks) * bt < new_len:
        blocks.append(content.fresh())
    return new_len


def coding_agent(cfg: CodingAgentConfig) -> list[WorkloadRequest]:
    """The coding-agent workload (see the module doc and :class:`CodingAgentConfig`).

    Session starts are a compound Poisson process (bursts of ``burst_mean`` sessions on
    average), ramping up over ``ramp_s``. A session's turn ``k+1`` arrives ``think``
    seconds after turn ``k`` (open loop: it does not wait for the answer) with prompt =
    turn ``k``'s prompt + a stand-in for its answer (``output_len`` tokens) + new tool
    output.

    The session rate starts at ``qps / mean_turns`` and is then rescaled (same seed) until
    the requests arriving after the ramp come at ``qps``: sessions that outgrow
    ``max_context_tokens`` or the run end early, and the first sessions' turns build up
    over a session's lifetime, so the nominal rate alone falls short by up to a third
    (a sweep's target QPS would then not be what was offered).
    """
    if cfg.qps <= 0 or cfg.mean_turns < 1:
        raise ValueError("qps must be > 0 and mean_turns >= 1")
    session_rate = cfg.qps / cfg.mean_turns
    reqs = _coding_agent(cfg, session_rate)
    start = min(cfg.ramp_s, cfg.duration_s / 2)
    for _ in range(_CALIBRATION_ROUNDS):
        got = sum(r.arrival_s >= start for r in reqs) / (cfg.duration_s - start)
        if got <= 0 or abs(got / cfg.qps - 1) <= _CALIBRATION_TOLERANCE:
            break
        session_rate *= cfg.qps / got
        reqs = _coding_agent(cfg, session_rate)
    return reqs


def _coding_agent(cfg: CodingAgentConfig, session_rate: float) -> list[WorkloadRequest]:
    rng = np.random.default_rng(cfg.seed)
    bt = cfg.block_tokens
    content = _Content(SPACE_AGENT)
    # The shared system prompt: whole blocks, so every session starts with the same ones.
    system = [content.fresh() for _ in range(-(-cfg.system_tokens // bt))]
    system_len = len(system) * bt
    repos: list[tuple[list[int], int]] = []
    burst_rate = session_rate / cfg.burst_mean
    starts: list[float] = []
    t = 0.0
    while True:
        # Thinning for the linear ramp: accept a burst at t with probability rate(t)/max.
        t += float(rng.exponential(1.0 / burst_rate))
        if t >= cfg.duration_s:
            break
        if cfg.ramp_s > 0 and t < cfg.ramp_s and rng.uniform() > t / cfg.ramp_s:
            continue
        size = int(rng.geometric(1.0 / cfg.burst_mean))
        starts.extend(t + float(rng.uniform(0, cfg.burst_spread_s)) for _ in range(size))
    out: list[WorkloadRequest] = []
    for n, start in enumerate(sorted(starts)):
        if start >= cfg.duration_s:
            continue
        if repos and rng.uniform() < cfg.shared_repo_prob:
            repo_blocks, repo_len = repos[int(rng.integers(len(repos)))]
        else:
            repo_len = int(_loguniform(rng, cfg.repo_min_tokens, cfg.repo_max_tokens))
            repo_len -= repo_len % bt  # a repository context is whole blocks (files)
            repo_blocks = [content.fresh() for _ in range(repo_len // bt)]
            repos.append((repo_blocks, repo_len))
        s = _Session(f"s{n}", system + repo_blocks, system_len + repo_len,
                     int(rng.geometric(1.0 / cfg.mean_turns)), start)
        while s.turns_left > 0 and s.next_s < cfg.duration_s:
            step = int(_loguniform(rng, cfg.step_min_tokens, cfg.step_max_tokens))
            if s.length + step >= cfg.max_context_tokens:
                break
            # Fresh blocks for the new content: the last block of the previous prompt
            # is partial and its content id continues (same id = same tokens).
            s.length = _extend(s.blocks, s.length, step, bt, content)
            output = int(_loguniform(rng, cfg.output_min_tokens, cfg.output_max_tokens))
            out.append(WorkloadRequest(
                request_id=f"{s.sid}-t{s.turn}", arrival_s=s.next_s, session_id=s.sid,
                prompt_len=s.length, block_ids=tuple(s.blocks[:-(-s.length // bt)]),
                block_tokens=bt, output_len=output, turn=s.turn))
            # The answer becomes part of the next prompt (a stand-in for its tokens).
            s.length = _extend(s.blocks, s.length, output, bt, content)
            s.turn += 1
            s.turns_left -= 1
            s.next_s += cfg.think_min_s + float(rng.exponential(cfg.think_mean_s))
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
    nblocks = -(-prompt_len // block_tokens)
    return [WorkloadRequest(
        request_id=f"p{i}", arrival_s=float(t), session_id=f"p{i}", prompt_len=prompt_len,
        block_ids=tuple(_space(SPACE_POISSON, i * nblocks + b) for b in range(nblocks)),
        block_tokens=block_tokens, output_len=output_len) for i, t in enumerate(times)]


def replace_arrival(req: WorkloadRequest, arrival_s: float, request_id: str) -> WorkloadRequest:
    """The same prompt at another time under another id."""
    return msgspec.structs.replace(req, arrival_s=arrival_s, request_id=request_id)


def iter_window(requests: Iterable[WorkloadRequest], start_s: float,
                end_s: float) -> Iterator[WorkloadRequest]:
    """Requests arriving in ``[start_s, end_s)``."""
    return (r for r in requests if start_s <= r.arrival_s < end_s)


__all__ = ["CodingAgentConfig", "WorkloadRequest", "block_token_ids", "coding_agent",
           "iter_window", "mooncake", "poisson", "poisson_arrivals", "replace_arrival"]
