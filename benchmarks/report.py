"""Saving a benchmark's results the same way everywhere.

The report (markdown tables) is printed and written to ``<results>/<name>-<date>.md``; every raw
measurement goes to ``<results>/<name>-<date>.json`` with the date, the machine and the options.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
from pathlib import Path
from typing import Any


def save(
    results: Path, name: str, report: str, data: dict[str, Any], opts: argparse.Namespace
) -> Path:
    """Print and write ``report`` and ``data``; returns the path stem (for plots beside them)."""
    print(report)
    results.mkdir(parents=True, exist_ok=True)
    stem = results / f"{name}-{dt.date.today().isoformat()}"
    Path(f"{stem}.md").write_text(report.rstrip("\n") + "\n")
    payload = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
        },
        "options": {key: str(value) for key, value in vars(opts).items()},
        **data,
    }
    Path(f"{stem}.json").write_text(json.dumps(payload, indent=2))
    return stem
