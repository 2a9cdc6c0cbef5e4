#!/usr/bin/env bash
# Build a local stand-in for the Dockerfile's base image (`python:3.11-slim`) from Debian
# packages, for machines that reach a Debian mirror but no image registry:
#
#   sudo deploy/base-image.sh            # then: podman build --pull=never -t pipeshard:latest .
#
# debootstrap's minimal Debian 12 (bookworm: the release python:3.11-slim is built on) plus
# Debian's python3.11 with venv and pip, `python` and `pip` on PATH as in the official image,
# imported into podman (or docker: ENGINE=docker) and tagged with the name every `FROM` in the
# Dockerfile uses. Root only (debootstrap, chroot). Settings (environment):
#   DEBIAN_MIRROR  the mirror (default: the first one apt uses here, else deb.debian.org)
#   SUITE          the Debian release (default bookworm)
#   ENGINE         podman (default) or docker
#   TAG            the tag (default: the Dockerfile's FROM image)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
engine=${ENGINE:-podman}
suite=${SUITE:-bookworm}
tag=${TAG:-$(awk 'toupper($1) == "FROM" && $2 !~ /^(builder|base|export|runtime)$/ {print $2; exit}' "$root/Dockerfile")}

if [ "$(id -u)" != 0 ]; then
  echo "base-image: run as root (debootstrap and chroot need it)" >&2
  exit 2
fi
for tool in debootstrap "$engine"; do
  command -v "$tool" >/dev/null || { echo "base-image: $tool is missing (apt-get install $tool)" >&2; exit 2; }
done
if [ -z "${DEBIAN_MIRROR:-}" ]; then
  DEBIAN_MIRROR=$(
    { grep -hs '^URIs:' /etc/apt/sources.list.d/debian.sources | awk '{print $2}'
      grep -hs '^deb ' /etc/apt/sources.list | awk '{print $2}'; } | grep -m1 '/debian/*$' || true)
  DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
fi

work=$(mktemp -d /var/tmp/pipeshard-base.XXXXXX)
trap 'rm -rf "$work"' EXIT
rootfs=$work/rootfs
echo "base-image: debootstrap $suite from $DEBIAN_MIRROR" >&2
debootstrap --variant=minbase "$suite" "$rootfs" "$DEBIAN_MIRROR" >"$work/debootstrap.log" 2>&1 \
  || { tail -20 "$work/debootstrap.log" >&2; exit 1; }

# Packages from the release and its security updates, as the official image's Debian has.
cat >"$rootfs/etc/apt/sources.list" <<EOF
deb $DEBIAN_MIRROR $suite main
deb $DEBIAN_MIRROR $suite-updates main
deb ${DEBIAN_SECURITY_MIRROR:-${DEBIAN_MIRROR%/debian*}/debian-security} $suite-security main
EOF
cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
echo "base-image: installing python3.11" >&2
chroot "$rootfs" /usr/bin/env DEBIAN_FRONTEND=noninteractive sh -ec '
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends python3.11 python3.11-venv python3-pip \
    python-is-python3 ca-certificates >/dev/null
  apt-get clean
  rm -rf /var/lib/apt/lists/* /var/cache/debconf/*-old /var/log/*.log /var/log/apt/* \
    /usr/share/doc/* /usr/share/man/* /usr/share/info/*
  # python:3.11-slim lets pip install into the system Python (no PEP 668 marker); so does this.
  rm -f /usr/lib/python3.*/EXTERNALLY-MANAGED
  ln -sf /usr/bin/pip3 /usr/local/bin/pip
  python --version && pip --version && python -m venv --help >/dev/null'
: >"$rootfs/etc/resolv.conf"

echo "base-image: importing as $tag" >&2
tar -C "$rootfs" --numeric-owner -c . | "$engine" import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["python3"]' \
  --quiet - "$tag" >/dev/null
"$engine" image ls "$tag"
