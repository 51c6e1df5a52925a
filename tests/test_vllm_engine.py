"""The vLLM engine wrapper (AsyncLLM + CPD connector) streams deltas, loads and saves
through the arena with identical outputs, and aborts cleanly."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from cpd.modelbuild.runtime import prepare_cpu_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def results(model_cache: Path, engine_helper: Callable[..., dict]) -> dict:
    return engine_helper("engine_check.py", model_cache, "engine")


def test_streams_deltas_to_the_end(results: dict) -> None:
    plain = results["plain"]
    assert len(plain["tokens"]) == 10 and plain["finished"] and plain["reason"] == "length"
    assert plain["steps"] >= 2  # streamed, not one final blob



def test_engine_settings_reach_vllm(results: dict) -> None:
    """[engine] settings are vLLM's: the engine runs with the context and batch limits
    they set (the model's own context is 8,192)."""
    assert results["max_model_len"] == 4096
    assert (results["max_num_seqs"], results["max_num_batched_tokens"]) == (4, 4096)


def test_save_then_load_is_token_identical(results: dict) -> None:
    assert results["save"]["saved"] == 3 and results["save"]["tokens"] == results["plain"]["tokens"]
    load = results["load"]
    assert load["loaded"] == 3 and load["cached"] == 3 * 256
    assert load["tokens"] == results["plain"]["tokens"]


def test_abort_ends_the_stream_and_the_engine_keeps_serving(results: dict) -> None:
    assert 3 <= results["aborted_tokens"] < 2000
    assert results["after_abort"]["tokens"] == results["plain"]["tokens"]


def test_a_run_asked_to_ends_once_its_text_is_whole(results: dict) -> None:
    """``until_whole_text``: a run of four tokens ends after its first when that token
    ends a character, with the connector's figures of a finished run; a run whose tokens
    each end inside a character goes on to its ``max_tokens``; unasked, a run does."""
    assert results["stops_at_whole_text"] is True
    assert results["whole_a"] == {"tokens": [97], "reason": "length",
                                  "connector_figures": True}
    assert results["whole_half"]["tokens"] == [228] * 4
    assert results["plain_a"]["tokens"] == [97] * 4


def test_whole_text_tokens_follow_the_detokenizer(model_cache: Path) -> None:
    """The scheduler's table: a token ends a character where the workers' detokenizer
    holds no text back after it."""
    from tokenizers import Tokenizer

    from cpd.engines.servedmodel import Detokenizer
    from cpd.engines.vllm.wholetext import whole_text_tokens
    from cpd.modelbuild import build

    folder = build("tiny", model_cache)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    table = whole_text_tokens(folder / "tokenizer.json", tok.get_vocab_size() + 5)
    assert (table[97], table[228]) == (1, 0)
    assert table[-5:] == b"\x01" * 5  # ids the tokenizer does not know
    for i in range(tok.get_vocab_size()):
        detok = Detokenizer(tok)
        detok.push([97, i])
        assert table[i] == (not detok.incomplete), i


def test_the_engine_sockets_are_removed_when_it_stops(results: dict) -> None:
    """vLLM binds its ZMQ sockets in a folder of the engine's own and never unlinks them:
    the folder goes when the engine stops (not one socket left per start), and so does
    its name from the environment."""
    assert results["sockets_while_running"] >= 1
    assert results["sockets_left"] is False
    # Processes started after it do not inherit the removed folder.
    assert results["rpc_path_restored"] is True


@pytest.mark.parametrize("deep", [False, True])
def test_an_engine_socket_path_fits_however_deep_the_temp_folder(
        deep: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Unix socket's path holds 107 characters: the engine's socket folder is in the
    temp folder, or in /tmp when that is too deep (a cluster's own, inside a test's)."""
    import tempfile
    import uuid

    from cpd.engines.vllm import engine

    base = tmp_path / ("d" * 80) if deep else Path(tempfile.mkdtemp(dir="/tmp"))
    base.mkdir(exist_ok=True)
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "restored after the test")
    folder = Path(engine._socket_folder())
    try:
        assert len(str(folder / str(uuid.uuid4()))) <= 107
        assert folder.parent == (Path("/tmp") if deep else base)
        assert os.environ["VLLM_RPC_BASE_PATH"] == str(folder)
    finally:
        shutil.rmtree(folder)
        if not deep:
            base.rmdir()


def test_engine_section_becomes_vllm_arguments(model_cache: Path) -> None:
    """Per role, [engine] with its [engine_<role>] overrides becomes vLLM's engine
    arguments of the same names; vLLM accepts them; CPD's own stay CPD's."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from cpd.engines.vllm.engine import VllmEngine
    from cpd.modelbuild import build
    from cpd.ops.config import load_settings

    folder = build("tiny", model_cache)
    s = load_settings(environ={"CPD_ENGINE__EXTRA_ARGS": '{"max_logprobs": 7}'}, overrides=[
        "engine.gpu_memory_utilization=0.5", "engine_decode.max_num_seqs=3",
        "engine_prefill.max_num_batched_tokens=1024", "engine_prefill.enforce_eager=true"])
    prefill = VllmEngine(folder, block_size=256, arena=None,
                         engine=s.engine_for("prefill")).engine_args()
    decode = VllmEngine(folder, block_size=256, arena=None,
                        engine=s.engine_for("decode")).engine_args()
    assert (prefill["max_num_batched_tokens"], prefill["enforce_eager"]) == (1024, True)
    assert "max_num_seqs" not in prefill and decode["max_num_seqs"] == 3
    for args in (prefill, decode):
        assert args["gpu_memory_utilization"] == 0.5 and args["max_logprobs"] == 7
        assert args["block_size"] == 256 and args["max_model_len"] == 8192
        parsed = AsyncEngineArgs(**args)
        assert parsed.max_logprobs == 7 and parsed.gpu_memory_utilization == 0.5


def test_a_scheduler_the_settings_name_turns_the_whole_text_stop_off(
        model_cache: Path) -> None:
    """CPD's scheduler class is the engine's unless ``[engine] extra_args`` names one;
    then runs are not ended at whole text, and the engine says so."""
    from cpd.engines.vllm.engine import VllmEngine
    from cpd.engines.vllm.wholetext import FQCN
    from cpd.modelbuild import build
    from cpd.ops.config import load_settings

    folder = build("tiny", model_cache)
    own = "vllm.v1.core.sched.scheduler.Scheduler"
    s = load_settings(environ={"CPD_ENGINE__EXTRA_ARGS": f'{{"scheduler_cls": "{own}"}}'})
    default = VllmEngine(folder, block_size=256, arena=None)
    named = VllmEngine(folder, block_size=256, arena=None, engine=s.engine_for("prefill"))
    assert (default.engine_args()["scheduler_cls"], default.stops_at_whole_text) == (FQCN, True)
    assert (named.engine_args()["scheduler_cls"], named.stops_at_whole_text) == (own, False)


def test_long_prefill_cap_reaches_vllm(model_cache: Path) -> None:
    """worker.long_prefill_token_threshold is passed to vLLM under vLLM's own name (and
    left out at 0, vLLM's default); vLLM's engine arguments accept it."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from cpd.engines.vllm.engine import VllmEngine
    from cpd.modelbuild import build

    folder = build("tiny", model_cache)
    capped = VllmEngine(folder, block_size=256, arena=None,
                        long_prefill_token_threshold=2048).engine_args()
    assert capped["long_prefill_token_threshold"] == 2048
    assert AsyncEngineArgs(**capped).long_prefill_token_threshold == 2048
    plain = VllmEngine(folder, block_size=256, arena=None).engine_args()
    assert "long_prefill_token_threshold" not in plain


def test_async_kv_load_reaches_the_connector(model_cache: Path) -> None:
    """worker.async_kv_load picks, per role, whether the connector loads off the step."""
    from cpd.engines import ArenaSpec
    from cpd.engines.vllm.engine import VllmEngine
    from cpd.modelbuild import build
    from cpd.ops.config import load_settings

    worker = load_settings(environ={}).worker
    assert worker.async_kv_load == "decode"
    assert worker.loads_async("decode") and not worker.loads_async("prefill")
    assert not worker.loads_async("preprefill")
    every = load_settings(environ={}, overrides=["worker.async_kv_load=all"]).worker
    assert every.loads_async("preprefill") and every.loads_async("decode")
    folder = build("tiny", model_cache)
    arena = ArenaSpec("/dev/shm/unused", 4, 4096)
    for flag in (True, False):
        args = VllmEngine(folder, block_size=256, arena=arena,
                          async_kv_load=flag).engine_args()
        assert args["kv_transfer_config"].kv_connector_extra_config["async_load"] is flag


@pytest.mark.parametrize(("cpu", "expected"), [(True, {"VLLM_CPU_KVCACHE_SPACE": "3",
                                                       "VLLM_USE_AOT_COMPILE": "0"}),
                                               (False, {})])
def test_cpu_engines_use_the_compile_cache_that_loads_back(
        monkeypatch: pytest.MonkeyPatch, cpu: bool, expected: dict[str, str]) -> None:
    keys = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_USE_AOT_COMPILE", "HF_HUB_OFFLINE")
    for key in keys:
        monkeypatch.delenv(key, raising=False)
    prepare_cpu_env(3, cpu=cpu)
    assert {k: os.environ[k] for k in keys if k in os.environ} == {
        **expected, "HF_HUB_OFFLINE": "1"}
