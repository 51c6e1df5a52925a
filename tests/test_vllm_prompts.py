"""The prompt token ids CPD computes are vLLM's: CPD's gateway and vLLM's own OpenAI
server, on the same model folder, tokenize the same completions prompts and render and
tokenize the same chats to the same ids. The folder is the local model given what real
models have and it lacks: a tokenizer that adds a BOS and a chat template of its own."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from cpd.engines.servedmodel import ServedModel
from cpd.modelbuild import build
from cpd.modelbuild.tokenizer import BOS
from cpd.ops.config import load_settings
from cpd.ops.natsserver import NatsServer
from services.gateway import GatewayService
from tools.bench.servers import VllmServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NAME = "bos-model"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
            "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
            "{% endif %}")
PROMPTS = ["def fib(n):", "The cold suffix pushes the weight immediately.", " x"]
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hi there"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a lease?"},
     {"role": "assistant", "content": "a pin"}, {"role": "user", "content": "and then?"}],
    # Text parts of one message, joined as vLLM joins them.
    [{"role": "user", "content": [{"type": "text", "text": "first"},
                                  {"type": "text", "text": "second"}]}],
]


@pytest.fixture(scope="module")
def folder(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The local model with a BOS-adding tokenizer and a chat template."""
    out = tmp_path_factory.mktemp("bosmodel") / NAME
    shutil.copytree(build("tiny", model_cache), out)
    tok = json.loads((out / "tokenizer.json").read_text())
    bos_id = next(t["id"] for t in tok["added_tokens"] if t["content"] == BOS)
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}}}
    (out / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
async def vllm_url(folder: Path, tmp_path_factory: pytest.TempPathFactory,
                   model_cache: Path) -> AsyncIterator[str]:
    model = ServedModel.load(load_settings(environ={}, overrides=[
        f"model.path={folder}", f"model.cache_dir={model_cache}"]))
    server = VllmServer(tmp_path_factory.mktemp("vllmserve"), model, NAME, 256)
    try:
        await server.start()
        yield server.base_url.removesuffix("/v1")
    finally:
        server.stop()


@pytest.fixture(scope="module")
async def cpd_url(folder: Path, nats_server: NatsServer, model_cache: Path
                  ) -> AsyncIterator[str]:
    gateway = GatewayService(load_settings(environ={}, overrides=[
        f"nats.servers={nats_server.url}", "nats.drain_timeout_s=2", f"model.path={folder}",
        f"model.cache_dir={model_cache}", "gateway.port=0",
        f"gateway.served_model_name={NAME}"]))
    await gateway.start()
    try:
        yield gateway.url
    finally:
        await gateway.stop()


def _bos(folder: Path) -> int:
    return Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(BOS)


async def _tokens(url: str, body: dict[str, Any]) -> list[int]:
    async with httpx.AsyncClient(timeout=30) as http:
        resp = await http.post(f"{url}/tokenize", json={"model": NAME, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()["tokens"]


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_completion_prompts_get_vllms_ids(vllm_url: str, cpd_url: str, folder: Path,
                                                prompt: str) -> None:
    want = await _tokens(vllm_url, {"prompt": prompt})
    assert await _tokens(cpd_url, {"prompt": prompt}) == want
    assert want[0] == _bos(folder)  # the BOS the tokenizer adds


@pytest.mark.parametrize("messages", CHATS)
async def test_chats_get_vllms_ids(vllm_url: str, cpd_url: str, folder: Path,
                                   messages: list[dict[str, Any]]) -> None:
    want = await _tokens(vllm_url, {"messages": messages})
    assert await _tokens(cpd_url, {"messages": messages}) == want
    assert want.count(_bos(folder)) == 1  # the template's BOS, and no second one


async def test_special_tokens_as_asked(vllm_url: str, cpd_url: str) -> None:
    for body in ({"prompt": PROMPTS[0], "add_special_tokens": False},
                 {"messages": CHATS[0], "add_special_tokens": True}):
        assert await _tokens(cpd_url, body) == await _tokens(vllm_url, body)
