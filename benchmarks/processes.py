"""Start real pipeshard processes on free loopback ports and stop them by process group.

Used by the benchmarks (``pipeshard bench`` among them) and by the tests (``tests/processes.py``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

PIPESHARD = str(Path(sys.executable).parent / "pipeshard")

T = TypeVar("T")
_LOOP: asyncio.AbstractEventLoop | None = None


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on one event loop kept for the whole process.

    grpc.aio binds its completion-queue poller to every event loop it is used from and keeps
    calling into them: with a fresh ``asyncio.run`` per measurement, it later writes to the
    closed loops and prints "Event loop is closed" tracebacks.
    """
    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
        atexit.register(_close_loop, _LOOP)
    return _LOOP.run_until_complete(coro)


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """What ``asyncio.run`` does at its end: cancel what is left (grpc.aio leaves a task per
    finished call behind), let it unwind, then close."""
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


def free_port(count: int = 1) -> int:
    """A port on 127.0.0.1 that is free now, and the ``count - 1`` after it too (for
    `pipeshard up --stage-port`, whose stages take consecutive ports)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            base = int(sock.getsockname()[1])
            if base + count > 65536:
                continue
            with contextlib.ExitStack() as held:
                try:
                    for port in range(base + 1, base + count):
                        held.enter_context(socket.socket()).bind(("127.0.0.1", port))
                except OSError:
                    continue
            return base


@dataclass
class Proc:
    args: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        handle = self.log.open("ab")
        self.popen = subprocess.Popen(
            self.args,
            stdout=handle,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONWARNINGS": "ignore", **self.env},
            start_new_session=True,  # its own process group, stopped as a whole
        )
        return self

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "READY" in self.log.read_text(errors="replace"):
                return
            assert self.popen is not None
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.args} exited:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"{self.args} not ready:\n{self.log.read_text()[-3000:]}")

    def wait_http(self, url: str, timeout: float = 120.0, verify: str | bool = True) -> bool:
        """Poll ``url`` until it answers 200 (True), or the process exits or ``timeout``
        passes (False). ``verify``: httpx's (a CA bundle for HTTPS with a private CA)."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(url, verify=verify).status_code == 200:
                    return True
            except httpx.TransportError:
                pass  # not listening yet
            assert self.popen is not None
            if self.popen.poll() is not None:
                return False
            time.sleep(0.1)
        return False

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen is None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.popen.wait(timeout)

    def kill(self) -> None:
        if self.popen is not None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
            self.popen.wait(10)


def start_stages(
    export_dir: Path,
    log_dir: Path,
    extra: Sequence[str] = (),
    ports: Sequence[int] | None = None,
    stages: Sequence[int] | None = None,
    exact: bool = True,
) -> tuple[list[Proc], list[str]]:
    """One `pipeshard stage` process per stage of ``export_dir``; returns them and addresses.

    ``exact``: f32 compute and KV cache, as the token-for-token comparisons need.
    """
    from protos.manifest import load_manifest

    indices = (
        list(stages) if stages is not None else list(range(load_manifest(export_dir).num_stages))
    )
    ports = list(ports) if ports is not None else [free_port() for _ in indices]
    procs = []
    for index, port in zip(indices, ports, strict=True):
        args = [
            PIPESHARD,
            "stage",
            "--shards",
            str(export_dir),
            "--stage",
            str(index),
            "--listen",
            f"127.0.0.1:{port}",
            "--threads",
            "1",
            "--ov-cache-dir",
            str(log_dir / "ov-cache"),
            *extra,
        ]
        if exact:
            args += ["--kv-cache-precision", "f32", "--inference-precision", "f32"]
        procs.append(Proc(args, log_dir / f"stage-{index}-{port}.log").start())
    for proc in procs:
        proc.wait_ready()
    return procs, [f"127.0.0.1:{p}" for p in ports]


def start_pinned_stages(
    export_dir: Path,
    log_dir: Path,
    metrics: bool = False,
    cores: Sequence[str] | None = None,
    threads: int = 1,
    extra: Sequence[str] = (),
) -> tuple[list[Proc], list[str], list[int]]:
    """Benchmarks: one stage process per stage, stage k pinned to ``cores[k % len(cores)]``
    (default: core k modulo the machine's cores), ``threads`` inference threads, the runtime's
    defaults (``extra`` flags override any); returns them, their addresses and (with
    ``metrics``) their Prometheus ports."""
    from protos.manifest import load_manifest

    count = load_manifest(export_dir).num_stages
    pins = list(cores) if cores else [str(c) for c in range(os.cpu_count() or 1)]
    ports = [free_port() for _ in range(count)] if metrics else []
    procs: list[Proc] = []
    for index in range(count):
        flags = ["--cpus", pins[index % len(pins)], "--threads", str(threads), *extra]
        if metrics:
            flags += ["--metrics-port", str(ports[index])]
        started, _ = start_stages(export_dir, log_dir, flags, stages=[index], exact=False)
        procs += started
    return procs, [p.args[p.args.index("--listen") + 1] for p in procs], ports


def start_gateway(
    stages: Sequence[str],
    log: Path,
    extra: Sequence[str] = (),
    timeout: float = 120.0,
    prefix: Sequence[str] = (),
    https_ca: Path | None = None,
) -> tuple[Proc, str]:
    """`pipeshard serve` over ``stages`` on a free port; returns it and its URL once ready.

    ``prefix`` goes before the command (e.g. ``taskset -c 0,1``). ``https_ca``: the gateway
    serves HTTPS (``extra`` has its --tls-cert/--tls-key), verified with this CA bundle.
    """
    port = free_port()
    args = [PIPESHARD, "serve", "--stages", ",".join(stages), "--listen", f"127.0.0.1:{port}"]
    gateway = Proc([*prefix, *args, *extra], log).start()
    url = f"{'https' if https_ca else 'http'}://127.0.0.1:{port}"
    verify = str(https_ca) if https_ca else True
    if gateway.wait_http(f"{url}/ready", timeout, verify):
        return gateway, url
    gateway.stop()
    raise TimeoutError(f"gateway not ready:\n{log.read_text()[-3000:]}")
