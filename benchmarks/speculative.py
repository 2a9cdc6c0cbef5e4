"""Speculative decoding on the real pair: K sweep and adaptive K, under added network latency.

Setup (stated in the report):
  - the target's 2 `pipeshard stage` processes on loopback, stage k pinned to core k with 1
    inference thread; a latency-injecting proxy (benchmarks/latency_proxy.py) in front of each
    stage adds D ms one way to every hop (gateway -> stage 0 -> stage 1 -> gateway: 3 D a step);
  - the gateway's engine (scheduler, pipeline client, proposer) runs in this process, its
    scheduler configured as `pipeshard serve` would on this ring (``--no-batching`` as that
    flag: every request alone, pipelined across the stages), with the draft (Qwen2.5-Coder-0.5B
    int4, 1 inference thread) on the CPU beside it, not pinned: on this 2-core machine the
    draft shares the cores with the stages;
  - 8 prompts (code, prose, translation, lists); "1 user" runs them one after another, "2 users"
    as two concurrent streams of 4 prompts each; greedy, end-of-sequence suppressed so every
    answer has the same length.

First checks that greedy output with speculation is identical to without it (``--check-tokens``
tokens on the 8 prompts, no added latency). Then, for each added latency and user count: tok/s
without speculation, with fixed K and with adaptive K; acceptance rate; speedup over no
speculation at the same latency and user count. Ratios compare runs of the same invocation.

Usage: pipeshard bench speculation [--export DIR] [--delays 0,10,50,100] [--ks 1,2,4,8]
                                       [--users 1,2] [--rounds N]
Writes speculative-<date>.{json,md,png} in --results DIR (default: the current directory).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.latency_proxy import delay_stages
from benchmarks.processes import run_async, start_pinned_stages
from benchmarks.report import add_results_option, reachable_eos, save

if TYPE_CHECKING:
    from server.engine.loop import Engine
    from server.metrics import GatewayMetrics

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a JavaScript function that debounces another function.",
    "Explain in a short paragraph why the sky is blue.",
    "Describe the water cycle for a ten-year-old.",
    "Translate into French: The meeting is moved to Thursday at ten.",
    "Translate into German: Please send me the report by Friday.",
    "List eight common HTTP status codes with their meaning.",
    "List the planets of the solar system in order from the sun.",
]


def chat_ids(export: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    from protos.manifest import load_manifest

    manifest = load_manifest(export)
    tokenizer = AutoTokenizer.from_pretrained(str(export / manifest.tokenizer.directory))
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in PROMPTS
    ]
    return [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]


@contextlib.asynccontextmanager
async def gateway_engine(
    addresses: list[str],
    proposer: Any,
    spec_k: int,
    max_context: int,
    batching: bool = True,
) -> AsyncIterator[tuple[Engine, GatewayMetrics]]:
    """The gateway's engine (scheduler, pipeline client, proposer) in this process, with the
    scheduler `pipeshard serve` would run on this ring (``batching``: its ``--batching``)."""
    from server.engine.loop import Engine
    from server.metrics import GatewayMetrics
    from server.ring.grpc_client import PipelineClient
    from server.settings import GatewaySettings

    client = PipelineClient(addresses, step_timeout=600)
    await client.start(timeout=120)
    settings = GatewaySettings(stages=addresses, batching=batching)
    config = settings.ring_scheduler_config(len(addresses), client.paged, client.kv_pools)
    metrics = GatewayMetrics()
    engine = Engine(
        client,
        frozenset(),
        max_context,
        config,
        metrics,
        proposer=proposer,
        spec_k=spec_k,
    )
    try:
        yield engine, metrics
    finally:
        await engine.close()
        await client.close()


async def run_config(
    addresses: list[str],
    prompts: list[list[int]],
    tokens: int,
    users: int,
    proposer: Any,
    spec_k: int,
    eos: list[int],
    max_context: int,
    batching: bool = True,
) -> dict[str, Any]:
    """The prompts in ``users`` concurrent lanes; tok/s, acceptance, per-prompt seconds."""
    from protos.sampling import SamplingParams
    from server.engine.loop import GenerationRequest

    greedy = SamplingParams(logit_bias={e: -100.0 for e in eos})
    outputs: dict[int, list[int]] = {}
    seconds: dict[int, float] = {}

    engine_of = gateway_engine(addresses, proposer, spec_k, max_context, batching)
    async with engine_of as (engine, metrics):

        async def user(indices: list[int]) -> None:
            for i in indices:
                request = GenerationRequest(
                    f"p{i}-{time.monotonic_ns()}", prompts[i], tokens, greedy
                )
                began = time.perf_counter()
                outputs[i] = [t.token_id async for t in engine.generate(request)]
                seconds[i] = time.perf_counter() - began

        started = time.perf_counter()
        lanes = [list(range(u, len(prompts), users)) for u in range(users)]
        await asyncio.gather(*(user(lane) for lane in lanes))
        elapsed = time.perf_counter() - started
    proposed = metrics.registry.get_sample_value("pipeshard_gateway_spec_proposed_tokens_total")
    accepted = metrics.registry.get_sample_value("pipeshard_gateway_spec_accepted_tokens_total")
    steps = metrics.registry.get_sample_value("pipeshard_gateway_spec_k_count") or 0.0
    k_sum = metrics.registry.get_sample_value("pipeshard_gateway_spec_k_sum") or 0.0
    draft_s = metrics.registry.get_sample_value("pipeshard_gateway_draft_seconds_sum") or 0.0
    return {
        "tok_s": len(prompts) * tokens / elapsed,
        "seconds": elapsed,
        "prompt_seconds": [seconds[i] for i in range(len(prompts))],
        "acceptance": (accepted or 0.0) / proposed if proposed else None,
        "mean_k": k_sum / steps if steps else None,
        "draft_ms_per_token": 1000 * draft_s / proposed if proposed else None,
        "outputs": [outputs[i] for i in range(len(prompts))],
    }


def median(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median tok/s (the lower middle one for an even count), with every
    round's tok/s beside it."""
    ranked = sorted(outs, key=lambda o: o["tok_s"])
    return {**ranked[(len(ranked) - 1) // 2], "rounds_tok_s": [o["tok_s"] for o in outs]}


def stage_costs(port: int) -> dict[str, float]:
    """Mean ms of a decode step, a verification step and a rollback on one stage."""
    import re
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(
            r'^(pipeshard_stage_\w+_seconds_(?:sum|count))(?:\{phase="(\w+)"\})? (\S+)$', line
        )
        if match:
            values[f"{match.group(1)}:{match.group(2) or ''}"] = float(match.group(3))

    def mean(name: str, phase: str = "") -> float:
        count = values.get(f"pipeshard_stage_{name}_seconds_count:{phase}", 0.0)
        total = values.get(f"pipeshard_stage_{name}_seconds_sum:{phase}", 0.0)
        return 1000 * total / count if count else float("nan")

    return {
        "decode": mean("forward", "decode"),
        "verify": mean("forward", "verify"),
        "rollback": mean("rollback"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pipeshard bench speculation",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--export", type=Path, default=Path("exports/qwen15-int4-s2c"))
    p.add_argument("--delays", default="0,10,50,100", help="added one-way ms per hop")
    p.add_argument("--ks", default="1,2,4,8", help="fixed K values (adaptive is always run)")
    p.add_argument("--users", default="1,2")
    p.add_argument("--tokens", type=int, default=32, help="tokens per prompt in the sweep")
    p.add_argument("--check-tokens", type=int, default=64)
    p.add_argument("--draft-threads", type=int, default=1)
    p.add_argument(
        "--kv-backend",
        default="paged",
        choices=["stateful", "paged"],
        help="the stages' KV backend (default paged, the stages' default)",
    )
    p.add_argument("--stage-threads", type=int, default=1, help="inference threads per stage")
    p.add_argument(
        "--stage-cores",
        help="CPUs per stage, comma-separated, stage k takes the k-th (default: core k); "
        "e.g. 0-1 puts every stage on cores 0 and 1",
    )
    p.add_argument(
        "--check-only",
        action="store_true",
        help="only check greedy output with speculation equals without it (no sweep)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of every configuration, interleaved (each round runs them all in turn, "
        "in reverse order every other round); the report takes the median tok/s",
    )
    p.add_argument(
        "--batching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the gateway's --batching (default on); --no-batching: every request alone, "
        "pipelined across the stages",
    )
    add_results_option(p)
    opts = p.parse_args(argv)

    from protos.manifest import load_manifest
    from server.engine.speculative import DraftProposer
    from shard_runtime.runner import RunnerOptions

    manifest = load_manifest(opts.export)
    if manifest.draft is None:
        raise SystemExit(f"{opts.export} has no draft (export with --draft)")
    prompts = chat_ids(opts.export)
    eos = reachable_eos(manifest)
    proposer = DraftProposer(
        opts.export / manifest.draft.directory,
        RunnerOptions(threads=opts.draft_threads),
        manifest.model.vocab_size,
    )
    logs = Path(tempfile.mkdtemp(prefix="spec-bench-"))
    procs, direct, metric_ports = start_pinned_stages(
        opts.export,
        logs,
        metrics=True,
        cores=opts.stage_cores.split(",") if opts.stage_cores else None,
        threads=opts.stage_threads,
        extra=["--kv-backend", opts.kv_backend],
    )
    ks = [int(k) for k in opts.ks.split(",")]
    configs: list[tuple[str, Any, int]] = [("off", None, 0), ("adaptive", proposer, 0)]
    configs += [(f"K={k}", proposer, k) for k in ks]
    results: dict[str, Any] = {"runs": []}
    context = manifest.model.max_context

    def run(addresses: list[str], tokens: int, users: int, name: str, prop: Any, k: int) -> Any:
        out = run_async(
            run_config(addresses, prompts, tokens, users, prop, k, eos, context, opts.batching)
        )
        print(
            f"  {name:9s} users {users}: {out['tok_s']:.2f} tok/s"
            + (
                f", acceptance {out['acceptance']:.2f}, mean K {out['mean_k']:.1f}, "
                f"draft {out['draft_ms_per_token']:.1f} ms/token"
                if out["acceptance"] is not None
                else ""
            ),
            flush=True,
        )
        return out

    try:
        run(direct, 8, 1, "warm-up", proposer, 0)
        plain = run(direct, opts.check_tokens, 1, "off", None, 0)
        spec = run(direct, opts.check_tokens, 1, "adaptive", proposer, 0)
        results["check"] = {
            "tokens": opts.check_tokens,
            "identical": [a == b for a, b in zip(plain["outputs"], spec["outputs"], strict=True)],
            "off_tok_s": plain["tok_s"],
            "adaptive_tok_s": spec["tok_s"],
        }
        print(f"greedy identical with and without speculation: {results['check']['identical']}")
        if opts.check_only:
            return 0 if all(results["check"]["identical"]) else 1
        for delay in [float(d) for d in opts.delays.split(",")]:
            addresses, stop_proxies = (
                delay_stages(direct, delay / 1000) if delay > 0 else (direct, lambda: None)
            )
            print(f"+{delay:g} ms per hop", flush=True)
            try:
                for users in [int(u) for u in opts.users.split(",")]:
                    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in configs}
                    for i in range(opts.rounds):
                        for name, prop, k in configs if i % 2 == 0 else configs[::-1]:
                            out = run(addresses, opts.tokens, users, name, prop, k)
                            out.pop("outputs")
                            rounds[name].append(out)
                    for name, outs in rounds.items():
                        results["runs"].append(
                            {"delay_ms": delay, "users": users, "config": name, **median(outs)}
                        )
            finally:
                stop_proxies()
        results["stage_costs_ms"] = [stage_costs(port) for port in metric_ports]
    finally:
        for proc in procs:
            proc.stop()
    report(results, opts, manifest)
    return 0


def _cores(opts: argparse.Namespace) -> str:
    return f"cores {opts.stage_cores.split(',')}[k]" if opts.stage_cores else "core k"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(results: dict[str, Any], opts: argparse.Namespace, manifest: Any) -> None:
    runs = results["runs"]

    def find(delay: float, users: int, config: str) -> dict[str, Any]:
        return next(
            r
            for r in runs
            if r["delay_ms"] == delay and r["users"] == users and r["config"] == config
        )

    check = results["check"]
    lines = [
        f"Real pair: target {manifest.model.model_id} int4 in {manifest.num_stages} stages "
        f"(stage k pinned to {_cores(opts)}, {opts.stage_threads} inference thread(s) each, "
        f"{opts.kv_backend} KV), draft "
        f"{manifest.draft.model_id} int4 with {opts.draft_threads} thread in the gateway's "
        f"process (unpinned, sharing the {os.cpu_count()} cores); gateway scheduler as "
        f"`pipeshard serve {'(batching)' if opts.batching else '--no-batching'}` runs it on "
        f"this ring; {len(PROMPTS)} prompts "
        f"(code, prose, translation, lists), {opts.tokens} greedy tokens each; 1 user = prompts "
        "one after another, 2 users = two concurrent streams. "
        + (
            f"Every configuration ran {opts.rounds} times, interleaved (in reverse order every "
            "other round); tok/s is the median run's."
            if opts.rounds > 1
            else "One run per configuration, one after another."
        ),
        "",
        f"Greedy output with speculation (adaptive K) identical to without it, "
        f"{check['tokens']} tokens: {sum(check['identical'])}/{len(check['identical'])} prompts.",
        "",
        "| added latency per hop | users | no speculation tok/s | best fixed K | adaptive tok/s "
        "(mean K, acceptance) | adaptive speedup | adaptive / best fixed |",
        "|---|---|---|---|---|---|---|",
    ]
    delays = sorted({r["delay_ms"] for r in runs})
    user_counts = sorted({r["users"] for r in runs})
    for delay in delays:
        for users in user_counts:
            off = find(delay, users, "off")
            fixed = [
                r
                for r in runs
                if r["delay_ms"] == delay and r["users"] == users and r["config"].startswith("K=")
            ]
            best = max(fixed, key=lambda r: r["tok_s"])
            ada = find(delay, users, "adaptive")
            lines.append(
                f"| {delay:g} ms | {users} | {off['tok_s']:.2f} | {best['config']}: "
                f"{best['tok_s']:.2f} | {ada['tok_s']:.2f} ({_fmt(ada['mean_k'], '.1f')}, "
                f"{_fmt(ada['acceptance'], '.2f')}) | {ada['tok_s'] / off['tok_s']:.2f}x | "
                f"{ada['tok_s'] / best['tok_s']:.2f} |"
            )
    costs = results.get("stage_costs_ms", [])
    if costs:
        lines += [
            "",
            "Stage costs over the whole run, mean ms per step (stage 0, stage 1): decode "
            + ", ".join(f"{c['decode']:.1f}" for c in costs)
            + "; verification (K + 1 tokens) "
            + ", ".join(f"{c['verify']:.1f}" for c in costs)
            + "; rollback of rejected positions (trimming the KV state) "
            + ", ".join(f"{c['rollback']:.2f}" for c in costs)
            + ".",
        ]
    lines += ["", "Every configuration (tok/s, acceptance):", ""]
    configs = [c for c in dict.fromkeys(r["config"] for r in runs)]
    lines.append("| latency | users | " + " | ".join(configs) + " |")
    lines.append("|---" * (2 + len(configs)) + "|")
    for delay in delays:
        for users in user_counts:
            cells = []
            for c in configs:
                r = find(delay, users, c)
                acc = f" ({r['acceptance']:.2f})" if r["acceptance"] is not None else ""
                cells.append(f"{r['tok_s']:.2f}{acc}")
            lines.append(f"| {delay:g} ms | {users} | " + " | ".join(cells) + " |")
    if 50.0 in delays and 2 in user_counts and 1 in user_counts:
        two = find(50.0, 2, "adaptive")["tok_s"]
        one = find(50.0, 1, "off")["tok_s"]
        lines += [
            "",
            f"At +50 ms per hop: 2 users with speculation / 1 user without = {two / one:.2f}x.",
        ]
    stem = save(opts.results, "speculative", "\n".join(lines), results, opts)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(user_counts), figsize=(5 * len(user_counts), 4), squeeze=False)
    for ax, users in zip(axes[0], user_counts, strict=True):
        for c in configs:
            ys = [find(d, users, c)["tok_s"] / find(d, users, "off")["tok_s"] for d in delays]
            ax.plot(delays, ys, "o-" if c == "adaptive" else ".--", label=c)
        ax.set_title(f"{users} user(s)")
        ax.set_xlabel("added latency per hop (ms)")
        ax.set_ylabel("speedup over no speculation")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{stem}.png", dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
