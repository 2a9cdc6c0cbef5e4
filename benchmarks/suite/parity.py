"""Experiment 1, shard parity: is a split, stateful, fused shard as fast as the unsplit model?

Single-stream greedy decode tok/s, every configuration from the same prompt token ids, of:
(a) openvino-genai's LLMPipeline on an optimum-cli export (the monolithic baseline), (b) the
1-stage shard, (c) the 1-stage shard exported without ``beam_idx`` (no KV-cache fusion), (d) the
N stages of ``--export`` chained in one process, and (e) the same N stages as the running stage
processes over gRPC, driven by this process's pipeline client. (a)-(d) each run in a fresh
process pinned to the worker cores (benchmarks/workers.py); the configurations take turns round
by round and every ratio is taken within a round.
"""

from __future__ import annotations

import logging
from typing import Any

from benchmarks.ring_overhead import prompt_ids, ring_once
from benchmarks.suite import paper
from benchmarks.suite.context import Bench
from benchmarks.suite.stats import fmt, ratios, ref, spread

log = logging.getLogger(__name__)
TITLE = "1. Shard parity: single-stream decode"


def labels(stages: int) -> dict[str, str]:
    return {
        "genai": "(a) monolithic openvino-genai LLMPipeline (optimum-cli export)",
        "s1": "(b) 1-stage shard",
        "s1-nobeam": "(c) 1-stage shard without beam_idx",
        "chain": f"(d) {stages} stages chained in one process",
        "ring": f"(e) {stages} stages over gRPC (stage processes on loopback)",
    }


def run(bench: Bench) -> dict[str, Any]:
    paths = {
        "genai": bench.baseline,
        "s1": bench.variants.get("s1"),
        "s1-nobeam": bench.variants.get("s1-nobeam"),
        "chain": bench.export,
    }
    configs = [key for key in labels(1) if key == "ring" or paths.get(key) is not None]
    tokens = bench.knobs.tokens
    prompt = prompt_ids(bench.export)
    bench.run(ring_once(bench.addresses, prompt, min(tokens, 8)))  # warm-up
    rounds: list[dict[str, dict[str, float]]] = []
    for number in range(bench.knobs.rounds):
        measured: dict[str, dict[str, float]] = {}
        for key in configs:
            if key == "ring":
                step, _ = bench.run(ring_once(bench.addresses, prompt, tokens))
                measured[key] = {"decode_tok_s": 1.0 / step}
                continue
            path = paths[key]
            assert path is not None
            kind = "genai-decode" if key == "genai" else "chain-decode"
            measured[key] = bench.worker(kind, path, tokens=tokens, prompts=[prompt])
        rounds.append(measured)
        log.info(
            "parity round %d: %s",
            number + 1,
            ", ".join(f"{k} {v['decode_tok_s']:.2f}" for k, v in measured.items()),
        )
    summary = {}
    for key in configs:
        speeds = [r[key]["decode_tok_s"] for r in rounds]
        summary[key] = {
            "tok_s": spread(speeds),
            "vs_genai": ratios(speeds, [r["genai"]["decode_tok_s"] for r in rounds])
            if "genai" in configs
            else None,
            "vs_s1": ratios(speeds, [r["s1"]["decode_tok_s"] for r in rounds])
            if "s1" in configs
            else None,
        }
    skipped = []
    if bench.baseline is None:
        skipped.append(
            "(a) skipped: no --baseline (an optimum-cli export of the same model for "
            "openvino-genai), so there is no ratio to the monolithic model."
        )
    skipped += [note for note in bench.variant_notes if note]
    return {
        "configs": configs,
        "tokens": tokens,
        "rounds": rounds,
        "summary": summary,
        "skipped": skipped,
    }


def table(result: dict[str, Any], bench: Bench) -> list[str]:
    names = labels(bench.manifest.num_stages)
    lines = [
        f"Single-stream greedy decode, {result['tokens']} new tokens, the same prompt; "
        f"median [min, max] over {bench.knobs.rounds} rounds, ratios taken round by round. "
        "Paper: (a)-(c) on one iGPU; its (e) is the 2-node pipeline over Wi-Fi 6 (headline "
        "table), ours is loopback.",
        "",
        "| configuration | paper tok/s | paper vs (a) | tok/s | vs (a) | vs (b) |",
        "|---|---|---|---|---|---|",
    ]
    for key in labels(1):
        ours = result["summary"].get(key)
        paper_tok_s = paper.PARITY_TOK_S.get(key)
        paper_ratio = paper_tok_s / paper.PARITY_TOK_S["genai"] if paper_tok_s else None
        if ours is None:
            cells = "skipped | | "
        else:
            cells = f"{fmt(ours['tok_s'])} | {fmt(ours['vs_genai'], 3)} | {fmt(ours['vs_s1'], 3)}"
        lines.append(f"| {names[key]} | {ref(paper_tok_s)} | {ref(paper_ratio, 3)} | {cells} |")
    return lines
