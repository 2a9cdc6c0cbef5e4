"""`pipeshard up`: a whole local fleet from one command, and nothing left behind on SIGTERM."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.engine.scheduler import SchedulerConfig
from testing_support.tiny_models import CHAT_TEMPLATE, make_model
from tests.conftest import ExportFn, make_certificates
from tests.processes import PIPESHARD, free_port, settled

pytestmark = pytest.mark.integration


def children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        text = (task / "children").read_text() if (task / "children").exists() else ""
        found.update(int(c) for c in text.split())
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def listening(port: int) -> str | None:
    """The address a socket listens on at ``port`` (from /proc/net/tcp and tcp6, where
    grpc's IPv4 sockets are v4-mapped), if any."""
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                # 32-bit words in host (little-endian) order
                words = [address[i : i + 8] for i in range(0, len(address), 8)]
                raw = b"".join(bytes.fromhex(word)[::-1] for word in words)
                ip = ipaddress.ip_address(raw)
                mapped = getattr(ip, "ipv4_mapped", None)
                return str(mapped or ip)
    return None


def test_up_serves_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """A fleet on every interface over HTTPS (the certificate from the environment): the
    banner's curl command works as printed; SIGTERM stops every process."""
    ca, cert, key = make_certificates(tmp_path / "tls")
    tls = {"PIPESHARD_GATEWAY_TLS_CERT": str(cert), "PIPESHARD_GATEWAY_TLS_KEY": str(key)}
    source = make_model("llama", tmp_path / "tiny-chat", chat_template=CHAT_TEMPLATE)
    draft = make_model("llama", tmp_path / "tiny-draft", seed=1, chat_template=CHAT_TEMPLATE)
    port, stage_port = free_port(), free_port(2)
    log = (tmp_path / "up.log").open("wb")
    up = subprocess.Popen(
        [
            PIPESHARD,
            "up",
            "--model",
            str(source),
            "--stages",
            "2",
            "--weights",
            "fp32",
            "--host",
            "0.0.0.0",
            "--port",
            str(port),
            "--stage-port",
            str(stage_port),
            "--exports-dir",
            str(tmp_path / "exports"),
            "--log-dir",
            str(tmp_path / "logs"),
            "--draft",
            str(draft),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **tls},
    )
    try:
        deadline = time.monotonic() + 240
        while "pipeshard is serving" not in (tmp_path / "up.log").read_text():
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "up.log").read_text()
            time.sleep(0.2)
        banner = (tmp_path / "up.log").read_text()
        url = f"https://127.0.0.1:{port}"
        assert f"on {url} " in banner and f"--cacert {cert}" in banner
        curl = banner[banner.index("  curl -N") : banner.index("Stop with Ctrl-C.")]
        streamed = subprocess.run(
            ["bash", "-c", curl.replace("curl -N", "curl -sSN --max-time 60")],
            capture_output=True,
            text=True,
        )
        assert streamed.returncode == 0, streamed.stderr
        assert streamed.stdout.rstrip().endswith("data: [DONE]"), streamed.stdout
        assert "listening on 0.0.0.0" in banner and "with no API key" in banner
        assert listening(port) == "0.0.0.0" and listening(stage_port) == "127.0.0.1"
        assert "speculative decoding with the draft while at most 1 request decodes" in banner
        reply = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "model": "tiny-chat",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            },
            timeout=60,
            verify=str(ca),
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
        metrics = httpx.get(f"{url}/metrics", verify=str(ca)).text
        assert "pipeshard_gateway_spec_k_count" in metrics
        stage_pids = children(up.pid)
        assert len(stage_pids) == 2
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(60)
    assert code == 0
    # (a stage reaped just after up exits: the wait is a hang guard)
    assert settled(lambda: [pid for pid in stage_pids if alive(pid)], lambda left: not left) == []
    assert (tmp_path / "exports").is_dir() and any((tmp_path / "exports").iterdir())


