"""Greedy outputs of a plain, monolithic vLLM-CPU run (no CPD): the reference every
disaggregated path must equal token for token. The prompts (token id lists, from a JSON
file) each get ``max_tokens`` tokens, EOS ignored, on the local model of the preset
given last (``tiny`` by default). (The API tests' reference for
requests with their own sampling is vLLM's OpenAI server: ``tests/helpers/serverref.py``.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(model_cache: str, prompts_file: str, max_tokens: str, preset: str = "tiny") -> None:
    from cpd.modelbuild.runtime import engine_kwargs, prepare_cpu_env

    prepare_cpu_env()
    from vllm import LLM, SamplingParams

    from cpd.modelbuild import build

    prompts = json.loads(Path(prompts_file).read_text())
    llm = LLM(**engine_kwargs(build(preset, model_cache), prefix_caching=False))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=int(max_tokens),
                                       ignore_eos=True), use_tqdm=False)
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))


if __name__ == "__main__":
    main(*sys.argv[1:5])
