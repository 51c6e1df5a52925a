"""``SimEngine``: the engine protocol (:mod:`cpd.engines.protocol`) on a cost model, for
scale and capacity experiments (docs/architecture.md, "Engines", like Dynamo's mocker).

* Steps come from :class:`~cpd.sim.scheduler.Scheduler` (FCFS, token budget, chunked
  prefill, continuous batching); each one takes its simulated duration divided by
  ``time_scale`` of wall time (``asyncio.sleep`` to an absolute deadline, so lateness
  does not accumulate). A step that follows another starts where it ended in simulated
  time, as a GPU's does: the host's own time between steps is not simulated compute
  unless the host falls more than ``sim.host_slack_s`` behind. While idle, simulated time
  follows wall time × ``time_scale``.
* Output tokens are pseudo-random ids derived from (prompt tokens, position): two runs,
  and a run with or without cache hits, produce identical tokens: the "deterministic
  sim" reference for the correctness test of the KV path. KV that passed its checksum
  but is not the prompt's KV (a wrong block served) changes the tokens, as it would on
  a real engine. Of the sampling settings only ``max_tokens``, ``stop_token_ids``,
  ``ignore_eos`` and a seed (with a temperature) shape them; forced output tokens are
  taken as given and not reported again.
* KV blocks behave like CPD's vLLM connector (:mod:`cpd.engines.vllm.connector`): on save,
  deterministic bytes derived from the block's tokens and position are written to its
  arena slot (``np.memmap`` of ``(num_slots, slot_bytes)``); on load, each slot's
  xxh3-64 is checked against ``load_checksums`` and the first mismatch makes that block
  and the rest of the load recompute (their prefill time is charged), counted in
  ``failed_blocks``. The engine keeps a GPU prefix cache of its own (vLLM's automatic
  prefix caching), which counts in ``gpu_blocks``.
* :meth:`SimEngine.load_report` gives what the router needs (queue depth, queued new
  tokens, estimated queue time in simulated ms, in-flight).
* Like vLLM's KV cache events, changes of that GPU prefix cache go to ``cache_listener``
  (blocks stored with their tokens, blocks removed, all cleared); the worker forwards them
  to kvindex as GPU-tier events. Blocks of salted requests are not reported, as the vLLM
  bridge skips them: kvindex could not hash them in the tenant's namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import numpy as np
import xxhash

from cpd.engines.protocol import ArenaSpec, EngineRequest, EngineStep
from cpd.kvstore import checksum
from cpd.sim.costmodel import DEFAULT_PRESET, CostModel, preset
from cpd.sim.prefixcache import TOKEN_DTYPE, PrefixCache, chain_hashes
from cpd.sim.scheduler import Admission, Scheduler, SchedulerConfig, StepPlan, estimate_queue_s

from .cacheevents import CacheCleared, CacheEvent, CacheRemoved, CacheStored

DEFAULT_BLOCK_SIZE = 256
DEFAULT_MAX_MODEL_LEN = 262_144   # the coding-agent contexts reach 200K+ tokens
DEFAULT_VOCAB = 32_000
FINISH_LENGTH = "length"
FINISH_STOP = "stop"
FINISH_ABORT = "abort"
# Wall seconds the host may lag between two steps before the lag counts as simulated
# time (the host, not the modelled GPU, is then the bottleneck).
HOST_SLACK_S = 0.005
_MASK64 = (1 << 64) - 1


def block_bytes(block_hash: int, index: int, nbytes: int) -> np.ndarray:
    """The simulated KV of prompt block ``index`` whose chained hash is ``block_hash``:
    deterministic bytes, so equal prefixes give equal slots (and checksums)."""
    rng = np.random.default_rng([block_hash, index])
    return np.frombuffer(rng.bytes(nbytes), dtype=np.uint8)


def output_token(seed: int, index: int, vocab: int) -> int:
    """Output token ``index`` of a request whose token stream is seeded by ``seed``."""
    return xxhash.xxh3_64_intdigest(index.to_bytes(8, "little"), seed=seed) % vocab


@dataclass(frozen=True)
class LoadReport:
    """An engine's load, as the worker publishes it on ``cpd.v1.load.<role>.<node>``."""

    queue_depth: int          # requests waiting to start
    running: int              # requests in the running batch
    in_flight: int            # streams open (waiting + running)
    queued_new_tokens: int    # prompt tokens still to compute
    queue_ms: float           # simulated time to clear the queued prefill work


