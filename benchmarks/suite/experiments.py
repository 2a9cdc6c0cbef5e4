"""`pipeshard bench paper` (the default suite: `pipeshard bench [OPTIONS]`): the paper's
experiments, side by side, in one run.

  1 shard parity      monolithic openvino-genai vs 1-stage shard vs 1-stage without beam_idx
                      vs N stages in one process vs N stages over gRPC (single-stream decode)
  2 micro-batching    1, 2, 4, 8 users on N stages (+ 2 users with speculation, K=3) vs
                      monolithic single user
  3 speculative       K sweep and adaptive K on 8 chat prompts: acceptance, speedup
  4 latency sweep     0, 10, 50, 100 ms per hop: naive single stream (star, no speculation)
                      vs the full stack (ring + speculation + micro-batching)
  5 time to first     128, 512 and 2,048-token prompts, N stages vs monolithic
    token

Writes <out>/bench-<date>.md (tables beside the paper's numbers), <out>/bench-<date>.json
(every raw measurement) and <out>/bench-<date>-{users,speedup,ttft}.png. Experiments that need
the monolithic baseline (--baseline, an optimum-cli export for openvino-genai) measure the rest
without it and say so in the report. --quick runs a reduced version in a few minutes.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks.report import add_results_option, machine, save
from benchmarks.suite import latency, parity, render, speculation, ttft, users
from benchmarks.suite.context import Bench, Pinning, knobs, pin_this_process
from benchmarks.suite.exports import default_variants, find_variants, resolve_export
from benchmarks.suite.plots import draw

log = logging.getLogger(__name__)
EXPERIMENTS: dict[int, tuple[str, ModuleType]] = {
    1: ("parity", parity),
    2: ("microbatch", users),
    3: ("speculative", speculation),
    4: ("latency", latency),
    5: ("ttft", ttft),
}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def build_parser() -> argparse.ArgumentParser:
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="pipeshard bench paper",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument(
        "--export",
        type=Path,
        help="an N-stage export, with draft/ for experiments 3-4 (default: the default model's "
        "export that `pipeshard up` makes, made if missing)",
    )
    p.add_argument("--baseline", type=Path, help="optimum-cli export of the same model (genai)")
    p.add_argument(
        "--variants",
        type=Path,
        help="folder with (or for) the 1-stage exports of experiment 1, s1/ and s1-nobeam/ "
        "(default: ~/.cache/pipeshard/bench/<source>-<weights>)",
    )
    p.add_argument("--experiments", default="1,2,3,4,5", help="which to run (default all)")
    p.add_argument("--quick", action="store_true", help="a reduced version in a few minutes")
    p.add_argument("--rounds", type=int, help="rounds per figure (default 3; --quick 2)")
    add_results_option(p, "--out")
    group = p.add_argument_group("cores and threads (every process is pinned)")
    group.add_argument(
        "--stage-cores", default=cores, help=f"stage k on the k-th (cyclically) (default {cores})"
    )
    group.add_argument(
        "--worker-cores",
        default=cores.split(",")[0],
        help="monolithic genai and in-process chain workers (default: the first stage core)",
    )
    group.add_argument(
        "--coordinator-cores",
        default=cores,
        help=f"this process and the gateways (default {cores})",
    )
    group.add_argument("--threads", type=int, default=1, help="inference threads per process")
    group.add_argument(
        "--ov-cache-dir", type=Path, help="OpenVINO model cache (default pipeshard's)"
    )
    sizes = p.add_argument_group("sizes (override the full or --quick defaults)")
    sizes.add_argument("--tokens", type=int, help="decode tokens, experiments 1-2 (64; quick 16)")
    sizes.add_argument("--users", type=_ints, help="experiment 2 (1,2,4,8; quick 1,2)")
    sizes.add_argument("--ks", type=_ints, help="experiment 3 fixed K (1,2,3,4,8; quick 3)")
    sizes.add_argument("--spec-tokens", type=int, help="tokens per prompt, 3-4 (32; quick 16)")
    sizes.add_argument("--spec-delays", type=_floats, help="experiment 3 ms/hop (0,100; quick 0)")
    sizes.add_argument(
        "--delays", type=_floats, help="experiment 4 ms/hop (0,10,50,100; quick 0,100)"
    )
    sizes.add_argument("--lengths", type=_ints, help="experiment 5 (128,512,2048; quick 128,512)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    opts = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("benchmarks").setLevel(logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    chosen = sorted(set(_ints(opts.experiments)))
    if not chosen or any(n not in EXPERIMENTS for n in chosen):
        raise SystemExit(f"--experiments takes numbers from 1 to 5, got {opts.experiments!r}")
    sizes = knobs(
        opts.quick,
        rounds=opts.rounds,
        tokens=opts.tokens,
        users=opts.users,
        ks=opts.ks,
        spec_tokens=opts.spec_tokens,
        spec_delays=opts.spec_delays,
        delays=opts.delays,
        lengths=opts.lengths,
    )
    from common.net import default_ov_cache
    from protos.manifest import load_manifest

    export = resolve_export(opts.export).resolve()
    manifest = load_manifest(export)
    variants: dict[str, Path] = {}
    notes: list[str] = []
    if 1 in chosen:
        folder = opts.variants or default_variants(manifest)
        variants, notes = find_variants(manifest, folder.resolve())
    pin = Pinning(
        tuple(opts.stage_cores.split(",")), opts.worker_cores, opts.coordinator_cores, opts.threads
    )
    pin_this_process(pin.coordinator_cores)
    bench = Bench(
        export=export,
        manifest=manifest,
        baseline=opts.baseline.resolve() if opts.baseline else None,
        variants=variants,
        variant_notes=notes,
        knobs=sizes,
        pin=pin,
        ov_cache=opts.ov_cache_dir or default_ov_cache(),
    )
    info = machine()
    started = time.perf_counter()
    results, seconds, failures = run_all(bench, chosen)
    total = time.perf_counter() - started

    command = "pipeshard bench " + shlex.join(argv)
    lines = render.header(bench, command, info, total)
    for name, module in EXPERIMENTS.values():
        result = results.get(name)
        if name in failures:
            lines += render.failure(module.TITLE, failures[name])
            continue
        table = module.table(result, bench) if result and result.get("summary") else []
        lines += render.section(module.TITLE, result, table, seconds.get(name))
    report = "\n".join(lines)
    data: dict[str, Any] = {
        "machine": info,
        "command": command,
        "export": str(export),
        "baseline": str(bench.baseline) if bench.baseline else None,
        "variants": {k: str(v) for k, v in variants.items()},
        "knobs": asdict(sizes),
        "processes": pin.rows(manifest.num_stages, manifest.draft is not None),
        "seconds": {**seconds, "total": total},
        "failures": failures,
        "experiments": results,
    }
    stem = save(opts.results, "bench", report, data, opts)
    plots = draw(stem, results, manifest.num_stages)
    print(f"wrote {stem}.md, {stem}.json" + "".join(f", {p}" for p in plots), file=sys.stderr)
    if failures:
        print(f"the processes' logs are in {bench.logs}", file=sys.stderr)
        return 1
    shutil.rmtree(bench.logs, ignore_errors=True)
    return 0


def run_all(
    bench: Bench, chosen: list[int]
) -> tuple[dict[str, Any], dict[str, float], dict[str, str]]:
    """Every chosen experiment on one set of stage processes; one that fails is reported."""
    results: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    failures: dict[str, str] = {}
    bench.start()
    try:
        for number in chosen:
            name, module = EXPERIMENTS[number]
            log.info("experiment %d: %s", number, module.TITLE)
            began = time.perf_counter()
            try:
                results[name] = module.run(bench)
            except Exception as exc:
                log.exception("experiment %d failed", number)
                failures[name] = f"{type(exc).__name__}: {exc}"
            seconds[name] = time.perf_counter() - began
    finally:
        bench.stop()
    return results, seconds, failures
