"""The pure parts of ``cpd bench serve``: the client's command lines, the ShareGPT-style
file vLLM's sampler reads, and the figures over rounds and their ratios. The benchmark
itself runs both servers (docs/benchmarks/serve.md); a short run of its client against
the real gateway is in tests/test_api_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tools.bench.serve import KEYS, client_argv, combine, summarize, workloads, write_sharegpt


class _Tokenizer:
    """Whitespace words as tokens: enough for the file's shape."""

    def __call__(self, text: str, verbose: bool = True) -> Any:
        class _Out:
            input_ids = text.split()
        return _Out()

    def decode(self, ids: list[str]) -> str:
        return " ".join(ids)


def test_the_sharegpt_file_has_two_turn_conversations(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    write_sharegpt(path, _Tokenizer(), 12, seed=3)
    entries = json.loads(path.read_text())
    assert len(entries) == 12 and len({e["id"] for e in entries}) == 12
    for e in entries:
        human, gpt = e["conversations"]
        assert (human["from"], gpt["from"]) == ("human", "gpt")
        assert 64 <= len(human["value"].split()) <= 1000
        assert 16 <= len(gpt["value"].split()) <= 200
    again = tmp_path / "again.json"
    write_sharegpt(again, _Tokenizer(), 12, seed=3)
    assert again.read_text() == path.read_text()  # the same requests for every server


@pytest.mark.parametrize(("name", "backend", "endpoint"), [
    ("random", "openai", "/v1/completions"),
    ("sharegpt", "openai-chat", "/v1/chat/completions"),
    ("prefix_repetition", "openai", "/v1/completions"),
])
def test_each_workload_runs_vllms_client_with_the_same_seed(
        tmp_path: Path, name: str, backend: str, endpoint: str) -> None:
    w = next(w for w in workloads(tmp_path / "s.json") if w.name == name)
    argv = client_argv(w, base_url="http://127.0.0.1:9", model="cpd-tiny",
                       tokenizer=tmp_path, prompts=7, concurrency=3,
                       result=tmp_path / "r.json")
    at = argv.index("serve")
    assert argv[at - 3:at + 1] == ["-m", "tools.vllmcli", "bench", "serve"]
    rest = argv[at + 1:]
    flags = {a: (b if not b.startswith("--") else "")
             for a, b in zip(rest, [*rest[1:], "--"], strict=True) if a.startswith("--")}
    assert (flags["--backend"], flags["--endpoint"]) == (backend, endpoint)
    assert flags["--dataset-name"] == name
    assert (flags["--num-prompts"], flags["--max-concurrency"], flags["--seed"]) == (
        "7", "3", "1")
    assert flags["--ignore-eos"] == flags["--save-result"] == ""


def _fig(ttft: float, throughput: float, failed: int = 0) -> dict[str, Any]:
    return {"completed": 10 - failed, "failed": failed, "median_ttft_ms": ttft,
            "p99_ttft_ms": 2 * ttft, "median_tpot_ms": 5.0,
            "output_throughput": throughput, "request_throughput": throughput / 32}


@pytest.mark.parametrize(("rounds", "ttft", "completed"), [
    ([_fig(100, 50)], 100, 10),
    ([_fig(100, 50), _fig(140, 40)], 120, 20),  # two rounds: their mean
    ([_fig(100, 50), _fig(300, 40), _fig(120, 45)], 120, 30),  # the median
])
def test_rounds_combine_to_their_median(rounds: list[dict[str, Any]], ttft: float,
                                        completed: int) -> None:
    got = combine(rounds)
    assert got["median_ttft_ms"] == ttft and got["completed"] == completed
    assert set(got) <= set(KEYS)


def test_ratios_are_cpd_over_monolithic_and_failures_count() -> None:
    out = summarize({"cpd": {"random": [_fig(80, 60, failed=1)]},
                     "monolithic": {"random": [_fig(100, 50)]}})
    ratios = out["workloads"]["random"]["cpd_over_monolithic"]
    assert ratios["median_ttft_ms"] == 0.8 and ratios["output_throughput"] == 1.2
    assert out["requests_failed"] == 1
