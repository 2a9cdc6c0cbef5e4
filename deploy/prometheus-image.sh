#!/usr/bin/env bash
# Build a local stand-in for the Prometheus image of deploy/compose.yaml from Debian's
# `prometheus` package, for machines that reach a Debian mirror but no image registry:
#
#   deploy/base-image.sh && deploy/prometheus-image.sh    # then: podman-compose ... up -d
#
# On top of the Dockerfile's (local) base image; laid out as the official image is where the
# compose file relies on it: /bin/prometheus as the entrypoint, /prometheus (the data volume)
# owned by `nobody` and the working directory (also where Debian's build keeps its data by
# default: /var/lib/prometheus/metrics2), wget for the healthcheck. Settings (environment):
#   ENGINE  podman (default) or docker
#   TAG     the tag (default: the compose file's Prometheus image)
#   BASE    the image to build on (default: the Dockerfile's FROM image)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
engine=${ENGINE:-podman}
tag=${TAG:-$(awk '$1 == "image:" && $2 ~ /prometheus/ {print $2; exit}' "$root/deploy/compose.yaml")}
base=${BASE:-$(awk 'toupper($1) == "FROM" {print $2; exit}' "$root/Dockerfile")}
# The host's CA certificates for apt over a TLS-inspecting proxy, at build time only.
bundle=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}
mounts=()
if [ "$engine" = podman ] && [ -f "$bundle" ]; then
  mounts=(-v "$bundle:/etc/ssl/certs/ca-certificates.crt:ro")
fi
"$engine" build --network host "${mounts[@]}" -t "$tag" - <<EOF
FROM $base
RUN apt-get update -qq \\
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \\
       prometheus wget >/dev/null \\
    && apt-get clean && rm -rf /var/lib/apt/lists/* \\
    && { [ -e /bin/prometheus ] || ln -s /usr/bin/prometheus /bin/prometheus; } \\
    && mkdir -p /prometheus /etc/prometheus && chown nobody:nogroup /prometheus \
    && rm -rf /var/lib/prometheus/metrics2 && ln -s /prometheus /var/lib/prometheus/metrics2
USER nobody
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
EOF
"$engine" image ls "$tag"
