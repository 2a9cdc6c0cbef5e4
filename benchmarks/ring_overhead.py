"""gRPC ring vs in-process chain: what does the network hop cost?

Single-stream greedy decode on the real model, 2 stages:
  - in process: both stages chained in one process (1 inference thread each);
  - ring: 2 `pipeshard stage` processes on loopback, stage k pinned to core k (taskset) with
    1 inference thread, driven by the gateway's PipelineClient;
  - ring behind a latency-injecting proxy (benchmarks/latency_proxy.py) in front of every stage,
    adding D ms one way per hop: gateway -> stage 0 -> stage 1 -> gateway is N + 1 = 3 hops, so
    a step should cost about 3 * D more than with no added latency.
Also reports the bytes per token per hop (from the stages' own metrics) and checks that fp16
hidden states give the same greedy tokens as fp32.

Usage: pipeshard bench ring [--export DIR] [--tokens 64] [--delays 10,50]
       [--kv-backend paged|stateful] [--no-pin]
Writes ring_overhead[-stateful][-unpinned]-<date>.{json,md} in --results DIR (default: the
current directory).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Literal

from benchmarks.latency_proxy import delay_stages
from benchmarks.processes import free_port, run_async, start_stages
from benchmarks.report import add_results_option, save
from benchmarks.workers import PROMPT

ROUNDS = 5
PIN = True  # stage k on core k; --no-pin lets the OS place every thread


def prompt_ids(export: Path) -> list[int]:
    from transformers import AutoTokenizer

    from protos.manifest import load_manifest

    manifest = load_manifest(export)
    tokenizer = AutoTokenizer.from_pretrained(str(export / manifest.tokenizer.directory))
    return list(tokenizer.encode(PROMPT))


class LocalChainRunner:
    """Both stages chained in this process, 1 inference thread each (the reference), on the
    same KV backend as the ring's stages."""

    def __init__(self, export: Path, kv_backend: Literal["stateful", "paged"] = "stateful") -> None:
        from shard_runtime.chain import LocalChain
        from shard_runtime.runner import RunnerOptions

        self.kv_backend = kv_backend
        self.chain = LocalChain(export, RunnerOptions(threads=1), kv_backend)

    def once(self, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
        import numpy as np

        logits = self.chain.forward("run", np.array(prompt))
        out = [int(np.argmax(logits[-1]))]
        started = time.perf_counter()
        while len(out) < tokens:
            logits = self.chain.forward("run", np.array(out[-1:]))
            out.append(int(np.argmax(logits[-1])))
        step = (time.perf_counter() - started) / (tokens - 1)
        self.chain.release("run")
        return step, out


async def ring_once(
    addresses: list[str], prompt: list[int], tokens: int
) -> tuple[float, list[int]]:
    """One greedy run over the ring with the gateway's pipeline client: seconds per token."""
    from server.ring.grpc_client import PipelineClient

    client = PipelineClient(addresses, step_timeout=600)
    await client.start(timeout=600)
    try:
        out_step = await client.step("run", prompt, 0)
        out = [out_step.tokens[0].token_id]
        position = len(prompt)
        started = time.perf_counter()
        while len(out) < tokens:
            out_step = await client.step("run", out[-1:], position)
            position += 1
            out.append(out_step.tokens[0].token_id)
        step = (time.perf_counter() - started) / (tokens - 1)
        await client.release("run")
    finally:
        await client.close()
    return step, out


def decode_step_bytes(hidden_size: int, dtype: str) -> list[int]:
    """Payload of one decode step on each hop: gateway->stage 0, stage 0->1, stage 1->gateway
    (a batch of one step; hidden states travel beside the steps of a batch). ``hidden_size``:
    the width stage 1 takes (twice the model's hidden size behind a cut inside an MLP)."""
    import numpy as np

    from protos import pipeshard_v1_pb2 as pb
    from protos.codec import HIDDEN_DTYPES, numpy_to_tensor

    step = pb.Step(
        session_id="chatcmpl-" + "0" * 32,
        step_id=1000,
        client_id="0" * 32,
        token_ids=[151000],
        start_position=1000,
        num_logits=1,
        deadline_unix_ms=int(time.time() * 1000),
    )
    step.sampling.temperature = 0.0
    first = pb.StepBatch(steps=[step]).ByteSize()
    step.ClearField("token_ids")
    step.num_tokens = 1
    hidden = np.zeros((1, hidden_size), dtype=np.float32)
    onward = pb.StepBatch(steps=[step], hidden=numpy_to_tensor(hidden, HIDDEN_DTYPES[dtype]))
    result = pb.StepResult(session_id=step.session_id, step_id=1000, session_length=1001)
    result.tokens.add(token_id=151000)
    return [first, onward.ByteSize(), result.ByteSize()]


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r'^(pipeshard_stage_(?:bytes|tokens)_total)\{(\w+)="(\w+)"\} (\S+)$', line)
        if match:
            values[f"{match.group(1)}:{match.group(3)}"] = float(match.group(4))
    return values


