#!/usr/bin/env bash
# Debian packages the test suite needs beyond Python: kubectl (renders the Kubernetes
# manifests with its built-in kustomize). Installs only what is missing; needs root and
# apt (CI and the project's machines have both).
set -euo pipefail

missing=()
command -v kubectl >/dev/null || missing+=(kubernetes-client)

[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "system-deps: install ${missing[*]} (needs root and apt)" >&2
  exit 1
fi
echo "system-deps: installing ${missing[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
