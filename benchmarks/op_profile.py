"""Where a token's time goes: one decode step and one prefill chunk of each stage, by op type.

Each stage of an export is loaded in this process on each KV backend (``--backends``: the
paged ``PagedRunner``, the default for hybrids, and the stateful ``ShardRunner``), compiled as
the stages compile it (``--threads`` inference threads, f32 compute, f16 KV cache) plus
OpenVINO's per-op counters (``PERF_COUNT``), the process pinned to ``--cores``. A session is
prefilled with one ``--chunk``-token call (profiled: the prefill chunk), then decoded
``--steps`` times one token at a time (profiled each; the first is left out as a warm-up).
A first prefill before it, on which the CPU plugin repacks weights, is not profiled.
Every executed runtime op's time (``InferRequest.get_profiling_info``) is put in a category
(benchmarks/op_categories.py: LM head, embedding, router, experts, shared expert, Gated
DeltaNet, full attention, norms, other matmuls, other), so the categories add up to the
counters' total. Beside it, per call: the wall time of the ``infer()`` call (the counters' total
plus OpenVINO's own work around the ops) and of the runner's ``forward()`` (plus the Python
that packs inputs and reads outputs).

Paged stages also time the batch-invariance pad row: a one-row decode call padded to two rows
(what a stage that pads does for a lone user) against the same call unpadded (a solo step).

``--ring``: then the stages as a served ring: one ``pipeshard stage`` process per stage (stage
k pinned to core k, the ``--kv-backend`` given, their metrics on), driven step by step by the
gateway's ``PipelineClient`` for ``--ring-tokens`` greedy decode steps. A step's wall time at
the client against what the stages report (``pipeshard_stage_forward_seconds``: the runner's
forward; ``pipeshard_stage_busy_seconds``: the whole compute call with the sampling) gives the
time a step spends outside inference: gRPC, protobuf, queues and the client.

The counters add a little work per op, and the numbers are per call on whatever else the
machine runs: shares are steadier than milliseconds.

Usage: pipeshard bench profile [--export DIR] [--backends paged,stateful] [--chunk 128]
       [--steps 9] [--threads 1] [--cores 0] [--top 8] [--ring] [--ring-tokens 32]
       [--name op_profile]
Writes <name>-<date>.{md,json} in --results DIR (default: the current directory).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.op_categories import (
    CATEGORIES,
    ir_categories,
    runtime_category,
    runtime_sources,
)
from benchmarks.report import add_results_option, describe, machine, save


class TimedRequest:
    """An infer request that keeps the wall time of its last ``infer()`` call and counts its
    calls (everything else goes to the request itself): how the runners' calls are timed
    without changing them."""

    def __init__(self, request: Any) -> None:
        self._request = request
        self.seconds = 0.0
        self.calls = 0

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self._request.infer(*args, **kwargs)
        finally:
            self.seconds = time.perf_counter() - started
            self.calls += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


class Classifier:
    """Categories of one compiled stage's runtime ops (benchmarks.op_categories)."""

    def __init__(self, runner: Any) -> None:
        import openvino as ov

        self.own, self.follows = ir_categories(ov.Core().read_model(runner.model_xml))
        self.sources = runtime_sources(runner.compiled)
        self._cache: dict[tuple[str, str], str] = {}

    def __call__(self, name: str, node_type: str) -> str:
        key = (name, node_type)
        if key not in self._cache:
            names = self.sources.get(name, [name])
            self._cache[key] = runtime_category(node_type, names, self.own, self.follows)
        return self._cache[key]


class CallCounters:
    """Per-call times from the CPU plugin's counters, which report each op's *mean* over every
    call of the compiled graph so far (whole microseconds), not its last call: the call's time
    is the growth of the op's running total (mean x calls). The graph's calls are those of the
    one request timed (a paged stage's; a stateful stage's one session)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def read(self, request: TimedRequest, classify: Classifier) -> dict[str, Any]:
        """The last call's executed ops: ms by category and by op (name, type, kernel)."""
        by_category: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
        ops: list[dict[str, Any]] = []
        for info in request.get_profiling_info():
            if info.status != info.Status.EXECUTED:
                continue
            total = info.real_time.total_seconds() * 1000 * request.calls
            ms = total - self.totals.get(info.node_name, 0.0)
            self.totals[info.node_name] = total
            category = classify(info.node_name, info.node_type)
            by_category[category] += ms
            ops.append(
                {
                    "name": info.node_name,
                    "type": info.node_type,
                    "kernel": info.exec_type,
                    "category": category,
                    "ms": ms,
                }
            )
        return {"categories": by_category, "counters_ms": sum(by_category.values()), "ops": ops}


