"""systemd's service notifications (``sd_notify``): readiness, stopping and the watchdog, for the
units' ``Type=notify`` and ``WatchdogSec=`` (deploy/systemd/).

The protocol is one datagram of ``KEY=VALUE`` lines to the socket in ``$NOTIFY_SOCKET``; a
process that systemd did not start has no such variable and nothing is sent. ``WatchdogSec=``
makes systemd set ``$WATCHDOG_USEC``: a service that sends no ``WATCHDOG=1`` for that long is
killed and (``Restart=on-failure``) started again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

log = logging.getLogger(__name__)


def notify(*fields: str) -> bool:
    """Send ``fields`` (e.g. ``"READY=1"``) to systemd; False when not run by it."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # the abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(fields).encode(), address)
    except OSError as exc:
        log.warning("cannot notify systemd at %s: %s", address, exc)
        return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between watchdog pings (half of ``WatchdogSec=``), or None when systemd asks
    this process for none."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6


async def feed_watchdog(interval: float, problem: Callable[[], str | None]) -> None:
    """Send ``WATCHDOG=1`` every ``interval`` while ``problem()`` is None. While it names a
    problem (a hung inference call), the pings stop, so that systemd restarts the service once
    ``WatchdogSec=`` has passed; they start again if the problem goes away first."""
    stopped = False
    while True:
        why = problem()
        if why is None:
            if stopped:
                log.warning("feeding the systemd watchdog again")
                stopped = False
            notify("WATCHDOG=1")
        elif not stopped:
            log.error("stopped feeding the systemd watchdog: %s", why)
            notify(f"STATUS=unhealthy: {why}")
            stopped = True
        await asyncio.sleep(interval)
