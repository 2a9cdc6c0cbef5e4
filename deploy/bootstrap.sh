#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment at .venv with everything installed and
# `pipeshard` on its PATH. Safe to run again: it reinstalls only when pyproject.toml or this
# script changed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
python=${PYTHON:-python3}
extras=${PIPESHARD_EXTRAS:-export,bench,dev}

if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv" >&2
  "$python" -m venv .venv
fi
stamp=.venv/.pipeshard-installed
want=$( (cat pyproject.toml deploy/bootstrap.sh; echo "$extras") | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "bootstrap: installing pipeshard[$extras] into .venv" >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$extras]"
  # optimum-intel declares torchvision, pinned beside the CPU torch so pip does not pull a CUDA
  # torch; but PyPI's torchvision cannot load beside the CPU torch build, and transformers
  # imports it when present. Nothing here needs it (it is only for vision-language models).
  if .venv/bin/python -m pip show -q torchvision >/dev/null 2>&1; then
    .venv/bin/python -m pip uninstall -y -q torchvision
  fi
  echo "$want" > "$stamp"
fi
# System tools the deployment tests drive (tests/test_deploy.py, tests/test_prometheus.py,
# tests/test_image.py): systemd-analyze (Debian's systemd), docker-compose (`config` needs no
# engine), prometheus, and podman with runc, its bridge networks with names (netavark,
# aardvark-dns), podman-compose and debootstrap (the image's base, built locally), nftables
# (the lab's partitions, tests/test_hosts.py).
if [[ ",$extras," == *",dev,"* ]]; then
  missing=()
  has() { command -v "$1" >/dev/null || [ -x "/usr/sbin/$1" ] || [ -x "/usr/bin/$1" ]; }
  has systemd-analyze || missing+=(systemd)
  has docker-compose || missing+=(docker-compose)
  has prometheus || missing+=(prometheus)
  has podman || missing+=(podman netavark aardvark-dns iptables)
  has runc || missing+=(runc)
  has podman-compose || missing+=(podman-compose)
  has debootstrap || missing+=(debootstrap)
  has nft || missing+=(nftables)
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "bootstrap: installing ${missing[*]} (Debian packages) for the deployment tests" >&2
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
    else
      echo "bootstrap: the deployment tests need: ${missing[*]} (apt-get install them)" >&2
    fi
  fi
fi
# The gRPC stubs are generated from protos/*.proto (never committed); regenerate them every
# time so an edited .proto never meets stale stubs.
.venv/bin/python -m protos.codegen
