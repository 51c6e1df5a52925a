#!/usr/bin/env bash
# The prepared GPU check (docs/benchmarks/gpu-check.md): CUDA vLLM on the locally
# built `small` model through CPD's engine and KV connector, in one command that fits a
# device lease. The report goes to $OUT/gpu_check.json (else out/gpu_check.json) and the
# whole log to gpu_check.log beside it.
#
#   bash scripts/gpu_check.sh [--dry-run] [more tools/bench/gpu_check.py options]
#       On the GPU machine. Exit codes are tools/bench/gpu_check.py's (0 = passed; its module
#       docstring lists the others); 124 = killed by the hard limit below.
#   bash scripts/gpu_check.sh --fetch-wheels
#       Here, where pip reaches an index: wheels (CPython 3.12, x86-64) of CPD's Python
#       dependencies that the device image lacks, into out/gpu-wheels. Name that folder in
#       the device run's `carry`; this script installs them there before the check.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="$ROOT/out/gpu-wheels"
PY="${PYTHON:-python3}"
# The device allows 600 s per command; tools/bench/gpu_check.py reports by itself after its
# --budget (480 s), this only catches a check that cannot even do that.
HARD_LIMIT_S=540
SITE=/tmp/cpd-gpu-check-site
# Imported by the check (cpd.modelbuild, cpd.engine, cpd.kvstore) and missing from the
# GPU machine image (its package list, in the device tool notes).
DEVICE_WHEELS=(msgspec blake3 structlog opentelemetry-api opentelemetry-sdk
               opentelemetry-semantic-conventions importlib-metadata nats-py)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  venv_py="$ROOT/.venv/bin/python"
  specs=()
  for dist in "${DEVICE_WHEELS[@]}"; do
    # The versions this checkout is tested with, where it has them.
    v=$("$venv_py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" \
        "$dist" 2>/dev/null) && specs+=("$dist==$v") || specs+=("$dist")
  done
  mkdir -p "$WHEELS"
  exec "$venv_py" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEELS" "${specs[@]}"
fi

OUTDIR="${OUT:-$ROOT/out}"
mkdir -p "$OUTDIR"
cd "$ROOT" || exit 2
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  # Offline, no resolver: the carried wheels go to a private folder, not the image.
  # A failed install is not fatal: the report then names the modules still missing.
  if "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHEELS"/*.whl; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu_check: installing the carried wheels from $WHEELS failed" >&2
  fi
fi
# The checkout is not installed there: its packages come from the tree.
export PYTHONPATH="$ROOT/libs:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
echo "gpu_check: $("$PY" --version 2>&1) at $(command -v "$PY"); report in $OUTDIR" >&2
timeout -k 15 "$HARD_LIMIT_S" "$PY" -m tools.bench.gpu_check --json "$OUTDIR/gpu_check.json" "$@" \
  2>&1 | tee "$OUTDIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
