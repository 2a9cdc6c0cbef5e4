"""`pipeshard bench gateway-stream` end to end: it makes its tiny export, streams over a real
gateway and stages, and reports the gateway's CPU per streamed token."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.processes import PIPESHARD

pytestmark = pytest.mark.integration

SUITE = [PIPESHARD, "bench", "gateway-stream"]


def test_gateway_stream_benchmark_reports_cpu_per_token(tmp_path: Path) -> None:
    export = tmp_path / "tiny"
    subprocess.run(
        [*SUITE, "--make-tiny", str(export)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    assert (export / "manifest.json").is_file()
    results = tmp_path / "results"
    subprocess.run(
        [*SUITE, "--export", str(export), "--users", "2", "--tokens", "12",
         "--rounds", "2", "--gateway-flags=--no-batching", "--gateway-cores", "0",
         "--results", str(results)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    (report,) = results.glob("gateway_stream-*.md")
    (data,) = results.glob("gateway_stream-*.json")
    text = report.read_text()
    assert "2 users streaming 12 greedy tokens" in text and "--no-batching" in text
    assert "| gateway CPU ms per token |" in text
    rounds = json.loads(data.read_text())["rounds"]
    assert len(rounds) == 2
    for r in rounds:
        # every token was streamed, and the gateway spent some (not absurd) CPU on each
        assert 0 < r["gateway_cpu_ms_per_token"] < 1000
        assert r["decode_tok_s"] > 0 and r["end_to_end_tok_s"] > 0
