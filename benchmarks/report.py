"""Saving a benchmark's results the same way everywhere.

The report (markdown tables) is printed and written to ``<results>/<name>-<date>.md``; every raw
measurement goes to ``<results>/<name>-<date>.json`` with the date, the machine and the options.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """What the numbers were measured on: CPU model, cores, memory, load, software versions."""
    memory = _memory_gib()
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(memory, 1) if memory else None,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "openvino": _version("openvino"),
        "openvino_genai": _version("openvino-genai"),
        "pipeshard": _version("pipeshard"),
    }


def describe(info: dict[str, Any]) -> str:
    """One line for a report."""
    return (
        f"{info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB memory, "
        f"{info['os']}; Python {info['python']}, OpenVINO {info['openvino']}, "
        f"openvino-genai {info['openvino_genai'] or 'not installed'}; load average at start "
        f"{' / '.join(str(x) for x in info['load_average'])} (1 / 5 / 15 min)"
    )


def invocation() -> str:
    """This process's command line as typed: `pipeshard bench ...`, else `python script ...`."""
    if Path(sys.argv[0]).name == "pipeshard":
        return shlex.join(["pipeshard", *sys.argv[1:]])
    return shlex.join(["python", *sys.argv])


def save(
    results: Path, name: str, report: str, data: dict[str, Any], opts: argparse.Namespace
) -> Path:
    """Print and write ``report`` and ``data``; returns the path stem (for plots beside them)."""
    print(report)
    results.mkdir(parents=True, exist_ok=True)
    stem = results / f"{name}-{dt.date.today().isoformat()}"
    command = f"Command: `{invocation()}`\n\n"
    Path(f"{stem}.md").write_text(command + report.rstrip("\n") + "\n")
    payload = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(),
        "options": {key: str(value) for key, value in vars(opts).items()},
        **data,
    }
    Path(f"{stem}.json").write_text(json.dumps(payload, indent=2))
    return stem


def reachable_eos(manifest: Any) -> list[int]:
    """The export's end-of-sequence ids the model can emit (a tokenizer may add special tokens
    past the model's rows, e.g. transformers' Qwen converter on a file without them): the ids
    the benchmarks bias away so that every request decodes its full length."""
    vocab = manifest.model.vocab_size
    return [e for e in manifest.tokenizer.eos_token_ids if e < vocab]


def add_results_option(parser: argparse.ArgumentParser, *aliases: str) -> None:
    """``--results DIR``: where :func:`save` writes, the current directory unless the user names
    another (never the benchmarks' own folder, which may be an installed package)."""
    parser.add_argument(
        "--results",
        *aliases,
        dest="results",
        type=Path,
        default=Path("."),
        metavar="DIR",
        help="folder for the report and raw data (default: the current directory)",
    )
