"""Experiment 3, speculative decoding: the K sweep and adaptive K on the chat prompts.

The draft runs in this process beside the gateway's engine (benchmarks/speculative.py's
``run_config``), one user, the prompts one after another, greedy. Per added latency (0: the
stages directly; else a latency proxy in front of every stage, a ring), per configuration (no
speculation, adaptive K, each fixed K) and per round: tok/s, acceptance, mean K, and each
prompt's time. Speedups are taken against no speculation of the same round: overall (all
prompts) and prompt by prompt (the paper's "mean over 8 prompts, min-max"). Output with
speculation is checked token for token against output without.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

from benchmarks.latency_proxy import delay_stages
from benchmarks.speculative import run_config
from benchmarks.suite import paper
from benchmarks.suite.context import Bench
from benchmarks.suite.stats import fmt, ratio, ratios, spread

log = logging.getLogger(__name__)
TITLE = "3. Speculative decoding: K sweep and adaptive K"


def configs(bench: Bench) -> list[tuple[str, int]]:
    """(name, K) with K = 0 for adaptive; "off" first: every speedup is taken against it."""
    return [("off", 0), ("adaptive", 0), *((f"K={k}", k) for k in bench.knobs.ks)]


def measure(bench: Bench, addresses: list[str], prompts: list[list[int]]) -> dict[str, Any]:
    """One round at one latency: every configuration on the same prompts."""
    tokens = bench.knobs.spec_tokens
    runs: dict[str, Any] = {}
    plain: list[list[int]] = []
    for name, k in configs(bench):
        proposer = None if name == "off" else bench.proposer()
        out = bench.run(
            run_config(addresses, prompts, tokens, 1, proposer, k, bench.eos, bench.max_context)
        )
        outputs = out.pop("outputs")
        if name == "off":
            plain = outputs
        out["identical"] = [a == b for a, b in zip(outputs, plain, strict=True)]
        runs[name] = out
        log.info("speculative %s: %.2f tok/s", name, out["tok_s"])
    return runs


def warm_up(bench: Bench, prompts: list[list[int]]) -> None:
    """A few tokens with the draft (when there is one) through the ring: first compiles."""
    proposer = bench.proposer() if bench.draft_dir is not None else None
    bench.run(
        run_config(bench.addresses, prompts[:1], 4, 1, proposer, 0, bench.eos, bench.max_context)
    )


def run(bench: Bench) -> dict[str, Any]:
    if bench.draft_dir is None:
        return {"skipped": ["Skipped: the export has no draft/ (export with --draft)."]}
    prompts = bench.chat_prompts(bench.knobs.spec_prompts)
    warm_up(bench, prompts)
    rounds: list[dict[str, Any]] = []
    for _ in range(bench.knobs.rounds):
        per_delay = {}
        for delay in bench.knobs.spec_delays:
            addresses, stop = (
                delay_stages(bench.addresses, delay / 1000)
                if delay
                else (bench.addresses, lambda: None)
            )
            try:
                per_delay[f"{delay:g}"] = measure(bench, addresses, prompts)
            finally:
                stop()
        rounds.append(per_delay)
    return {
        "prompts": len(prompts),
        "tokens": bench.knobs.spec_tokens,
        "delays": [f"{d:g}" for d in bench.knobs.spec_delays],
        "rounds": rounds,
        "summary": summarize(rounds, [name for name, _ in configs(bench)]),
        "skipped": [],
    }


def summarize(rounds: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for delay in rounds[0]:
        runs = [r[delay] for r in rounds]
        off = [x["off"] for x in runs]
        rows = {}
        for name in names:
            mine = [x[name] for x in runs]
            # each prompt's speedup: its median over rounds, then mean / min / max over prompts
            prompt_speedups = [
                statistics.median(
                    ratio(o["prompt_seconds"][i], m["prompt_seconds"][i]) or 0.0
                    for o, m in zip(off, mine, strict=True)
                )
                for i in range(len(mine[0]["prompt_seconds"]))
            ]
            rows[name] = {
                "tok_s": spread(m["tok_s"] for m in mine),
                "speedup": ratios([m["tok_s"] for m in mine], [o["tok_s"] for o in off]),
                "prompt_speedups": prompt_speedups,
                "prompt_speedup_mean": statistics.mean(prompt_speedups),
                "acceptance": spread(m["acceptance"] for m in mine),
                "mean_k": spread(m["mean_k"] for m in mine),
                "identical": sum(all(m["identical"]) for m in mine),
                "identical_prompts": min(sum(m["identical"]) for m in mine),
            }
        summary[delay] = rows
    return summary


def table(result: dict[str, Any], bench: Bench) -> list[str]:
    lines = [
        f"{result['prompts']} chat prompts (code, prose, translation, lists), "
        f"{result['tokens']} greedy tokens each, 1 user; draft "
        f"{bench.manifest.draft.model_id if bench.manifest.draft else '-'} in the coordinator. "
        "Speedup = tok/s over no speculation of the same round (median [min, max] over "
        f"{bench.knobs.rounds} rounds); per prompt = each prompt's median speedup, mean over "
        "the prompts [slowest, fastest prompt]. Paper: K=3 on a single node, mean "
        f"{paper.SPEC_K3_MEAN}x over 8 prompts [{paper.SPEC_K3_MIN}, {paper.SPEC_K3_MAX}] "
        f"({paper.SPEC_K3_2048}x at 2,048 tokens); at +100 ms per hop K={paper.SPEC_BEST_K_100MS} "
        f"was best, {paper.SPEC_BEST_100MS}x.",
        "",
        "| added latency per hop | configuration | tok/s | acceptance | mean K | speedup | "
        "per prompt: mean [min, max] | identical to no speculation | paper |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for delay, rows in result["summary"].items():
        for name, row in rows.items():
            per_prompt = row["prompt_speedups"]
            paper_cell = "-"
            if name == "K=3" and float(delay) == 0:
                paper_cell = f"{paper.SPEC_K3_MEAN}x [{paper.SPEC_K3_MIN}, {paper.SPEC_K3_MAX}]"
            if name == f"K={paper.SPEC_BEST_K_100MS}" and float(delay) == 100:
                paper_cell = f"{paper.SPEC_BEST_100MS}x (best K)"
            rounds = bench.knobs.rounds
            lines.append(
                f"| {delay} ms | {name} | {fmt(row['tok_s'])} | {fmt(row['acceptance'])} | "
                f"{fmt(row['mean_k'], 1)} | {fmt(row['speedup'], 2, 'x')} | "
                f"{row['prompt_speedup_mean']:.2f}x [{min(per_prompt):.2f}, "
                f"{max(per_prompt):.2f}] | {row['identical']}/{rounds} rounds "
                f"(at least {row['identical_prompts']}/{len(per_prompt)} prompts) | "
                f"{paper_cell} |"
            )
    return lines
