# syntax=docker/dockerfile:1
# pipeshard images. One image runs every role; the command picks it:
#   docker build -t pipeshard:latest .                      # target runtime (default): no torch
#   docker run pipeshard:latest stage   (PIPESHARD_STAGE_* settings)
#   docker run pipeshard:latest serve   (PIPESHARD_GATEWAY_* settings)
#   docker run pipeshard:latest up ...
#   docker build --target export -t pipeshard:export .     # + the export extra (CPU torch)
#   docker run -v "$PWD/exports:/exports" pipeshard:export export default --stages 2 --draft default-draft --out /exports/default
# See deploy/compose.yaml for a whole fleet. With podman: `podman build --format docker ...` (its
# default OCI format drops the HEALTHCHECK); without a registry, deploy/base-image.sh builds the
# base from Debian packages (docs/deployment.md).

# --- builder: the pipeshard wheel. setup.py generates the gRPC stubs during the build, with
# grpcio-tools from pyproject's build-system requires (pip installs it in the build env).
FROM python:3.11-slim AS builder
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY protos ./protos
COPY common ./common
COPY pipeshard ./pipeshard
COPY server ./server
COPY shard_runtime ./shard_runtime
COPY stage_node ./stage_node
COPY exporter ./exporter
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# --- base: the runtime (OpenVINO, grpcio, FastAPI, ...), no torch; shared by the targets below.
FROM python:3.11-slim AS base
ENV VIRTUAL_ENV=/opt/pipeshard/.venv \
    PATH=/opt/pipeshard/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIPESHARD_STAGE_OV_CACHE_DIR=/var/cache/pipeshard/ov-cache
# The wheel is copied (300 KB), not bind-mounted from the builder: podman's build cache does not
# see a changed file behind a `RUN --mount=...,from=builder` and would keep the old install.
COPY --from=builder /wheels /tmp/wheels
RUN python -m venv /opt/pipeshard/.venv \
    && pip install --no-cache-dir /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels
# The OpenVINO cache dir exists and belongs to the user, so a fresh named volume mounted on
# /var/cache/pipeshard inherits that ownership.
RUN useradd --system --create-home --home-dir /home/pipeshard --shell /usr/sbin/nologin pipeshard \
    && mkdir -p /var/cache/pipeshard/ov-cache /models \
    && chown -R pipeshard:pipeshard /var/cache/pipeshard
# Inside a container, listen on every interface (the flags and the environment still win).
ENV PIPESHARD_STAGE_LISTEN=0.0.0.0:50051 \
    PIPESHARD_GATEWAY_LISTEN=0.0.0.0:8000
EXPOSE 8000 50051
USER pipeshard
WORKDIR /home/pipeshard
# One check for every role: `pipeshard health` takes the role from PID 1's command line (also
# under `docker run --init`). `stage`: its gRPC Health call answers (with PIPESHARD_STAGE_SECRET,
# over TLS with PIPESHARD_STAGE_TLS_CA or its own PIPESHARD_STAGE_TLS_CERT), so a stopped or
# stuck stage fails it, as does one whose inference call has run over 600 s (a hung device);
# `serve` / `up`: GET /health on the gateway's port answers 200 (over
# HTTPS when PIPESHARD_GATEWAY_TLS_CERT is set). Addresses come from PIPESHARD_STAGE_LISTEN /
# PIPESHARD_GATEWAY_LISTEN: ports, secrets and certificates given only as flags are not seen
# here, so set them through the environment. A stage's full health (linked into the ring) is
# the gateway's /ready.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["pipeshard", "health"]
ENTRYPOINT ["pipeshard"]
CMD ["--help"]

# --- export: base + the export extra (torch, optimum-intel, NNCF, gguf, accelerate), for
# `pipeshard export` / `pipeshard verify`. The CPU index keeps pip on the CPU torch build
# (2.13.0+cpu satisfies the ==2.13.0 pin); as in deploy/bootstrap.sh, torchvision is removed
# again (it cannot load beside the CPU torch, and transformers imports it when present).
FROM base AS export
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
USER root
COPY --from=builder /wheels /tmp/wheels
RUN pip install --no-cache-dir --extra-index-url "$TORCH_INDEX_URL" "$(ls /tmp/wheels/pipeshard-*.whl)[export]" \
    && pip uninstall -y torchvision \
    && rm -rf /tmp/wheels
USER pipeshard

# --- runtime (default target, last): the stage nodes and the gateway. No torch.
FROM base AS runtime
