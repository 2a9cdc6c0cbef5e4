"""Decode speed of exports of one model side by side, and of llama.cpp on the same GGUF.

Every export (``--export NAME=DIR``, e.g. the GGUF's own blocks in each ``--gguf-form`` and the
old NNCF ``int4`` re-quantization) is loaded once in this process, all its stages chained
(``LocalChain``: no network, so only the stages' compute and the Python step loop are timed),
under each runtime of ``--runtimes`` (``default``: pipeshard's CPU defaults; ``exact``: f32 KV
cache and dynamic activation quantization off, see benchmarks/gguf_fidelity.py). This process
and everything it starts are pinned to ``--cores`` and every compiled stage gets ``--threads``
inference threads. Each round, every configuration (in an order reversed every other round, so
machine drift hits all alike) prefills the same chat prompt and decodes ``--tokens`` greedy
tokens; its decode tok/s is the tokens after the first over the time they took. ``--llama-bench
BIN`` adds llama.cpp's ``llama-bench -p 0 -n TOKENS -t THREADS -r 1`` on the export's GGUF in
each round. The report gives medians over the rounds and each configuration's ratio to the
first (per round, then the median).

  pipeshard bench gguf-speed --export gguf=DIR --export int4=DIR [--export ...]
      [--runtimes default,exact] [--llama-bench BIN] [--cores 0] [--threads 1]
      [--tokens 64] [--rounds 5] [--name gguf-speed]
Writes <name>-<date>.{json,md} in --results DIR (default: the current directory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.gguf_fidelity import PROMPTS, runtime_options


def parse_cores(text: str) -> set[int]:
    cores: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return cores


def decode_rate(chain: Any, prompt: list[int], tokens: int, session: str) -> float:
    import numpy as np

    logits = chain.forward(session, np.asarray(prompt))[-1]
    token = int(np.argmax(logits))
    start = time.perf_counter()
    for _ in range(tokens - 1):
        token = int(np.argmax(chain.forward(session, np.asarray([token]))[-1]))
    seconds = time.perf_counter() - start
    chain.release(session)
    return (tokens - 1) / seconds


def llama_bench_rate(binary: Path, gguf: Path, tokens: int, threads: int) -> float:
    out = subprocess.run(
        [
            str(binary),
            "-m",
            str(gguf),
            "-p",
            "0",
            "-n",
            str(tokens),
            "-t",
            str(threads),
            "-r",
            "1",
            "-o",
            "json",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    [result] = json.loads(out)
    return float(result["avg_ts"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pipeshard bench gguf-speed", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    parser.add_argument("--export", action="append", required=True, metavar="NAME=DIR")
    parser.add_argument("--runtimes", default="default")
    parser.add_argument("--llama-bench", type=Path, default=None)
    parser.add_argument("--cores", default="0", help="pin this process (and llama-bench) here")
    parser.add_argument("--threads", type=int, default=1, help="inference threads per stage")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--name", default="gguf-speed")
    report.add_results_option(parser)
    opts = parser.parse_args(argv)

    os.sched_setaffinity(0, parse_cores(opts.cores))
    from exporter.verify import encode_prompts
    from protos.manifest import load_manifest
    from shard_runtime.chain import LocalChain

    exports = {}
    for spec in opts.export:
        name, sep, folder = spec.partition("=")
        if not sep:
            raise SystemExit(f"--export wants NAME=DIR, got {spec!r}")
        exports[name] = Path(folder)
    first = load_manifest(next(iter(exports.values())))
    [(_, prompt)] = encode_prompts(next(iter(exports.values())), first, PROMPTS[:1])
    chains: dict[str, Any] = {}
    sizes: dict[str, int] = {}
    for name, folder in exports.items():
        sizes[name] = sum(p.stat().st_size for p in folder.glob("stage-*/model.bin"))
        for runtime in opts.runtimes.split(","):
            chain = LocalChain(folder, runtime_options(runtime, opts.threads))
            decode_rate(chain, prompt, 4, "warm-up")  # first inferences allocate
            chains[f"{name}, {runtime}"] = chain
    gguf = Path(first.source.path)
    names = list(chains) + (["llama.cpp"] if opts.llama_bench else [])

    rates: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(opts.rounds):
        order = names if round_ % 2 == 0 else names[::-1]
        for name in order:
            if name == "llama.cpp":
                rate = llama_bench_rate(opts.llama_bench, gguf, opts.tokens, opts.threads)
            else:
                rate = decode_rate(chains[name], prompt, opts.tokens, f"r{round_}")
            rates[name].append(rate)
        print(f"round {round_ + 1}: " + ", ".join(f"{n} {rates[n][-1]:.2f}" for n in names))

    base = names[0]
    lines = [
        f"Machine: {report.describe(report.machine())}",
        "",
        f"Model: {first.model.model_id} ({gguf.name}), {first.num_stages} stages chained in one "
        f"process pinned to cores {opts.cores}, {opts.threads} inference thread(s) per stage; "
        f"llama-bench with -t {opts.threads} on the same cores. {len(prompt)}-token chat prompt, "
        f"{opts.tokens} greedy tokens, {opts.rounds} interleaved rounds (medians).",
        "",
        f"| configuration | stage weights | decode tok/s | x {base} |",
        "|---|---:|---:|---:|",
    ]
    for name in names:
        ratio = statistics.median(r / b for r, b in zip(rates[name], rates[base], strict=True))
        size = next((sizes[e] for e in exports if name.startswith(f"{e}, ")), None)
        mib = (size or gguf.stat().st_size) / 2**20
        weight = f"{mib:.0f} MiB" + ("" if size else " (GGUF)")
        lines.append(f"| {name} | {weight} | {statistics.median(rates[name]):.2f} | {ratio:.3f} |")
    report.save(
        opts.results,
        opts.name,
        "\n".join(lines) + "\n",
        {"rates": rates, "stage_bytes": sizes, "prompt_tokens": len(prompt)},
        opts,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
