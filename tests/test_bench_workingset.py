"""``cpd bench workingset``: the visits it sends, the figures it derives from what came
back, and (slow) its ``--quick`` run against ``cpd up`` and vLLM's own server."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from cpd.modelbuild import build
from tools.bench.corpus import CorpusPrompts
from tools.bench.servers import PRESET
from tools.bench.workingset import (
    CONFIGS_QUICK,
    PASSES,
    RATIOS_QUICK,
    TARGETS,
    Result,
    Visit,
    headline,
    make_visits,
    per_size,
    plot,
    sessions_for,
)


@pytest.mark.parametrize(("ratio", "blocks", "bs", "tokens", "sessions"), [
    (1.0, 64, 256, 2048, 8), (2.0, 64, 256, 2048, 16), (0.25, 64, 256, 2048, 2),
    (0.01, 64, 256, 2048, 1), (8.0, 32, 256, 2048, 32), (2.0, 64, 256, 4096, 8)])
def test_a_working_set_is_sessions_filling_that_many_engine_caches(
        ratio: float, blocks: int, bs: int, tokens: int, sessions: int) -> None:
    assert sessions_for(ratio, blocks, bs, tokens) == sessions


def test_every_visit_extends_its_sessions_last_prompt(model_cache: Path) -> None:
    prompts = CorpusPrompts(build(PRESET, model_cache), random.Random(1))
    visits = make_visits(prompts, [0.5, 1.0], 16, 256, 1024, random.Random(2))
    assert [v.ratio for v in visits] == [0.5] * 6 + [1.0] * 12
    assert [v.step for v in visits[:6]] == [p for p in PASSES for _ in range(2)]
    last: dict[tuple[float, int], str] = {}
    for v in visits:
        before = last.get((v.ratio, v.session))
        assert before is None or (v.prompt.startswith(before) and len(v.prompt) > len(before))
        last[(v.ratio, v.session)] = v.prompt
    # The sessions of one size are distinct, and of different sizes too.
    firsts = [v.prompt[:40] for v in visits if v.step == "start"]
    assert len(set(firsts)) == len(firsts) == 6
    shuffled = [v.session for v in visits if v.ratio == 1.0 and v.step == "shuffled"]
    assert sorted(shuffled) == list(range(4))


def _r(ratio: float, session: int, step: str, ttft: float, prompt: int, cached: int,
       dram: int = 0, disk: int = 0) -> Result:
    return Result(Visit(ratio, session, step, ""), ttft, prompt, cached,
                  {"gpu": 0, "dram": dram, "disk": disk, "remote": cached - dram - disk})


def test_reuse_and_ttft_count_the_revisits_only() -> None:
    rows = per_size([
        _r(2.0, 0, "start", 900, 1000, 0), _r(2.0, 1, "start", 800, 1000, 0),
        _r(2.0, 0, "in_order", 100, 1000, 1000, dram=400, disk=100),
        _r(2.0, 1, "in_order", 300, 1000, 0),
        _r(2.0, 1, "shuffled", 200, 2000, 1500), _r(2.0, 0, "shuffled", 150, 2000, 500)])
    (row,) = rows
    assert (row["sessions"], row["revisits"]) == (2, 4)
    assert row["reuse"] == 3000 / 6000
    assert row["reuse_by_pass"] == {"in_order": 0.5, "shuffled": 2000 / 4000}
    assert row["reuse_by_tier"] == {"gpu": 0.0, "dram": round(400 / 6000, 4),
                                    "disk": round(100 / 6000, 4),
                                    "remote": round(2500 / 6000, 4)}
    assert (row["ttft_p50_ms"], row["cold_ttft_p50_ms"]) == (200, 900)


def test_headline_keys_compare_with_monolithic_at_each_size() -> None:
    def row(ratio: float, reuse: float, p50: float) -> dict:
        return {"ratio": ratio, "reuse": reuse, "ttft_p50_ms": p50}

    out = headline({"cpd": [row(0.5, 0.99, 90), row(2.0, 0.92, 50), row(8.0, 0.3, 500)],
                    "cpd_disk": [row(8.0, 0.85, 120)],
                    "monolithic": [row(0.5, 0.99, 100), row(2.0, 0.0, 250),
                                   row(8.0, 0.0, 400)]})
    assert (out["reuse_at_2x_engine"], out["reuse_at_2x_engine_monolithic"]) == (0.92, 0.0)
    assert out["reuse_at_8x_engine_disk"] == 0.85
    assert out["ttft_p50_at_2x_over_monolithic"] == 0.2
    assert out["worst_ttft_p50_over_monolithic"] == 1.25
    assert out["worst_ttft_p50_over_monolithic_disk"] == 0.3
    assert out["met"] == {"reuse_at_2x_engine": True, "ttft_p50_at_2x_over_monolithic": True,
                          "worst_ttft_p50_over_monolithic": False,
                          "reuse_at_8x_engine_disk": True}
    assert set(TARGETS) >= set(out["met"])


def test_the_tier_plot_goes_beside_the_json(tmp_path: Path) -> None:
    def row(ratio: float, tiers: dict[str, float], p50: float) -> dict:
        return {"ratio": ratio, "reuse": sum(tiers.values()), "reuse_by_tier": tiers,
                "ttft_p50_ms": p50}

    result = {"configs": ["cpd", "cpd_disk", "monolithic"], "engine_blocks": 64,
              "block_size": 256, "sizes": {
                  "cpd": [row(2.0, {"gpu": 0.1, "dram": 0.2, "remote": 0.63}, 73),
                          row(8.0, {"gpu": 0.05, "remote": 0.1}, 186)],
                  "cpd_disk": [row(8.0, {"dram": 0.7, "disk": 0.02, "remote": 0.22}, 58)],
                  "monolithic": [row(2.0, {"gpu": 0.08}, 270), row(8.0, {"gpu": 0.01}, 259)]}}
    out = tmp_path / "ws.png"
    assert plot(result, out) == [str(out)]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_quick_run_serves_every_request_on_both_servers(model_cache: Path,
                                                            tmp_path: Path) -> None:
    """``--quick`` at its larger size only (2x one engine's cache): every request served
    on both servers, and CPD's three arenas, each the size of one engine's cache, pool
    what one cannot hold (they reused 0.44 of it before evicting copies first, 0.86
    after)."""
    out = tmp_path / "ws.json"
    env = {**os.environ, "CPD_MODEL__CACHE_DIR": str(model_cache)}
    subprocess.run([sys.executable, "-m", "tools.cli", "bench", "workingset", "--quick",
                    "--ratios", str(RATIOS_QUICK[-1]), "--json", str(out)], check=True,
                   env=env, timeout=1400, cwd=Path(__file__).resolve().parents[1])
    result = json.loads(out.read_text())
    assert result["requests_failed"] == 0
    assert result["configs"] == list(CONFIGS_QUICK)
    for config in CONFIGS_QUICK:
        assert [r["ratio"] for r in result["sizes"][config]] == [RATIOS_QUICK[-1]]
    assert result["reuse_at_2x_engine"] > 0.6
    assert "ttft_p50_at_2x_over_monolithic" in result
