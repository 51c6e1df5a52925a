"""A pure, step-based scheduler in the shape of vLLM's (v1): continuous batching with
chunked prefill under a per-step token budget.

Each :meth:`Scheduler.step`:

1. schedules the **running** requests first, in admission order: a decode takes one
   token of the budget; a request still prefilling takes ``min(remaining, budget)``;
2. then admits **waiting** requests in FCFS order while budget and sequence slots are
   left (and, if set, the KV capacity holds their prompt). The head of the queue blocks
   the rest (strict FCFS, as vLLM), so a long prompt is never overtaken.

   With ``long_prefill_token_threshold`` set (vLLM's setting of that name), no prefill
   takes more than that many tokens of one step while other requests are running or
   waiting, so a long prompt leaves budget for the short prompts behind it instead of
   holding the whole budget until it is done (alone it still takes the whole budget).

   With ``async_kv_load`` set, a request whose admission loads KV from the arena leaves
   the queue for the engine's KV link instead (vLLM's ``WAITING_FOR_REMOTE_KVS``, as
   its NIXL and offloading connectors load): loads run one after another on the link,
   off the step, and the request joins the running batch at the first step after its
   load is done, so a long load no longer stalls every other request's step. Without
   it the load is copied inside the request's first step (a synchronous connector).
3. prices the batch with the cost model (plus the KV loads and saves it carries), and
   applies it: prompt tokens computed, one output token for every request whose prompt
   is complete after this step (the step that computes the last prompt token samples the
   first output token, as in vLLM), finished requests leave.

A run of decode-only steps can also be taken at once (:meth:`Scheduler.decode_span`,
:meth:`Scheduler.apply_decodes`): while every running request decodes and nothing else can
join, the batch is the same from step to step and only its context grows, so the steps
up to the first finish are priced in one go, exactly as :meth:`Scheduler.step` would
price them one by one. The capacity planner uses it; a decode node then costs one event
per change of its batch instead of one per step.

Tokens a request starts with in cache (engine prefix cache or loaded from the arena) are
not computed; the last prompt token always is (its logits give the first token). No
clock of its own: the caller advances time by :attr:`StepPlan.duration_s`. No I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from cpd.sim.costmodel import CostModel

DEFAULT_MAX_BATCHED_TOKENS = 8192   # vLLM v1's default for online serving on big GPUs
DEFAULT_MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class SchedulerConfig:
    """vLLM-like limits."""

    max_num_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    # Admit a request only while running prompts + its prompt fit (None: no limit).
    kv_capacity_tokens: int | None = None
    # Engine block size: prompt blocks are written through to the arena when complete.
    block_size: int = 256
    # Most prompt tokens one request computes per step while others are eligible (0: no
    # cap, vLLM's default).
    long_prefill_token_threshold: int = 0
    # Load arena KV off the step, on the engine's KV link (see the module doc).
    async_kv_load: bool = False

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.block_size < 1:
            raise ValueError("token budget, max sequences and block size must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")


@dataclass(frozen=True)
class Admission:
    """What the caller decides when a request is first scheduled (its cache lookup)."""

    cached_tokens: int = 0   # prompt tokens not computed
    load_tokens: int = 0     # of which are copied in from the arena in this step
    # Full prompt blocks to write through to the arena once their KV exists (blocks just
    # loaded from the arena are already there: leave them out); a ``range`` is taken
    # without a membership test per block.
    save_blocks: frozenset[int] | range = frozenset()


AdmitHook = Callable[[str], Admission]


@dataclass
class SeqState:
    """A request inside the scheduler."""

    request_id: str
    prompt_len: int
    max_tokens: int
    cached_tokens: int = 0
    computed: int = 0        # prompt tokens with KV (cached + computed so far)
    output: int = 0          # output tokens produced
    admitted: bool = False
    load_tokens: int = 0
    save_blocks: frozenset[int] | range = frozenset()
    saved_upto: int = 0      # prompt blocks [0, saved_upto) handled for saving
    ready_s: float = 0.0     # asynchronous load: when its KV is in (simulated seconds)

    @property
    def remaining_prompt(self) -> int:
        return self.prompt_len - self.computed

    @property
    def context(self) -> int:
        """Tokens whose KV a decode step attends to."""
        return self.computed + max(self.output - 1, 0)


@dataclass(frozen=True)
class Advance:
    """One request's part of a step."""

    request_id: str
    new_tokens: int          # tokens computed (prompt chunk, or 1 for a decode)
    context: int             # tokens already in cache before them
    prompt_done: int         # prompt tokens with KV after the step
    output_index: int        # index of the output token this step emits; -1: none
    finished: bool = False   # reached max_tokens with this step
    load_tokens: int = 0     # KV copied in from the arena in this step
    saved_blocks: tuple[int, ...] = ()  # prompt blocks written through in this step

    @property
    def emits_token(self) -> bool:
        return self.output_index >= 0


@dataclass(frozen=True)
class StepPlan:
    """A step: who advances by how much, and for how long (simulated seconds)."""

    advances: tuple[Advance, ...]
    duration_s: float
    batched_tokens: int
    save_tokens: int = 0     # KV written through to the arena in this step


