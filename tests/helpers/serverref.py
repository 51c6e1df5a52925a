"""Reference answers from vLLM's own OpenAI server (``tools.bench.servers.VllmServer`` on
the local model's folder): what a client of monolithic vLLM gets for the same request,
the reference the API tests hold CPD's answers to.

A case is ``{"prompt": [ids], "sampling": {...}, "stop_from": [start, length]}`` (the
last optional): the prompt sent as token ids with those Completions API fields (vLLM's
extras included); with ``stop_from``, the stop string is that slice of the answer's
choice 0 without it. Each result has the token ids, text, finish and stop reasons, the
stop string used and, when asked, each token's log probability and the top ``logprobs``
``[id, logprob]`` by rank, of choice 0, and the same of every choice in ``choices``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from cpd.engines.servedmodel import ServedModel
from cpd.modelbuild import build
from cpd.ops.config import load_settings
from tools.bench.servers import VllmServer

_TOKEN_ID = "token_id:"  # vLLM's spelling of a token with return_tokens_as_token_ids


async def server_answers(model_cache: Path, tmp: Path, cases: list[dict[str, Any]],
                         name: str = "cpd-tiny") -> list[dict[str, Any]]:
    """Start vLLM's server on the local ``tiny`` model, answer ``cases``, stop it."""
    folder = build("tiny", model_cache)
    model = ServedModel.load(load_settings(environ={}, overrides=[
        f"model.path={folder}", f"model.cache_dir={model_cache}"]))
    server = VllmServer(tmp, model, name, 256)
    try:
        await server.start()
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as http:
            return [await _answer(http, name, case) for case in cases]
    finally:
        server.stop()


async def _answer(http: httpx.AsyncClient, name: str, case: dict[str, Any]) -> dict[str, Any]:
    sampling = dict(case.get("sampling", {}))
    if "logit_bias" in sampling:  # JSON keys are strings
        sampling["logit_bias"] = {str(k): v for k, v in sampling["logit_bias"].items()}
    if "stop_from" in case:
        start, length = case["stop_from"]
        plain = await _complete(http, name, case["prompt"], sampling)
        sampling["stop"] = [plain["choices"][0]["text"][start:start + length]]
    reply = await _complete(http, name, case["prompt"], sampling)
    choices = [_choice(c, sampling.get("logprobs"))
               for c in sorted(reply["choices"], key=lambda c: c["index"])]
    return {**choices[0], "stop": sampling.get("stop"), "choices": choices}


async def _complete(http: httpx.AsyncClient, name: str, prompt: list[int],
                    sampling: dict[str, Any]) -> dict[str, Any]:
    resp = await http.post("/completions", json={
        "model": name, "prompt": prompt, **sampling, "return_token_ids": True,
        "return_tokens_as_token_ids": True})
    resp.raise_for_status()
    return resp.json()


def _choice(choice: dict[str, Any], k: int | None) -> dict[str, Any]:
    """One choice of the server's answer; its top log probabilities (the server lists
    the token and the most likely ones) as the ``k`` most likely, by rank."""
    logprobs = []
    lp = choice.get("logprobs")
    if lp and k is not None:
        for own, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
            ranked = sorted(((int(t.removeprefix(_TOKEN_ID)), v) for t, v in top.items()),
                            key=lambda tv: -tv[1])
            logprobs.append({"logprob": own, "top": [list(tv) for tv in ranked[:k]]})
    return {"token_ids": choice["token_ids"], "text": choice["text"],
            "finish_reason": choice["finish_reason"], "stop_reason": choice.get("stop_reason"),
            "logprobs": logprobs}
