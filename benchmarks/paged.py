"""Paged KV vs stateful KV on the stages: 1 to 16 concurrent users, with genai baselines.

Setup (stated in the report):
  - for each stage KV backend (``--backends``, `pipeshard stage --kv-backend`): 2 `pipeshard
    stage` processes on loopback, stage k pinned to core k (taskset) with 1 inference thread,
    the runtime's defaults otherwise (f32 compute, f16 KV cache, fp16 hidden states; a paged
    stage's KV budget is ``--kv-cache-size`` GiB, the stage's default when not given);
  - the gateway (`pipeshard serve`, its own process, ``--max-concurrent`` at least 16) and the
    streaming HTTP clients (threads in this process) are not pinned: they share both cores
    with the stages;
  - every user streams a chat completion of ``--tokens`` tokens (end-of-sequence suppressed
    with logit_bias so all lengths are equal), each with its own prompt (benchmarks.microbatch's
    TOPICS, taken in turn beyond 8 users), greedy; the fleets of all backends are up at once
    (the idle one costs nothing) and measured side by side: each user count on every backend in
    turn, round after round;
  - baseline 1 (monolithic): openvino-genai LLMPipeline on the optimum-cli int4 export of the
    same model (``--baseline``), one user, pinned to core 0 with 1 thread, the stages' precisions
    (benchmarks.workers.PIPESHARD_CPU); measured before and after the fleets, median;
  - baseline 2 (continuous batching): openvino-genai ContinuousBatchingPipeline on the same
    export, core 0, 1 thread, the same precisions, a 1 GB KV cache (``--cb-cache-size``), prefix
    caching off; at each user count U, U requests (the same chat-templated prompts) added at
    once and stepped to the end, ``--tokens`` each with EOS ignored.

Per system and user count: aggregate decode tok/s (tokens that arrived while every user was
decoding, over that window), end-to-end tok/s (U * tokens over first request to last token),
time to first token p50/p95, inter-token latency p50/p95 (gaps between arrivals) and their
ratio, and the ratio to the monolithic single-user decode tok/s. Figures are medians over
``--rounds`` rounds (TTFT percentiles over all users of all rounds).

A system ``paged:gN`` (or ``stateful:gN``) is that backend with the gateway's
``--micro-batch-groups N`` instead of its default.

Targets (issue): 8 users >= 4x the monolithic single user; paged single user within 5% of
stateful; inter-token p95 at 8 users within 2x of p50.

Usage:
  python benchmarks/paged.py --export exports/qwen15-int4-s2d \\
      --baseline benchmarks/out/shard_parity/optimum [--users 1,2,4,8,16] [--tokens 32] \\
      [--rounds 1] [--backends stateful,paged] [--kv-cache-size GIB]
Writes benchmarks/results/paged-<date>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.microbatch import busy_seconds, median_row, run_users, summarize  # noqa: E402
from benchmarks.microbatch import plot as plot_users  # noqa: E402
from benchmarks.processes import PIPESHARD, Proc, start_gateway, start_pinned_stages  # noqa: E402
from benchmarks.report import describe, machine, reachable_eos, save  # noqa: E402
from benchmarks.workers import PIPESHARD_CPU, measure  # noqa: E402

BACKENDS = ("stateful", "paged")
CB = "genai CB"
MONO = "genai mono"


def split_system(name: str) -> tuple[str, str]:
    """``paged:g2`` -> (``paged``, ``2``): the stage KV backend and the gateway's
    ``--micro-batch-groups`` ("" for its default)."""
    kind, _, groups = name.partition(":g")
    return kind, groups


def stage_has_kv_backend() -> bool:
    """Whether this `pipeshard stage` knows ``--kv-backend`` (older ones only run stateful)."""
    out = subprocess.run([PIPESHARD, "stage", "--help"], capture_output=True, text=True)
    return "--kv-backend" in out.stdout


def stage_infos(addresses: list[str]) -> list[dict[str, Any]]:
    """What each stage says it runs (its Info RPC): KV backend and blocks where reported."""
    import grpc

    from protos import pipeshard_v1_pb2 as pb
    from protos import pipeshard_v1_pb2_grpc as pb_grpc

    infos = []
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            info = pb_grpc.StageStub(channel).Info(pb.InfoRequest(), timeout=10)
        infos.append(
            {
                "stage": info.stage_index,
                "layers": [info.layer_start, info.layer_end],
                "kv_backend": getattr(info, "kv_backend", ""),
                "kv_block_size": getattr(info, "kv_block_size", 0),
                "kv_blocks": getattr(info, "kv_blocks", 0),
            }
        )
    return infos


def run_cb(
    baseline: Path, users: list[int], tokens: int, rounds: int, cache_gb: int
) -> tuple[dict[int, list[dict[str, Any]]], list[int]]:
    """Baseline 2 in its own pinned process; its rounds per user count and prompt lengths."""
    raw = measure(
        "genai-cb",
        baseline,
        cores="0",
        threads=1,
        tokens=tokens,
        props=PIPESHARD_CPU,
        users=users,
        rounds=rounds,
        cache_size=cache_gb,
    )
    out: dict[int, list[dict[str, Any]]] = {u: [] for u in users}
    for run in raw["runs"]:
        arrivals = [[(float(t), int(n)) for t, n in a] for a in run["arrivals"]]
        result = summarize([0.0] * run["users"], arrivals, tokens)
        result["wall_tok_s"] = run["users"] * tokens / run["wall_s"]
        out[run["users"]].append(result)
    return out, list(raw["prompt_tokens"])


@dataclass
class Fleet:
    """One fleet (2 pinned stages + gateway) on one stage KV backend."""

    backend: str
    procs: list[Proc] = field(default_factory=list)
    gateway: Proc | None = None
    url: str = ""
    model: str = ""
    ports: list[int] = field(default_factory=list)
    infos: list[dict[str, Any]] = field(default_factory=list)

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        for proc in self.procs:
            proc.stop()


def start_fleet(
    backend: str, opts: argparse.Namespace, users: list[int], logs: Path, eos: list[int], flag: bool
) -> Fleet:
    """Start and warm up a fleet on ``backend``. Fleets of all backends stay up together (on
    the same cores, idle while another is measured) so their rounds interleave."""
    kind, groups = split_system(backend)
    extra: list[str] = ["--kv-backend", kind] if flag else []
    gateway_extra = ["--micro-batch-groups", groups] if groups else []
    if kind == "paged" and opts.kv_cache_size is not None:
        extra += ["--kv-cache-size", str(opts.kv_cache_size)]
    fleet = Fleet(backend)
    (logs / backend).mkdir(parents=True, exist_ok=True)
    try:
        fleet.procs, addresses, fleet.ports = start_pinned_stages(
            opts.export, logs / backend, metrics=True, threads=1, extra=extra
        )
        fleet.infos = stage_infos(addresses)
        reported = {i["kv_backend"] for i in fleet.infos} - {""}
        if reported and reported != {kind}:
            raise RuntimeError(f"asked for --kv-backend {backend}, stages report {reported}")
        running = str(max(16, *users))
        fleet.gateway, fleet.url = start_gateway(
            addresses,
            logs / f"gateway-{backend}.log",
            ["--max-concurrent", running, *gateway_extra],
        )
        fleet.model = httpx.get(f"{fleet.url}/v1/models").json()["data"][0]["id"]
        run_users(fleet.url, fleet.model, 1, 8, eos)  # warm-up
        run_users(fleet.url, fleet.model, min(2, max(users)), 4, eos)
    except Exception:
        fleet.stop()
        raise
    return fleet


def measure_round(fleet: Fleet, count: int, tokens: int, eos: list[int]) -> dict[str, Any]:
    busy = [busy_seconds(port) for port in fleet.ports]
    began = time.perf_counter()
    result = run_users(fleet.url, fleet.model, count, tokens, eos)
    wall = time.perf_counter() - began
    result["stage_busy"] = [
        (busy_seconds(port) - b) / wall for port, b in zip(fleet.ports, busy, strict=True)
    ]
    print(
        f"{fleet.backend}, users {count}: {result['decode_tok_s']:.2f} tok/s decode, "
        f"ITL p50 {result['itl_p50_ms']:.1f} / p95 {result['itl_p95_ms']:.1f} ms",
        flush=True,
    )
    return result


def targets(rows: list[dict[str, Any]], base: float) -> list[str]:
    """The issue's three targets, each PASS / FAIL with its numbers."""

    def find(system: str, users: int) -> dict[str, Any] | None:
        return next((r for r in rows if r["system"] == system and r["users"] == users), None)

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    lines = []
    for backend in BACKENDS:
        r8 = find(backend, 8)
        if r8 is not None:
            lines.append(
                f"- {backend}, 8 users >= 4x monolithic single user: {r8['decode_tok_s']:.2f} "
                f"tok/s = {r8['vs_monolithic']:.2f}x ({4 * base:.2f} needed): "
                f"{verdict(r8['vs_monolithic'] >= 4)}"
            )
            lines.append(
                f"- {backend}, inter-token p95 at 8 users within 2x of p50: "
                f"{r8['itl_p95_ms']:.1f} / {r8['itl_p50_ms']:.1f} ms = {r8['itl_ratio']:.2f}: "
                f"{verdict(r8['itl_ratio'] <= 2)}"
            )
    paged, stateful = find("paged", 1), find("stateful", 1)
    if paged is not None and stateful is not None:
        ratio = paged["decode_tok_s"] / stateful["decode_tok_s"]
        lines.append(
            f"- paged single user within 5% of stateful: {paged['decode_tok_s']:.2f} vs "
            f"{stateful['decode_tok_s']:.2f} tok/s = {ratio:.3f}: {verdict(ratio >= 0.95)}"
        )
    return lines


