"""SimEngine honours the engine contract (cpd.engines.protocol) like VllmEngine does:
streamed deltas ending in a finished step, abort, deterministic tokens, arena
write-through and verified loads (a bad checksum recomputes, tokens unchanged)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import pytest

from cpd.engines import ArenaSpec, EngineRequest, EngineStep
from cpd.engines.sim.engine import (
    HOST_SLACK_S,
    CacheCleared,
    CacheEvent,
    CacheRemoved,
    CacheStored,
    SimEngine,
    block_bytes,
    checksum,
)
from cpd.protocol import wire
from cpd.sim.costmodel import B200_TP4_8B
from cpd.sim.prefixcache import chain_hashes
from cpd.sim.scheduler import SchedulerConfig

pytestmark = pytest.mark.timeout(20)

BS = 256
SLOTS = 8
SLOT_BYTES = 4096   # scaled-down KV: real bytes, not 32 MiB per block
FAST = 1000.0       # simulated seconds per wall second
PROMPT = np.random.default_rng(3).integers(0, 30_000, size=3 * BS + 5).tolist()
GREEDY = wire.SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture
def arena_spec(tmp_path: Path) -> ArenaSpec:
    path = tmp_path / "arena"
    np.memmap(path, dtype=np.uint8, mode="w+", shape=(SLOTS, SLOT_BYTES)).flush()
    return ArenaSpec(str(path), SLOTS, SLOT_BYTES)


@pytest.fixture
def arena(arena_spec: ArenaSpec) -> np.memmap:
    return np.memmap(arena_spec.path, dtype=np.uint8, mode="r+", shape=(SLOTS, SLOT_BYTES))


@pytest.fixture
async def engine(arena_spec: ArenaSpec) -> AsyncIterator[SimEngine]:
    e = SimEngine(B200_TP4_8B, block_size=BS, arena=arena_spec, time_scale=FAST,
                  prefix_caching=False)
    await e.start()
    yield e
    await e.stop()


async def gen(e: SimEngine, rid: str, prompt: list[int] = PROMPT,
              sampling: wire.SamplingParams = GREEDY, **kw: object) -> list[EngineStep]:
    return [s async for s in e.generate(EngineRequest(rid, prompt, sampling, **kw))]


def tokens(steps: list[EngineStep]) -> list[int]:
    return [t for s in steps for t in s.token_ids]


async def test_streams_deltas_ending_in_a_finished_step(engine: SimEngine) -> None:
    steps = await gen(engine, "a")
    assert len(steps) == 10 and all(len(s.token_ids) == 1 for s in steps)
    assert [s.finished for s in steps] == [False] * 9 + [True]
    assert steps[-1].finish_reason == "length"
    assert all(s.prompt_tokens == len(PROMPT) and s.cached_tokens == 0 for s in steps)
    assert all(0 <= t < engine.vocab_size for t in tokens(steps))
    assert len(set(tokens(steps))) > 5  # pseudo-random, not a constant


async def test_tokens_are_deterministic_across_engines_and_prompts(
        engine: SimEngine, arena_spec: ArenaSpec) -> None:
    first = tokens(await gen(engine, "a"))
    other = SimEngine(B200_TP4_8B, block_size=BS, arena=arena_spec, time_scale=FAST)
    await other.start()
    try:
        assert tokens(await gen(other, "b")) == first
        changed = tokens(await gen(other, "c", [*PROMPT[:-1], PROMPT[-1] + 1]))
        assert changed != first
    finally:
        await other.stop()


async def test_arena_save_then_load_gives_identical_tokens(engine: SimEngine,
                                                           arena: np.memmap) -> None:
    plain = tokens(await gen(engine, "plain"))
    saved = await gen(engine, "save", save_slots=[0, 1, 2])
    assert saved[-1].saved_blocks == 3 and tokens(saved) == plain
    # The slots hold the deterministic KV of the prompt's blocks.
    hashes = chain_hashes(PROMPT, BS)
    for i in range(3):
        assert np.array_equal(arena[i], block_bytes(hashes[i], i, SLOT_BYTES))
    cks = [checksum(arena[i]) for i in range(3)]
    load = await gen(engine, "load", load_slots=[0, 1, 2], load_checksums=cks)
    last = load[-1]
    assert (last.loaded_blocks, last.failed_blocks, last.cached_tokens) == (3, 0, 3 * BS)
    assert tokens(load) == plain


async def test_loaded_prefix_skips_its_prefill_time(engine: SimEngine,
                                                   arena: np.memmap) -> None:
    # Deterministic simulated busy time, not wall time.
    prompt = np.random.default_rng(5).integers(0, 30_000, size=SLOTS * BS + 5).tolist()
    slots = list(range(SLOTS))
    one = wire.SamplingParams(max_tokens=1)
    b0 = engine.busy_s
    await gen(engine, "cold", prompt, one, save_slots=slots)
    cold = engine.busy_s - b0
    b1 = engine.busy_s
    cks = [checksum(arena[i]) for i in slots]
    await gen(engine, "warm", prompt, one, load_slots=slots, load_checksums=cks)
    warm = engine.busy_s - b1
    cost, cached = engine.cost, SLOTS * BS
    # Cold: the whole prompt plus writing its blocks through; warm: 5 tokens after the
    # cached ones plus copying them in.
    assert cold == pytest.approx(cost.prefill_s(len(prompt)) + cost.kv_move_s(cached))
    assert warm == pytest.approx(cost.prefill_s(5, cached) + cost.kv_move_s(cached))
    assert warm < cold / 2


async def test_async_load_is_off_the_step_and_gives_identical_tokens(
        arena_spec: ArenaSpec, arena: np.memmap) -> None:
    e = SimEngine(B200_TP4_8B, block_size=BS, arena=arena_spec, time_scale=FAST,
                  prefix_caching=False, scheduler=SchedulerConfig(async_kv_load=True))
    await e.start()
    try:
        prompt = np.random.default_rng(5).integers(0, 30_000, size=SLOTS * BS + 5).tolist()
        slots = list(range(SLOTS))
        one = wire.SamplingParams(max_tokens=1)
        plain = tokens(await gen(e, "cold", prompt, one, save_slots=slots))
        b0, t0 = e.busy_s, e.sim_now()
        cks = [checksum(arena[i]) for i in slots]
        warm = await gen(e, "warm", prompt, one, load_slots=slots, load_checksums=cks)
        cached = SLOTS * BS
        # The engine waited for its link with nothing to run, then ran only the suffix.
        assert e.busy_s - b0 == pytest.approx(e.cost.prefill_s(5, cached))
        assert e.sim_now() - t0 >= e.cost.kv_move_s(cached)
        assert warm[-1].loaded_blocks == SLOTS and tokens(warm) == plain
    finally:
        await e.stop()


async def test_checksum_mismatch_recomputes_with_identical_tokens(engine: SimEngine,
                                                                  arena: np.memmap) -> None:
    plain = tokens(await gen(engine, "save", save_slots=[0, 1, 2]))
    cks = [checksum(arena[i]) for i in range(3)]
    arena[1, 0] ^= 0xFF  # corrupt block 1 after sealing
    arena.flush()
    load = await gen(engine, "load", load_slots=[0, 1, 2], load_checksums=cks)
    last = load[-1]
    # Block 0 loads; blocks 1 and 2 are recomputed (from the first bad block on).
    assert (last.loaded_blocks, last.failed_blocks, last.cached_tokens) == (1, 2, BS)
    assert tokens(load) == plain


async def test_wrong_kv_with_a_valid_checksum_changes_the_tokens(engine: SimEngine,
                                                                 arena: np.memmap) -> None:
    plain = tokens(await gen(engine, "save", save_slots=[0, 1, 2]))
    arena[[1, 2]] = arena[[2, 1]]  # a routing bug: the right checksums, the wrong blocks
    arena.flush()
    cks = [checksum(arena[i]) for i in range(3)]
    load = await gen(engine, "load", load_slots=[0, 1, 2], load_checksums=cks)
    assert load[-1].loaded_blocks == 3 and tokens(load) != plain


async def test_engine_prefix_cache_counts_gpu_blocks(arena_spec: ArenaSpec) -> None:
    e = SimEngine(B200_TP4_8B, block_size=BS, arena=arena_spec, time_scale=FAST)
    await e.start()
    try:
        first = await gen(e, "a")
        again = await gen(e, "b")
        assert first[-1].gpu_blocks == 0
        assert (again[-1].gpu_blocks, again[-1].cached_tokens) == (3, 3 * BS)
        assert tokens(again) == tokens(first)
    finally:
        await e.stop()


async def test_prefix_cache_changes_are_reported_like_vllm_kv_events(
        arena_spec: ArenaSpec) -> None:
    """Stored runs carry their parent and tokens, evictions and resets are reported,
    salted requests keep their own blocks (and are not reported: kvindex could not hash
    them in the tenant's namespace)."""
    e = SimEngine(B200_TP4_8B, block_size=BS, arena=arena_spec, time_scale=FAST,
                  gpu_cache_blocks=4)
    seen: list[CacheEvent] = []
    e.cache_listener = seen.append
    await e.start()
    try:
        await gen(e, "a")
        hashes = chain_hashes(PROMPT, BS)
        stored = [ev for ev in seen if isinstance(ev, CacheStored)]
        assert [h for ev in stored for h in ev.hashes] == hashes
        assert stored[0].parent is None
        assert np.concatenate([ev.tokens for ev in stored]).tolist() == PROMPT[:3 * BS]
        seen.clear()
        other = np.random.default_rng(4).integers(0, 30_000, size=2 * BS + 1).tolist()
        await gen(e, "b", other)  # 3 + 2 blocks in a 4-block cache: one evicted
        assert [ev for ev in seen if isinstance(ev, CacheRemoved)] == [
            CacheRemoved([hashes[2]])]  # a prompt's tail goes first
        seen.clear()
        salted = await gen(e, "c", cache_salt="tenant-b")
        assert salted[-1].gpu_blocks == 0  # the default tenant's blocks are not its own
        assert not [ev for ev in seen if isinstance(ev, CacheStored)]
        assert await e.reset_prefix_cache() and isinstance(seen[-1], CacheCleared)
    finally:
        await e.stop()


async def test_abort_ends_the_stream_and_the_engine_keeps_serving(engine: SimEngine) -> None:
    plain = tokens(await gen(engine, "plain"))
    got = []
    async for step in engine.generate(EngineRequest(
            "long", PROMPT, wire.SamplingParams(max_tokens=100_000, ignore_eos=True))):
        got.extend(step.token_ids)
        if len(got) == 3:
            await engine.abort("long")
        if step.finished:
            assert step.finish_reason == "abort"
    assert len(got) == 3
    assert engine.load_report().in_flight == 0
    assert tokens(await gen(engine, "after")) == plain


async def test_consumer_going_away_frees_the_request(engine: SimEngine) -> None:
    stream = engine.generate(EngineRequest("x", PROMPT, wire.SamplingParams(max_tokens=1000)))
    async for _ in stream:
        break
    await stream.aclose()
    assert engine.load_report().in_flight == 0


async def test_stop_token_ends_with_stop(engine: SimEngine) -> None:
    plain = tokens(await gen(engine, "plain"))
    sampling = wire.SamplingParams(max_tokens=10, stop_token_ids=[plain[4]])
    steps = await gen(engine, "s", sampling=sampling)
    assert tokens(steps) == plain[:plain.index(plain[4]) + 1]
    assert steps[-1].finish_reason == "stop"


async def test_concurrent_requests_and_load_report(engine: SimEngine) -> None:
    prompts = [np.random.default_rng(i).integers(0, 30_000, size=2000).tolist()
               for i in range(4)]
    streams = [asyncio.create_task(gen(engine, f"r{i}", p)) for i, p in enumerate(prompts)]
    await asyncio.sleep(0)  # let them queue
    report = engine.load_report()
    assert report.in_flight == 4 and report.queued_new_tokens == 4 * 2000
    assert report.queue_ms > 0
    outs = await asyncio.gather(*streams)
    assert all(len(tokens(o)) == 10 for o in outs)
    assert engine.load_report() == type(report)(0, 0, 0, 0, 0.0)


async def test_time_scale_paces_wall_time() -> None:
    e = SimEngine(B200_TP4_8B, block_size=BS, time_scale=10.0, prefix_caching=False)
    await e.start()
    try:
        t0, s0 = time.monotonic(), e.sim_now()
        await gen(e, "a", sampling=wire.SamplingParams(max_tokens=40))
        wall, sim = time.monotonic() - t0, e.sim_now() - s0
    finally:
        await e.stop()
    # ~40 steps of ~3 ms simulated = ~0.1 s simulated = ~10 ms wall at 10x.
    assert sim > 40 * B200_TP4_8B.overhead_s
    assert wall >= 0.9 * sim / 10.0


async def _host_lag_gap(monkeypatch: pytest.MonkeyPatch, lag: Callable[[int], float], *,
                        slack_s: float = HOST_SLACK_S) -> tuple[int, float]:
    """Generate 20 tokens with the host blocking ``lag(step)`` seconds after each step;
    the steps run and the simulated clock's excess over the steps' own time (the first
    step's start, simulated time while idle following the wall clock, plus any lag that
    counted)."""
    e = SimEngine(B200_TP4_8B, block_size=BS, time_scale=1.0, prefix_caching=False,
                  host_slack_s=slack_s)
    deliver = e._deliver

    def slow_deliver(plan: object) -> None:
        deliver(plan)  # type: ignore[arg-type]
        time.sleep(lag(e.steps))

    monkeypatch.setattr(e, "_deliver", slow_deliver)
    await e.start()
    try:
        await gen(e, "a", sampling=wire.SamplingParams(max_tokens=20, ignore_eos=True))
    finally:
        await e.stop()
    return e.steps, e._sim_clock - e.busy_s


@pytest.mark.parametrize(("lag_s", "chained"), [(0.002, True), (2 * HOST_SLACK_S, False)])
async def test_host_lag_between_steps_is_not_simulated_compute(
        monkeypatch: pytest.MonkeyPatch, lag_s: float, chained: bool) -> None:
    """Back-to-back steps chain in simulated time, as a GPU's do: the host blocking
    ``lag_s`` after each step (delivering tokens, other work on the loop) does not move
    the next step's start while it is under the slack; past it, the host is the
    bottleneck and its lag counts."""
    steps, gap = await _host_lag_gap(monkeypatch, lambda _: lag_s)
    assert steps == 20
    if chained:
        assert gap < 0.5 * (steps - 1) * lag_s
    else:
        assert gap >= (steps - 1) * lag_s


@pytest.mark.parametrize(("slack_s", "counted"), [(HOST_SLACK_S, True),
                                                  (10 * HOST_SLACK_S, False)])
async def test_a_host_stall_counts_only_past_the_configured_slack(
        monkeypatch: pytest.MonkeyPatch, slack_s: float, counted: bool) -> None:
    """One 20 ms stall of the host between two steps (``sim.host_slack_s``): past a 5 ms
    slack it is simulated time; within a 50 ms one the next steps catch up with their
    deadlines and the simulated clock is the steps' own."""
    stall = 0.02
    _, gap = await _host_lag_gap(monkeypatch, lambda step: stall if step == 5 else 0.0,
                                 slack_s=slack_s)
    assert (gap >= stall) is counted, gap


async def test_rejects_bad_requests(engine: SimEngine) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        await gen(engine, "big", sampling=wire.SamplingParams(max_tokens=engine.max_model_len))
    with pytest.raises(ValueError):
        await gen(engine, "empty", [])
    with pytest.raises(ValueError):
        SimEngine(time_scale=0)