def test_up_reports_a_failed_export_and_starts_nothing(tmp_path: Path) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    up = subprocess.run(
        [
            PIPESHARD,
            "up",
            "--model",
            str(broken),
            "--exports-dir",
            str(tmp_path / "exports"),
            "--port",
            str(free_port()),
            "--stage-port",
            str(free_port(2)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert up.returncode == 2, up.stderr
    assert "pipeshard export: error:" in up.stderr  # the export's own reason
    assert f"pipeshard up: error: the export of {broken} failed (exit status 2" in up.stderr
    assert "Traceback" not in up.stderr
    assert not (tmp_path / "exports" / "broken-model-2stage-int4" / "manifest.json").exists()


def test_up_keeps_a_ggufs_form_in_its_export_path_and_refuses_it_for_a_folder(
    tiny_model: Any, tmp_path: Path
) -> None:
    """`up` exports a GGUF in the fast form unless told (its own folder, so an export in
    another form is never taken for it); --gguf-form for a Hugging Face folder is refused,
    not ignored, before anything is exported or started."""
    from pipeshard.fleet import FleetOptions, export_path

    base = FleetOptions(exports_dir=tmp_path)
    assert export_path(base, "m").name == "m-2stage-auto-fast"
    assert export_path(FleetOptions(exports_dir=tmp_path, gguf_form="split"), "m").name == (
        "m-2stage-auto"
    )
    assert export_path(base, "m", gguf=False).name == "m-2stage-auto"
    up = subprocess.run(
        [
            PIPESHARD,
            "up",
            "--model",
            str(tiny_model("llama")),
            "--gguf-form",
            "split",
            "--exports-dir",
            str(tmp_path / "exports"),
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert up.returncode == 2, up.stderr
    assert "--gguf-form is for a GGUF model" in up.stderr and "Traceback" not in up.stderr
    assert not (tmp_path / "exports").exists()


def up_watching_stages(export: Path, logs: Path) -> tuple[int, str, set[int]]:
    """Run `pipeshard up --export` until it exits: its status, its output and the stage
    processes it started."""
    up = subprocess.Popen(
        [
            PIPESHARD,
            "up",
            "--export",
            str(export),
            "--port",
            str(free_port()),
            "--stage-port",
            str(free_port(2)),
            "--log-dir",
            str(logs),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stage_pids: set[int] = set()
    deadline = time.monotonic() + 120
    while up.poll() is None and time.monotonic() < deadline:
        for pid in children(up.pid) - stage_pids:
            with contextlib.suppress(FileNotFoundError):  # other children come and go
                if " stage " in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "):
                    stage_pids.add(pid)
        time.sleep(0.05)
    out, err = up.communicate(timeout=60)
    return up.returncode, out + err, stage_pids


def test_up_reports_a_gateway_that_cannot_start_and_stops_its_stages(
    tiny_export: ExportFn, tmp_path: Path
) -> None:
    """An export whose draft folder holds no export: the stages start, the gateway cannot;
    `up` says why in one line, exits 2 and leaves no stage running."""
    export = tmp_path / "export"
    shutil.copytree(tiny_export("llama", 2), export)
    manifest = json.loads((export / "manifest.json").read_text())
    manifest["draft"] = {"directory": "draft", "model_id": "gone", "manifest_sha256": "0" * 64}
    (export / "manifest.json").write_text(json.dumps(manifest))
    (export / "draft").mkdir()
    code, output, stage_pids = up_watching_stages(export, tmp_path / "logs")
    assert code == 2, output
    assert "pipeshard up: error: the gateway did not start: " in output, output
    assert "not a pipeshard export folder" in output and "Traceback" not in output, output
    assert len(stage_pids) == 2
    assert not [pid for pid in stage_pids if alive(pid)]


def test_up_reports_a_stage_that_exits_while_starting(
    tiny_export: ExportFn, tmp_path: Path
) -> None:
    """Stage 1's weights are gone: it exits while the gateway waits for it; `up` names the
    stage and its log in one line (the gateway's start ends as a failed one, no traceback),
    exits 2 and stops stage 0."""
    export = tmp_path / "export"
    shutil.copytree(tiny_export("llama", 2), export)
    for weights in (export / "stage-1").glob("*.bin"):
        weights.unlink()
    code, output, stage_pids = up_watching_stages(export, tmp_path / "logs")
    assert code == 2, output
    log = tmp_path / "logs" / "stage-1.log"
    why = f"stage 1 exited during start-up (exit status 2; its log: {log})"
    assert f"pipeshard up: error: {why}" in output, output
    assert "Traceback" not in output, output
    # the stage's own reason, in one line, is in its log
    assert "pipeshard stage: error: cannot load stage 1 on CPU: " in log.read_text()
    assert len(stage_pids) == 2
    assert not [pid for pid in stage_pids if alive(pid)]


def test_up_refuses_a_port_in_use_before_starting_anything(
    tiny_export: ExportFn, tmp_path: Path
) -> None:
    """Another fleet holds the gateway's port, or a stage's: `up` says which option to
    change, at once (no stage started); so does a gateway host that is not this machine's.
    A stage started on a port another stage holds exits with the reason instead of sharing
    the port (gRPC's default SO_REUSEPORT would let it)."""
    export = tiny_export("llama", 2)
    with socket.socket() as taken:
        # as a gRPC server binds (SO_REUSEPORT): a second one could share the port
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        in_use = f"cannot listen on port {port} of 127.0.0.1: address already in use"
        cases = [
            (
                ["--port", str(port)],
                f"{in_use} (another pipeshard up?); choose another with --port",
            ),
            (
                ["--port", str(free_port()), "--stage-port", str(port - 1)],
                "choose another with --stage-port",
            ),
            (
                ["--host", "192.0.2.1"],
                "cannot listen on 192.0.2.1: cannot assign requested address",
            ),
        ]
        for flags, message in cases:
            up = subprocess.run(
                [PIPESHARD, "up", "--export", str(export), *flags],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert up.returncode == 2 and message in up.stderr, up.stderr
            assert "stage 0" not in up.stdout + up.stderr  # no stage was started
        stage = subprocess.run(
            [
                PIPESHARD,
                "stage",
                "--shards",
                str(export),
                "--stage",
                "0",
                "--listen",
                f"127.0.0.1:{port}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert stage.returncode == 2, stage.stderr
    assert (
        f"pipeshard stage: error: cannot listen on 127.0.0.1:{port}: address already in use"
        in stage.stderr
    )
    # found before the shard is loaded, and gRPC has nothing to log about it
    assert "warmed up" not in stage.stderr and "add_port" not in stage.stderr, stage.stderr


def test_up_batches_every_request_in_one_micro_batch_group(
    tiny_export: ExportFn, tmp_path: Path
) -> None:
    """The stages of `up` share this machine's cores, so its gateway keeps every request in
    one micro-batch group (pipelining groups across stages that share the cores gains nothing:
    docs/scheduling.md); --micro-batch-groups N sets it, and goes with --no-batching or a
    number below 1 only as a clear error before anything starts."""
    from pipeshard.fleet import FleetOptions, gateway_settings

    addresses = ["127.0.0.1:1", "127.0.0.1:2"]

    def scheduler(**options: Any) -> SchedulerConfig:
        settings = gateway_settings(FleetOptions(**options), addresses)
        return settings.ring_scheduler_config(2, paged=True)

    one = scheduler()
    assert (one.groups, one.group_size, one.lockstep, one.solo) == (1, 0, True, False)
    # the gateway's own default, for stages on PCs of their own: a group per stage
    per_stage = scheduler(micro_batch_groups=None)
    assert (per_stage.groups, per_stage.group_size) == (2, 2)
    assert scheduler(micro_batch_groups=3).groups == 3
    assert scheduler(batching=False).solo
    export = tiny_export("llama", 2)
    for flags, message in [
        (["--no-batching", "--micro-batch-groups", "2"], "do not go together"),
        (["--micro-batch-groups", "0"], "--micro-batch-groups must be 1 or more, not 0"),
    ]:
        up = subprocess.run(
            [PIPESHARD, "up", "--export", str(export), "--port", str(free_port()), *flags],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert up.returncode == 2 and message in up.stderr, up.stderr
        assert "stage 0" not in up.stdout + up.stderr  # no stage was started


def test_startup_benchmark_times_up_to_serving(tiny_export: ExportFn, tmp_path: Path) -> None:
    from benchmarks.startup import main as startup

    port = free_port()
    command = (
        f"{PIPESHARD} up --export {tiny_export('llama', 2)} --port {port} "
        f"--stage-port {free_port(2)}"
    )
    args = ["--variant", f"tiny={command}", "--rounds", "1", "--port", str(port)]
    assert startup([*args, "--out", str(tmp_path), "--name", "startup"]) == 0
    [table] = tmp_path.glob("startup-*.md")
    row = next(line for line in table.read_text().splitlines() if line.startswith("| tiny |"))
    reuse, ready, serving, reply = (cell.strip() for cell in row.split("|")[2:6])
    assert reuse == "-"  # --export: nothing to check
    assert 0 < float(ready.split()[0]) <= float(serving.split()[0]) <= float(reply.split()[0])
    [data] = tmp_path.glob("startup-*.json")
    assert json.loads(data.read_text())["runs"]["tiny"][0]["serving"] > 0


def test_a_stage_passes_ov_properties_to_the_compile(tiny_export: ExportFn) -> None:
    """--ov-property (or PIPESHARD_STAGE_OV_PROPERTIES, a JSON object) reaches OpenVINO's
    compile as given: one the device does not know stops the stage with OpenVINO's own reason
    in one line, not a traceback; a malformed one is refused before anything loads."""
    export = tiny_export("llama", 2)
    base = [PIPESHARD, "stage", "--shards", str(export), "--stage", "0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPESHARD_")}
    runs = [
        (["--ov-property", "NOT_A_PROPERTY=1"], env),
        ([], env | {"PIPESHARD_STAGE_OV_PROPERTIES": '{"NOT_A_PROPERTY": "1"}'}),
    ]
    for flags, run_env in runs:
        listen = ["--listen", f"127.0.0.1:{free_port()}"]
        stage = subprocess.run(
            [*base, *listen, *flags], capture_output=True, text=True, timeout=120, env=run_env
        )
        assert stage.returncode == 2, stage.stderr
        last = stage.stderr.strip().splitlines()[-1]
        assert last.startswith("pipeshard stage: error: cannot load stage 0 on CPU: ")
        assert "NOT_A_PROPERTY" in last and "Traceback" not in stage.stderr, stage.stderr
    bad = subprocess.run(
        [*base, "--ov-property", "no-equals-sign"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2
    assert "expected KEY=VALUE, got 'no-equals-sign'" in bad.stderr, bad.stderr
