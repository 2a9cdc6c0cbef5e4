"""What constrained decoding costs: the same requests with and without a JSON-schema constraint.

The export's stages run pinned (`pipeshard stage`, a core each, ``--threads``); the gateway's
engine runs in this process (no HTTP: only the ring, the scheduler and the constraint are
timed). For each user count, every user sends the same kind of request (a chat prompt asking
for a JSON record, greedy, ``--tokens`` tokens at most, end-of-sequence biased away while
unconstrained) once unconstrained and once under the schema, in alternating order per round;
the report gives decode tok/s of both and the time the gateway spent computing token masks
(llguidance) per decode step, against the step's time (target: <= 5% at 8 users). The stage's
share (applying a mask to a row of logits) is timed apart, per row, on the same vocabulary.

  pipeshard bench constraints [--export DIR] [--users 1,8] [--tokens 64] [--rounds 2]
      [--cores 0,1] [--threads 1] [--name constraints]
Writes <name>-<date>.{md,json} in --results DIR (default: the current directory).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.processes import start_pinned_stages
from benchmarks.report import add_results_option, reachable_eos, save

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "language": {"type": "string", "enum": ["python", "rust", "go", "c"]},
        "stars": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        "archived": {"type": "boolean"},
    },
    "required": ["name", "language", "stars", "tags", "archived"],
    "additionalProperties": False,
}


class TimedMatcher:
    """A Matcher whose mask and advance calls are timed (the gateway's share of the cost)."""

    def __init__(self, inner: Any, clock: list[float]) -> None:
        self.inner, self.clock = inner, clock

    def masks(self, draft: Any = ()) -> Any:
        began = time.perf_counter()
        try:
            return self.inner.masks(draft)
        finally:
            self.clock[0] += time.perf_counter() - began
            self.clock[1] += 1

    def advance(self, tokens: Any) -> None:
        began = time.perf_counter()
        try:
            self.inner.advance(tokens)
        finally:
            self.clock[0] += time.perf_counter() - began


async def run_users(
    addresses: list[str],
    codec: Any,
    grammars: Any,
    users: int,
    tokens: int,
    constrained: bool,
    eos: list[int],
) -> dict[str, float]:
    from dataclasses import replace

    from protos.sampling import SamplingParams
    from server.engine.constraints import json_schema_constraint
    from server.engine.loop import Engine, GenerationRequest
    from server.engine.scheduler import SchedulerConfig
    from server.ring.grpc_client import PipelineClient

    client = PipelineClient(addresses)
    await client.start()
    clock = [0.0, 0.0]  # seconds in the matcher, masks computed
    constraint = json_schema_constraint(SCHEMA) if constrained else None
    config = SchedulerConfig(
        max_running=max(users, 1), kv_pools=client.kv_pools, lockstep=client.paged
    )
    engine = Engine(client, codec.eos_ids, 4096, config, grammars=grammars)
    real = grammars.matcher
    grammars.matcher = lambda c: TimedMatcher(real(c), clock)
    bias = {} if constrained else {e: -100.0 for e in eos}
    sampling = replace(SamplingParams(), logit_bias=bias)

    async def one(i: int) -> tuple[int, float, float]:
        prompt = codec.chat_prompt(
            [
                {
                    "role": "user",
                    "content": f"Describe open-source project number {i} as a JSON record "
                    "with name, language, stars, tags and archived.",
                }
            ]
        )
        request = GenerationRequest(f"u{i}", prompt, tokens, sampling, constraint=constraint)
        arrivals = []
        async for _ in engine.generate(request):
            arrivals.append(time.perf_counter())
        return len(arrivals), arrivals[0], arrivals[-1]

    began = time.perf_counter()
    try:
        results = await asyncio.gather(*(one(i) for i in range(users)))
    finally:
        grammars.matcher = real
        await engine.close()
        await client.close()
    wall = time.perf_counter() - began
    decoded = sum(n - 1 for n, _, _ in results)
    decode_s = max(last for _, _, last in results) - min(first for _, first, _ in results)
    steps = clock[1]
    return {
        "users": users,
        "constrained": constrained,
        "tokens": sum(n for n, _, _ in results),
        "decode_tok_s": decoded / decode_s if decode_s > 0 else 0.0,
        "wall_s": wall,
        "mask_s": clock[0],
        "masks": steps,
        "step_s": decode_s / max(1, max(n for n, _, _ in results) - 1),
    }


def stage_mask_seconds(vocab: int, rows: int = 200) -> float:
    """Seconds the last stage takes to apply one mask to one row of logits."""
    from shard_runtime.sampling import apply_masks

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((1, vocab)).astype(np.float32)
    mask = np.packbits(rng.random(vocab) < 0.5, bitorder="little").tobytes()
    began = time.perf_counter()
    for _ in range(rows):
        apply_masks(logits, [mask])
    return (time.perf_counter() - began) / rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pipeshard bench constraints", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--export", type=Path, default=None, help="default: the default model's")
    parser.add_argument("--users", default="1,8")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cores", default=None, help="stage k on the k-th core (default 0,1,..)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default="constraints")
    add_results_option(parser)
    opts = parser.parse_args(argv)
    from protos.manifest import load_manifest
    from server.api.tokenization import keep_torch_out, load_codec
    from server.engine.constraints import Grammars

    keep_torch_out()
    if opts.export is None:
        from benchmarks.suite.exports import resolve_export

        opts.export = resolve_export(None)
    manifest = load_manifest(opts.export)
    codec = load_codec(opts.export / manifest.tokenizer.directory, manifest)
    grammars = Grammars(codec.chat, codec.vocab_size, sorted(codec.eos_ids))
    grammars.tokenizer()  # built once, before anything is timed
    users = [int(u) for u in opts.users.split(",")]
    eos = reachable_eos(manifest)
    runs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as logs:
        cores = opts.cores.split(",") if opts.cores else None
        procs, addresses, _ = start_pinned_stages(
            opts.export, Path(logs), cores=cores, threads=opts.threads
        )
        try:
            for n in users:  # warm-up: compile caches, allocate
                asyncio.run(run_users(addresses, codec, grammars, n, 8, True, eos))
            for r in range(opts.rounds):
                for n in users:
                    for constrained in (False, True) if r % 2 == 0 else (True, False):
                        run = asyncio.run(
                            run_users(addresses, codec, grammars, n, opts.tokens, constrained, eos)
                        )
                        runs.append({**run, "round": r})
        finally:
            for proc in procs:
                proc.stop()
    row_s = stage_mask_seconds(manifest.model.vocab_size)
    lines = [
        f"Model: {manifest.model.model_id}, {manifest.num_stages} stages pinned a core each "
        f"({opts.threads} inference thread(s)); the engine in the benchmark process; greedy, "
        f"{opts.tokens} tokens at most, {opts.rounds} rounds (medians).",
        "",
        "| users | decode tok/s free | decode tok/s constrained | ratio | gateway mask ms / "
        "step | step ms | mask share of a step |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    summary = []
    for n in users:
        free = [r for r in runs if r["users"] == n and not r["constrained"]]
        tied = [r for r in runs if r["users"] == n and r["constrained"]]
        free_tok = statistics.median(r["decode_tok_s"] for r in free)
        tied_tok = statistics.median(r["decode_tok_s"] for r in tied)
        # per decode step of the batch: every user's mask (users masks per step)
        per_mask = statistics.median(r["mask_s"] / max(1, r["masks"]) for r in tied)
        step = statistics.median(r["step_s"] for r in tied)
        share = per_mask * n / step if step else 0.0
        summary.append(
            {"users": n, "free": free_tok, "constrained": tied_tok, "mask_ms": per_mask * n * 1000,
             "step_ms": step * 1000, "share": share}
        )  # fmt: skip
        lines.append(
            f"| {n} | {free_tok:.2f} | {tied_tok:.2f} | {tied_tok / free_tok:.3f} | "
            f"{per_mask * n * 1000:.2f} | {step * 1000:.1f} | {share:.1%} |"
        )
    lines += [
        "",
        f"The last stage applies a mask to one row of {manifest.model.vocab_size} logits in "
        f"{row_s * 1000:.2f} ms (numpy; a mask is {manifest.model.vocab_size // 8} bytes on "
        "the wire).",
    ]
    data = {"runs": runs, "summary": summary, "stage_row_s": row_s}
    save(opts.results, opts.name, "\n".join(lines), data, opts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
