"""The engine profile: one place resolves what differs between the vLLM and sim engines,
and no other module branches on ``worker.engine``."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from cpd.engines.profile import SimProfile, VllmProfile, engine_profile
from cpd.modelbuild import PRESETS
from cpd.ops.config import load_settings
from cpd.protocol.errors import ConfigError, InvalidRequest
from cpd.sim.costmodel import preset

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "libs" / "cpd" / "engines" / "profile.py"
CONFIG = ROOT / "libs" / "cpd" / "ops" / "config.py"


@pytest.mark.parametrize(("overrides", "kind", "slot_bytes"), [
    ([], VllmProfile, PRESETS["tiny"].kv_bytes_per_token() * 256),
    (["model.dtype=bfloat16"], VllmProfile, PRESETS["tiny"].kv_bytes_per_token() * 256 // 2),
    (["dataplane.block_bytes=4096"], VllmProfile, 4096),
    (["worker.engine=sim"], SimProfile, -(-preset("b200-tp4-llama-3.1-8b").kv_bytes_per_token
                                          * 256 // 8192)),
    (["worker.engine=sim", "sim.kv_scale_down=1"], SimProfile,
     preset("b200-tp4-llama-3.1-8b").kv_bytes_per_token * 256),
    (["worker.engine=sim", "dataplane.block_bytes=4096"], SimProfile, 4096),
])
def test_the_profile_and_its_slot_bytes_follow_the_settings(
        overrides: list[str], kind: type, slot_bytes: int) -> None:
    profile = engine_profile(load_settings(environ={}, overrides=overrides))
    assert type(profile) is kind and profile.kind == load_settings(
        environ={}, overrides=overrides).worker.engine
    assert profile.slot_bytes == slot_bytes


@pytest.mark.parametrize(("config", "slot_bytes"), [
    # Llama-3.1-8B: 32 layers, 8 KV heads of 128, K and V, float32 here (4 bytes).
    ({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
      "hidden_size": 4096}, 32 * 8 * 128 * 2 * 4 * 256),
    # No grouped-query attention: as many KV heads as attention heads.
    ({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256},
     2 * 4 * 64 * 2 * 4 * 256),
    # An explicit head dim wins over hidden_size / heads.
    ({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "hidden_size": 256, "head_dim": 128}, 2 * 2 * 128 * 2 * 4 * 256),
    ({"num_hidden_layers": 2}, None),  # not a model's config: refused, typed
])
def test_a_model_folders_slot_bytes_come_from_its_config(
        tmp_path: Path, config: dict[str, int], slot_bytes: int | None) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    profile = engine_profile(load_settings(environ={}, overrides=[f"model.path={tmp_path}"]))
    if slot_bytes is None:
        with pytest.raises(ConfigError):
            _ = profile.slot_bytes
    else:
        assert profile.slot_bytes == slot_bytes


@pytest.mark.parametrize(("overrides", "expected"), [
    (["router.prefill_fixed_ms=7", "router.prefill_per_token_ms=0.5",
      "router.prefill_per_token_ctx_ms=0.001"], (7.0, 0.5, 0.001)),
])
def test_vllm_cost_seeds_are_the_configured_ones(overrides: list[str],
                                                 expected: tuple[float, ...]) -> None:
    assert engine_profile(load_settings(environ={}, overrides=overrides)).prefill_cost_ms() \
        == pytest.approx(expected)


@pytest.mark.parametrize("scale", [1.0, 2.0, 4.0])
def test_sim_cost_seeds_are_the_presets_in_wall_time(scale: float) -> None:
    s = load_settings(environ={}, overrides=["worker.engine=sim", f"sim.time_scale={scale}"])
    simulated = preset(s.sim.preset).prefill_coefficients_ms()
    assert engine_profile(s).prefill_cost_ms() == pytest.approx(
        tuple(c / scale for c in simulated))


@pytest.mark.parametrize(("overrides", "slack_s"), [
    (["worker.engine=sim"], 0.005),
    (["worker.engine=sim", "sim.host_slack_s=0.05"], 0.05),
])
def test_a_sim_engine_takes_its_host_slack_from_the_settings(overrides: list[str],
                                                             slack_s: float) -> None:
    s = load_settings(environ={}, overrides=overrides)
    assert engine_profile(s).build_engine("decode", None, None).host_slack_s == slack_s


def test_a_negative_host_slack_is_refused() -> None:
    with pytest.raises(ConfigError):
        load_settings(environ={}, overrides=["sim.host_slack_s=-1"])


def _engine_kind_reads(path: Path) -> list[int]:
    """Lines of ``path`` that read ``<x>.worker.engine`` (the engine kind)."""
    tree = ast.parse(path.read_text())
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr == "engine"
            and isinstance(n.value, ast.Attribute) and n.value.attr == "worker"]


@pytest.mark.parametrize("render", [
    lambda m: m.encode("a prompt"),
    lambda m: m.render_chat([{"role": "user", "content": "a chat"}]),
])
def test_a_sim_model_without_a_tokenizer_refuses_text_typed(render: object) -> None:
    """The sim engine's model has no tokenizer: a completion's text and a chat are
    refused as invalid requests (a 400 at the gateway), never an internal error."""
    model = engine_profile(load_settings(environ={}, overrides=["worker.engine=sim"])
                           ).served_model()
    model.prepare_chat()  # nothing to load
    with pytest.raises(InvalidRequest, match="no tokenizer"):
        render(model)  # type: ignore[operator]


def test_only_the_profile_reads_the_engine_kind() -> None:
    readers = {}
    for folder in ("libs", "services", "tools"):
        for path in (ROOT / folder).rglob("*.py"):
            if path not in (PROFILE, CONFIG) and (lines := _engine_kind_reads(path)):
                readers[str(path.relative_to(ROOT))] = lines
    assert not readers, readers
    assert _engine_kind_reads(PROFILE)  # the check looks at the right thing


def test_a_branch_on_the_engine_kind_is_found(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f(settings):\n    if settings.worker.engine == 'sim':\n"
                     "        return 1\n")
    assert _engine_kind_reads(probe) == [2]
