#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment at .venv with `pipeshard` on its PATH.
#   bash deploy/bootstrap.sh         what serving needs: the runtime and the gguf extra
#                                    (`pipeshard up` exports the default model on its first run)
#   bash deploy/bootstrap.sh --dev   also the test bench: the bench and dev extras, and (as root
#                                    on Debian) the system tools the tests drive
# $PIPESHARD_EXTRAS overrides the extras. Safe to run again: it reinstalls only when
# pyproject.toml or this script changed, or extras are asked for that are not installed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
python=${PYTHON:-python3}
dev=false
for arg in "$@"; do
  case "$arg" in
    --dev) dev=true ;;
    *) echo "bootstrap: unknown argument $arg (only --dev)" >&2; exit 2 ;;
  esac
done
if $dev; then
  extras=${PIPESHARD_EXTRAS:-export,bench,dev}
else
  extras=${PIPESHARD_EXTRAS:-gguf}
fi

if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv" >&2
  "$python" -m venv .venv
fi
# The stamp holds the hash of pyproject.toml and this script, then the extras installed: a run
# that asks for no extra beyond them (`up` after the tests) installs nothing.
stamp=.venv/.pipeshard-installed
want=$(cat pyproject.toml deploy/bootstrap.sh | sha256sum | cut -d' ' -f1)
have="" installed=""
if [ -f "$stamp" ]; then read -r have installed < "$stamp" || true; fi
covered=true
for extra in ${extras//,/ }; do
  [[ ",$installed," == *",$extra,"* ]] && continue
  [[ $extra == gguf && ",$installed," == *",export,"* ]] && continue  # export holds gguf's
  covered=false
done
if [ "$have" != "$want" ] || ! $covered; then
  if [ "$have" = "$want" ]; then  # the same project: keep what is installed, add the rest
    extras=$(echo "$installed,$extras" | tr ',' '\n' | sed '/^$/d' | sort -u | paste -sd, -)
  fi
  echo "bootstrap: installing pipeshard[$extras] into .venv" >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
  # grpcio-tools (pyproject's build requirement, pinned there) generates the stubs below
  tools=$(.venv/bin/python -c 'import tomllib; print(next(r for r in tomllib.load(open(
    "pyproject.toml", "rb"))["build-system"]["requires"] if r.startswith("grpcio-tools")))')
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$extras]" "$tools"
  # optimum-intel declares torchvision, pinned beside the CPU torch so pip does not pull a CUDA
  # torch; but PyPI's torchvision cannot load beside the CPU torch build, and transformers
  # imports it when present. Nothing here needs it (it is only for vision-language models).
  if .venv/bin/python -m pip show -q torchvision >/dev/null 2>&1; then
    .venv/bin/python -m pip uninstall -y -q torchvision
  fi
  echo "$want $extras" > "$stamp"
fi
# The test bench's system tools (--dev only: serving needs none of them): systemd-analyze
# (Debian's systemd), docker-compose (`config` needs no engine) and prometheus
# (tests/test_deploy.py, tests/test_prometheus.py); podman with runc, its bridge networks with
# names (netavark, aardvark-dns), podman-compose and debootstrap (the container image, built
# locally: tests/test_image.py); ip and tc (iproute2) and nft (nftables) for the lab of network
# namespaces (tests/test_hosts.py).
if $dev; then
  missing=()
  has() { command -v "$1" >/dev/null || [ -x "/usr/sbin/$1" ] || [ -x "/usr/bin/$1" ]; }
  has systemd-analyze || missing+=(systemd)
  has docker-compose || missing+=(docker-compose)
  has prometheus || missing+=(prometheus)
  has podman || missing+=(podman netavark aardvark-dns iptables)
  has runc || missing+=(runc)
  has podman-compose || missing+=(podman-compose)
  has debootstrap || missing+=(debootstrap)
  { has ip && has tc; } || missing+=(iproute2)
  has nft || missing+=(nftables)
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "bootstrap: installing ${missing[*]} (Debian packages) for the tests" >&2
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
    else
      echo "bootstrap: the tests need: ${missing[*]} (apt-get install them)" >&2
    fi
  fi
fi
# The gRPC stubs are generated from protos/*.proto (never committed); regenerate them every
# time so an edited .proto never meets stale stubs.
.venv/bin/python -m protos.codegen
