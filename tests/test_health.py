"""`pipeshard health` against real stage processes and a real gateway: serving, a wrong
secret, a stopped stage (which still accepts TCP connections), the container's own service
(role from PID 1's command line), and stages over TLS."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from pipeshard.health import check_stage
from tests.conftest import make_certificates
from tests.fleets import MESSAGES, export_chat_model
from tests.processes import PIPESHARD, settled, start_gateway, start_stages

pytestmark = pytest.mark.integration

SECRET = "health-check-secret"
LOAD = {  # one request of real load: as long as the tiny model's context (256) allows
    "model": "chat-model",
    "messages": MESSAGES,
    "max_tokens": 230,
    "temperature": 0,
    "logit_bias": {"2": -100},  # no end-of-sequence
}


def health(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIPESHARD_")}
    return subprocess.run(
        [PIPESHARD, "health", *args],
        env=clean | (env or {}),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_health_of_stages_and_gateway_with_a_secret(tmp_path: Path) -> None:
    _, export = export_chat_model(tmp_path)
    procs, addresses = start_stages(export, tmp_path, ["--secret", SECRET])
    gateway = None
    try:
        gateway, url = start_gateway(addresses, tmp_path / "gateway.log", ["--secret", SECRET])
        secret = {"PIPESHARD_STAGE_SECRET": SECRET}

        first = health("stage", "--address", addresses[0], env=secret)
        assert first.returncode == 0, first.stderr
        assert "serving" in first.stdout
        assert f"next stage {addresses[1]} connected" in first.stdout

        refused = health("stage", "--address", addresses[0])  # no secret
        assert refused.returncode == 1
        assert "UNAUTHENTICATED" in refused.stderr and "secret" in refused.stderr

        assert health("gateway", "--address", url).returncode == 0

        # The age of the inference call in progress is in the reply: allowed no time at all, a
        # probe that lands during a call fails (the check a hung device fails); idle, none runs.
        load = threading.Thread(
            target=lambda: [
                httpx.post(f"{url}/v1/chat/completions", json=LOAD, timeout=120).raise_for_status()
                for _ in range(3)
            ]
        )
        load.start()
        busy = []
        while load.is_alive() and not busy:
            verdict = check_stage(addresses[0], secret=SECRET, max_compute_s=0.0, timeout=5)
            if not verdict.healthy:
                busy.append(verdict.message)
        load.join()
        assert busy, "no probe landed during an inference call"
        assert "an inference call has run for" in busy[0]
        assert check_stage(addresses[0], secret=SECRET, max_compute_s=0.0).healthy
        port = addresses[1].rsplit(":", 1)[1]
        own = tmp_path / "cmdline"  # what a container's PID 1 runs: a stage, from the env
        own.write_bytes(b"/opt/pipeshard/.venv/bin/pipeshard\0stage\0")
        env = secret | {"PIPESHARD_STAGE_LISTEN": f"0.0.0.0:{port}"}
        auto = health("--cmdline", str(own), env=env)
        assert auto.returncode == 0, auto.stderr

        # A stopped stage: the kernel still accepts its TCP connections (the old check), but
        # it does not answer the Health call.
        procs[1].signal(signal.SIGSTOP)
        try:
            socket.create_connection(("127.0.0.1", int(port)), timeout=2).close()
            stopped = health("--cmdline", str(own), "--timeout", "1", env=env)
            assert stopped.returncode == 1
            # no answer in time: on a new connection gRPC says UNAVAILABLE (no SETTINGS frame)
            assert "DEADLINE_EXCEEDED" in stopped.stderr or "timed out" in stopped.stderr
        finally:
            procs[1].signal(signal.SIGCONT)
        assert health("--cmdline", str(own), env=env).returncode == 0

        gateway.stop()
        gone = health("gateway", "--address", url)
        assert gone.returncode == 1 and "refused" in gone.stderr.lower()
    finally:
        if gateway is not None:
            gateway.stop()
        for proc in procs:
            proc.stop()


def test_health_of_a_stage_over_tls(tmp_path: Path) -> None:
    _, export = export_chat_model(tmp_path, stages=1)
    ca, cert, key = make_certificates(tmp_path / "tls")
    procs, [address] = start_stages(
        export, tmp_path, ["--tls-cert", str(cert), "--tls-key", str(key)]
    )
    try:
        env = {
            "PIPESHARD_STAGE_LISTEN": f"0.0.0.0:{address.rsplit(':', 1)[1]}",
            "PIPESHARD_STAGE_TLS_CERT": str(cert),
            "PIPESHARD_STAGE_TLS_CA": str(ca),
        }
        ok = health("stage", env=env)
        assert ok.returncode == 0, ok.stderr
        del env["PIPESHARD_STAGE_TLS_CA"]  # the stage's own certificate, trusted as it is
        assert health("stage", env=env).returncode == 0
        other, _, _ = make_certificates(tmp_path / "other")
        untrusted = health("stage", env=env | {"PIPESHARD_STAGE_TLS_CA": str(other)})
        assert untrusted.returncode == 1  # a CA that did not sign it
        assert health("stage", "--address", address, "--tls-ca", str(ca)).returncode == 0
        plain = health("stage", "--address", address, "--timeout", "2")
        assert plain.returncode == 1  # plain gRPC to a TLS port
    finally:
        for proc in procs:
            proc.stop()


class NotifySocket(threading.Thread):
    """systemd's side of sd_notify: a datagram socket that records every notification with the
    sender's PID (SCM_CREDENTIALS)."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[int, str]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except TimeoutError:
                continue
            pid = next(
                int.from_bytes(cdata[:4], "little")
                for level, kind, cdata in ancillary
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS
            )
            self.messages.append((pid, data.decode()))

    def of(self, pid: int) -> list[str]:
        return [text for sender, text in self.messages if sender == pid]

    def close(self) -> None:
        self.done.set()
        self.join()
        self.sock.close()