@dataclass
class _Stream:
    request: EngineRequest
    tokens: np.ndarray
    hashes: list[int]
    queue: asyncio.Queue[EngineStep | BaseException | None]
    seed: int
    cached_tokens: int = 0
    gpu_blocks: int = 0
    loaded_blocks: int = 0
    failed_blocks: int = 0
    saved_blocks: int = 0
    kv_digest: int = 0          # != 0: some loaded KV was not this prompt's
    inserted_upto: int = 0      # blocks [0, inserted_upto) put in the prefix cache
    first_load: int = 0
    done: bool = False
    stops: frozenset[int] = field(default_factory=frozenset)
    scheduled_at: float = 0.0   # time.monotonic() when first scheduled


class SimEngine:
    """A simulated engine: real asyncio streaming, simulated compute."""

    stops_at_whole_text = False  # its tokens have no text

    def __init__(self, cost: CostModel | str = DEFAULT_PRESET, *,
                 block_size: int = DEFAULT_BLOCK_SIZE, arena: ArenaSpec | None = None,
                 time_scale: float = 1.0, scheduler: SchedulerConfig | None = None,
                 max_model_len: int = DEFAULT_MAX_MODEL_LEN, vocab_size: int = DEFAULT_VOCAB,
                 prefix_caching: bool = True, gpu_cache_blocks: int | None = None,
                 host_slack_s: float = HOST_SLACK_S) -> None:
        if time_scale <= 0 or host_slack_s < 0:
            raise ValueError("time_scale must be > 0 and host_slack_s >= 0")
        self.host_slack_s = host_slack_s
        self.cost = preset(cost) if isinstance(cost, str) else cost
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.arena = arena
        self.time_scale = time_scale
        self.vocab_size = vocab_size
        self.prefix_caching = prefix_caching
        cfg = replace(scheduler or SchedulerConfig(), block_size=block_size)
        self._sched = Scheduler(self.cost, cfg, admit_hook=self._admit)
        cap = (gpu_cache_blocks if gpu_cache_blocks is not None
               else self.cost.kv_capacity_tokens // block_size)
        self.prefix_cache = PrefixCache(cap if prefix_caching else 0)
        self._streams: dict[str, _Stream] = {}
        self._arena: np.ndarray | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._t0 = 0.0
        self._sim_clock = 0.0
        self.steps = 0
        self.busy_s = 0.0   # simulated time spent in steps (utilisation = busy / elapsed)
        # Where GPU prefix-cache changes go (the worker's kvindex forwarding); None: nowhere.
        self.cache_listener: Callable[[CacheEvent], None] | None = None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Map the arena and start the step loop."""
        if self._task is not None:
            return
        if self.arena is not None:
            self._arena = np.memmap(self.arena.path, dtype=np.uint8, mode="r+",
                                    shape=(self.arena.num_slots, self.arena.slot_bytes))
        loop = asyncio.get_running_loop()
        self._t0 = loop.time()
        self._sim_clock = 0.0
        self._task = asyncio.create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        """Stop the loop; open streams end with an ``abort`` step."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for rid in list(self._streams):
            self._end(rid, FINISH_ABORT)
        if self._arena is not None:
            self._arena.flush()
            self._arena = None

    def sim_now(self) -> float:
        """Simulated seconds since :meth:`start`."""
        return max(self._sim_clock, self._wall_sim())

    def _wall_sim(self) -> float:
        if self._task is None:
            return self._sim_clock
        return (asyncio.get_running_loop().time() - self._t0) * self.time_scale

    # ------------------------------------------------------------ requests

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineStep]:
        """Stream the request's steps (token deltas); the last one has ``finished``."""
        if self._task is None:
            raise RuntimeError("start() the engine first")
        rid = request.request_id
        n = len(request.tokens)
        max_tokens = request.sampling.max_tokens
        if n < 1:
            raise ValueError("a prompt has at least one token")
        if n + max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({n}) + max_tokens ({max_tokens}) exceeds "
                             f"max_model_len {self.max_model_len}")
        if rid in self._streams:
            raise ValueError(f"request {rid!r} is already running")
        tokens = np.ascontiguousarray(request.tokens, dtype=TOKEN_DTYPE)
        s = request.sampling
        seed = xxhash.xxh3_64_intdigest(tokens.tobytes())
        if s.temperature > 0 and s.seed is not None:
            seed = xxhash.xxh3_64_intdigest(seed.to_bytes(8, "little"),
                                            seed=s.seed & _MASK64)
        st = _Stream(request, tokens,
                     chain_hashes(tokens, self.block_size, request.cache_salt), asyncio.Queue(),
                     seed, stops=frozenset(s.stop_token_ids))
        self._streams[rid] = st
        self._sched.add(rid, n, max_tokens, cached_tokens=self._provisional_cached(st))
        self._wake.set()
        try:
            while True:
                item = await st.queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not st.done:  # the consumer went away: free the request
                self._sched.abort(rid)
                st.done = True
            self._streams.pop(rid, None)

    async def reset_prefix_cache(self) -> bool:
        """Drop the simulated engine prefix cache (the GPU tier), as vLLM's does."""
        self.prefix_cache.clear()
        if self.cache_listener is not None:
            self.cache_listener(CacheCleared())
        return True

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with a finished ``abort`` step."""
        if request_id in self._streams:
            self._sched.abort(request_id)
            self._end(request_id, FINISH_ABORT)

    def load_report(self) -> LoadReport:
        """Queue depth, queued new tokens, estimated queue time (simulated ms), in-flight."""
        queued = self._sched.queued_prefill()
        return LoadReport(
            queue_depth=self._sched.num_waiting, running=self._sched.num_running,
            in_flight=self._sched.num_waiting + self._sched.num_running,
            queued_new_tokens=sum(t for t, _ in queued),
            queue_ms=1e3 * estimate_queue_s(self.cost, queued,
                                            self._sched.config.max_num_batched_tokens))

    # ------------------------------------------------------------ KV plan

    def _load_cap(self, st: _Stream) -> int:
        # The last prompt token is always computed: its logits are the first output.
        return (len(st.tokens) - 1) // self.block_size

    def _provisional_cached(self, st: _Stream) -> int:
        """Cached tokens as far as known now (for the load report until admission)."""
        cap = self._load_cap(st)
        gpu = 0
        if self.prefix_caching:
            for h in st.hashes[:cap]:
                if h not in self.prefix_cache:
                    break
                gpu += 1
        return max(gpu, min(len(st.request.load_slots), cap)) * self.block_size

    def _admit(self, request_id: str) -> Admission:
        """Called by the scheduler when the request is first scheduled: the engine's
        prefix cache, then the arena loads (verified), then the blocks to save."""
        st = self._streams[request_id]
        st.scheduled_at = time.monotonic()
        req, bs, cap = st.request, self.block_size, self._load_cap(st)
        gpu = self.prefix_cache.match(st.hashes[:cap]) if self.prefix_caching else 0
        have = min(len(req.load_slots), cap) if self._arena is not None else 0
        loaded = failed = 0
        digest = 0
        for i in range(gpu, have):
            slot = self._arena[req.load_slots[i]]  # type: ignore[index]
            got = checksum(slot)
            ck = req.load_checksums[i] if i < len(req.load_checksums) else 0
            if ck and got != ck:
                failed = have - i  # recomputed from the first bad block on, as vLLM does
                break
            want = checksum(block_bytes(st.hashes[i], i, len(slot)))
            if got != want:
                digest = xxhash.xxh3_64_intdigest(got.to_bytes(8, "little"), seed=digest)
            loaded += 1
        st.gpu_blocks, st.loaded_blocks, st.failed_blocks = gpu, loaded, failed
        st.first_load, st.kv_digest = gpu, digest
        st.cached_tokens = (gpu + loaded) * bs
        saves = req.save_slots
        save = frozenset(i for i in range(min(len(saves), len(st.hashes)))
                         if saves[i] >= 0 and not gpu <= i < gpu + loaded) \
            if self._arena is not None else frozenset()
        return Admission(cached_tokens=st.cached_tokens, load_tokens=loaded * bs,
                         save_blocks=save)

    # ------------------------------------------------------------ step loop

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        chained = False   # the previous iteration ran a step: the next one follows it
        try:
            while True:
                if not self._sched.has_work():
                    chained = False
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                wall = self._wall_sim()   # after a step, the next starts where it ended
                start = (self._sim_clock if chained and wall - self._sim_clock
                         <= self.host_slack_s * self.time_scale else max(self._sim_clock, wall))
                plan = self._sched.step(start)
                chained = plan is not None
                if plan is None:  # only KV loads in flight (or a KV cap holds the queue)
                    self._wake.clear()
                    ready = self._sched.next_ready_s()
                    timeout = (None if ready is None
                               else max(self._t0 + ready / self.time_scale - loop.time(), 0.0))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), timeout)
                    continue
                end = start + plan.duration_s
                delay = self._t0 + end / self.time_scale - loop.time()
                await asyncio.sleep(max(delay, 0.0))
                self._sim_clock = end
                self.steps += 1
                self.busy_s += plan.duration_s
                self._deliver(plan)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave a stream hanging on a broken loop
            for st in self._streams.values():
                st.done = True
                st.queue.put_nowait(exc)
            raise

    def _deliver(self, plan: StepPlan) -> None:
        bs = self.block_size
        wrote = False
        for adv in plan.advances:
            st = self._streams.get(adv.request_id)
            if st is None or st.done:
                continue  # aborted while the step ran: its results are dropped
            done_blocks = min(adv.prompt_done // bs, len(st.hashes))
            if self.prefix_caching and done_blocks > st.inserted_upto:
                self._cache_insert(st, done_blocks)
                st.inserted_upto = done_blocks
            for i in adv.saved_blocks:
                self._save(st, i)
                wrote = True
            if not adv.emits_token:
                continue
            forced = st.request.forced_output
            if adv.output_index < len(forced):  # the caller has it: not reported again
                tok, ids = forced[adv.output_index], []
            else:
                tok = output_token(st.seed ^ st.kv_digest, adv.output_index, self.vocab_size)
                ids = [tok]
            stop = bool(ids) and tok in st.stops and not st.request.sampling.ignore_eos
            finished = adv.finished or stop
            step = EngineStep(token_ids=ids, finished=finished,
                              prompt_tokens=len(st.tokens), cached_tokens=st.cached_tokens)
            if finished:
                if stop:
                    self._sched.finish(adv.request_id)
                    step.stop_token = tok
                step.finish_reason = FINISH_STOP if stop else FINISH_LENGTH
                self._fill_kv_counts(st, step)
                st.done = True
            st.queue.put_nowait(step)
        if wrote and self._arena is not None:
            self._arena.flush()

    def _cache_insert(self, st: _Stream, n: int) -> None:
        """Put the prompt's first ``n`` blocks in the prefix cache, reporting what
        entered and what it evicted."""
        hashes = st.hashes[:n]
        listener = self.cache_listener
        if listener is None:
            self.prefix_cache.insert(hashes)
            return
        # Earlier blocks of this prompt may have been evicted meanwhile: they come back.
        absent = [i for i, h in enumerate(hashes) if h not in self.prefix_cache]
        evicted = self.prefix_cache.insert(hashes)
        # (A prompt longer than the cache holds only its tail.)
        new = [i for i in absent if hashes[i] in self.prefix_cache]
        if evicted:
            listener(CacheRemoved(evicted))
        if st.request.cache_salt:
            return
        bs = self.block_size
        start = 0
        for k in range(1, len(new) + 1):  # one event per run of consecutive new blocks
            if k == len(new) or new[k] != new[k - 1] + 1:
                first, last = new[start], new[k - 1] + 1
                listener(CacheStored(hashes[first:last], hashes[first - 1] if first else None,
                                     st.tokens[first * bs:last * bs]))
                start = k

    def _save(self, st: _Stream, index: int) -> None:
        assert self._arena is not None
        slot = st.request.save_slots[index]
        self._arena[slot] = block_bytes(st.hashes[index], index, self._arena.shape[1])
        st.saved_blocks += 1

    @staticmethod
    def _fill_kv_counts(st: _Stream, step: EngineStep) -> None:
        # Like the vLLM engine: the connector's counts arrive with the final output.
        step.gpu_blocks, step.loaded_blocks = st.gpu_blocks, st.loaded_blocks
        step.failed_blocks, step.saved_blocks = st.failed_blocks, st.saved_blocks
        step.scheduled_at = st.scheduled_at

    def _end(self, request_id: str, reason: str) -> None:
        st = self._streams.get(request_id)
        if st is None or st.done:
            return
        st.done = True
        step = EngineStep(finished=True, finish_reason=reason, prompt_tokens=len(st.tokens),
                          cached_tokens=st.cached_tokens)
        self._fill_kv_counts(st, step)
        st.queue.put_nowait(step)
