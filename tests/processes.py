"""Start real pipeshard processes on free loopback ports and stop them by process group, and
wait for what they do to settle.

The launcher lives in ``benchmarks/processes.py`` (`pipeshard bench` uses it too); the tests
import it from here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from benchmarks.processes import (
    PIPESHARD,
    Proc,
    free_port,
    start_gateway,
    start_pinned_stages,
    start_stages,
)

__all__ = [
    "HANG_GUARD_S",
    "PIPESHARD",
    "Proc",
    "free_port",
    "settled",
    "settled_async",
    "start_gateway",
    "start_pinned_stages",
    "start_stages",
]

T = TypeVar("T")
# How long a test waits for something that happens at once or after a set interval (a session
# freed, probes resumed, a stage seen down): a guard against a hang, never a measure. Generous,
# so that a loaded shared machine never fails a test for being slow.
HANG_GUARD_S = 60.0


def settled(read: Callable[[], T], done: Callable[[T], bool], timeout: float = HANG_GUARD_S) -> T:
    """Call ``read`` until ``done`` holds for its value or ``timeout`` runs out; returns the last
    value, on which the caller asserts (so a failure shows what was seen)."""
    deadline = time.monotonic() + timeout
    while not done(value := read()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


async def settled_async(
    read: Callable[[], Awaitable[T]], done: Callable[[T], bool], timeout: float = HANG_GUARD_S
) -> T:
    """:func:`settled` for a coroutine ``read``, inside an event loop."""
    deadline = time.monotonic() + timeout
    while not done(value := await read()) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return value
