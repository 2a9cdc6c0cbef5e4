"""Gateway overhead: time to first token over HTTP (chat template, tokenization, JSON, SSE)
against driving the gateway's pipeline client directly with the same token ids.

Both paths use the same running stage processes; requests alternate between the two so that
machine noise hits both alike. Streaming requests with max_tokens=1: the first content chunk
over HTTP against the first sampled token from PipelineClient.step.

Usage: pipeshard bench gateway [--export DIR] [--requests 20]
Writes gateway_overhead-<date>.{json,md} in --results DIR (default: the current directory).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.processes import Proc, start_gateway, start_pinned_stages
from benchmarks.report import add_results_option, save

MESSAGES = [{"role": "user", "content": "Write a haiku about pipelines."}]


async def measure(
    url: str, model: str, stages: list[str], prompt: list[int], n: int
) -> dict[str, Any]:
    from server.ring.grpc_client import PipelineClient

    client = PipelineClient(stages)
    await client.start()
    direct: list[float] = []
    http: list[float] = []
    body = {"model": model, "messages": MESSAGES, "max_tokens": 1, "stream": True, "temperature": 0}
    async with httpx.AsyncClient(timeout=120) as session:
        for i in range(n + 1):  # the first round warms both paths up
            started = time.perf_counter()
            await client.step(f"direct-{i}", prompt, 0)
            elapsed_direct = time.perf_counter() - started
            await client.release(f"direct-{i}")

            started = time.perf_counter()
            first = None
            async with session.stream("POST", f"{url}/v1/chat/completions", json=body) as reply:
                async for line in reply.aiter_lines():
                    if line.startswith("data: {") and '"content":"' in line and first is None:
                        first = time.perf_counter() - started
                    if line == "data: [DONE]":
                        break
            if i:
                direct.append(elapsed_direct)
                http.append(first if first is not None else time.perf_counter() - started)
    await client.close()
    pairs = [h - d for h, d in zip(http, direct, strict=True)]
    return {
        "direct_ms": [d * 1000 for d in direct],
        "http_ms": [h * 1000 for h in http],
        "direct_median_ms": statistics.median(direct) * 1000,
        "http_median_ms": statistics.median(http) * 1000,
        "overhead_median_ms": statistics.median(pairs) * 1000,
        "overhead_p90_ms": sorted(pairs)[int(0.9 * (len(pairs) - 1))] * 1000,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pipeshard bench gateway",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--export", type=Path, default=Path("benchmarks/out/shard_parity/s2"))
    p.add_argument("--requests", type=int, default=20)
    add_results_option(p)
    opts = p.parse_args(argv)

    from protos.manifest import load_manifest
    from server.api.tokenization import load_codec

    manifest = load_manifest(opts.export)
    codec = load_codec(opts.export / manifest.tokenizer.directory, manifest)
    prompt = codec.chat_prompt(MESSAGES)
    logs = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    procs: list[Proc] = []
    try:
        procs, stages, _ = start_pinned_stages(opts.export, logs)
        gateway, url = start_gateway(
            stages,
            logs / "gateway.log",
            ["--log-level", "WARNING"],
            timeout=600,
            prefix=["taskset", "-c", "0,1"],
        )
        procs.append(gateway)
        result = asyncio.run(measure(url, manifest.model.model_id, stages, prompt, opts.requests))
    finally:
        for proc in procs:
            proc.stop()

    report = "\n".join(
        [
            f"Gateway overhead on time to first token, {manifest.model.model_id} "
            f"({manifest.num_stages} stages, {manifest.weights.format}), {len(prompt)}-token chat "
            f"prompt, {opts.requests} requests per path, alternating; stage k pinned to core "
            "k % 2, gateway on cores 0-1",
            "",
            "| path | TTFT median (ms) |",
            "|---|---|",
            f"| PipelineClient.step directly | {result['direct_median_ms']:.1f} |",
            f"| HTTP streaming via the gateway | {result['http_median_ms']:.1f} |",
            "",
            f"Added by the gateway (paired, request by request): median "
            f"{result['overhead_median_ms']:.2f} ms, p90 {result['overhead_p90_ms']:.2f} ms "
            "(target: under 5 ms).",
        ]
    )
    save(opts.results, "gateway_overhead", report, result, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
