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

from server.health import check_stage
from tests.conftest import make_certificates
from tests.processes import PIPESHARD, start_gateway, start_stages
from tests.test_gateway import MESSAGES, export_chat_model

SECRET = "health-check-secret"


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
        body = {
            "model": "chat-model",
            "messages": MESSAGES,
            "max_tokens": 230,  # the tiny model's context is 256
            "temperature": 0,
            "logit_bias": {"2": -100},  # no end-of-sequence: the load lasts
        }
        load = threading.Thread(
            target=lambda: [
                httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).raise_for_status()
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
