"""Where the stages run: the same ring with its stage processes on different core layouts.

Each layout (``--layouts``, e.g. ``0,1`` = stage 0 on core 0 and stage 1 on core 1; ``0,0`` =
both stages on core 0) gets its own stage processes (1 inference thread each) and its own
gateway (``--gateway-flags``, default ``--no-batching``), all started once; the gateways and the
HTTP clients are not pinned. Round after round, each layout serves ``--users`` streaming users
of ``--tokens`` greedy tokens in turn, so the machine's drift hits every layout alike; the
report gives each layout's inter-token latency p50 and decode tok/s (medians over the rounds)
and the round-by-round ratio of each layout's inter-token p50 to the first layout's.

With one user the stages compute one after the other, so a ring on one core loses no
parallelism; a difference between the layouts is what spreading the ring's processes over the
cores costs on this machine (cross-core wake-ups, the unpinned gateway and clients sharing the
stages' cores): on a 2-core VM both stages on one core were faster (README, "AMD EPYC").

Usage: python benchmarks/core_placement.py --export DIR [--layouts 0,1/0,0] [--users 1]
       [--tokens 48] [--rounds 5] [--gateway-flags=--no-batching]
Writes benchmarks/results/core_placement-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.microbatch import run_users  # noqa: E402
from benchmarks.processes import Proc, start_gateway, start_pinned_stages  # noqa: E402
from benchmarks.report import reachable_eos, save  # noqa: E402
from benchmarks.suite.stats import fmt, ratios, spread  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--export", type=Path, required=True)
    p.add_argument(
        "--layouts", default="0,1/0,0", help="core of each stage, per layout, '/'-separated"
    )
    p.add_argument("--users", type=int, default=1)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--gateway-flags", default="--no-batching", help="`pipeshard serve` flags")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    opts = p.parse_args()

    from protos.manifest import load_manifest

    manifest = load_manifest(opts.export)
    layouts = [layout.split(",") for layout in opts.layouts.split("/")]
    if any(len(cores) != manifest.num_stages for cores in layouts):
        p.error(f"--layouts: give a core for each of the {manifest.num_stages} stages")
    names = ["/".join(cores) for cores in layouts]
    eos = reachable_eos(manifest)
    flags = shlex.split(opts.gateway_flags)
    logs = Path(tempfile.mkdtemp(prefix="core-placement-"))
    procs: list[Proc] = []
    urls: list[str] = []
    try:
        for cores in layouts:
            stages, addresses, _ = start_pinned_stages(opts.export, logs, cores=cores)
            procs += stages
            gateway, url = start_gateway(addresses, logs / f"gateway-{len(urls)}.log", flags)
            procs.append(gateway)
            urls.append(url)
        model = httpx.get(f"{urls[0]}/v1/models").json()["data"][0]["id"]
        for url in urls:  # warm-up
            run_users(url, model, opts.users, min(8, opts.tokens), eos)
        rounds: list[list[dict[str, Any]]] = []
        for n in range(opts.rounds):
            rounds.append([run_users(url, model, opts.users, opts.tokens, eos) for url in urls])
            print(
                f"round {n + 1}: "
                + ", ".join(
                    f"{name} {r['itl_p50_ms']:.1f} ms"
                    for name, r in zip(names, rounds[-1], strict=True)
                ),
                flush=True,
            )
    finally:
        for proc in procs:
            proc.stop()

    def column(key: str, i: int) -> list[float]:
        return [r[i][key] for r in rounds]

    table: list[dict[str, Any]] = [
        {
            "layout": name,
            "itl_p50_ms": spread(column("itl_p50_ms", i)),
            "decode_tok_s": spread(column("decode_tok_s", i)),
            "itl_vs_first": ratios(column("itl_p50_ms", i), column("itl_p50_ms", 0)),
        }
        for i, name in enumerate(names)
    ]
    lines = [
        f"Export {opts.export.name}: {manifest.num_stages} stage processes per layout, 1 "
        f"inference thread each; gateway `{shlex.join(['pipeshard', 'serve', *flags])}`"
        f"{'' if flags else ' (defaults: batching)'}, gateways and "
        f"clients unpinned; {opts.users} user(s) x {opts.tokens} greedy tokens; layouts in turn, "
        f"{opts.rounds} rounds, medians [min, max].",
        "",
        "| stage cores | inter-token p50 ms | decode tok/s | inter-token p50 vs first layout |",
        "|---|---|---|---|",
    ]
    for row in table:
        lines.append(
            f"| {row['layout']} | {fmt(row['itl_p50_ms'], 1)} | {fmt(row['decode_tok_s'])} | "
            f"{fmt(row['itl_vs_first'], 3, 'x')} |"
        )
    save(opts.results, "core_placement", "\n".join(lines), {"rounds": rounds, "table": table}, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