def run_ring(
    export: Path,
    prompt: list[int],
    tokens: int,
    hidden: str,
    delays: list[float],
    logs: Path,
    local: LocalChainRunner,
) -> dict[str, Any]:
    """Rounds alternating the in-process chain and the ring, so noise hits both alike."""
    metrics = [free_port(), free_port()]
    procs = []
    try:
        for index in (0, 1):
            p, _ = start_stages(
                export,
                logs,
                stages=[index],
                exact=False,
                extra=[
                    *(["--cpus", str(index)] if PIN else []),
                    "--threads",
                    "1",
                    "--kv-backend",
                    local.kv_backend,
                    "--hidden-dtype",
                    hidden,
                    "--metrics-port",
                    str(metrics[index]),
                ],
            )
            procs += p
        direct = [p.args[p.args.index("--listen") + 1] for p in procs]
        run_async(ring_once(direct, prompt, tokens))  # warm-up
        local.once(prompt, tokens)
        before = [scrape(m) for m in metrics]
        rounds = []
        for _ in range(ROUNDS):
            local_step, local_tokens = local.once(prompt, tokens)
            ring_step, ring_tokens = run_async(ring_once(direct, prompt, tokens))
            rounds.append(
                {
                    "local_ms": local_step * 1000,
                    "ring_ms": ring_step * 1000,
                    "ratio": local_step / ring_step,
                }
            )
        after = [scrape(m) for m in metrics]
        runs: dict[str, Any] = {
            "rounds": rounds,
            "local_ms": statistics.median(r["local_ms"] for r in rounds),
            "ring_ms": statistics.median(r["ring_ms"] for r in rounds),
            "ratio_median": statistics.median(r["ratio"] for r in rounds),
            "ratio_min": min(r["ratio"] for r in rounds),
            "ratio_max": max(r["ratio"] for r in rounds),
            "tokens_identical": ring_tokens == local_tokens,
            "tokens": ring_tokens,
        }
        steps = ROUNDS * tokens
        runs["bytes_per_token_in"] = [
            (
                a.get("pipeshard_stage_bytes_total:in", 0)
                - b.get("pipeshard_stage_bytes_total:in", 0)
            )
            / steps
            for a, b in zip(after, before, strict=True)
        ]
        for delay in delays:
            addresses, stop_proxies = delay_stages(direct, delay / 1000)
            try:
                step, _ = run_async(ring_once(addresses, prompt, tokens))
                runs[f"delay_{delay:g}_ms"] = step * 1000
            finally:
                stop_proxies()
        return runs
    finally:
        for proc in procs:
            proc.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pipeshard bench ring",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--export", type=Path, default=Path("benchmarks/out/shard_parity/s2"))
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--delays", default="10,50", help="added one-way ms per hop")
    add_results_option(p)
    p.add_argument("--no-pin", action="store_true", help="do not pin stage k to core k")
    p.add_argument(
        "--kv-backend",
        default="paged",
        choices=["paged", "stateful"],
        help="the stages' KV backend, in the ring and in process alike (default paged)",
    )
    opts = p.parse_args(argv)
    global PIN
    PIN = not opts.no_pin
    delays = [float(d) for d in opts.delays.split(",") if d]
    prompt = prompt_ids(opts.export)
    logs = Path(tempfile.mkdtemp(prefix="ring-bench-"))

    os.sched_setaffinity(0, {0, 1})
    local = LocalChainRunner(opts.export, opts.kv_backend)
    ring32 = run_ring(opts.export, prompt, opts.tokens, "fp32", delays, logs, local)
    ring16 = run_ring(opts.export, prompt, opts.tokens, "fp16", [], logs, local)

    from protos.manifest import load_manifest

    manifest = load_manifest(opts.export)
    # what stage 1 takes: the hidden size, or twice it where the split cuts inside an MLP
    hidden_size = manifest.stages[1].input_width(manifest.model.hidden_size)
    base = ring32["ring_ms"]
    lines = [
        f"Real 2-stage export {opts.export.name}, single stream, {opts.tokens} tokens, {ROUNDS} "
        "rounds alternating in-process and ring runs (medians; ratio = in-process ms / ring ms "
        f"per round); {'stage k pinned to core k' if PIN else 'stages not pinned'}, "
        f"1 inference thread each, {opts.kv_backend} KV backend; the in-process chain "
        f"({opts.kv_backend} too) and the client ran on cores 0-1 with 1 thread per stage; "
        "f16 KV cache, f32 compute",
        "",
        "| configuration | ms/token | tok/s | ring vs in-process, median [min, max] |",
        "|---|---|---|---|",
    ]
    for label, ring in (("fp32 hidden", ring32), ("fp16 hidden", ring16)):
        lines.append(
            f"| in-process chain (paired with {label}) | {ring['local_ms']:.1f} | "
            f"{1000 / ring['local_ms']:.2f} | 1.000 |"
        )
        lines.append(
            f"| gRPC ring, {label} | {ring['ring_ms']:.1f} | {1000 / ring['ring_ms']:.2f} | "
            f"{ring['ratio_median']:.3f} [{ring['ratio_min']:.3f}, {ring['ratio_max']:.3f}] |"
        )
    for d in delays:
        ms = ring32[f"delay_{d:g}_ms"]
        lines.append(
            f"| gRPC ring, fp32 hidden, +{d:g} ms per hop | {ms:.1f} | {1000 / ms:.2f} | |"
        )
    hop_ms = (base - ring32["local_ms"]) / 3
    lines += [
        "",
        f"Per-hop overhead ((ring - in-process) / 3 hops, medians): {hop_ms:.2f} ms.",
        "Bytes per decode step per hop (gateway->stage 0, stage 0->1, stage 1->gateway): "
        f"fp32 hidden {decode_step_bytes(hidden_size, 'fp32')}, "
        f"fp16 hidden {decode_step_bytes(hidden_size, 'fp16')}. Measured on the stages, "
        "averaged over all steps (prefill included): fp32 "
        + ", ".join(f"stage {i} in {b:.0f} B" for i, b in enumerate(ring32["bytes_per_token_in"]))
        + "; fp16 "
        + ", ".join(f"stage {i} in {b:.0f} B" for i, b in enumerate(ring16["bytes_per_token_in"]))
        + ".",
    ]
    for d in delays:
        extra = ring32[f"delay_{d:g}_ms"] - base
        lines.append(
            f"+{d:g} ms per hop: step +{extra:.1f} ms = {extra / d:.2f} x the added latency"
        )
    if len(delays) >= 2:
        low, high = min(delays), max(delays)
        slope = (ring32[f"delay_{high:g}_ms"] - ring32[f"delay_{low:g}_ms"]) / (high - low)
        lines.append(
            f"Step cost per ms of added one-way latency, between +{low:g} and +{high:g} ms: "
            f"{slope:.2f} (the ring's N + 1 = 3 transfers; a star would be 2N = 4). The proxy "
            "itself (user-space, in the client process) adds a constant on top."
        )
    lines.append(
        f"Greedy tokens identical to the in-process chain: ring fp32 {ring32['tokens_identical']}, "
        f"ring fp16 {ring16['tokens_identical']}"
    )
    report = "\n".join(lines)
    name = "ring_overhead" + ("-stateful" if opts.kv_backend == "stateful" else "")
    name += "" if PIN else "-unpinned"
    save(opts.results, name, report, {"ring_fp32": ring32, "ring_fp16": ring16}, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
