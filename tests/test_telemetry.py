"""No pipeshard process sends OpenVINO or NNCF usage telemetry (common/telemetry.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.processes import PIPESHARD

pytestmark = pytest.mark.integration


def _env(home: Path) -> dict[str, str]:
    """This environment with its own home and none of the switches that would hide telemetry
    (a CI variable, NNCF's), so the libraries decide as on a user's PC."""
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "NNCF_CI", "NNCF_DEV")}
    return {**env, "HOME": str(home)}


def test_an_export_sends_no_telemetry(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """An int4 export (openvino imported, NNCF compressing) leaves no trace of telemetry in
    its home: no ~/intel (client id, usage counter), where a plain `import openvino` makes one."""
    home = tmp_path / "home"
    home.mkdir()
    export = subprocess.run(
        [
            PIPESHARD,
            "export",
            str(tiny_model("llama")),
            "--stages",
            "2",
            "--weights",
            "int4",
            "--group-size",
            "32",
            "--out",
            str(tmp_path / "export"),
        ],
        capture_output=True,
        text=True,
        env=_env(home),
        timeout=300,
    )
    assert export.returncode == 0, export.stderr
    assert not (home / "intel").exists()
    # the control: the same home, openvino imported without pipeshard's switch
    plain = home.parent / "plain"
    plain.mkdir()
    subprocess.run(
        [sys.executable, "-c", "import openvino"], env=_env(plain), check=True, timeout=120
    )
    assert (plain / "intel").is_dir()
