"""Waves in the planner: CPD's elastic split under a sudden wave of cold first turns and
one of long outputs (:mod:`tools.plan.waves`), against the split held fixed."""

from __future__ import annotations

from typing import Any

import pytest

from cpd.ops.config import Settings, load_settings
from cpd.protocol.errors import CpdError
from tools.bench import plan as bench_plan
from tools.bench.loaddriver import Result
from tools.cli import build_parser
from tools.plan import waves

pytestmark = pytest.mark.timeout(120)

ROLES = {"pp0": "preprefill", "p0": "prefill", "d0": "decode"}


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    return waves.run()


def test_warm_requests_stay_within_the_slo_while_the_split_moves_and_moves_back(
        result: dict[str, Any]) -> None:
    assert result["met_all"], result["met"]
    slo = result["slo_ttft_p90_s"]
    cold, fixed = result["cold_wave"], result["cold_wave_fixed_split"]
    assert cold["during"]["warm_ttft_p90_s"] <= slo
    # Held fixed, the pre-prefill tier queues the wave and the client's requests in
    # flight fill with it: warm requests wait past the SLO, cold ones far longer.
    assert fixed["during"]["warm_ttft_p90_s"] > slo
    assert cold["during"]["cold_ttft_p90_s"] < fixed["during"]["cold_ttft_p90_s"]
    assert all(fixed[w]["cold_on_prefill_share"] == 0.0 for w in waves.WINDOWS)
    assert all(result[r][w]["unfinished"] == 0 for r in ("cold_wave", "long_output_wave")
               for w in waves.WINDOWS)


def test_decode_is_lent_only_while_the_long_outputs_fill_the_decode_pool(
        result: dict[str, Any]) -> None:
    lent, alone = result["long_output_wave"], result["long_output_wave_no_lending"]
    assert lent["before"]["decode_lent"] == lent["after"]["decode_lent"] == 0
    assert lent["during"]["decode_lent"] > 0
    assert all(alone[w]["decode_lent"] == 0 for w in waves.WINDOWS)
    assert lent["during"]["warm_ttft_p90_s"] <= result["slo_ttft_p90_s"]
    assert lent["during"]["tpot_p50_ms"] < alone["during"]["tpot_p50_ms"]


def _r(rid: str, arrival: float, turn: int, prefill: str, decode: str = "d0",
       first: float | None = 1.0, finish: float | None = 2.0, out: int = 11) -> Result:
    return Result(request_id=rid, arrival_s=arrival, prompt_tokens=100,
                  first_token_s=None if first is None else arrival + first,
                  finish_s=None if finish is None else arrival + finish, output_tokens=out,
                  prefill_node=prefill, decode_node=decode, turn=turn)


@pytest.mark.parametrize(("results", "expect"), [
    ([], {"requests": 0, "warm_ttft_p90_s": None, "cold_on_prefill_share": None,
          "decode_lent": 0, "tpot_p50_ms": None}),
    ([_r("a", 1, 0, "pp0"), _r("b", 2, 0, "p0"), _r("c", 3, 0, "p0"), _r("d", 4, 0, "pp0")],
     {"cold": 4, "cold_on_prefill_share": 0.5, "warm_ttft_p90_s": None}),
    ([_r("a", 1, 1, "p0", "p0"), _r("b", 2, 2, "p0", "d0"), _r("c", 3, 1, "pp0", "pp0")],
     {"cold": 0, "decode_lent": 2, "warm_ttft_p90_s": 1.0, "tpot_p50_ms": 100.0}),
    ([_r("a", 1, 1, "p0", first=None, finish=None), _r("x", 50, 1, "p0")],
     {"requests": 1, "unfinished": 1, "warm_ttft_p90_s": None}),
])
def test_window_stats(results: list[Result], expect: dict[str, Any]) -> None:
    got = waves.window_stats(results, ROLES, 0.0, 10.0)
    assert {k: got[k] for k in expect} == expect


@pytest.mark.parametrize("flags", [["--waves", "--quick"], ["--waves", "--fidelity"],
                                   ["--services"], ["--quick", "--services"]])
def test_waves_run_on_their_own(flags: list[str]) -> None:
    args = build_parser().parse_args(["bench", "plan", *flags])
    with pytest.raises(CpdError):
        bench_plan.run_args(args, Settings)


@pytest.mark.parametrize("run", waves.RUNS, ids=[r.label for r in waves.RUNS])
def test_a_services_run_gets_the_settings_the_planner_runs(run: waves.WaveRun) -> None:
    planned, served = run.settings(Settings()), load_settings(environ=run.env())
    assert (planned.router, planned.worker) == (served.router, served.worker)
