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
KEEPALIVE_TIME_MS = 10_000  # a ping after this long without one (see CHANNEL_OPTIONS)
KEEPALIVE_TIMEOUT_MS = 20_000  # no answer within this: the connection is closed
MIN_PING_INTERVAL_MS = 1_000  # a stage accepts pings this often (callers ping every 10 s)

CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Reconnect quickly when a stage comes back (defaults back off up to 2 minutes).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.enable_retries", 0),
    # Keepalive: a connection whose peer has gone silent (its host cut off for good, a
    # firewall that forgot an idle stream) is closed, failing its calls, instead of staying
    # "connected" until TCP gives up minutes later. The gateway notices a cut within seconds
    # by its own probes (link_loss_timeout); this is the backstop for the long-lived streams,
    # generous enough for a ping queued behind a large step on a slow link. Pings go on while
    # a stream is idle (max_pings_without_data 0); SERVER_OPTIONS lets stages accept them.
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),  # (what gRPC 1.8x waits for the ack)
    ("grpc.http2.max_pings_without_data", 0),
]

# A stage's server: the same message sizes; it accepts its callers' keepalive pings (gRPC's
# default allows one every 5 minutes while no data flows and answers more with GOAWAY
# "too_many_pings"), and pings its callers the same way, so the calls of a gateway or stage
# cut off for good (an idle Results stream, a Push stream) end instead of lingering.
SERVER_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),  # (what gRPC 1.8x waits for the ack)
    ("grpc.http2.max_pings_without_data", 0),
]


def open_channel(
    address: str,
    tls_ca: Path | None = None,
    server_name: str | None = None,
    options: list[tuple[str, int | str]] | None = None,
) -> grpc.aio.Channel:
    """An asyncio channel to a stage: TLS (verified against ``tls_ca``) when a CA is given;
    ``options``: more channel options, or other values of CHANNEL_OPTIONS (gRPC would take
    the first of two values of one option)."""
    options = list({**dict(CHANNEL_OPTIONS), **dict(options or [])}.items())
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