@dataclass(frozen=True)
class DecodeSpan:
    """Consecutive decode-only steps of an unchanged batch: ``ends_s[j]`` is when step
    ``j`` ends, in simulated seconds from the span's start; the last one is the first
    step after which a request finishes (or the last to start before a KV load lands)."""

    ends_s: np.ndarray

    @property
    def steps(self) -> int:
        return len(self.ends_s)

    def started_before(self, dt_s: float) -> int:
        """How many of the span's steps start before ``dt_s`` after its start (at least
        the first: it has started)."""
        if dt_s <= 0:
            return 1
        return min(len(self.ends_s), 1 + int(np.searchsorted(self.ends_s, dt_s, side="left")))


@dataclass
class Scheduler:
    """FCFS continuous batching with chunked prefill; deterministic, no clock."""

    cost: CostModel
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    admit_hook: AdmitHook | None = None
    _waiting: deque[SeqState] = field(default_factory=deque, init=False)
    _running: list[SeqState] = field(default_factory=list, init=False)
    _by_id: dict[str, SeqState] = field(default_factory=dict, init=False)
    # Asynchronous loads in flight, in link order (so ready times ascend).
    _loading: deque[SeqState] = field(default_factory=deque, init=False)
    _link_free_s: float = field(default=0.0, init=False)

    # -------------------------------------------------------------- requests

    def add(self, request_id: str, prompt_len: int, max_tokens: int,
            cached_tokens: int = 0) -> None:
        """Queue a request. ``cached_tokens`` (if no admit hook decides it later) are
        not computed; at most ``prompt_len - 1`` count."""
        if request_id in self._by_id:
            raise ValueError(f"duplicate request id {request_id!r}")
        if prompt_len < 1 or max_tokens < 1:
            raise ValueError("a request has at least one prompt token and one output token")
        seq = SeqState(request_id, prompt_len, max_tokens,
                       cached_tokens=_clamp_cached(cached_tokens, prompt_len))
        self._waiting.append(seq)
        self._by_id[request_id] = seq

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; False if unknown (finished or never added)."""
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return False
        for queue in (self._running, self._loading, self._waiting):
            if seq in queue:
                queue.remove(seq)
                break
        return True

    def finish(self, request_id: str) -> bool:
        """End a request early (a stop token); same as :meth:`abort`."""
        return self.abort(request_id)

    # ---------------------------------------------------------------- views

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._loading)

    def next_ready_s(self) -> float | None:
        """When the first asynchronous load in flight completes; None if none is."""
        return self._loading[0].ready_s if self._loading else None

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: queued, or waiting for their KV load (as vLLM)."""
        return len(self._waiting) + len(self._loading)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def get(self, request_id: str) -> SeqState | None:
        return self._by_id.get(request_id)

    def queued_prefill(self) -> list[tuple[int, int]]:
        """(uncomputed prompt tokens, their context) of every request not yet done
        prefilling, in the order they will be served."""
        out = [(s.remaining_prompt, s.computed) for s in self._running if s.remaining_prompt]
        out += [(s.remaining_prompt, s.computed) for s in self._loading]
        out += [(s.prompt_len - s.cached_tokens, s.cached_tokens) for s in self._waiting]
        return out

    # ----------------------------------------------------------------- step

    def step(self, now_s: float = 0.0) -> StepPlan | None:
        """Schedule, price and apply one step starting at simulated time ``now_s`` (only
        asynchronous loads read it); None when nothing can run now (see
        :meth:`next_ready_s` for when a load lets something run)."""
        while self._loading and self._loading[0].ready_s <= now_s:
            self._running.append(self._loading.popleft())
        if not (self._waiting or self._running):
            return None
        budget = self.config.max_num_batched_tokens
        # As vLLM: the cap applies only when another request could use the budget.
        cap = (self.config.long_prefill_token_threshold
               if len(self._running) + len(self._waiting) > 1 else 0) or budget
        picks: list[tuple[SeqState, int]] = []
        for seq in self._running:
            if budget <= 0:
                break
            n = 1 if seq.remaining_prompt == 0 else min(seq.remaining_prompt, budget, cap)
            picks.append((seq, n))
            budget -= n
        while self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            seq = self._waiting[0]
            if not seq.admitted:
                self._admit(seq)
            if not self._fits(seq):
                break
            self._waiting.popleft()
            if self.config.async_kv_load and seq.load_tokens:
                self._start_load(seq, now_s)
                continue
            self._running.append(seq)
            n = min(seq.remaining_prompt, budget, cap)
            picks.append((seq, n))
            budget -= n
        if not picks:
            # Everything admitted went to the KV link, or a KV capacity smaller than
            # one prompt holds the queue.
            return None
        return self._apply(picks)

    def decode_span(self, now_s: float = 0.0) -> DecodeSpan | None:
        """The decode-only steps from ``now_s`` on, as :meth:`step` would run them, up
        to the first one after which a request finishes; None unless every running
        request is decoding and nothing else can join before the span's last step
        starts (nothing waiting; an asynchronous load landing later cuts it short)."""
        if self._waiting or not self._running:
            return None
        running = self._running
        if len(running) > self.config.max_num_batched_tokens:
            return None
        if any(s.remaining_prompt for s in running):
            return None
        ready = self._loading[0].ready_s if self._loading else None
        if ready is not None and ready <= now_s:
            return None
        c = self.cost
        batch = len(running)
        steps = min(s.max_tokens - s.output for s in running)
        context = sum(s.context for s in running) + batch * np.arange(steps, dtype=float)
        compute = c.per_token_s * batch + c.per_pair_s * context
        memory = c.weight_read_s + c.per_kv_token_read_s * context
        ends = np.cumsum(c.overhead_s + np.maximum(compute, memory))
        if ready is not None:
            # A step that starts once the load has landed takes the loaded request too.
            ends = ends[:DecodeSpan(ends).started_before(ready - now_s)]
        return DecodeSpan(ends)

    def apply_decodes(self, steps: int) -> list[str]:
        """Apply ``steps`` steps of the current :meth:`decode_span` (at most its length):
        every running request gains that many output tokens; returns the ids of those
        that finished (they leave)."""
        done = []
        for seq in self._running:
            seq.output += steps
            if seq.output >= seq.max_tokens:
                done.append(seq)
        for seq in done:
            self._running.remove(seq)
            del self._by_id[seq.request_id]
        return [s.request_id for s in done]

    def _admit(self, seq: SeqState) -> None:
        seq.admitted = True
        if self.admit_hook is not None:
            a = self.admit_hook(seq.request_id)
            seq.cached_tokens = _clamp_cached(a.cached_tokens, seq.prompt_len)
            seq.load_tokens = min(max(a.load_tokens, 0), seq.cached_tokens)
            seq.save_blocks = a.save_blocks
        seq.computed = seq.cached_tokens

    def _start_load(self, seq: SeqState, now_s: float) -> None:
        # One link per engine: a load starts when the one before it is done.
        start = max(self._link_free_s, now_s)
        self._link_free_s = seq.ready_s = start + self.cost.kv_move_s(seq.load_tokens)
        seq.load_tokens = 0  # copied off the step: no step pays for it
        self._loading.append(seq)

    def _fits(self, seq: SeqState) -> bool:
        cap = self.config.kv_capacity_tokens
        if cap is None:
            return True
        held = [*self._running, *self._loading]
        used = sum(s.prompt_len + s.output for s in held)
        # An empty engine always takes the head request (else it would never run).
        return not held or used + seq.prompt_len + 1 <= cap

    def _apply(self, picks: list[tuple[SeqState, int]]) -> StepPlan:
        chunks: list[tuple[int, int]] = []
        decodes = decode_ctx = load = save = 0
        bs = self.config.block_size
        advances: list[Advance] = []
        for seq, n in picks:
            loaded = 0
            if seq.remaining_prompt > 0:
                chunks.append((n, seq.computed))
                if seq.load_tokens:
                    loaded, seq.load_tokens = seq.load_tokens, 0
                    load += loaded
                ctx = seq.computed
                seq.computed += n
            else:
                decodes += 1
                ctx = seq.context
                decode_ctx += ctx
            saved: tuple[int, ...] = ()
            if seq.save_blocks:
                # Like CPD's connector: every full prompt block with KV after this step,
                # cached ones included, is written through once.
                upto = min(seq.computed, seq.prompt_len) // bs
                save_set = seq.save_blocks
                if isinstance(save_set, range) and save_set.step == 1:
                    saved = tuple(range(max(seq.saved_upto, save_set.start),
                                        min(upto, save_set.stop)))
                else:
                    saved = tuple(i for i in range(seq.saved_upto, upto) if i in save_set)
                seq.saved_upto = max(seq.saved_upto, upto)
                save += len(saved) * bs
            emits = seq.remaining_prompt == 0
            index = -1
            if emits:
                index = seq.output
                seq.output += 1
            finished = seq.output >= seq.max_tokens
            advances.append(Advance(seq.request_id, n, ctx, seq.computed, index, finished,
                                    loaded, saved))
            if finished:
                self._running.remove(seq)
                del self._by_id[seq.request_id]
        duration = (self.cost.step_s(chunks, decodes, decode_ctx)
                    + self.cost.kv_move_s(load) + self.cost.kv_move_s(save))
        return StepPlan(tuple(advances), duration, sum(n for _, n in picks), save)


def _clamp_cached(cached: int, prompt_len: int) -> int:
    # The last prompt token is always computed: its logits are the first output.
    return min(max(cached, 0), prompt_len - 1)


def estimate_queue_s(cost: CostModel, queued: list[tuple[int, int]],
                     chunk_tokens: int = DEFAULT_MAX_BATCHED_TOKENS) -> float:
    """Time to clear the queued prefill work ``queued`` as (new tokens, context), in
    chunks of ``chunk_tokens`` (the load report's estimate; decodes not counted)."""
    total = 0.0
    for new, ctx in queued:
        chunks = -(-new // chunk_tokens) if new > 0 else 0
        total += cost.prefill_s(new, ctx) + cost.overhead_s * max(chunks - 1, 0)
    return total
