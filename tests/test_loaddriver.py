"""The load driver's accounting (bench/loaddriver.py): client queueing in TTFT,
rejections and errors never counted as throughput, goodput under the SLO, fresh content
per run. A fake client stands in for NATS."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator

import pytest

from cpd.client import Client
from cpd.protocol import wire
from cpd.protocol.errors import Overloaded, Unavailable
from cpd.sim.workloads import WorkloadRequest, poisson
from tools.bench.loaddriver import UNFINISHED, Phases, Result, drive, fresh_content, report

pytestmark = pytest.mark.timeout(30)


def _req(rid: str, arrival: float, out: int = 3) -> WorkloadRequest:
    return WorkloadRequest(request_id=rid, arrival_s=arrival, session_id=rid, prompt_len=600,
                           block_ids=(1, 2, 3), block_tokens=256, output_len=out)


class _FakeClient(Client):
    """Serves each request in ``service_s`` wall seconds (first token after half of
    it); ids in ``refuse`` are shed as overloaded, ids in ``fail`` fail, ids in ``hang``
    never finish."""

    def __init__(self, service_s: float = 0.05, refuse: frozenset[str] = frozenset(),
                 fail: frozenset[str] = frozenset(), hang: frozenset[str] = frozenset()
                 ) -> None:
        super().__init__(bus=None)  # type: ignore[arg-type]
        self.service_s, self.refuse, self.fail, self.hang = service_s, refuse, fail, hang
        self.concurrent = self.peak = 0

    async def stream_request(self, req: wire.GenerateRequest
                             ) -> AsyncGenerator[wire.TokenChunk | wire.Final, None]:
        if req.request_id in self.refuse:
            raise Overloaded("full")
        self.concurrent += 1
        self.peak = max(self.peak, self.concurrent)
        try:
            await asyncio.sleep(self.service_s / 2)
            if req.request_id in self.fail:
                raise Unavailable("node lost")
            if req.request_id in self.hang:
                await asyncio.sleep(3600)
            yield wire.TokenChunk(request_id=req.request_id, seq=0, token_ids=[1])
            await asyncio.sleep(self.service_s / 2)
            n = req.sampling.max_tokens
            yield wire.TokenChunk(request_id=req.request_id, seq=1, token_ids=[2] * (n - 1))
            yield wire.Final(request_id=req.request_id, seq=2, finish_reason="length",
                             usage=wire.Usage(prompt_tokens=600, completion_tokens=n,
                                              cached_tokens=512),
                             route=wire.Route(path="warm", prefill_node="p0",
                                              decode_node="d0",
                                              tokens=wire.PromptTokens(dram=512,
                                                                       computed=88)))
        finally:
            self.concurrent -= 1


async def test_client_queue_counts_in_ttft_and_inflight_is_capped() -> None:
    client = _FakeClient(service_s=0.1)
    reqs = [_req(f"r{i}", 0.0) for i in range(4)]
    res = await drive(client, reqs, max_inflight=2, progress=False)
    assert client.peak == 2
    assert all(r.error is None for r in res)
    ttfts = sorted(r.record().ttft_s for r in res)
    # Two waited for a whole service time in the client's queue before being sent.
    assert ttfts[0] == pytest.approx(0.05, abs=0.04)
    assert ttfts[-1] == pytest.approx(0.15, abs=0.05)
    assert sorted(r.client_queue_s for r in res)[-1] == pytest.approx(0.1, abs=0.05)
    assert res[0].path == "warm" and res[0].tokens.dram == 512 and res[0].output_tokens == 3


async def test_times_are_simulated_seconds() -> None:
    client = _FakeClient(service_s=0.05)
    res = await drive(client, [_req("a", 0.0), _req("b", 0.4)], time_scale=4.0,
                      progress=False)
    # 0.4 simulated seconds are played in 0.1 s of wall time; 0.05 s wall = 0.2 sim.
    assert res[1].sent_s == pytest.approx(0.4, abs=0.08)
    assert res[0].record().ttft_s == pytest.approx(0.1, abs=0.08)
    assert res[0].finish_s == pytest.approx(0.2, abs=0.1)


async def test_rejections_errors_and_unfinished_are_recorded() -> None:
    client = _FakeClient(refuse=frozenset({"shed"}), fail=frozenset({"lost"}),
                         hang=frozenset({"stuck"}))
    reqs = [_req("ok", 0.0), _req("shed", 0.0), _req("lost", 0.0), _req("stuck", 0.0)]
    res = {r.request_id: r for r in await drive(client, reqs, drain_timeout_s=0.5,
                                                 progress=False)}
    assert res["ok"].error is None
    assert res["shed"].rejected and res["shed"].error == "overloaded"
    assert res["lost"].error == "unavailable" and not res["lost"].rejected
    assert res["stuck"].error == UNFINISHED
    assert res["stuck"].first_token_s is None


def _result(rid: str, arrival: float, ttft: float | None, e2e: float | None,
            error: str | None = None, **kw: object) -> Result:
    return Result(request_id=rid, arrival_s=arrival, prompt_tokens=1000,
                  sent_s=arrival, first_token_s=None if ttft is None else arrival + ttft,
                  finish_s=None if e2e is None else arrival + e2e, output_tokens=11,
                  error=error, **kw)  # type: ignore[arg-type]


def test_report_counts_only_good_work_in_the_window() -> None:
    phases = Phases(ramp_s=10.0, steady_s=10.0)
    results = [
        # before the window
        _result("ramp", 5.0, 0.5, 1.0, tokens=wire.PromptTokens(computed=999)),
        _result("fast", 11.0, 0.5, 1.0, path="warm",
                tokens=wire.PromptTokens(computed=100, dram=900)),
        _result("slow", 12.0, 4.0, 5.0, path="cold", tokens=wire.PromptTokens(computed=1000)),
        _result("shed", 13.0, None, None, error="overloaded", rejected=True),
        # ends after
        _result("late", 19.5, 0.2, 2.0, path="warm", tokens=wire.PromptTokens(computed=100)),
    ]
    out = report(results, target_qps=0.5, gpus=2, ttft_slo_s=3.0, phases=phases)
    assert out["requests"] == 4
    # Offered is what arrived in the window (4 in 10 s), the target is kept beside it.
    assert out["offered_qps"] == pytest.approx(0.4) and out["target_qps_per_gpu"] == 0.25
    assert out["completed"] == 3 and out["errors"] == 1 and out["rejected"] == 1
    # Finished in the window: fast (12.0), slow (17.0); late finishes at 21.5.
    assert out["achieved_qps"] == pytest.approx(0.2)
    assert out["achieved_qps_per_gpu"] == pytest.approx(0.1)
    # Good: arrived in the window, ok, TTFT ≤ 3 s: fast and late.
    assert out["goodput_qps"] == pytest.approx(0.2)
    assert out["paths"] == {"warm": 2, "cold": 1}
    assert out["errors_by_code"] == {"overloaded": 1}
    assert out["prompt_tokens_by_tier"]["dram"] == 900
    # The shed request has no first token: TTFT ∞ pushes p90 to it (null in JSON).
    assert out["ttft_p90_s"] is None
    # First tokens in the window: fast, slow, late: 1200 computed tokens / 10 s / 2 GPUs.
    assert out["prefill_tokens_per_s_per_gpu"] == pytest.approx(60.0)
    assert out["decode_tokens_per_s_per_gpu"] == pytest.approx(22 / 10 / 2)
    assert not out["sustainable"]


def test_the_settle_phase_runs_but_is_not_measured() -> None:
    phases = Phases(ramp_s=10.0, steady_s=10.0, settle_s=5.0)
    assert phases.window == (15.0, 25.0) and phases.duration_s == 25.0
    results = [_result("settling", 12.0, 4.0, 5.0, path="cold"),  # the ramp's backlog
               _result("steady", 16.0, 0.5, 1.0, path="warm")]
    out = report(results, target_qps=0.1, gpus=1, ttft_slo_s=3.0, phases=phases)
    assert out["requests"] == 1 and out["paths"] == {"warm": 1}
    assert out["ttft_p90_s"] == pytest.approx(0.5)


def test_report_sums_what_the_requests_pulled_from_peers_and_their_load_time() -> None:
    phases = Phases(ramp_s=10.0, steady_s=10.0)
    results = [
        _result("pulled", 11.0, 0.5, 1.0, path="warm", timings={"load_ms": 20.0},
                tokens=wire.PromptTokens(remote=4000, computed=10)),
        _result("pulled too", 12.0, 0.5, 1.0, path="warm", timings={"load_ms": 30.0},
                tokens=wire.PromptTokens(remote=1000, dram=50)),
        # Loaded only from its own DRAM: not the network's time.
        _result("own", 13.0, 0.5, 1.0, path="warm", timings={"load_ms": 9.0},
                tokens=wire.PromptTokens(dram=900)),
        _result("failed", 14.0, None, None, error="unavailable", timings={"load_ms": 99.0},
                tokens=wire.PromptTokens(remote=7000)),
        _result("ramp", 5.0, 0.5, 1.0, timings={"load_ms": 99.0},
                tokens=wire.PromptTokens(remote=7000)),
    ]
    out = report(results, target_qps=0.5, gpus=1, ttft_slo_s=3.0, phases=phases)
    assert out["remote_load"] == {"tokens": 5000, "wall_s": 0.05}


def test_report_of_an_empty_window_is_json_safe() -> None:
    out = report([], target_qps=1.0, gpus=1, ttft_slo_s=3.0, phases=Phases(1.0, 1.0))
    assert out["requests"] == 0 and out["ttft_p50_s"] is None
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in out.values())


def test_fresh_content_separates_runs_and_keeps_sharing_within_one() -> None:
    reqs = poisson(5.0, 2.0, prompt_len=512, block_tokens=256)
    a, b = fresh_content(reqs, 1), fresh_content(reqs, 2)
    assert [r.arrival_s for r in a] == [r.arrival_s for r in reqs]
    assert not set(a[0].block_ids) & set(b[0].block_ids)
    assert (a[0].token_ids() != b[0].token_ids()).any()
    assert (fresh_content(reqs, 1)[0].token_ids() == a[0].token_ids()).all()
    with pytest.raises(ValueError):
        fresh_content(reqs, 256)
    with pytest.raises(ValueError):
        fresh_content(a, 1)  # already moved