def test_systemd_readiness_watchdog_and_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stages and the gateway under a (simulated) systemd: READY=1 once they serve, WATCHDOG=1
    every half WatchdogSec, STOPPING=1 on SIGTERM. A stage whose inference call has run longer
    than its compute_timeout stops feeding the watchdog (here a limit every call exceeds, under
    real load: the pings every 10 ms land in calls many times), and feeds it again once idle."""
    _, export = export_chat_model(tmp_path)
    notify = NotifySocket(tmp_path / "notify.sock")
    notify.start()
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
    monkeypatch.setenv("WATCHDOG_USEC", "20000")  # a ping every 10 ms: many land in a call
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    procs, addresses = start_stages(export, tmp_path, stages=[0])
    last, [last_address] = start_stages(
        export, tmp_path, ["--compute-timeout", "0.000001"], stages=[1]
    )
    procs += last
    gateway = None
    try:
        gateway, url = start_gateway([*addresses, last_address], tmp_path / "gateway.log")
        pids = [p.popen.pid for p in [*procs, gateway] if p.popen is not None]
        statuses = ["stage 0 serving", "stage 1 serving", "serving on"]
        for pid, status in zip(pids, statuses, strict=True):
            ready = [m for m in notify.of(pid) if m.startswith("READY=1")]
            assert len(ready) == 1 and status in ready[0], notify.of(pid)
        for _ in range(3):
            httpx.post(f"{url}/v1/chat/completions", json=LOAD, timeout=120).raise_for_status()

        def fed_again(messages: list[str]) -> bool:
            marks = [i for i, m in enumerate(messages) if m.startswith("STATUS=unhealthy")]
            return bool(marks) and "WATCHDOG=1" in messages[marks[-1] + 1 :]

        # idle: the hung-looking stage feeds the watchdog again
        hung = settled(lambda: notify.of(pids[1]), fed_again)
        unhealthy = [i for i, m in enumerate(hung) if m.startswith("STATUS=unhealthy")]
        assert unhealthy, "stage 1 never stopped feeding the watchdog"
        assert "an inference call has run for" in hung[unhealthy[0]]
        assert "WATCHDOG=1" in hung[unhealthy[-1] + 1 :]
        for pid in (pids[0], pids[2]):  # no limit reached: fed all along
            assert notify.of(pid).count("WATCHDOG=1") >= 10
            assert not any(m.startswith("STATUS=unhealthy") for m in notify.of(pid))
        gateway.stop()
        for proc in procs:
            proc.stop()
        for pid in pids:  # (told before each exited: read by the listener soon after)
            assert "STOPPING=1" in settled(lambda p=pid: notify.of(p), lambda m: "STOPPING=1" in m)
    finally:
        if gateway is not None:
            gateway.stop()
        for proc in procs:
            proc.stop()
        notify.close()
