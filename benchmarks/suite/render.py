"""The markdown report of one `pipeshard bench` run."""

from __future__ import annotations

import datetime as dt
from typing import Any

from benchmarks.report import describe
from benchmarks.suite import paper
from benchmarks.suite.context import Bench


def header(bench: Bench, command: str, machine: dict[str, Any], seconds: float) -> list[str]:
    manifest = bench.manifest
    layers = ", ".join(f"[{s.layer_start}, {s.layer_end})" for s in manifest.stages)
    weights = manifest.weights
    detail = (
        f" (group {weights.group_size}, {'symmetric' if weights.symmetric else 'asymmetric'})"
        if weights.group_size
        else ""
    )
    draft = f"draft {manifest.draft.model_id}" if manifest.draft else "no draft"
    quick = " (`--quick`: fewer rounds, tokens and settings)" if "--quick" in command else ""
    lines = [
        "# pipeshard bench: the paper's experiments on this machine",
        "",
        f"- Date: {dt.datetime.now().isoformat(sep=' ', timespec='minutes')}; the whole run "
        f"took {seconds:.0f} s{quick}.",
        f"- Command: `{command}`",
        f"- Machine: {describe(machine)}.",
        f"- Model: `{bench.export}`: {manifest.model.model_id}, {manifest.num_stages} stages "
        f"(layers {layers}), {weights.format} weights{detail}, {draft}; maximum context "
        f"{manifest.model.max_context}.",
        "- Monolithic baseline: "
        + (f"`{bench.baseline}` (openvino-genai)" if bench.baseline else "none (no --baseline)")
        + ".",
        "- Runtime: pipeshard's CPU defaults in every process (f32 compute, f16 KV cache); the "
        "openvino-genai baseline (its default pipeline) with the same properties. Every process "
        f"is pinned (table below); {bench.knobs.rounds} rounds, every figure a median [min, max] "
        "over them, ratios taken pair by pair within a round.",
        f"- {paper.SOURCE}. Its numbers stand beside ours for reference; the hardware, model "
        "and network differ.",
        "",
        "## Processes: cores and threads",
        "",
        "| process | cores | inference threads |",
        "|---|---|---|",
    ]
    for row in bench.pin.rows(manifest.num_stages, manifest.draft is not None):
        lines.append(f"| {row['process']} | {row['cores']} | {row['threads']} |")
    return lines


def section(
    title: str, result: dict[str, Any] | None, table: list[str], seconds: float | None
) -> list[str]:
    lines = ["", f"## {title}", ""]
    if result is None:
        return [*lines, "Not run (not in --experiments)."]
    lines += [f"> {note}" for note in result.get("skipped", [])]
    if result.get("skipped"):
        lines.append("")
    lines += table
    if seconds is not None:
        lines += ["", f"Took {seconds:.0f} s."]
    return lines


def failure(title: str, error: str) -> list[str]:
    return ["", f"## {title}", "", f"**Failed**: {error} (see the log)."]
