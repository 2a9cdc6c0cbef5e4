"""What a paged stage's decode step costs with 1, 2, 4 and 8 users in one inference call.

Batching pays when a call of several rows costs little more than a call of one (the weights are
read once per call). Hosts differ: on one a two-row call cost 1.05x a one-row call, on another
1.4x, and there a lone row is also computed on another kernel path than a row among others, so
batch-invariant stages pad it to two rows (``PagedRunner`` checks when it loads). This measures
both, per stage, in this process: each stage's ``PagedRunner`` (``--threads`` inference threads,
the runtime's defaults otherwise, batch invariance off so the raw kernels are timed), pinned to
``--cores``, sessions holding a ``--context``-token prompt, ``--steps`` decode calls per row count
in interleaved rounds (median). It also reports whether the stage pads one-row calls.

``--stateful``: also each stage's stateful backend (``ShardRunner``, an infer request per session:
the fused stateful attention) for one row, loaded beside the paged runner in the same process
and timed in the same rounds, so the two one-row calls are compared side by side: which backend
a lone user (or a ``--no-batching`` gateway's pipelined users) decodes faster on here.

``--side-by-side``: every stage in its own process pinned to its own core (stage k on core k, as
the fleet benchmarks run them), all measuring at once, so each stage's time includes the
contention a running fleet has (memory bandwidth, the shared cache). Either way the report
suggests the ``--split`` that evens the stages out (each stage's time minus its layers at stage
0's cost per layer is what it does besides layers, e.g. the output head; the shares that leave
every stage the same total), to export with a fractional ``--split`` (README "Cuts inside a
layer").

Usage: pipeshard bench batch-cost [--export DIR] [--rows 1,2,4,8] [--threads 1] [--cores 0]
       [--side-by-side] [--stateful]
Writes batch_cost-<date>.{md,json} in --results DIR (default: the current directory).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from queue import Empty
from typing import Any

import numpy as np

from benchmarks.report import add_results_option, machine, save


def stage_costs(
    export: Path,
    index: int,
    rows: list[int],
    threads: int,
    context: int,
    steps: int,
    rounds: int,
    stateful: bool = False,
    sync: Any = None,
) -> dict[str, Any]:
    """``stateful``: also time the stateful backend's one-row call (one session, the same
    prompt length) in each round. ``sync``: a barrier the stages measured side by side wait at
    before each row count of each round, so that they compute at the same time."""
    from shard_runtime.paged import PagedRunner, PagedStep
    from shard_runtime.runner import RunnerOptions, ShardRunner

    runner = PagedRunner(export, index, RunnerOptions(threads=threads, batch_invariant=False))
    plain = ShardRunner(export, index, RunnerOptions(threads=threads)) if stateful else None
    pads = not runner.lone_row_is_invariant()
    rng = np.random.default_rng(index)

    def data(n: int) -> np.ndarray:
        if runner.is_first:
            return rng.integers(3, min(1000, runner.manifest.model.vocab_size), n)
        return rng.standard_normal((n, runner.input_width)).astype(np.float32)

    sessions = [f"user-{i}" for i in range(max(rows))]
    length = {}
    for sid in sessions:
        step = PagedStep(sid, data(context), 0)
        runner.place(step)
        runner.forward([step])
        length[sid] = context
    if plain is not None:
        plain.forward("alone", data(context))
    stateful_times: list[float] = []
    times: dict[int, list[float]] = {n: [] for n in rows}
    for _ in range(rounds):
        if plain is not None:
            if sync is not None:
                sync.wait()
            for _ in range(steps):
                one = data(1)
                started = time.perf_counter()
                plain.forward("alone", one)
                stateful_times.append(time.perf_counter() - started)
        for n in rows:
            if sync is not None:
                sync.wait()
            for _ in range(steps):
                batch = [PagedStep(sid, data(1), length[sid]) for sid in sessions[:n]]
                for step in batch:
                    runner.place(step)
                started = time.perf_counter()
                runner.forward(batch)
                times[n].append(time.perf_counter() - started)
                for sid in sessions[:n]:
                    length[sid] += 1
    result: dict[str, Any] = {
        "stage": index,
        "layers": runner.stage.span(runner.manifest.model.intermediate_size),
        "pads_one_row_calls": pads,
        "ms": {n: statistics.median(t) * 1000 for n, t in times.items()},
    }
    if stateful_times:
        result["stateful_ms"] = statistics.median(stateful_times) * 1000
    return result


def _pinned_stage_costs(queue: Any, core: int, args: tuple[Any, ...]) -> None:
    """One stage's costs; or the error that stopped it, with the barrier (the last of
    ``args``) broken so that the other stages stop waiting for this one; or None for a stage
    stopped by that broken barrier."""
    os.sched_setaffinity(0, {core})
    index, barrier = args[1], args[-1]
    try:
        queue.put(stage_costs(*args))
    except threading.BrokenBarrierError:
        queue.put(None)
    except BaseException as exc:
        barrier.abort()
        queue.put(RuntimeError(f"stage {index}: {type(exc).__name__}: {exc}"))


def side_by_side(export: Path, stages: int, *rest: Any) -> list[dict[str, Any]]:
    """Every stage measured at once, stage k in a process of its own on core k; each row count
    of each round starts on all stages together (a barrier)."""
    spawn = multiprocessing.get_context("spawn")
    queue: Any = spawn.Queue()
    barrier = spawn.Barrier(stages)
    cores = os.cpu_count() or 1
    procs = [
        spawn.Process(
            target=_pinned_stage_costs, args=(queue, k % cores, (export, k, *rest, barrier))
        )
        for k in range(stages)
    ]
    for proc in procs:
        proc.start()
    results: list[Any] = []
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=1))
        except Empty:  # a stage process that died without a word (a crash) fails the run
            dead = [k for k, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
            if dead:
                barrier.abort()
                for proc in procs:
                    proc.terminate()
                raise RuntimeError(
                    f"stage {dead[0]}'s process exited with {procs[dead[0]].exitcode}"
                ) from None
    for proc in procs:
        proc.join()
    failed = [r for r in results if not isinstance(r, dict)]
    if failed:
        raise next((r for r in failed if r is not None), RuntimeError("a stage stopped"))
    return sorted(results, key=lambda r: r["stage"])


def suggested_split(shares: list[float], ms: list[float]) -> list[float]:
    """Shares that even out the stages' times, at stage 0's cost per layer share."""
    per_share = ms[0] / shares[0]
    extra = [t - per_share * n for t, n in zip(ms, shares, strict=True)]
    target = sum(ms) / len(ms)
    split = [round((target - e) / per_share, 2) for e in extra]
    split[-1] = round(sum(shares) - sum(split[:-1]), 2)
    return split


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pipeshard bench batch-cost",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--export", type=Path, default=Path("exports/qwen15-int4-s2d"))
    p.add_argument("--rows", default="1,2,4,8", help="users (rows) per inference call")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cores", default="0", help="CPUs this process runs on, e.g. 0 or 0-1")
    p.add_argument("--context", type=int, default=40, help="prompt tokens per session")
    p.add_argument("--steps", type=int, default=6, help="decode calls per row count per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--side-by-side", action="store_true", help="all stages at once, stage k on core k"
    )
    p.add_argument(
        "--stateful",
        action="store_true",
        help="also time the stateful backend's one-row call, in the same rounds",
    )
    add_results_option(p)
    opts = p.parse_args(argv)
    rows = [int(r) for r in opts.rows.split(",") if r]
    first, _, last = opts.cores.partition("-")
    os.sched_setaffinity(0, set(range(int(first), int(last or first) + 1)))

    from protos.manifest import load_manifest

    manifest = load_manifest(opts.export)
    args = (rows, opts.threads, opts.context, opts.steps, opts.rounds, opts.stateful)
    if opts.side_by_side:
        stages = side_by_side(opts.export, manifest.num_stages, *args)
        where = "in its own process pinned to CPU k (stage k), all stages at once"
    else:
        stages = [stage_costs(opts.export, k, *args) for k in range(manifest.num_stages)]
        where = f"in one process pinned to CPU(s) {opts.cores}, one after the other"
    lines = [
        f"{manifest.model.model_id} ({manifest.weights.format}), export {opts.export.name}: "
        f"each stage's PagedRunner {where}, "
        f"{opts.threads} inference thread(s), f32 compute, f16 KV cache, batch invariance off "
        f"(raw kernels); sessions hold a {opts.context}-token prompt; median of "
        f"{opts.rounds} x {opts.steps} decode calls per row count, rounds interleaved.",
        "",
        "| stage | layers | pads one-row calls | "
        + " | ".join(f"{n} row{'s' if n > 1 else ''}: ms (x 1 row)" for n in rows)
        + (f" | stateful 1 row: ms (x paged {rows[0]} row)" if opts.stateful else "")
        + " |",
        "|---|---|---|" + "---|" * (len(rows) + opts.stateful),
    ]
    for s in stages:
        one = s["ms"][rows[0]]
        cells = " | ".join(f"{s['ms'][n]:.1f} ({s['ms'][n] / one:.2f}x)" for n in rows)
        if opts.stateful:
            cells += f" | {s['stateful_ms']:.1f} ({s['stateful_ms'] / one:.2f}x)"
        lines.append(
            f"| {s['stage']} | {s['layers']} | {'yes' if s['pads_one_row_calls'] else 'no'} "
            f"| {cells} |"
        )
    total = {n: sum(s["ms"][n] for s in stages) for n in rows}
    lines += [
        "",
        "Tokens per second of one ring step (all stages in turn, no transport) by users per call: "
        + ", ".join(f"{n}: {n * 1000 / total[n]:.2f}" for n in rows)
        + "."
        + (
            f" The stateful backend, one user: {1000 / sum(s['stateful_ms'] for s in stages):.2f}."
            if opts.stateful
            else ""
        ),
    ]
    data: dict[str, Any] = {"stages": stages, "host": machine()}
    if manifest.num_stages > 1:
        shares = [e.share(manifest.model.intermediate_size) for e in manifest.stages]
        ms = [s["ms"][rows[0]] for s in stages]
        data["suggested_split"] = suggested_split(shares, ms)
        lines += [
            "",
            f"Slowest over fastest stage at {rows[0]} row(s): {max(ms) / min(ms):.3f}. "
            f"Split now: {','.join(f'{n:g}' for n in shares)}; the split that evens them "
            f"out: `--split {','.join(f'{n:g}' for n in data['suggested_split'])}`.",
        ]
    save(opts.results, "batch_cost", "\n".join(lines), data, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