def plot(rows: list[dict[str, Any]], base: float, path: Path) -> bool:
    labels = {
        "stateful": "2 stages, stateful KV",
        "paged": "2 stages, paged KV",
        CB: "genai continuous batching, 1 core",
    }
    return plot_users([r for r in rows if r["system"] != MONO], base, path, labels, target=4)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--export", type=Path, default=ROOT / "exports" / "qwen15-int4-s2d")
    p.add_argument(
        "--baseline",
        type=Path,
        default=ROOT / "benchmarks" / "out" / "shard_parity" / "optimum",
        help="optimum-cli export of the same model, for the openvino-genai baselines",
    )
    p.add_argument("--users", default="1,2,4,8,16")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--backends", default=",".join(BACKENDS), help="stage KV backends to run")
    p.add_argument(
        "--kv-cache-size", type=float, help="paged stages' KV budget in GiB (stage default)"
    )
    p.add_argument("--cb-cache-size", type=int, default=1, help="genai CB KV cache (GB)")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--no-baseline", action="store_true", help="skip genai (e.g. tiny models)")
    opts = p.parse_args()
    users = [int(u) for u in opts.users.split(",")]
    backends = [b for b in opts.backends.split(",") if b]
    unknown = {split_system(b)[0] for b in backends} - set(BACKENDS)
    if unknown:
        p.error(f"unknown backends {sorted(unknown)}; choose from {', '.join(BACKENDS)}")
    at_start = machine()
    flag = stage_has_kv_backend()
    if not flag and backends != ["stateful"]:
        p.error("this `pipeshard stage` has no --kv-backend: only --backends stateful can run")

    from protos.manifest import load_manifest

    manifest = load_manifest(opts.export)
    eos = reachable_eos(manifest)
    logs = Path(tempfile.mkdtemp(prefix="paged-"))
    print(f"logs: {logs}", flush=True)

    bases: list[float] = []
    mono: list[dict[str, Any]] = []
    cb_rounds: dict[int, list[dict[str, Any]]] = {}
    cb_prompts: list[int] = []
    if not opts.no_baseline:
        mono.append(measure("genai-decode", opts.baseline, cores="0", tokens=opts.tokens))
        print(f"genai mono, 1 user: {mono[-1]['decode_tok_s']:.2f} tok/s", flush=True)
        cb_rounds, cb_prompts = run_cb(
            opts.baseline, users, opts.tokens, opts.rounds, opts.cb_cache_size
        )
        for count, rs in cb_rounds.items():
            print(f"genai CB, users {count}: {rs[0]['decode_tok_s']:.2f} tok/s decode", flush=True)

    fleets: dict[str, dict[int, list[dict[str, Any]]]] = {
        b: {u: [] for u in users} for b in backends
    }
    infos: dict[str, list[dict[str, Any]]] = {}
    errors: dict[str, str] = {}
    running: list[Fleet] = []
    try:
        for backend in backends:
            try:
                running.append(start_fleet(backend, opts, users, logs, eos, flag))
                infos[backend] = running[-1].infos
            except Exception as exc:  # keep the other backends' results; reported below
                traceback.print_exc()
                errors[backend] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
        # side by side: each user count on every backend in turn, round after round
        for _ in range(opts.rounds):
            for count in users:
                for fleet in running:
                    try:
                        fleets[fleet.backend][count].append(
                            measure_round(fleet, count, opts.tokens, eos)
                        )
                    except Exception as exc:
                        traceback.print_exc()
                        errors[fleet.backend] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
    finally:
        for fleet in running:
            fleet.stop()

    if not opts.no_baseline:
        mono.append(measure("genai-decode", opts.baseline, cores="0", tokens=opts.tokens))
        print(f"genai mono, 1 user (after): {mono[-1]['decode_tok_s']:.2f} tok/s", flush=True)
    bases = [m["decode_tok_s"] for m in mono]
    base = statistics.median(bases) if bases else float("nan")

    rows: list[dict[str, Any]] = []
    if mono:
        rows.append(
            {
                "system": MONO,
                "users": 1,
                "decode_tok_s": base,
                "decode_tok_s_range": [min(bases), max(bases)],
                "ttft_p50_ms": statistics.median(m["ttft_ms"] for m in mono),
                "vs_monolithic": 1.0,
            }
        )
    for backend in backends:
        for count in users:
            if fleets.get(backend, {}).get(count):
                rows.append(median_row(backend, count, fleets[backend][count], base))
    for count in users:
        if cb_rounds.get(count):
            rows.append(median_row(CB, count, cb_rounds[count], base))

    ncpu = os.cpu_count()
    flag_note = "" if flag else " (this pipeshard has no --kv-backend: stateful, its only one)"
    kv_size = (
        f"{opts.kv_cache_size} GiB" if opts.kv_cache_size is not None else "the stage's default"
    )
    lines = [
        f"# Paged vs stateful stage KV: {manifest.model.model_id} int4, 1 to {max(users)} users",
        "",
        "Processes, cores and threads:",
        "",
    ]
    for s in manifest.stages:
        lines.append(
            f"- stage {s.index} (layers {s.span(manifest.model.intermediate_size)}): pinned to "
            f"core {s.index % (ncpu or 1)} (taskset), 1 inference thread, f32 compute, f16 KV, "
            "fp16 hidden states"
        )
    lines.append(
        f"- stage KV backend: `--kv-backend` as in each row's system{flag_note}; paged stages' "
        f"KV budget: {kv_size}"
    )
    lines += [
        f"- gateway (`pipeshard serve --max-concurrent {max(16, *users)}`) and the streaming "
        f"HTTP clients (threads of the benchmark process): not pinned, sharing the {ncpu} cores "
        "with the stages",
        "- genai mono: openvino-genai LLMPipeline (optimum-cli int4 export), 1 user, pinned to "
        "core 0, INFERENCE_NUM_THREADS=1, f32 compute, f16 KV; before and after the fleets",
        "- genai CB: openvino-genai ContinuousBatchingPipeline (same export), pinned to core 0, "
        f"INFERENCE_NUM_THREADS=1, f32 compute, f16 KV, {opts.cb_cache_size} GB KV cache, "
        "prefix caching off; U requests added at once, add_request/step loop in the worker "
        "process (its end-to-end column: U x tokens / wall time of the batch)",
        "",
        f"{opts.tokens} greedy tokens per user, end-of-sequence suppressed; each user its own "
        f"prompt (8 chat prompts in turn; genai CB: the same, {cb_prompts or '?'} tokens after "
        f"the chat template); medians over {opts.rounds} round(s). Monolithic single user: "
        f"{base:.2f} tok/s decode (runs: {', '.join(f'{b:.2f}' for b in bases) or 'none'}).",
        "",
        f"Machine: {describe(at_start)}.",
        "",
    ]
    for backend, stage_list in infos.items():
        desc = "; ".join(
            f"stage {i['stage']}: {i['kv_backend'] or 'not reported'}"
            + (f", {i['kv_blocks']} blocks of {i['kv_block_size']}" if i["kv_blocks"] else "")
            for i in stage_list
        )
        lines.append(f"Stages asked for `{backend}` report: {desc}.")
    for backend, error in errors.items():
        lines.append(f"**{backend} failed**: `{error.splitlines()[0] if error else ''}`")
    lines += [
        "",
        "| system | users | aggregate decode tok/s [min, max] | vs monolithic 1 user | "
        "end-to-end tok/s | TTFT p50 / p95 (ms) | inter-token p50 / p95 (ms) | p95 / p50 | "
        "stage busy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(r: dict[str, Any], key: str, fmt: str) -> str:
        return format(r[key], fmt) if key in r else "-"

    for r in rows:
        lo, hi = r["decode_tok_s_range"]
        e2e = cell(r, "e2e_tok_s", ".2f")
        if "wall_tok_s" in r:
            e2e = f"{r['wall_tok_s']:.2f}"
        lines.append(
            f"| {r['system']} | {r['users']} | {r['decode_tok_s']:.2f} [{lo:.2f}, {hi:.2f}] | "
            f"{r['vs_monolithic']:.2f}x | {e2e} | "
            f"{cell(r, 'ttft_p50_ms', '.0f')} / {cell(r, 'ttft_p95_ms', '.0f')} | "
            f"{cell(r, 'itl_p50_ms', '.1f')} / {cell(r, 'itl_p95_ms', '.1f')} | "
            f"{cell(r, 'itl_ratio', '.2f')} | "
            f"{' / '.join(f'{b:.2f}' for b in r.get('stage_busy', [])) or '-'} |"
        )
    goals = targets(rows, base) if bases else []
    if goals:
        lines += ["", "Targets:", "", *goals]
    data: dict[str, Any] = {
        "baseline_runs": mono,
        "rows": rows,
        "stage_infos": infos,
        "errors": errors,
        "kv_backend_flag": flag,
        "cb_prompt_tokens": cb_prompts,
        "rounds": {
            system: {str(u): rs for u, rs in by_users.items()}
            for system, by_users in [*fleets.items(), (CB, cb_rounds)]
        },
        "logs": str(logs),
    }
    stem = save(opts.results, "paged", "\n".join(lines), data, opts)
    if rows and plot(rows, base, Path(f"{stem}.png")):
        print(f"plot: {stem}.png")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
