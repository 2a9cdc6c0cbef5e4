"""Whether an address names this machine (a stage that shares the gateway's cores)."""

from __future__ import annotations

import ipaddress
import socket


def runs_here(host: str) -> bool:
    """True when ``host`` resolves to a loopback address or to one of this machine's own
    interfaces (binding a socket to an address succeeds only on the machine that has it).
    A name that does not resolve is not here."""
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        address = str(sockaddr[0]).split("%", 1)[0]  # an IPv6 scope id
        try:
            if ipaddress.ip_address(address).is_loopback:
                return True
        except ValueError:
            continue
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind((str(sockaddr[0]), 0))
            except OSError:
                continue
            return True
    return False


def stages_here(addresses: list[str]) -> list[int]:
    """Indices of the stage addresses (HOST:PORT) that run on this machine."""
    return [i for i, address in enumerate(addresses) if runs_here(address.rpartition(":")[0])]
