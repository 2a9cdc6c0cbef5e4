"""`pipeshard up`: a whole local fleet from one command, and nothing left behind on SIGTERM."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tests.conftest import ExportFn
from tests.processes import PIPESHARD, free_port
from tests.tiny_models import CHAT_TEMPLATE, make_model


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


def test_up_serves_and_leaves_nothing_behind(tmp_path: Path) -> None:
    source = make_model("llama", tmp_path / "tiny-chat", chat_template=CHAT_TEMPLATE)
    draft = make_model("llama", tmp_path / "tiny-draft", seed=1, chat_template=CHAT_TEMPLATE)
    port, stage_port = free_port(), free_port()
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
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    try:
        deadline = time.monotonic() + 240
        while "pipeshard is serving" not in (tmp_path / "up.log").read_text():
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "up.log").read_text()
            time.sleep(0.2)
        banner = (tmp_path / "up.log").read_text()
        assert f"http://127.0.0.1:{port}" in banner and "curl -N" in banner
        assert "speculative decoding with the draft while at most 1 request decodes" in banner
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={
                "model": "tiny-chat",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            },
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert "pipeshard_gateway_spec_k_count" in metrics
        stage_pids = children(up.pid)
        assert len(stage_pids) == 2
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(60)
    assert code == 0
    time.sleep(0.5)
    assert not [pid for pid in stage_pids if alive(pid)]
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
            str(free_port()),
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
    up = subprocess.Popen(
        [
            PIPESHARD,
            "up",
            "--export",
            str(export),
            "--port",
            str(free_port()),
            "--stage-port",
            str(free_port()),
            "--log-dir",
            str(tmp_path / "logs"),
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
    assert up.returncode == 2, out + err
    assert "pipeshard up: error: the gateway did not start: " in err, err
    assert "not a pipeshard export folder" in err and "Traceback" not in out + err, out + err
    assert len(stage_pids) == 2
    assert not [pid for pid in stage_pids if alive(pid)]


def test_startup_benchmark_times_up_to_serving(tiny_export: ExportFn, tmp_path: Path) -> None:
    from benchmarks.startup import main as startup

    port = free_port()
    command = (
        f"{PIPESHARD} up --export {tiny_export('llama', 2)} --port {port} "
        f"--stage-port {free_port()}"
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