def profiled(
    request: TimedRequest, counters: CallCounters, classify: Classifier, call: Any
) -> dict[str, Any]:
    """Run ``call`` (one runner forward, one inference) and read its counters and walls."""
    calls = request.calls
    started = time.perf_counter()
    call()
    forward = time.perf_counter() - started
    if request.calls != calls + 1:
        raise RuntimeError(f"a profiled call ran {request.calls - calls} inferences, not one")
    out = counters.read(request, classify)
    out["infer_ms"] = request.seconds * 1000
    out["forward_ms"] = forward * 1000
    return out


def mean_call(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean of several calls' figures (so that the categories still add up), the median
    infer() wall beside it, and each op's mean time."""
    n = len(calls)
    ops: dict[tuple[str, str, str, str], float] = defaultdict(float)
    for call in calls:
        for op in call["ops"]:
            ops[(op["name"], op["type"], op["kernel"], op["category"])] += op["ms"] / n
    return {
        "calls": n,
        "categories": {c: sum(x["categories"][c] for x in calls) / n for c in CATEGORIES},
        "counters_ms": sum(x["counters_ms"] for x in calls) / n,
        "infer_ms": sum(x["infer_ms"] for x in calls) / n,
        "forward_ms": sum(x["forward_ms"] for x in calls) / n,
        "infer_ms_median": statistics.median(x["infer_ms"] for x in calls),
        "ops": [
            {"name": k[0], "type": k[1], "kernel": k[2], "category": k[3], "ms": ms}
            for k, ms in sorted(ops.items(), key=lambda kv: -kv[1])
        ],
    }


def _data(runner: Any, rng: np.random.Generator, count: int) -> np.ndarray:
    if runner.is_first:
        return rng.integers(3, min(1000, runner.manifest.model.vocab_size), count)
    return rng.standard_normal((count, runner.input_width)).astype(np.float32)


def profile_stateful(export: Path, index: int, options: Any, chunk: int, steps: int) -> Any:
    from shard_runtime.runner import ShardRunner

    runner = ShardRunner(export, index, options)
    classify = Classifier(runner)
    rng = np.random.default_rng(index)
    sid = "profile"
    runner._open(sid)
    session = runner._sessions[sid]
    request = session.request = TimedRequest(session.request)
    counters = CallCounters()

    def feed(count: int) -> None:
        runner.forward(sid, _data(runner, rng, count))

    # a first call, not profiled: the CPU plugin repacks weights on a graph's first inference
    profiled(request, counters, classify, lambda: feed(chunk))
    runner.rollback(sid, chunk)  # back to empty (a hybrid's too: its state reset)
    prefill = profiled(request, counters, classify, lambda: feed(chunk))
    decode = [profiled(request, counters, classify, lambda: feed(1)) for _ in range(steps)]
    return runner, {"prefill": mean_call([prefill]), "decode": mean_call(decode[1:])}


def profile_paged(export: Path, index: int, options: Any, chunk: int, steps: int) -> Any:
    """Prefill, then decode steps alternating a padded one-row call (two rows computed) and a
    solo one (one row), so that load hits both alike."""
    from shard_runtime.paged import PagedRunner, PagedStep

    runner = PagedRunner(export, index, options, pad_lone_rows=True)
    classify = Classifier(runner)
    rng = np.random.default_rng(index)
    request = runner.request = TimedRequest(runner.request)
    counters = CallCounters()
    sid, length = "warm-up", 0

    def feed(count: int, solo: bool) -> None:
        nonlocal length
        step = PagedStep(sid, _data(runner, rng, count), length, solo=solo)
        runner.place(step)
        runner.forward([step])
        length += count

    # a first call, not profiled: the CPU plugin repacks weights on a graph's first inference
    profiled(request, counters, classify, lambda: feed(chunk, False))
    runner.release(sid)
    sid, length = "profile", 0
    prefill = profiled(request, counters, classify, lambda: feed(chunk, False))
    padded, alone = [], []
    for _ in range(steps):
        padded.append(profiled(request, counters, classify, lambda: feed(1, False)))
        alone.append(profiled(request, counters, classify, lambda: feed(1, True)))
    return (
        runner,
        {
            "prefill": mean_call([prefill]),
            "decode": mean_call(padded[1:]),  # what a padding stage runs for a lone user
            "decode_solo": mean_call(alone[1:]),
        },
    )


def layers_of(manifest: Any, index: int) -> str:
    entry = manifest.stages[index]
    kinds = manifest.model.layer_types[entry.layer_start : entry.layer_end]
    counts = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
    named = ", ".join(f"{n} {k.replace('_attention', '')}" for k, n in counts.items())
    return f"{entry.layer_start}-{entry.layer_end - 1} ({named})"


# -- the ring: time outside inference -------------------------------------------------------
def _scrape(port: int) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, _, value = line.rpartition(" ")
        values[key] = float(value)
    return values


def _phase_sum(values: dict[str, float], metric: str, phase: str) -> float:
    return values.get(f'pipeshard_stage_{metric}{{phase="{phase}"}}', 0.0)


def ring_overhead(
    export: Path, backend: str, threads: int, tokens: int, prompt: int
) -> dict[str, Any]:
    """Greedy decode steps over real stage processes; per step: the client's wall time, each
    stage's forward and busy time (from its metrics)."""
    from benchmarks.processes import PIPESHARD, Proc, free_port, run_async
    from protos.manifest import load_manifest
    from server.ring.grpc_client import PipelineClient

    manifest = load_manifest(export)
    vocab = manifest.model.vocab_size
    ids = [int(i) for i in np.random.default_rng(0).integers(3, min(1000, vocab), prompt)]

    async def run(addresses: list[str], count: int) -> list[float]:
        client = PipelineClient(addresses, step_timeout=600)
        await client.start(timeout=600)
        walls = []
        try:
            out = await client.step("ring", ids, 0)
            last, position = out.tokens[0].token_id, len(ids)
            for _ in range(count):
                started = time.perf_counter()
                out = await client.step("ring", [last], position)
                walls.append(time.perf_counter() - started)
                last, position = out.tokens[0].token_id, position + 1
            await client.release("ring")
        finally:
            await client.close()
        return walls

    with tempfile.TemporaryDirectory(prefix="profile-ring-") as logs:
        procs: list[Any] = []
        try:
            # started here, not by start_pinned_stages, so that a stage that never gets
            # ready (a slow compile on a loaded machine) is stopped with the others
            addresses, ports = [], []
            for index in range(manifest.num_stages):
                port, metrics = free_port(), free_port()
                args = [
                    PIPESHARD, "stage", "--shards", str(export), "--stage", str(index),
                    "--listen", f"127.0.0.1:{port}", "--cpus", str(index % (os.cpu_count() or 1)),
                    "--threads", str(threads), "--kv-backend", backend,
                    "--metrics-port", str(metrics),
                ]  # fmt: skip
                procs.append(Proc(args, Path(logs) / f"stage-{index}.log").start())
                addresses.append(f"127.0.0.1:{port}")
                ports.append(metrics)
            for proc in procs:
                proc.wait_ready(timeout=900)
            run_async(run(addresses, 4))  # warm-up
            before = [_scrape(p) for p in ports]
            walls = run_async(run(addresses, tokens))
            after = [_scrape(p) for p in ports]
        finally:
            for proc in procs:
                proc.stop()
    stages = []
    for b, a in zip(before, after, strict=True):
        # the prefill of the measured run is a call of its own: counted apart by phase
        decode_forward = _phase_sum(a, "forward_seconds_sum", "decode") - _phase_sum(
            b, "forward_seconds_sum", "decode"
        )
        decode_calls = _phase_sum(a, "forward_seconds_count", "decode") - _phase_sum(
            b, "forward_seconds_count", "decode"
        )
        prefill_forward = sum(
            _phase_sum(a, "forward_seconds_sum", p) - _phase_sum(b, "forward_seconds_sum", p)
            for p in ("prefill", "mixed")
        )
        busy = a.get("pipeshard_stage_busy_seconds_total", 0.0) - b.get(
            "pipeshard_stage_busy_seconds_total", 0.0
        )
        # busy counts the prefill call too: take its forward time out, at the decode share
        # of busy over forward
        decode_busy = busy * decode_forward / max(decode_forward + prefill_forward, 1e-12)
        stages.append(
            {
                "decode_calls": decode_calls,
                "forward_ms": decode_forward / max(decode_calls, 1) * 1000,
                "busy_ms": decode_busy / max(decode_calls, 1) * 1000,
            }
        )
    step_ms = statistics.mean(walls) * 1000
    inside = sum(s["busy_ms"] for s in stages)
    return {
        "backend": backend,
        "tokens": tokens,
        "step_ms": step_ms,
        "step_ms_median": statistics.median(walls) * 1000,
        "stages": stages,
        "outside_ms": step_ms - inside,
    }


# -- the report -----------------------------------------------------------------------------
def _cell(ms: float, total: float) -> str:
    return f"{ms:.2f} ({100 * ms / total:.1f}%)" if total > 0 else f"{ms:.2f}"


def stage_table(columns: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """One stage's categories, a column per (label, mean call)."""
    lines = [
        "| category | " + " | ".join(f"{label}: ms (%)" for label, _ in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for category in CATEGORIES:
        if all(call["categories"][category] == 0 for _, call in columns):
            continue
        cells = [_cell(call["categories"][category], call["counters_ms"]) for _, call in columns]
        lines.append(f"| {category} | " + " | ".join(cells) + " |")
    lines.append(
        "| **inference (counters' total)** | "
        + " | ".join(f"**{call['counters_ms']:.2f}**" for _, call in columns)
        + " |"
    )
    lines.append(
        "| infer() wall (OpenVINO around the ops) | "
        + " | ".join(
            f"{call['infer_ms']:.2f} ({call['infer_ms'] - call['counters_ms']:+.2f})"
            for _, call in columns
        )
        + " |"
    )
    lines.append(
        "| runner forward() wall (Python around infer) | "
        + " | ".join(
            f"{call['forward_ms']:.2f} ({call['forward_ms'] - call['infer_ms']:+.2f})"
            for _, call in columns
        )
        + " |"
    )
    return lines


def top_ops(call: dict[str, Any], top: int) -> list[str]:
    total = call["counters_ms"]
    lines = ["| op | type | kernel | category | ms | % |", "|---|---|---|---|---:|---:|"]
    for op in call["ops"][:top]:
        share = 100 * op["ms"] / total if total > 0 else 0.0
        lines.append(
            f"| {op['name'][:60]} | {op['type']} | {op['kernel']} | {op['category']} | "
            f"{op['ms']:.2f} | {share:.1f} |"
        )
    return lines


def report(
    manifest: Any, export: Path, stages: list[dict[str, Any]], ring: list[dict[str, Any]],
    opts: argparse.Namespace, info: dict[str, Any],
) -> str:  # fmt: skip
    lines = [
        f"# Where a token's time goes: {manifest.model.model_id}, export {export.name}",
        "",
        f"Host: {describe(info)}.",
        "",
        f"Each stage in this process pinned to CPU(s) {opts.cores}, {opts.threads} inference "
        f"thread(s), f32 compute, f16 KV cache, OpenVINO's per-op counters on "
        f"({manifest.weights.format} weights). Prefill: one call of {opts.chunk} tokens from "
        f"empty, after a first one left out (the CPU plugin repacks weights on a first call). "
        f"Decode: one token after it, the mean of {opts.steps - 1} calls (a first one "
        "left out). Paged decode, 1 row: the call a stage that pads runs for a lone user (the "
        "batch-invariance pad row: two rows computed); `solo`: the same call unpadded. Shares "
        "are steadier than milliseconds on a shared machine.",
    ]
    for stage in stages:
        lines += ["", f"## Stage {stage['stage']}: layers {stage['layers']}", ""]
        runs = stage["backends"]
        decode: list[tuple[str, dict[str, Any]]] = []
        if "paged" in runs:
            decode += [
                ("paged, 1 row + pad row", runs["paged"]["decode"]),
                ("paged, 1 row solo", runs["paged"]["decode_solo"]),
            ]
        if "stateful" in runs:
            decode.append(("stateful, 1 row", runs["stateful"]["decode"]))
        lines += ["Decode step:", "", *stage_table(decode)]
        if "paged" in runs:
            padded, solo = runs["paged"]["decode"], runs["paged"]["decode_solo"]
            extra = padded["counters_ms"] - solo["counters_ms"]
            lines += [
                "",
                f"The pad row costs {extra:.2f} ms of inference a step "
                f"({100 * extra / solo['counters_ms']:.1f}% over the solo call; by category: "
                + ", ".join(
                    f"{c} {padded['categories'][c] - solo['categories'][c]:+.2f}"
                    for c in CATEGORIES
                    if abs(padded["categories"][c] - solo["categories"][c]) >= 0.005
                )
                + "). A paged stage pads one-row calls where its load-time probe finds a "
                "lone row computed differently (`pipeshard bench batch-cost` says which); "
                "here it is forced on to time it.",
            ]
        prefill = [(f"{b}, {opts.chunk} tokens", runs[b]["prefill"]) for b in runs]
        lines += ["", "Prefill chunk:", "", *stage_table(prefill)]
        for backend, run in runs.items():
            lines += [
                "",
                f"Top {opts.top} ops, {backend} decode step (1 row"
                + (" + pad row" if backend == "paged" else "")
                + "):",
                "",
                *top_ops(run["decode"], opts.top),
            ]
    failed = [r for r in ring if "error" in r]
    ring = [r for r in ring if "error" not in r]
    for r in failed:
        lines += ["", f"The served ring on {r['backend']} stages failed: {r['error'][:300]}"]
    if ring:
        lines += [
            "",
            "## A served step: time outside inference",
            "",
            f"{opts.ring_tokens} greedy decode steps over `pipeshard stage` processes (stage k "
            f"pinned to core k, {opts.threads} thread(s)), driven by the gateway's "
            "PipelineClient; mean ms a step. forward: the stage's runner call (inference and "
            "its Python); busy: the whole compute call (with the last stage's sampling); "
            "outside: the client's step less every stage's busy time (gRPC, protobuf, queues, "
            "the client).",
            "",
            "| backend | step at the client | "
            + " | ".join(f"stage {k} forward / busy" for k in range(len(ring[0]["stages"])))
            + " | outside inference |",
            "|---|---:|" + "---:|" * len(ring[0]["stages"]) + "---:|",
        ]
        for r in ring:
            cells = " | ".join(f"{s['forward_ms']:.2f} / {s['busy_ms']:.2f}" for s in r["stages"])
            lines.append(
                f"| {r['backend']} | {r['step_ms']:.2f} | {cells} | "
                f"{r['outside_ms']:.2f} ({100 * r['outside_ms'] / r['step_ms']:.1f}%) |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pipeshard bench profile",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--export", type=Path, default=Path("exports/qwen15-int4-s2d"))
    p.add_argument("--backends", default="paged,stateful", help="paged, stateful or both")
    p.add_argument("--chunk", type=int, default=128, help="prefill tokens in the one call")
    p.add_argument("--steps", type=int, default=9, help="decode calls (the first left out)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cores", default="0", help="CPUs this process runs on, e.g. 0 or 0-1")
    p.add_argument("--top", type=int, default=8, help="ops listed per stage and backend")
    p.add_argument("--ring", action="store_true", help="also time served steps over gRPC")
    p.add_argument("--ring-tokens", type=int, default=32)
    p.add_argument("--name", default="op_profile")
    add_results_option(p)
    opts = p.parse_args(argv)
    backends = [b for b in opts.backends.split(",") if b]
    if not backends or any(b not in ("paged", "stateful") for b in backends):
        p.error("--backends takes paged, stateful or both, comma-separated")
    if opts.steps < 2 or opts.chunk < 1 or opts.threads < 1 or opts.ring_tokens < 1:
        p.error("--steps must be at least 2; --chunk, --threads, --ring-tokens at least 1")
    first, _, last = opts.cores.partition("-")
    os.sched_setaffinity(0, set(range(int(first), int(last or first) + 1)))

    from protos.manifest import load_manifest
    from shard_runtime.runner import RunnerOptions

    manifest = load_manifest(opts.export)
    if opts.chunk + opts.steps * 2 > manifest.model.max_context:
        p.error(f"--chunk and --steps exceed the model's context ({manifest.model.max_context})")
    info = machine()
    options = RunnerOptions(threads=opts.threads, properties={"PERF_COUNT": True})
    stages: list[dict[str, Any]] = []
    for index in range(manifest.num_stages):
        stage: dict[str, Any] = {
            "stage": index,
            "layers": layers_of(manifest, index),
            "backends": {},
        }
        for backend in backends:
            started = time.perf_counter()
            how = profile_paged if backend == "paged" else profile_stateful
            runner, result = how(opts.export, index, options, opts.chunk, opts.steps)
            del runner  # one stage's weights in memory at a time
            gc.collect()
            stage["backends"][backend] = result
            print(f"stage {index} {backend}: {time.perf_counter() - started:.1f} s, load "
                  f"{os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
        stages.append(stage)
    ring: list[dict[str, Any]] = []
    if opts.ring:
        for backend in backends:
            try:
                ring.append(
                    ring_overhead(opts.export, backend, opts.threads, opts.ring_tokens, opts.chunk)
                )
            except Exception as exc:  # keep the profile: say what stopped the ring
                ring.append({"backend": backend, "error": f"{type(exc).__name__}: {exc}"[:2000]})
    text = report(manifest, opts.export, stages, ring, opts, info)
    text += f"\nLoad average at the end: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}.\n"
    data = {"export": str(opts.export), "stages": stages, "ring": ring}
    save(opts.results, opts.name, text, data, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
