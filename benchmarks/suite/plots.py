"""The report's pictures: throughput vs users, speedup vs K and vs latency, TTFT vs prompt length.

Each plot is drawn only when its experiment ran; the error bars are the [min, max] over rounds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.suite import paper
from benchmarks.suite.stats import Spread
from benchmarks.suite.users import SPEC_USERS


def _bars(values: list[Spread | None]) -> tuple[list[float], list[list[float]]]:
    medians = [v["median"] if v else float("nan") for v in values]
    errors = [
        [v["median"] - v["min"] if v else 0.0 for v in values],
        [v["max"] - v["median"] if v else 0.0 for v in values],
    ]
    return medians, errors


def _label(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def users_plot(result: dict[str, Any], stages: int, path: Path) -> None:
    import matplotlib.pyplot as plt

    rows = result["summary"]["rows"]
    users = result["users"]
    fig, ax = plt.subplots(figsize=(6, 4))
    medians, errors = _bars([rows[name]["tok_s"] for name in list(rows)[: len(users)]])
    ax.errorbar(users, medians, yerr=errors, fmt="o-", capsize=3, label=f"{stages} stages")
    for name in list(rows)[len(users) :]:  # speculative, at SPEC_USERS users
        medians, errors = _bars([rows[name]["tok_s"]])
        ax.errorbar(
            [SPEC_USERS], medians, yerr=errors, fmt="s", capsize=3, label=f"{stages} stages, {name}"
        )
    mono = result["summary"]["monolithic"]
    if mono:
        ax.axhline(mono["median"], color="grey", linestyle="--", label="monolithic, 1 user")
    ax.set_xticks(users)
    _label(ax, "concurrent users", "aggregate decode tok/s", "Throughput vs users")
    _save(fig, path)


def speculation_plot(spec: dict[str, Any] | None, wan: dict[str, Any] | None, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    if spec and spec.get("summary"):
        for delay, rows in spec["summary"].items():
            fixed = [(int(n[2:]), row) for n, row in rows.items() if n.startswith("K=")]
            medians, errors = _bars([row["speedup"] for _, row in fixed])
            line = left.errorbar([k for k, _ in fixed], medians, yerr=errors, fmt="o-", capsize=3)
            line.set_label(f"fixed K, +{delay} ms per hop")
            adaptive = rows["adaptive"]["speedup"]
            if adaptive:
                left.axhline(
                    adaptive["median"],
                    linestyle=":",
                    color=line.lines[0].get_color(),
                    label=f"adaptive K, +{delay} ms",
                )
        left.plot([3], [paper.SPEC_K3_MEAN], "k*", label="paper, K=3, single node")
    left.axhline(1.0, color="grey", linewidth=0.8)
    _label(left, "draft tokens per step (K)", "speedup over no speculation", "Speedup vs K")
    if wan and wan.get("summary"):
        delays = [float(d) for d in wan["summary"]]
        for name in wan["names"][1:]:
            medians, errors = _bars([rows[name]["vs_naive"] for rows in wan["summary"].values()])
            right.errorbar(delays, medians, yerr=errors, fmt="o-", capsize=3, label=name)
        paper_delays = sorted(paper.WAN)
        right.plot(
            paper_delays,
            [paper.WAN[d][1] / paper.WAN[d][0] for d in paper_delays],
            "k*--",
            label="paper, 2 users + speculative",
        )
    right.axhline(1.0, color="grey", linewidth=0.8)
    _label(
        right,
        "added latency per hop (ms)",
        "full stack / naive single stream",
        "Speedup vs latency",
    )
    _save(fig, path)


def ttft_plot(result: dict[str, Any], stages: int, path: Path) -> None:
    import matplotlib.pyplot as plt

    lengths = result["lengths"]
    rows = list(result["summary"].values())
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("monolithic_ms", "monolithic genai"), ("stages_ms", f"{stages} stages")):
        if any(row[key] for row in rows):
            medians, errors = _bars([row[key] for row in rows])
            ax.errorbar(lengths, medians, yerr=errors, fmt="o-", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    _label(ax, "prompt tokens", "time to first token (ms)", "TTFT vs prompt length")
    _save(fig, path)


def draw(stem: Path, results: dict[str, Any], stages: int) -> list[Path]:
    """Every plot whose experiment ran, as ``<stem>-<name>.png``; the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    written = []
    users = results.get("microbatch")
    if users and users.get("summary"):
        written.append(Path(f"{stem}-users.png"))
        users_plot(users, stages, written[-1])
    spec, wan = results.get("speculative"), results.get("latency")
    if (spec and spec.get("summary")) or (wan and wan.get("summary")):
        written.append(Path(f"{stem}-speedup.png"))
        speculation_plot(spec, wan, written[-1])
    ttft = results.get("ttft")
    if ttft and ttft.get("summary"):
        written.append(Path(f"{stem}-ttft.png"))
        ttft_plot(ttft, stages, written[-1])
    return written
