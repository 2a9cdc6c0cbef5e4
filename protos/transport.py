"""gRPC plumbing shared by both ends of every hop: channels, TLS, call metadata."""

from __future__ import annotations

from pathlib import Path

import grpc

# Call metadata keys (lower case, as gRPC requires).
SECRET_KEY = "x-pipeshard-secret"
MANIFEST_KEY = "x-pipeshard-manifest"
# Methods a caller may use before it knows the manifest hash.
OPEN_METHODS = frozenset({"Info", "Health"})

MAX_MESSAGE_BYTES = 256 * 2**20  # a 2,000-token fp32 prefill of a 8k-wide model is 64 MiB

CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Reconnect quickly when a stage comes back (defaults back off up to 2 minutes).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.enable_retries", 0),
]


def open_channel(
    address: str,
    tls_ca: Path | None = None,
    server_name: str | None = None,
    options: list[tuple[str, int | str]] | None = None,
) -> grpc.aio.Channel:
    """An asyncio channel to a stage: TLS (verified against ``tls_ca``) when a CA is given;
    ``options``: more channel options."""
    options = [*CHANNEL_OPTIONS, *(options or [])]
    if tls_ca is None:
        return grpc.aio.insecure_channel(address, options=options)
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    credentials = grpc.ssl_channel_credentials(root_certificates=tls_ca.read_bytes())
    return grpc.aio.secure_channel(address, credentials, options=options)


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string (``ipv4:10.0.0.2:41234``, ``ipv6:[::1]:5``): the
    caller's port is a fresh one per connection, so only the host names the link."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6") or not rest:
        return peer or "unknown"
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    return host.strip("[]")


def call_metadata(secret: str | None, manifest_hash: str | None) -> tuple[tuple[str, str], ...]:
    items = []
    if secret:
        items.append((SECRET_KEY, secret))
    if manifest_hash:
        items.append((MANIFEST_KEY, manifest_hash))
    return tuple(items)
