"""How long `pipeshard up` takes to serve, warm (export and OpenVINO cache in place).

Runs each ``--variant LABEL=COMMAND`` (default: ``now=pipeshard up``) ``--rounds`` times, the
variants alternating round by round so that drift in the machine's speed hits all alike. Each
run is timed from its start to "pipeshard is serving" on its output, then to the end of one
short greedy request, and stopped with SIGINT (as Ctrl-C does). Stage output goes to the same
terminal unless the command has --log-dir, so the table also shows when the reuse check ended
and when the last stage was ready (READY), where the output has them.

  pipeshard bench startup [--rounds 3] [--variant LABEL=COMMAND ...] [--port 8000]
                               [--results DIR] [--name startup]

A COMMAND is split like a shell line and must serve on --port (e.g. a checkout of another
commit: ``before=env PYTHONPATH=/tmp/before python -m server.cli up``, run from there with
``--cwd before=/tmp/before``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.report import add_results_option, describe, machine, save

MARKS = {
    "reuse checked": "already holds this export",
    "stages ready": "READY",  # the last one seen
    "serving": "pipeshard is serving",
}


def _request(port: int) -> None:
    models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=60).json()
    body = {"model": models["data"][0]["id"], "prompt": "Hi", "max_tokens": 4, "temperature": 0}
    # text completions: any model has them (chat needs a chat template)
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
    reply.raise_for_status()


def run_once(command: list[str], port: int, cwd: str | None, timeout: float) -> dict[str, float]:
    """Seconds from the start to each mark, and to the end of a first request."""
    started = time.monotonic()
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    seen: dict[str, float] = {}
    serving = threading.Event()
    tail: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail[:] = [*tail[-40:], line]
            for mark, text in MARKS.items():
                if text in line:
                    seen[mark] = time.monotonic() - started
            if MARKS["serving"] in line:
                serving.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not serving.wait(timeout):
            raise RuntimeError(f"{shlex.join(command)} did not serve:\n{''.join(tail)}")
        _request(port)
        seen["first reply"] = time.monotonic() - started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(5)
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pipeshard bench startup", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--variant", action="append", default=[], help="LABEL=COMMAND")
    parser.add_argument("--cwd", action="append", default=[], help="LABEL=DIR to run it in")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=8000, help="the port the commands serve on")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to serving")
    add_results_option(parser, "--out")
    parser.add_argument("--name", default="startup")
    opts = parser.parse_args(argv)
    pipeshard = str(Path(sys.executable).parent / "pipeshard")
    variants = dict(v.split("=", 1) for v in opts.variant) or {"now": f"{pipeshard} up"}
    cwds = dict(c.split("=", 1) for c in opts.cwd)
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in variants}
    for round_ in range(opts.rounds):
        for label, command in variants.items():
            seen = run_once(shlex.split(command), opts.port, cwds.get(label), opts.timeout)
            runs[label].append(seen)
            marks = ", ".join(f"{k} {v:.1f} s" for k, v in seen.items())
            print(f"round {round_ + 1} {label}: {marks}", flush=True)
    columns = [*MARKS, "first reply"]
    lines = [
        f"`pipeshard up` start-up, warm; {opts.rounds} rounds, variants alternating; "
        "median [min, max] seconds from the command's start",
        "",
        "| variant | " + " | ".join(columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for label, found in runs.items():
        cells = []
        for column in columns:
            values = [r[column] for r in found if column in r]
            cells.append(
                f"{statistics.median(values):.1f} [{min(values):.1f}, {max(values):.1f}]"
                if values
                else "-"
            )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Commands:", *[f"- {label}: `{command}`" for label, command in variants.items()]]
    lines += ["", f"Machine: {describe(machine())}"]
    data: dict[str, Any] = {"variants": variants, "runs": runs}
    save(opts.results, opts.name, "\n".join(lines) + "\n", data, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
