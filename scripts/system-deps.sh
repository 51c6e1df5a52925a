#!/usr/bin/env bash
# Debian packages the test suite needs beyond Python: kubectl (renders the Kubernetes
# manifests with its built-in kustomize), podman with runc and mmdebstrap (builds the
# container images and runs docker-compose.yml). Installs only what is missing; needs
# root and apt (CI and the project's machines have both).
set -euo pipefail

missing=()
command -v kubectl >/dev/null || missing+=(kubernetes-client)
command -v podman >/dev/null || missing+=(podman)
command -v runc >/dev/null || missing+=(runc)
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)

if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "system-deps: install ${missing[*]} (needs root and apt)" >&2
    exit 1
  fi
  echo "system-deps: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# podman as root on these hosts: runc (crun fails on their cgroups) and no default
# rlimits (the defaults are refused).
conf=/etc/containers/containers.conf
if [ ! -e "$conf" ] && [ "$(id -u)" -eq 0 ]; then
  mkdir -p /etc/containers
  printf '[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\n' > "$conf"
elif ! grep -q '^default_ulimits *= *\[\]' "$conf" 2>/dev/null; then
  echo "system-deps: $conf should set default_ulimits = [] under [containers]" \
       "and runtime = \"runc\" under [engine]" >&2
fi
