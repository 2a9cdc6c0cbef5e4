"""`pipeshard bench SUITE [OPTIONS]`: pipeshard's benchmarks.

Each suite measures one thing and writes a markdown report and its raw JSON (and plots where
there are any) to <name>-<date>.* in --results DIR (default: the current directory);
`pipeshard bench SUITE --help` gives its options. Without a suite (`pipeshard bench [OPTIONS]`)
the paper run starts, as before there were suites. docs/benchmarks.md says what each one
measures and the current figures.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# suite -> (the module whose main(argv) runs it, what it measures)
SUITES: dict[str, tuple[str, str]] = {
    "paper": (
        "benchmarks.suite.experiments",
        "the paper's 5 experiments in one run: parity, users, speculation, latency, TTFT "
        "(the default)",
    ),
    "parity": (
        "benchmarks.shard_parity",
        "single-stream decode: monolithic openvino-genai vs 1-stage shard vs chained stages",
    ),
    "ring": (
        "benchmarks.ring_overhead",
        "gRPC ring vs in-process chain: cost per hop, bytes per token, added latency",
    ),
    "users": (
        "benchmarks.microbatch",
        "1-8 concurrent users over HTTP on 2 pinned stages vs monolithic openvino-genai",
    ),
    "speculation": (
        "benchmarks.speculative",
        "speculative decoding: K sweep and adaptive K, under added per-hop latency",
    ),
    "long-prompt": (
        "benchmarks.long_prompt",
        "how long one user's stream pauses while another user's long prompt goes in",
    ),
    "prefix": (
        "benchmarks.prefix_cache",
        "prefix caching: multi-turn chat and a shared system prompt, cache on vs off",
    ),
    "startup": ("benchmarks.startup", "seconds until a warm `pipeshard up` serves"),
    "gateway": (
        "benchmarks.gateway_overhead",
        "the gateway's time to first token over HTTP vs its pipeline client driven directly",
    ),
    "gateway-stream": (
        "benchmarks.gateway_stream",
        "the gateway's CPU time per streamed token",
    ),
    "compare": (
        "benchmarks.servers",
        "running servers (other options, another build) side by side: tok/s, same text",
    ),
    "llamacpp": (
        "benchmarks.llamacpp",
        "the 2026 families' stand-ins: pipeshard up against llama-server, tok/s, TTFT, agreement",
    ),
    "llama-agree": (
        "benchmarks.llama_agree",
        "greedy tokens of pipeshard and llama-server on the same GGUF and prompt ids: "
        "where they first differ, the top-2 gap",
    ),
    "batch-cost": (
        "benchmarks.batch_cost",
        "one decode call with 1-8 rows per stage (dense or MoE): does batching pay here",
    ),
    "gguf-export": (
        "benchmarks.gguf_export",
        "GGUF export: write a big test file, measure export memory, plan a split, dense MoE",
    ),
    "gguf-speed": (
        "benchmarks.gguf_speed",
        "decode speed of exports side by side, and of llama.cpp on the same GGUF",
    ),
    "gguf-fidelity": (
        "benchmarks.gguf_fidelity",
        "greedy tokens of exports and llama.cpp against transformers on the same GGUF",
    ),
    "mxfp4-forms": (
        "benchmarks.mxfp4_forms",
        "gpt-oss's MXFP4 experts: run-time memory and speed of each exact form under GatherMatmul",
    ),
    "attention-cost": (
        "benchmarks.attention_cost",
        "a hybrid's linear-attention layer against its full-attention layer: decode, prefill",
    ),
    "profile": (
        "benchmarks.op_profile",
        "where a token's time goes: a decode step and a prefill chunk per stage, by op type",
    ),
    "stand-in": (
        "benchmarks.stand_in",
        "stand-in exports (real graphs, random weights) to time a model on a host it can't reach",
    ),
    "constraints": (
        "benchmarks.constraints",
        "constrained decoding (a JSON schema) vs free at 1 and 8 users: tok/s, mask cost a step",
    ),
    "latency-proxy": (
        "benchmarks.latency_proxy",
        "a TCP proxy that delays every chunk (what the suites put in front of each stage)",
    ),
    "links": (
        "benchmarks.links",
        "the fleet on hosts of its own over shaped links vs loopback: TTFT, tok/s, bytes (root)",
    ),
    "lab": (
        "benchmarks.lab",
        "a lab of hosts on this machine: network namespaces on a bridge, shaped links (root)",
    ),
    "agent": (
        "benchmarks.agent_loop",
        "a two-tool agent loop with the openai client against a running server",
    ),
}
DEFAULT = "paper"


def build_parser() -> argparse.ArgumentParser:
    """For --help only: each suite parses its own options."""
    parser = argparse.ArgumentParser(
        prog="pipeshard bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(title="suites", metavar="SUITE")
    for name, (_, summary) in SUITES.items():
        sub.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-h", "--help"):
        build_parser().print_help()
        return 0
    if argv and not argv[0].startswith("-"):
        name, rest = argv[0], argv[1:]
        if name not in SUITES:
            build_parser().error(f"no suite {name!r} (choose from {', '.join(SUITES)})")
    else:
        name, rest = DEFAULT, argv  # `pipeshard bench --quick ...`: the paper run
    module = importlib.import_module(SUITES[name][0])
    result = module.main(rest)
    return int(result or 0)  # gguf-export's main returns None
