"""The sim scheduler: FCFS, token budget, chunked prefill, continuous batching of
decodes, cached tokens, write-through pricing, determinism (virtual clock only)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpd.sim.costmodel import B200_TP4_8B
from cpd.sim.scheduler import Admission, Scheduler, SchedulerConfig, StepPlan, estimate_queue_s

pytestmark = pytest.mark.timeout(30)
COST = B200_TP4_8B


def sched(budget: int = 100, seqs: int = 8, **kw: object) -> Scheduler:
    return Scheduler(COST, SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs,
                                           **kw))


def run(s: Scheduler, limit: int = 10_000) -> list[StepPlan]:
    plans = []
    while (p := s.step()) is not None:
        plans.append(p)
        assert len(plans) < limit
    return plans


def by_id(plan: StepPlan) -> dict[str, tuple[int, int, int]]:
    return {a.request_id: (a.new_tokens, a.context, a.output_index) for a in plan.advances}


def test_chunked_prefill_then_first_token() -> None:
    s = sched(budget=100)
    s.add("a", prompt_len=250, max_tokens=2)
    plans = run(s)
    # 100 + 100 + 50 prompt tokens; the step computing the last one samples token 0.
    assert [by_id(p)["a"] for p in plans] == [(100, 0, -1), (100, 100, -1), (50, 200, 0),
                                              (1, 250, 1)]
    assert plans[-1].advances[0].finished and not s.has_work()


def test_fcfs_head_blocks_and_budget_fills_in_order() -> None:
    s = sched(budget=100)
    s.add("long", 250, 1)
    s.add("short", 10, 1)
    plans = run(s)
    assert list(by_id(plans[0])) == ["long"]           # budget used up by the head
    assert list(by_id(plans[1])) == ["long"]
    assert by_id(plans[2]) == {"long": (50, 200, 0), "short": (10, 0, 0)}  # leftover budget
    assert all(p.batched_tokens <= 100 for p in plans)


def test_long_prefill_threshold_leaves_budget_for_short_prompts() -> None:
    """vLLM's long_prefill_token_threshold: a long prompt running alone takes the whole
    budget; once another request is eligible it takes at most the cap per step, so a
    short prompt behind it starts in the next step instead of after it."""
    s = sched(budget=100, long_prefill_token_threshold=30)
    s.add("long", 250, 1)
    first = s.step()
    assert first is not None and by_id(first) == {"long": (100, 0, -1)}  # alone: no cap
    s.add("short", 40, 1)
    second = s.step()
    assert second is not None
    assert by_id(second) == {"long": (30, 100, -1), "short": (30, 0, -1)}
    third = s.step()
    assert third is not None
    assert by_id(third) == {"long": (30, 130, -1), "short": (10, 30, 0)}  # short done
    rest = run(s)  # alone again: the rest of its prompt in one step
    assert [by_id(p) for p in rest] == [{"long": (90, 160, 0)}]
    # Without the cap the short prompt waits for the long one's last chunk.
    plain = sched(budget=100)
    plain.add("long", 250, 1)
    plain.step()
    plain.add("short", 40, 1)
    steps = run(plain)
    assert [list(by_id(p)) for p in steps[:2]] == [["long"], ["long", "short"]]
    with pytest.raises(ValueError):
        SchedulerConfig(long_prefill_token_threshold=-1)


def test_decodes_batch_continuously_with_new_prefills() -> None:
    s = sched(budget=64, seqs=3)
    for r in ("a", "b"):
        s.add(r, 8, 5)
    first = s.step()
    assert first is not None and {a.output_index for a in first.advances} == {0}
    s.add("c", 40, 2)
    s.add("d", 8, 2)   # max_num_seqs=3: waits for a slot
    second = s.step()
    assert second is not None
    assert by_id(second) == {"a": (1, 8, 1), "b": (1, 8, 1), "c": (40, 0, 0)}
    # The step is priced as one mixed batch: two decodes and a 40-token chunk.
    assert second.duration_s == pytest.approx(COST.step_s([(40, 0)], 2, 16))
    plans = run(s)
    assert "d" in by_id(plans[-1]) and not s.has_work()


def test_cached_tokens_are_not_computed() -> None:
    s = sched(budget=1000)
    s.add("warm", 1000, 1, cached_tokens=900)
    s.add("all", 300, 1, cached_tokens=300)  # the last token is always computed
    plan = s.step()
    assert plan is not None
    assert by_id(plan) == {"warm": (100, 900, 0), "all": (1, 299, 0)}
    assert plan.duration_s == pytest.approx(COST.step_s([(100, 900), (1, 299)]))
    assert plan.duration_s < COST.prefill_s(1000)


def test_admit_hook_decides_cache_loads_and_saves_at_first_schedule() -> None:
    seen: list[str] = []

    def hook(rid: str) -> Admission:
        seen.append(rid)
        return Admission(cached_tokens=512, load_tokens=256, save_blocks=frozenset({0, 2, 3}))

    s = Scheduler(COST, SchedulerConfig(max_num_batched_tokens=300, block_size=256),
                  admit_hook=hook)
    s.add("a", 1100, 1)
    assert seen == []  # looked up when scheduled, not when queued (like vLLM)
    p1 = s.step()
    assert p1 is not None and seen == ["a"]
    adv = p1.advances[0]
    assert (adv.new_tokens, adv.context, adv.load_tokens) == (300, 512, 256)
    # Blocks 0-2 have KV after this step (812 tokens); 0 and 2 are to be saved.
    assert adv.saved_blocks == (0, 2) and p1.save_tokens == 512
    assert p1.duration_s == pytest.approx(COST.step_s([(300, 512)]) + COST.kv_move_s(256)
                                          + COST.kv_move_s(512))
    p2 = s.step()
    assert p2 is not None and p2.advances[0].saved_blocks == (3,)
    assert all(not a.saved_blocks for p in run(s) for a in p.advances)  # block 4 is partial


def _loading_sched(**kw: object) -> Scheduler:
    loads = {"big": Admission(cached_tokens=99_999, load_tokens=99_999),
             "big2": Admission(cached_tokens=99_999, load_tokens=99_999)}
    return Scheduler(COST, SchedulerConfig(max_num_batched_tokens=1000, **kw),
                     admit_hook=lambda rid: loads.get(rid, Admission()))


def test_async_load_runs_off_the_step_and_joins_when_done() -> None:
    s = _loading_sched(async_kv_load=True)
    s.add("dec", 10, 50)
    s.add("big", 100_000, 2)
    s.add("big2", 100_000, 2)
    s.add("short", 20, 1)
    load = COST.kv_move_s(99_999)
    p = s.step(0.0)
    assert p is not None
    # The loads went to the link; the request behind them is not held back (vLLM skips
    # requests waiting for remote KV), and no step pays for a load.
    assert set(by_id(p)) == {"dec", "short"}
    assert p.duration_s == pytest.approx(COST.step_s([(10, 0), (20, 0)]))
    assert s.num_waiting == 2 and s.next_ready_s() == pytest.approx(load)
    # The link moves one load at a time: the second is ready one load time later.
    now = p.duration_s
    while now < load:
        p = s.step(now)
        assert p is not None and set(by_id(p)) == {"dec"}
        now += p.duration_s
    p = s.step(now)
    assert p is not None and by_id(p)["big"] == (1, 99_999, 0)
    assert "big2" not in by_id(p) and s.next_ready_s() == pytest.approx(2 * load)
    assert p.duration_s < COST.kv_move_s(99_999) / 2


def test_async_load_alone_waits_for_its_link() -> None:
    s = _loading_sched(async_kv_load=True)
    s.add("big", 100_000, 1)
    assert s.step(0.0) is None and s.has_work()
    ready = s.next_ready_s()
    assert ready is not None and s.step(ready / 2) is None
    p = s.step(ready)
    assert p is not None and p.advances[0].finished and not s.has_work()
    assert s.next_ready_s() is None


def test_sync_load_is_paid_inside_the_step() -> None:
    s = _loading_sched()
    s.add("dec", 10, 5)
    s.add("big", 100_000, 1)
    p = s.step(0.0)
    assert p is not None and set(by_id(p)) == {"dec", "big"}
    assert p.duration_s == pytest.approx(COST.step_s([(10, 0), (1, 99_999)])
                                         + COST.kv_move_s(99_999))


def test_abort_while_loading() -> None:
    s = _loading_sched(async_kv_load=True)
    s.add("big", 100_000, 1)
    s.step(0.0)
    assert s.abort("big") and not s.has_work() and s.next_ready_s() is None


def test_abort_and_finish_remove_requests() -> None:
    s = sched(budget=100)
    s.add("a", 50, 10)
    s.add("b", 50, 10)
    s.step()
    assert s.abort("a") and not s.abort("a") and s.finish("b")
    assert not s.has_work() and s.step() is None
    with pytest.raises(ValueError):
        s.add("c", 0, 1)


def test_kv_capacity_limits_admission() -> None:
    s = sched(budget=1000, kv_capacity_tokens=250)
    s.add("a", 200, 3)
    s.add("b", 100, 1)
    p = s.step()
    assert p is not None and list(by_id(p)) == ["a"]  # b would overflow the cache
    plans = run(s)
    assert "b" in by_id(plans[-1])


def test_queue_estimate_counts_chunks() -> None:
    s = sched(budget=100)
    s.add("a", 250, 1)
    s.add("b", 1000, 1, cached_tokens=800)
    s.step()
    queued = s.queued_prefill()
    assert queued == [(150, 100), (200, 800)]
    est = estimate_queue_s(COST, queued, chunk_tokens=100)
    assert est == pytest.approx(COST.prefill_s(150, 100) + COST.overhead_s
                                + COST.prefill_s(200, 800) + COST.overhead_s)


requests = st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 6), st.integers(0, 3000)),
                    min_size=1, max_size=12)


@given(reqs=requests, budget=st.integers(16, 2048), seqs=st.integers(1, 6))
@settings(max_examples=60, deadline=None)
def test_every_request_completes_within_budget(reqs: list[tuple[int, int, int]], budget: int,
                                               seqs: int) -> None:
    s = sched(budget=budget, seqs=seqs)
    for i, (n, out, cached) in enumerate(reqs):
        s.add(f"r{i}", n, out, cached_tokens=cached)
    computed = {f"r{i}": 0 for i in range(len(reqs))}
    outputs = {f"r{i}": [] for i in range(len(reqs))}
    first_token_order = []
    for plan in run(s):
        assert 0 < plan.batched_tokens <= budget and len(plan.advances) <= seqs
        assert plan.duration_s > 0
        for a in plan.advances:
            if a.output_index == 0:
                first_token_order.append(a.request_id)
            if a.output_index >= 0:
                outputs[a.request_id].append(a.output_index)
            if a.output_index <= 0:
                computed[a.request_id] += a.new_tokens
    for i, (n, out, cached) in enumerate(reqs):
        assert outputs[f"r{i}"] == list(range(out))
        assert computed[f"r{i}"] == n - min(cached, n - 1)
    # FCFS: the head of the queue is admitted first, so first tokens come in order
    # whenever prompts are served to completion in admission order (one at a time).
    if seqs == 1:
        assert first_token_order == [f"r{i}" for i in range(len(reqs))]


@given(reqs=requests)
@settings(max_examples=20, deadline=None)
def test_deterministic(reqs: list[tuple[int, int, int]]) -> None:
    def once() -> list[StepPlan]:
        s = sched(budget=512, seqs=4)
        for i, (n, out, cached) in enumerate(reqs):
            s.add(f"r{i}", n, out, cached_tokens=cached)
        return run(s)

    assert once() == once()


def _step_ends(s: Scheduler, now: float, steps: int) -> tuple[list[float], list[str]]:
    """Step ``steps`` times from ``now``: when each step ends, and who finished."""
    ends, finished = [], []
    for _ in range(steps):
        p = s.step(now)
        assert p is not None
        now += p.duration_s
        ends.append(now)
        finished += [a.request_id for a in p.advances if a.finished]
    return ends, finished


@given(reqs=st.lists(st.tuples(st.integers(1, 40_000), st.integers(2, 300)),
                     min_size=1, max_size=8))
@settings(max_examples=40, deadline=None)
def test_decode_span_prices_the_steps_one_by_one_would(reqs: list[tuple[int, int]]) -> None:
    """A span is the run of decode-only steps up to the first finish, priced exactly as
    :meth:`Scheduler.step` prices them, and applying it leaves the scheduler where the
    steps would."""
    def started() -> Scheduler:
        s = sched(budget=50_000, seqs=8)
        for i, (n, out) in enumerate(reqs):
            s.add(f"r{i}", n, out)
        while s.decode_span(0.0) is None:   # prefill steps until everyone decodes
            assert s.step(0.0) is not None
        return s

    a, b = started(), started()
    span = a.decode_span(0.0)
    assert span is not None
    ends, finished = _step_ends(b, 0.0, span.steps)
    assert list(span.ends_s) == pytest.approx(ends, rel=1e-12)
    done = a.apply_decodes(span.steps)
    assert done and done == finished
    assert a.num_running == b.num_running
    assert [s.output for s in a._running] == [s.output for s in b._running]


def test_decode_span_not_while_prefilling_or_waiting() -> None:
    s = sched(budget=100, seqs=2)
    s.add("a", 250, 5)
    assert s.decode_span() is None          # nothing scheduled yet: a is waiting
    s.step()
    assert s.decode_span() is None          # a still has prompt left
    s.step()
    s.step()
    span = s.decode_span()
    assert span is not None and span.steps == 4  # tokens 1..4 of 5 (token 0 came with the prompt)
    s.add("b", 10, 1)
    assert s.decode_span() is None          # b waits: the next step takes it


def test_decode_span_ends_where_an_async_load_lands() -> None:
    """A KV load landing mid-span joins the next step, so the span stops at the last
    step that starts before it; ``started_before`` says where a span is cut."""
    s = _loading_sched(async_kv_load=True)
    s.add("dec", 10, 100_000)
    s.step(0.0)                       # dec's prompt
    s.add("big", 100_000, 2)
    now = s.step(0.0)                 # big goes to the link; dec decodes one token
    assert now is not None and s.num_waiting == 1
    t = now.duration_s
    ready = s.next_ready_s()
    assert ready is not None and ready > t
    span = s.decode_span(t)
    assert span is not None
    starts = [0.0, *span.ends_s[:-1]]
    assert starts[-1] < ready - t <= span.ends_s[-1]
    assert span.started_before(0.0) == 1 and span.started_before(span.ends_s[-1]) == span.steps
    assert span.started_before(span.ends_s[0]) == 1
    assert span.started_before(span.ends_s[0] + 1e-9) == 2
    assert s.decode_span(ready) is None    # landed: the next step is a real one
