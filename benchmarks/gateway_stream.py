"""Gateway streaming cost: the gateway's CPU time per streamed token, and the tok/s it serves.

Each round, ``--users`` clients (threads of this process) stream a chat completion of
``--tokens`` greedy tokens each at once (end-of-sequence suppressed); the gateway
(`pipeshard serve`, its own process, pinned to ``--gateway-cores``) is measured by its CPU time
(user + system, all threads) over the round, divided by the tokens streamed. The stages are
pinned to ``--stage-cores`` (1 inference thread each) and the clients to ``--client-cores``.
Over a real model the stages set the pace and the gateway's share is small; over a tiny export
(fast stages: a random model from ``pipeshard bench gateway-stream --make-tiny DIR``) the
gateway is the bottleneck, and its CPU per token is the cost of the streaming path itself: the
result stream from the last stage, detokenizing, the SSE chunk, the HTTP write.

Usage: pipeshard bench gateway-stream --export DIR [--users 4] [--tokens 200] [--rounds 3]
       [--gateway-flags="--no-batching"] [--gateway-cores 1] [--stage-cores 0] [--client-cores 0]
       pipeshard bench gateway-stream --make-tiny DIR   (needs the exporter's torch)
Writes gateway_stream-<date>.{json,md} in --results DIR (default: the current directory).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.microbatch import cpu_seconds, run_users
from benchmarks.processes import Proc, start_gateway, start_pinned_stages
from benchmarks.report import add_results_option, reachable_eos, save
from benchmarks.suite.stats import fmt, spread
from stage_node.settings import parse_cpus


def make_tiny(out: Path) -> None:
    """A 2-stage fp32 export of the test suite's random 4-layer Qwen2, with a chat template."""
    from benchmarks.fixtures import use_testing_support
    from exporter.export import ExportOptions, export_model
    from protos.manifest import WeightSpec

    use_testing_support()
    from testing_support.tiny_models import CHAT_TEMPLATE, make_model

    with tempfile.TemporaryDirectory() as scratch:
        hf = make_model(
            "qwen2", Path(scratch) / "tiny-qwen2", layers=4, chat_template=CHAT_TEMPLATE
        )
        export_model(
            ExportOptions(
                model=str(hf), out=out, stages=2, weights=WeightSpec(format="fp32"), quiet=True
            )
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pipeshard bench gateway-stream",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--export", type=Path)
    p.add_argument("--make-tiny", type=Path, metavar="DIR", help="write a tiny export and exit")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--gateway-flags", default="", help="extra `pipeshard serve` flags (--gateway-flags=...)"
    )
    p.add_argument("--gateway-cores", default="1")
    p.add_argument("--stage-cores", default="0", help="one CPU list for every stage")
    p.add_argument("--client-cores", default="0")
    add_results_option(p)
    opts = p.parse_args(argv)
    if opts.make_tiny is not None:
        make_tiny(opts.make_tiny)
        return 0
    if opts.export is None:
        p.error("--export DIR is needed (or --make-tiny DIR)")

    from protos.manifest import load_manifest

    manifest = load_manifest(opts.export)
    eos = reachable_eos(manifest)
    flags = shlex.split(opts.gateway_flags)
    logs = Path(tempfile.mkdtemp(prefix="gateway-stream-"))
    procs: list[Proc] = []
    rounds: list[dict[str, float]] = []
    try:
        cores = [opts.stage_cores] * manifest.num_stages
        procs, stages, _ = start_pinned_stages(opts.export, logs, cores=cores)
        gateway, url = start_gateway(
            stages,
            logs / "gateway.log",
            ["--log-level", "WARNING", "--max-concurrent", str(max(8, opts.users)), *flags],
            timeout=600,
            prefix=["taskset", "-c", opts.gateway_cores],
        )
        procs.append(gateway)
        assert gateway.popen is not None
        os.sched_setaffinity(0, parse_cpus(opts.client_cores))
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        run_users(url, model, opts.users, 16, eos)  # warm-up
        for _ in range(opts.rounds):
            before, started = cpu_seconds(gateway.popen.pid), time.perf_counter()
            result = run_users(url, model, opts.users, opts.tokens, eos)
            wall = time.perf_counter() - started
            spent = cpu_seconds(gateway.popen.pid) - before
            streamed = opts.users * opts.tokens
            rounds.append(
                {
                    "gateway_cpu_ms_per_token": spent * 1000 / streamed,
                    "gateway_cpu_fraction": spent / wall,
                    "decode_tok_s": result["decode_tok_s"],
                    "end_to_end_tok_s": streamed / wall,
                }
            )
            print(
                f"gateway {rounds[-1]['gateway_cpu_ms_per_token']:.3f} ms CPU per token, "
                f"{result['decode_tok_s']:.1f} tok/s",
                flush=True,
            )
    finally:
        for proc in procs:
            proc.stop()

    spreads = {k: spread(r[k] for r in rounds) for k in rounds[0]}
    medians = {k: v["median"] for k, v in spreads.items() if v is not None}
    report = "\n".join(
        [
            f"Gateway streaming cost, {manifest.model.model_id} ({manifest.num_stages} stages, "
            f"{manifest.weights.format}): {opts.users} users streaming {opts.tokens} greedy tokens "
            f"each at once, {opts.rounds} rounds (medians [min, max]); gateway "
            f"`{shlex.join(['pipeshard', 'serve', *flags])}` on CPU(s) {opts.gateway_cores}, "
            f"stages on CPU(s) {opts.stage_cores} (1 inference thread each), HTTP clients on "
            f"CPU(s) {opts.client_cores}.",
            "",
            "| gateway CPU ms per token | gateway CPU (fraction of a core) | aggregate decode "
            "tok/s | end-to-end tok/s |",
            "|---|---|---|---|",
            f"| {fmt(spreads['gateway_cpu_ms_per_token'], 3)} "
            f"| {medians['gateway_cpu_fraction']:.2f} "
            f"| {fmt(spreads['decode_tok_s'], 1)} | {medians['end_to_end_tok_s']:.1f} |",
        ]
    )
    save(opts.results, "gateway_stream", report, {"rounds": rounds, "medians": medians}, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
