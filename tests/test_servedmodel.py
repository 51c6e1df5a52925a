"""The served model as the router and gateway see it: namespaces, limits, text."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import jinja2
import pytest

from cpd.engines.servedmodel import ServedModel
from cpd.ops.config import load_settings
from cpd.protocol.errors import ConfigError


@pytest.fixture(scope="module")
def model(model_cache: Path) -> ServedModel:
    return ServedModel.load(load_settings(environ={},
                                          overrides=[f"model.cache_dir={model_cache}"]))


def test_limits_and_namespaces(model: ServedModel) -> None:
    assert (model.name, model.max_model_len, model.vocab_size) == ("cpd-tiny", 8192, 1970)
    assert model.namespace_for() == model.namespace
    a, b = model.namespace_for("acme"), model.namespace_for("acme", "salt")
    assert len({model.namespace.id, a.id, b.id}) == 3


@pytest.mark.parametrize("special", [True, False])
@pytest.mark.parametrize("text", [
    "", "def fib(n):\n    return n", "ünïcödé ✓ 数 🦊" * 3, "  spaces\t\ttabs\n\n",
    "<s>a special token in the text</s>", "word " * 3000])
def test_the_gateways_encoding_is_the_tokenizers_own(model: ServedModel, text: str,
                                                     special: bool) -> None:
    """``encode`` takes the faster path without character offsets: the same ids."""
    assert model.encode(text, add_special_tokens=special) == model.tokenizer.encode(
        text, add_special_tokens=special).ids


def test_incremental_text_equals_the_whole_and_never_splits_a_character(
        model: ServedModel) -> None:
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # ünïcödé ✓ 数"
    ids = model.encode(text)
    assert model.decode(ids) == text
    detok = model.detokenizer()
    parts = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(parts) == text
    assert not any("\ufffd" in p for p in parts)


def test_chat_prompt_holds_every_turn(model: ServedModel) -> None:
    prompt = model.render_chat([{"role": "system", "content": "be brief"},
                                {"role": "user", "content": "hi there"}])
    assert "be brief" in prompt and "hi there" in prompt
    assert prompt.endswith("<|assistant|>\n")


def test_a_model_chat_template_is_rendered_sandboxed(model: ServedModel) -> None:
    """By ``transformers``, as vLLM renders it: the tokenizer's special tokens in scope."""
    templated = dataclasses.replace(
        model,
        chat_template="{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n"
                      "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
    assert templated.render_chat([{"role": "user", "content": "hi"}]) == (
        "<|bos|>[user] hi\n[assistant] ")
    hostile = dataclasses.replace(model, chat_template="{{ ''.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        hostile.render_chat([{"role": "user", "content": "hi"}])


def test_the_namespace_follows_the_weights(model: ServedModel, tmp_path: Path,
                                           model_cache: Path) -> None:
    """Same weights elsewhere: same revision. Other weights behind the same folder:
    another revision, hence another namespace. No weights: ``model.revision`` or a
    typed refusal."""
    copy = tmp_path / "m"
    shutil.copytree(model.folder, copy)
    settings = load_settings(environ={}, overrides=[f"model.path={copy}",
                                                    f"model.cache_dir={model_cache}"])
    same = ServedModel.load(settings)
    assert same.namespace.model_revision == model.namespace.model_revision
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # "retrained": the last bytes differ
    weights.write_bytes(bytes(data))
    changed = ServedModel.load(settings)
    assert changed.namespace.model_revision != same.namespace.model_revision
    assert changed.namespace.id != same.namespace.id
    weights.unlink()
    with pytest.raises(ConfigError):
        ServedModel.load(settings)
    named = ServedModel.load(load_settings(environ={}, overrides=[
        f"model.path={copy}", f"model.cache_dir={model_cache}", "model.revision=v7"]))
    assert named.namespace.model_revision == "v7"


@pytest.mark.parametrize(("text", "incomplete_after"), [
    # "你" is three byte-level tokens: its text is held back until the third.
    ("你", [True, True, False]),
    ("a你", [False, True, True, False]),
    ("ab", [False, False]),
])
def test_the_detokenizer_says_when_its_ids_end_inside_a_character(
        model: ServedModel, text: str, incomplete_after: list[bool]) -> None:
    ids = model.encode(text, add_special_tokens=False)
    assert len(ids) == len(incomplete_after)
    detok = model.detokenizer()
    seen = []
    for i in ids:
        detok.push([i])
        seen.append(detok.incomplete)
    assert seen == incomplete_after
    assert detok.flush() == "" and not detok.incomplete
