"""`pipeshard health`: is a stage or a gateway serving? For Docker's HEALTHCHECK, monitoring
scripts and people. Exit 0 when it is, 1 when it is not, with one line that says why.

- A stage is asked over gRPC (its Health call, with the shared secret and over TLS as its
  settings say): the answer comes from the stage's own event loop, so a process that is
  stopped or stuck fails the check, while the kernel still accepts TCP connections for it. A
  stage whose inference call has run longer than ``max_compute_s`` (a hung GPU or NPU
  driver; the event loop still answers) fails it too.
- A gateway answers ``GET /health`` (over HTTPS when it serves TLS).

Without an address, the settings of the role come from the environment the services read
(``PIPESHARD_STAGE_*``, ``PIPESHARD_GATEWAY_*``); ``auto`` takes the role from the command line
of PID 1 (the service a container runs).
"""

from __future__ import annotations

import asyncio
import os
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc

from common.net import local_address
from protos import pipeshard_v1_pb2 as pb
from protos import pipeshard_v1_pb2_grpc as pb_grpc
from protos.transport import call_metadata, open_channel
from server.settings import GatewaySettings
from stage_node.settings import StageSettings, hung_call

STAGE_ENV = "PIPESHARD_STAGE_"
GATEWAY_ENV = "PIPESHARD_GATEWAY_"
# the services' own defaults, where their environment does not say
STAGE_LISTEN: str = StageSettings.model_fields["listen"].default
GATEWAY_LISTEN: str = GatewaySettings.model_fields["listen"].default
COMPUTE_TIMEOUT: float = StageSettings.model_fields["compute_timeout"].default
TIMEOUT = 4.0  # seconds a check waits for the answer


@dataclass(frozen=True)
class Verdict:
    healthy: bool
    message: str


def role_of_pid1(cmdline: Path = Path("/proc/1/cmdline")) -> str:
    """``stage`` or ``gateway``: the service PID 1 runs (`pipeshard stage`, or `serve` / `up`)."""
    try:
        args = cmdline.read_bytes().split(b"\0")
    except OSError as exc:
        raise ValueError(f"cannot tell the role from {cmdline} ({exc}): name it") from None
    return "stage" if b"stage" in args else "gateway"


def check_stage(
    address: str,
    *,
    secret: str | None = None,
    tls_ca: Path | None = None,
    server_name: str | None = None,
    timeout: float = TIMEOUT,
    max_compute_s: float = COMPUTE_TIMEOUT,
) -> Verdict:
    """The stage's Health call answers ``serving`` within ``timeout``, with no inference call
    running for longer than ``max_compute_s``."""

    async def ask() -> pb.HealthReply:
        channel = open_channel(address, tls_ca, server_name)
        try:
            stub = pb_grpc.StageStub(channel)
            reply: pb.HealthReply = await stub.Health(
                pb.HealthRequest(), metadata=call_metadata(secret, None), timeout=timeout
            )
            return reply
        finally:
            await channel.close()

    try:
        reply = asyncio.run(ask())
    except OSError as exc:  # e.g. the CA file
        return Verdict(False, f"stage {address}: {exc}")
    except grpc.aio.AioRpcError as exc:
        why = "no answer" if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else exc.details()
        return Verdict(False, f"stage {address}: {exc.code().name}: {why}")
    if not reply.serving:
        return Verdict(False, f"stage {address}: not serving")
    if hung := hung_call(reply.compute_seconds, max_compute_s):
        return Verdict(False, f"stage {address}: {hung}")
    link = ""
    if reply.downstream:
        state = "connected" if reply.downstream_ok else "NOT connected"
        link = f", next stage {reply.downstream} {state}"
    return Verdict(
        True, f"stage {address}: serving, {reply.sessions_in_use} session(s) in use{link}"
    )


def check_gateway(url: str, *, timeout: float = TIMEOUT) -> Verdict:
    """``GET {url}/health`` answers 200. Over HTTPS the certificate is not verified: the check
    is about the service, not its certificate (run it where the gateway runs)."""
    context = ssl._create_unverified_context() if url.startswith("https:") else None
    target = url.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(target, timeout=timeout, context=context) as reply:
            return Verdict(True, f"gateway {url}: {reply.status} {reply.read(200).decode()}")
    except urllib.error.HTTPError as exc:
        return Verdict(False, f"gateway {url}: HTTP {exc.code}")
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return Verdict(False, f"gateway {url}: {reason}")


def check(
    role: str,
    address: str | None = None,
    *,
    timeout: float = TIMEOUT,
    tls_ca: str | None = None,
    server_name: str | None = None,
    max_compute_s: float | None = None,
    cmdline: Path = Path("/proc/1/cmdline"),
) -> Verdict:
    """Check a ``stage``, a ``gateway`` or (``auto``) the service PID 1 runs; without
    ``address``, where and how to reach it come from the service's environment settings."""
    env = os.environ.get
    if role == "auto":
        role = role_of_pid1(cmdline)
    if role == "stage":
        # over TLS: verified against the fleet's CA, or the stage's own (self-signed) certificate
        ca = tls_ca or env(STAGE_ENV + "TLS_CA") or env(STAGE_ENV + "TLS_CERT")
        return check_stage(
            address or local_address(env(STAGE_ENV + "LISTEN") or STAGE_LISTEN),
            secret=env(STAGE_ENV + "SECRET") or None,
            tls_ca=Path(ca) if ca else None,
            server_name=server_name or env(STAGE_ENV + "TLS_SERVER_NAME") or None,
            timeout=timeout,
            # the stage's own limit (its compute_timeout setting), unless one is given
            max_compute_s=max_compute_s
            if max_compute_s is not None
            else float(env(STAGE_ENV + "COMPUTE_TIMEOUT") or COMPUTE_TIMEOUT),
        )
    if role == "gateway":
        if address is None or "://" not in address:
            scheme = "https" if env(GATEWAY_ENV + "TLS_CERT") else "http"
            where = address or local_address(env(GATEWAY_ENV + "LISTEN") or GATEWAY_LISTEN)
            address = f"{scheme}://{where}"
        return check_gateway(address, timeout=timeout)
    raise ValueError(f"unknown role {role!r}: stage, gateway or auto")
