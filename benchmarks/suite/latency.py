"""Experiment 4, network latency sweep: the naive single stream vs the full stack.

Latency is added per hop by benchmarks/latency_proxy.py, one proxy in front of every stage
(``delay_stages``), at every setting including 0 ms (then the proxies relay without delay), so
both systems pay the same relaying.

- naive, the paper's baseline style: one user, no speculation, and a star topology. pipeshard
  has no star mode (stages push to the next stage), so it is emulated: what reaches stage k > 0
  waits 2 x the delay (stage k - 1 -> coordinator -> stage k, relayed by a proxy thread in the
  coordinator's process) and what leaves a stage 1 x, i.e. 2N transfers per step for N stages,
  as when the coordinator sends every stage its input and gets its output back.
- full stack: the ring (N + 1 transfers per step), speculative decoding with the draft
  (adaptive K) and, with more than one user, micro-batching.

Both run the gateway's engine in this process (benchmarks/speculative.py's ``run_config``) over
the same chat prompts, greedy; ratios are taken round by round.
"""

from __future__ import annotations

import logging
from typing import Any

from benchmarks.latency_proxy import delay_stages
from benchmarks.speculative import run_config
from benchmarks.suite import paper
from benchmarks.suite.context import Bench
from benchmarks.suite.speculation import warm_up
from benchmarks.suite.stats import fmt, ratios, ref, spread

log = logging.getLogger(__name__)
TITLE = "4. Network latency sweep: naive single stream vs the full stack"


def full_name(users: int) -> str:
    return f"full, {users} user{'s' if users > 1 else ''}"


def measure(bench: Bench, delay_ms: float, prompts: list[list[int]]) -> dict[str, Any]:
    tokens = bench.knobs.spec_tokens
    proposer = bench.proposer() if bench.draft_dir is not None else None
    star, stop_star = delay_stages(bench.addresses, delay_ms / 1000, star=True)
    ring, stop_ring = delay_stages(bench.addresses, delay_ms / 1000)
    runs: dict[str, Any] = {}
    try:
        runs["naive"] = bench.run(
            run_config(star, prompts, tokens, 1, None, 0, bench.eos, bench.max_context)
        )
        for users in bench.knobs.latency_users:
            runs[full_name(users)] = bench.run(
                run_config(ring, prompts, tokens, users, proposer, 0, bench.eos, bench.max_context)
            )
    finally:
        stop_star()
        stop_ring()
    for name, out in runs.items():
        out.pop("outputs")
        log.info("+%g ms %s: %.2f tok/s", delay_ms, name, out["tok_s"])
    return runs


def run(bench: Bench) -> dict[str, Any]:
    prompts = bench.chat_prompts(bench.knobs.latency_prompts)
    warm_up(bench, prompts)
    rounds = [
        {f"{d:g}": measure(bench, d, prompts) for d in bench.knobs.delays}
        for _ in range(bench.knobs.rounds)
    ]
    names = ["naive", *(full_name(u) for u in bench.knobs.latency_users)]
    summary: dict[str, Any] = {}
    for delay in rounds[0]:
        naive = [r[delay]["naive"]["tok_s"] for r in rounds]
        summary[delay] = {
            name: {
                "tok_s": spread(r[delay][name]["tok_s"] for r in rounds),
                "vs_naive": ratios([r[delay][name]["tok_s"] for r in rounds], naive),
                "acceptance": spread(r[delay][name]["acceptance"] for r in rounds),
                "mean_k": spread(r[delay][name]["mean_k"] for r in rounds),
            }
            for name in names
        }
    skipped = []
    if bench.draft_dir is None:
        skipped.append(
            "The export has no draft/: the full stack here is the ring with micro-batching, "
            "without speculative decoding."
        )
    return {
        "prompts": len(prompts),
        "tokens": bench.knobs.spec_tokens,
        "names": names,
        "rounds": rounds,
        "summary": summary,
        "skipped": skipped,
    }


def table(result: dict[str, Any], bench: Bench) -> list[str]:
    stages = bench.manifest.num_stages
    fulls = result["names"][1:]
    lines = [
        f"Aggregate tok/s, {result['prompts']} chat prompts x {result['tokens']} greedy tokens "
        f"(1 user: one after another; 2 users: two concurrent streams), {stages} stages. "
        f"Naive: 1 user, no speculation, star topology emulated ({2 * stages} transfers per "
        f"step: the hidden states relayed through the coordinator's process). Full: ring "
        f"({stages + 1} transfers per step) + speculative decoding with the draft (adaptive K) "
        "+ micro-batching. Median [min, max] over "
        f"{bench.knobs.rounds} rounds; ratios round by round. Paper: naive single stream vs "
        "2 users + speculative, Wi-Fi 6 plus simulated WAN delay.",
        "",
        "| added latency per hop | paper naive | paper full | paper ratio | naive tok/s | "
        + " | ".join(f"{name} tok/s | vs naive" for name in fulls)
        + " |",
        "|---|---|---|---|---|" + "---|---|" * len(fulls),
    ]
    for delay, rows in result["summary"].items():
        naive_paper, full_paper = paper.WAN.get(float(delay), (None, None))
        paper_ratio = full_paper / naive_paper if naive_paper and full_paper else None
        cells = " | ".join(
            f"{fmt(rows[name]['tok_s'])} | {fmt(rows[name]['vs_naive'], 2, 'x')}" for name in fulls
        )
        lines.append(
            f"| {delay} ms | {ref(naive_paper, 1)} | {ref(full_paper, 1)} | "
            f"{ref(paper_ratio, 2, 'x')} | {fmt(rows['naive']['tok_s'])} | {cells} |"
        )
    return lines
