"""What the gateway and the stages share about where they listen and how: listen addresses,
whether a port can be bound, the TLS certificate pair, the OpenVINO cache's default place."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path


def default_ov_cache() -> Path:
    return Path.home() / ".cache" / "pipeshard" / "ov-cache"


def split_listen(value: str) -> tuple[str, int]:
    """A listen address HOST:PORT (an IPv6 host in brackets: ``[::]:8000``) as (host without
    brackets, port). Raises ValueError."""
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"listen address must be HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def local_address(listen: str) -> str:
    """HOST:PORT where a client on this machine reaches a service listening on ``listen``
    (loopback for a wildcard address)."""
    host, _, port = listen.rpartition(":")
    host = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]"}.get(host, host)
    return f"{host}:{port}"


def check_listen(value: str) -> str:
    """``value`` when it is a listen address HOST:PORT (see split_listen)."""
    split_listen(value)
    return value


def bind_problem(host: str, port: int) -> str | None:
    """Why a server cannot listen on ``host:port`` (``address already in use``, ...), as the
    operating system says it; None when it can. Binds as the servers do (SO_REUSEADDR: a
    port left in TIME_WAIT by a process just stopped is free)."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except socket.gaierror as exc:
            return f"unknown host {host!r} ({exc.strerror})"
        except OSError as exc:
            return str(exc.strerror).lower()
    return None


def check_can_listen(listen: str) -> None:
    """Raise ValueError ("cannot listen on HOST:PORT: why") when a server cannot listen on
    ``listen`` (see bind_problem); port 0, any free port, always can."""
    host, port = split_listen(listen)
    problem = bind_problem(host, port) if port else None
    if problem is not None:
        raise ValueError(f"cannot listen on {listen}: {problem}")


def check_tls_pair(cert: Path | None, key: Path | None) -> None:
    """A certificate and key to serve TLS with: both or neither, and loadable together. A
    wrong path, a file that is not PEM or a key of another certificate is one clear error at
    start, not a traceback from inside gRPC or uvicorn. Raises ValueError."""
    if cert is None and key is None:
        return
    if cert is None or key is None:
        raise ValueError("TLS needs both tls_cert and tls_key (--tls-cert and --tls-key)")
    for path in (cert, key):
        if not path.is_file():
            raise ValueError(f"TLS file {path} does not exist")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except OSError as exc:  # ssl.SSLError included; also an unreadable file
        if getattr(exc, "reason", None) == "KEY_VALUES_MISMATCH":
            reason = "the key does not belong to the certificate"
        elif isinstance(exc, ssl.SSLError):
            reason = "they are not a PEM certificate and its PEM private key"
        else:
            reason = exc.strerror or str(exc)
        raise ValueError(
            f"cannot serve TLS with certificate {cert} and key {key}: {reason}"
        ) from None
