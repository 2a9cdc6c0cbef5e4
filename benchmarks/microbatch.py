"""Micro-batching: 1, 2, 4 and 8 concurrent users on 2 stages vs monolithic openvino-genai.

Setup (stated in the report):
  - 2 `pipeshard stage` processes on loopback, stage k pinned to the k-th of ``--stage-cores``
    (taskset; default 0,1) with 1 inference thread each, hidden states in fp16 (the default);
  - the gateway (`pipeshard serve`, its own process) and the streaming HTTP clients (threads
    in this process) are not pinned: they share both cores with the stages (``--gateway-cores``
    pins them, e.g. to the lighter last stage's core);
  - every user streams a chat completion of ``--tokens`` tokens (end-of-sequence suppressed
    with logit_bias so all lengths are equal), each with its own prompt, greedy;
  - baseline: openvino-genai LLMPipeline on the optimum-cli int4 export of the same model,
    one user, pinned to stage 0's core with 1 thread, loaded once in a process of its own
    (benchmarks/workers.py's genai-repeat), measured before each user count of every round and
    after the last; each time followed by two such copies decoding at once, one on each stage's
    core (what the two cores give together, see :class:`Baselines`). A stand-in export and
    baseline (benchmarks/stand_in.py: the real graphs, random weights) are timed alike and
    named so in the report.

Per user count: aggregate decode tok/s (tokens that arrived while every user was decoding,
over that window), end-to-end tok/s (all tokens over first request to last token), time to
first token p50/p95 and inter-token latency p50/p95 (gaps between streamed chunks). Every
figure is the median over ``--rounds`` rounds. This machine's speed drifts by 10-15% over tens of
minutes, so each result is divided by the baseline measured next to it (the mean of the one
right before its user count's turn and the one right after); the ratio reported is the median
of those ratios over the rounds, with their range.

Systems (``--systems``), one gateway each over the same stage processes, measured side by
side: ``batched`` (the gateway's defaults), ``unbatched`` (``--no-batching``: every request
computed alone, pipelined across the stages, the ring decoding on its own; see the README's
"No batching") and ``stepped`` (``--no-batching --ring-decode 0``: every step through the
gateway, as before the ring decoded on its own); ``batched-stepped`` (``--ring-decode-batched
0``: batching with every step through the gateway) on request.

Usage: pipeshard bench users [--export DIR] [--users 1,2,4,8] [--tokens 64]
       [--rounds 2] [--systems batched,unbatched,stepped] [--no-baseline] [--delay-ms D]
       [--gateway-cores CPUS] [--stage-cores 0,1] [--stage-flags='--kv-backend stateful']
Writes microbatch-<date>.{json,md,png} in --results DIR (default: the current directory).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shlex
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks.latency_proxy import delay_stages
from benchmarks.processes import Proc, start_gateway, start_pinned_stages
from benchmarks.report import add_results_option, reachable_eos, save
from benchmarks.stand_in import is_stand_in, stand_in_label
from benchmarks.suite.stats import fmt, ratios

TOPICS = [
    "Write a Python function that merges two sorted lists and explain it.",
    "Explain how a hash map handles collisions, with an example in Java.",
    "Translate 'the weather is nice today' into French, German and Spanish.",
    "List ten uses of the Linux find command with a one-line example each.",
    "Write a SQL query for the top five customers by total order value.",
    "Describe the difference between TCP and UDP for a beginner.",
    "Write a bash script that backs up a folder into a dated tar.gz file.",
    "Explain recursion with a factorial example in JavaScript.",
]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    low, high = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def one_user(
    url: str,
    model: str,
    prompt: str | list[dict[str, str]],
    tokens: int,
    eos: list[int],
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Stream one chat completion of ``prompt`` (a user message, or the whole list of
    messages): its start, (time, tokens) arrivals, text and usage."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logit_bias": {str(e): -100 for e in eos},
    }
    start = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=600
    ) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode()}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    arrivals.append((time.perf_counter(), 1))
                    pieces.append(choice["delta"]["content"])
    # A chunk holds one token, except where the detokenizer held a partial character or a
    # possible stop string back; the last chunk then carries the rest.
    completion = usage.get("completion_tokens", 0)
    if arrivals and completion > len(arrivals):
        arrivals[-1] = (arrivals[-1][0], 1 + completion - len(arrivals))
    return {"start": start, "arrivals": arrivals, "text": "".join(pieces), "usage": usage}


def run_users(url: str, model: str, users: int, tokens: int, eos: list[int]) -> dict[str, Any]:
    results: list[dict[str, Any]] = [{} for _ in range(users)]
    errors: list[Exception] = []

    def work(i: int) -> None:
        try:
            results[i] = one_user(url, model, TOPICS[i % len(TOPICS)], tokens, eos)
        except Exception as exc:  # raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {users} users failed: {errors[0]!r}") from errors[0]
    return summarize([r["start"] for r in results], [r["arrivals"] for r in results], tokens)


def summarize(
    starts: list[float], arrivals: list[list[tuple[float, int]]], tokens: int
) -> dict[str, Any]:
    """The figures of one round from each user's start and (time, tokens) arrivals: decode
    tok/s while every user decodes, end-to-end tok/s, TTFT, inter-token p50/p95."""
    users = len(arrivals)
    counts = [sum(n for _, n in a) for a in arrivals]
    if any(c != tokens for c in counts):
        raise RuntimeError(f"expected {tokens} tokens per user, got {counts}")
    first = [a[0][0] for a in arrivals]
    last = [a[-1][0] for a in arrivals]
    window = (max(first), min(last))
    in_window = sum(n for a in arrivals for t, n in a[1:] if window[0] < t <= window[1])
    gaps = [b[0] - a[0] for arr in arrivals for a, b in itertools.pairwise(arr)]
    return {
        "decode_tok_s": in_window / (window[1] - window[0]) if window[1] > window[0] else 0.0,
        "e2e_tok_s": users * tokens / (max(last) - min(starts)),
        "ttft_ms": [(f - s) * 1000 for f, s in zip(first, starts, strict=True)],
        "itl_p50_ms": percentile(gaps, 0.5) * 1000,
        "itl_p95_ms": percentile(gaps, 0.95) * 1000,
    }


def cpu_seconds(pid: int) -> float:
    """CPU time of a process's threads (Linux /proc): in nanoseconds, summed over its live
    threads' schedstat, where the kernel keeps it (a thread that ends takes its time along:
    the processes measured here keep theirs); else user + system time of /proc/PID/stat, in
    clock ticks (10 ms, too coarse for a few tokens of a tiny model)."""
    if not Path(f"/proc/{pid}/schedstat").is_file():
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # it just ended
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def stage_metrics(port: int, *names: str) -> list[float]:
    """The values of these samples (name with labels, as exposed) on a stage; 0 if absent."""
    values = dict.fromkeys(names, 0.0)
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in values:
            values[name] = float(value)
    return list(values.values())


BUSY = "pipeshard_stage_busy_seconds_total"
# a stage's busy seconds, and the summed seconds and count of its decode calls
STAGE_SAMPLES = (
    BUSY,
    'pipeshard_stage_forward_seconds_sum{phase="decode"}',
    'pipeshard_stage_forward_seconds_count{phase="decode"}',
)


def busy_seconds(port: int) -> float:
    return stage_metrics(port, BUSY)[0]


def stage_figures(before: list[float], after: list[float], wall: float) -> tuple[float, float]:
    """A stage's busy fraction and mean decode call (ms) between two readings of
    STAGE_SAMPLES ``wall`` seconds apart."""
    busy, seconds, calls = (a - b for a, b in zip(after, before, strict=True))
    return busy / wall, seconds * 1000 / calls if calls else float("nan")


class Baselines:
    """The monolithic baseline, measured next to the fleets' rounds: one openvino-genai copy on
    core 0 alone (1 user, 1 thread, f32), then two copies decoding at once, one on each core:
    what the two cores give together. Decoding on both cores at once, each may run slower than
    alone (they share the memory bus and the last-level cache), which caps any 2-core
    arrangement, pipelined stages included. Both copies load once (benchmarks/workers.py's
    genai-repeat)."""

    def __init__(self, model_dir: Path, tokens: int, cores: Sequence[str] = ("0", "1")) -> None:
        from benchmarks.workers import Repeater

        props = {"INFERENCE_PRECISION_HINT": "f32"}
        self.copies = [
            Repeater(model_dir, cores=core, tokens=tokens, props=props) for core in cores[:2]
        ]
        self.alone: list[float] = []
        self.together: list[float] = []

    def measure(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.alone.append(self.copies[0].measure())
        with ThreadPoolExecutor(len(self.copies)) as pool:
            self.together.append(sum(pool.map(lambda copy: copy.measure(), self.copies)))
        print(
            f"baseline: {self.alone[-1]:.2f} tok/s alone, {self.together[-1]:.2f} two at once",
            flush=True,
        )

    def close(self) -> None:
        for copy in self.copies:
            copy.close()


# Gateway flags of each system; all run over the same stage processes, side by side.
SYSTEMS = {
    "batched": [],
    "batched-stepped": ["--ring-decode-batched", "0"],
    "unbatched": ["--no-batching"],
    "stepped": ["--no-batching", "--ring-decode", "0"],
}
LABELS = {
    "batched": "2 stages, batched (default)",
    "batched-stepped": "2 stages, batched, --ring-decode-batched 0",
    "unbatched": "2 stages, --no-batching",
    "stepped": "2 stages, --no-batching --ring-decode 0",
}


def plot(
    rows: list[dict[str, Any]],
    base: float,
    path: Path,
    target: float = 1.9,
    two_copies: float = float("nan"),
) -> bool:
    """Aggregate decode tok/s and inter-token p50/p95 by user count, a line per system, with
    the monolithic baseline, ``target`` times it and (where measured) two monolithic copies
    decoding at once."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    users = sorted({r["users"] for r in rows})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for system, marker in zip(dict.fromkeys(r["system"] for r in rows), "osd^v", strict=False):
        mine = [r for r in rows if r["system"] == system]
        xs = [r["users"] for r in mine]
        label = LABELS.get(system, f"2 stages, {system}")
        left.plot(xs, [r["decode_tok_s"] for r in mine], marker + "-", label=label)
        line = right.plot(xs, [r["itl_p50_ms"] for r in mine], marker + "-", label=system + " p50")
        right.plot(
            xs,
            [r["itl_p95_ms"] for r in mine],
            marker + "--",
            color=line[0].get_color(),
            label=system + " p95",
        )
    if base == base:  # not NaN
        left.axhline(base, color="grey", linestyle="--", label="monolithic genai, 1 user, 1 core")
        left.axhline(target * base, color="grey", linestyle=":", label=f"{target:g}x target")
    if two_copies == two_copies:
        left.axhline(
            two_copies, color="black", linestyle="-.", label="two monolithic copies at once"
        )
    for ax, name in ((left, "aggregate decode tok/s"), (right, "inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(users, [str(u) for u in users])
        ax.set_xlabel("concurrent users")
        ax.set_ylabel(name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def median_row(system: str, users: int, rs: list[dict[str, Any]], base: float) -> dict[str, Any]:
    """One system at one user count: medians over its rounds (TTFT percentiles over all
    users of all rounds), and of the stage busy fractions, CPU time per token and wall tok/s
    where the rounds have them."""
    ttft = [t for r in rs for t in r["ttft_ms"]]
    decode = [r["decode_tok_s"] for r in rs]
    row: dict[str, Any] = {
        "system": system,
        "users": users,
        "decode_tok_s": statistics.median(decode),
        "decode_tok_s_range": [min(decode), max(decode)],
        "e2e_tok_s": statistics.median(r["e2e_tok_s"] for r in rs),
        "ttft_p50_ms": percentile(ttft, 0.5),
        "ttft_p95_ms": percentile(ttft, 0.95),
        "itl_p50_ms": statistics.median(r["itl_p50_ms"] for r in rs),
        "itl_p95_ms": statistics.median(r["itl_p95_ms"] for r in rs),
    }
    row["itl_ratio"] = row["itl_p95_ms"] / row["itl_p50_ms"]
    # each round against the baseline measured next to it where there is one (microbatch's
    # rounds), else against the run's baseline; and against two monolithic copies at once
    row["vs_monolithic_rounds"] = ratios(decode, [r.get("baseline", base) for r in rs])
    row["vs_two_copies_rounds"] = ratios(decode, [r.get("two_copies") for r in rs])
    mono = row["vs_monolithic_rounds"]
    row["vs_monolithic"] = mono["median"] if mono else float("nan")
    for key in ("stage_busy", "decode_call_ms"):  # per stage
        if key in rs[0]:
            stages = zip(*(r[key] for r in rs), strict=True)
            row[key] = [statistics.median(stage) for stage in stages]
    if "decode_call_ms" in row and "--no-batching" in SYSTEMS.get(system, []):
        row["bound_tok_s"] = pipeline_bound(users, row["decode_call_ms"])
        row["vs_monolithic_bound"] = row["bound_tok_s"] / base
    if "cpu_ms_per_token" in rs[0]:
        row["cpu_ms_per_token"] = {
            name: statistics.median(r["cpu_ms_per_token"][name] for r in rs)
            for name in rs[0]["cpu_ms_per_token"]
        }
    if "wall_tok_s" in rs[0]:
        row["wall_tok_s"] = statistics.median(r["wall_tok_s"] for r in rs)
    return row


def pipeline_bound(users: int, call_ms: list[float]) -> float:
    """The most tok/s that stages computing each user's token in a call of its own can give
    ``users`` users: each user waits for every stage in turn (users / sum of the calls), and
    the slowest stage computes every user's token (1 / its call)."""
    return min(users / sum(call_ms), 1 / max(call_ms)) * 1000


def targets(rows: list[dict[str, Any]], base: float) -> list[str]:
    """The issue's targets per system, PASS / FAIL with their numbers."""
    lines = []
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = {r["users"]: r for r in rows if r["system"] == system}
        if 2 in mine and base == base:
            r = mine[2]
            verdict = "PASS" if r["vs_monolithic"] >= 1.9 else "FAIL"
            lines.append(
                f"- {system}, 2 users >= 1.9x monolithic single user: "
                f"{fmt(r['vs_monolithic_rounds'], 2, 'x')} "
                f"({r['decode_tok_s']:.2f} tok/s; 1.9x the run's median "
                f"baseline is {1.9 * base:.2f}): {verdict}"
            )
        if 8 in mine:
            r = mine[8]
            verdict = "PASS" if r["itl_ratio"] <= 2 else "FAIL"
            lines.append(
                f"- {system}, inter-token p95 at 8 users within 2x of p50: {r['itl_p95_ms']:.1f} "
                f"/ {r['itl_p50_ms']:.1f} ms = {r['itl_ratio']:.2f}: {verdict}"
            )
    return lines


def stage_padding(logs: Path) -> list[str]:
    """What each stage's log says about padding one-row calls (batch invariance at load), or
    that it runs the stateful backend (no block pool, nothing padded)."""
    out = []
    for log in sorted(logs.glob("stage-*.log")):
        text = log.read_text(errors="replace")
        if "paged KV:" not in text:
            out.append("stateful KV")
        elif "padded to two" in text:
            out.append("pads one-row calls")
        else:
            out.append("does not pad")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pipeshard bench users",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--export", type=Path, default=Path("exports/qwen15-int4-s2b"))
    p.add_argument("--baseline-dir", type=Path, default=Path("benchmarks/out/shard_parity"))
    p.add_argument("--users", default="1,2,4,8")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--systems",
        default="batched,unbatched,stepped",
        help="gateways to compare over the same stages: " + ", ".join(SYSTEMS),
    )
    add_results_option(p)
    p.add_argument("--no-baseline", action="store_true", help="skip genai (e.g. tiny models)")
    p.add_argument(
        "--delay-ms",
        type=float,
        default=0.0,
        help="one-way latency added per hop (a proxy in front of every stage, as a network)",
    )
    p.add_argument(
        "--stage-cores",
        default="0,1",
        help="the cores of stage 0 and stage 1 (taskset), one each, e.g. 0,8 where cores 0 and "
        "1 are hyper-threads of one physical core; the baseline's copies run on the same cores",
    )
    p.add_argument(
        "--gateway-cores",
        help="pin the gateways (taskset) and the HTTP clients to these cores, e.g. 1 (the last "
        "stage's core, whose stage is the lighter one); default: unpinned",
    )
    p.add_argument(
        "--stage-flags",
        default="",
        help="more `pipeshard stage` flags for both stages (stated in the report), e.g. "
        "--stage-flags='--kv-backend stateful'; default: the stages' defaults",
    )
    opts = p.parse_args(argv)
    user_counts = [int(u) for u in opts.users.split(",")]
    systems = [s for s in opts.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown or not systems:
        p.error(f"--systems: choose from {', '.join(SYSTEMS)}")

    from protos.manifest import load_manifest
    from stage_node.settings import parse_cpus

    manifest = load_manifest(opts.export)
    logs = Path(tempfile.mkdtemp(prefix="microbatch-"))
    stage_cores = [c for c in opts.stage_cores.split(",") if c]
    if len(stage_cores) < 2:
        p.error("--stage-cores: two cores, e.g. 0,1")
    mono = (
        None
        if opts.no_baseline
        else Baselines(opts.baseline_dir / "optimum", opts.tokens, stage_cores)
    )
    procs: list[Proc] = []
    gateways: dict[str, tuple[Proc, str]] = {}
    rounds: dict[tuple[str, int], list[dict[str, Any]]] = {}
    stop_proxies = lambda: None  # noqa: E731
    try:
        procs, addresses, metric_ports = start_pinned_stages(
            opts.export, logs, metrics=True, cores=stage_cores, extra=shlex.split(opts.stage_flags)
        )
        if opts.delay_ms > 0:
            addresses, stop_proxies = delay_stages(addresses, opts.delay_ms / 1000)
        for system in systems:
            gateways[system] = start_gateway(
                addresses,
                logs / f"gateway-{system}.log",
                ["--max-concurrent", str(max(user_counts)), *SYSTEMS[system]],
                prefix=["taskset", "-c", opts.gateway_cores] if opts.gateway_cores else (),
            )
        if opts.gateway_cores:  # the client threads start from this one and inherit its cores
            os.sched_setaffinity(0, parse_cpus(opts.gateway_cores))
        url = next(iter(gateways.values()))[1]
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        eos = reachable_eos(manifest)
        for _, url in gateways.values():
            # warm-up: every call shape the rounds will see (the CPU plugin prepares kernels
            # per input shape once), so the first round is not slower than the others
            run_users(url, model, 1, 8, eos)
            run_users(url, model, max(user_counts), opts.tokens, eos)
        names = [f"stage {i}" for i in range(len(procs))] + ["gateway", "clients"]
        blocks: list[list[dict[str, Any]]] = []  # each user count of each round
        for _ in range(opts.rounds):
            for users in user_counts:
                if mono is not None:
                    mono.measure()
                blocks.append([])
                for system in systems:  # side by side: every system at each user count in turn
                    gateway, url = gateways[system]
                    pids = [p.popen.pid for p in [*procs, gateway] if p.popen] + [os.getpid()]
                    readings = [stage_metrics(port, *STAGE_SAMPLES) for port in metric_ports]
                    cpu = [cpu_seconds(pid) for pid in pids]
                    began = time.perf_counter()
                    result = run_users(url, model, users, opts.tokens, eos)
                    wall = time.perf_counter() - began
                    result["cpu_ms_per_token"] = {
                        name: (cpu_seconds(pid) - c) * 1000 / (users * opts.tokens)
                        for name, pid, c in zip(names, pids, cpu, strict=True)
                    }
                    figures = [
                        stage_figures(before, stage_metrics(port, *STAGE_SAMPLES), wall)
                        for port, before in zip(metric_ports, readings, strict=True)
                    ]
                    result["stage_busy"] = [busy for busy, _ in figures]
                    result["decode_call_ms"] = [call for _, call in figures]
                    rounds.setdefault((system, users), []).append(result)
                    blocks[-1].append(result)
                    print(
                        f"{system}, users {users}: {result['decode_tok_s']:.2f} tok/s, ITL p50 "
                        f"{result['itl_p50_ms']:.1f} / p95 {result['itl_p95_ms']:.1f} ms",
                        flush=True,
                    )
        if mono is not None:
            mono.measure()
            for k, results in enumerate(blocks):  # the baselines right before and after
                for result in results:
                    result["baseline"] = (mono.alone[k] + mono.alone[k + 1]) / 2
                    result["two_copies"] = (mono.together[k] + mono.together[k + 1]) / 2
    finally:
        if mono is not None:
            mono.close()
        for gateway, _ in gateways.values():
            gateway.stop()
        stop_proxies()
        for proc in procs:
            proc.stop()
    padding = stage_padding(logs)
    bases = mono.alone if mono is not None else []
    pairs = mono.together if mono is not None else []
    base = statistics.median(bases) if bases else float("nan")
    rows = [
        median_row(system, users, rounds[(system, users)], base)
        for system in systems
        for users in user_counts
    ]

    stages_desc = ", ".join(
        f"stage {s.index} layers {s.span(manifest.model.intermediate_size)} "
        f"on core {stage_cores[s.index % len(stage_cores)]}"
        + (f" ({padding[s.index]})" if s.index < len(padding) else "")
        for s in manifest.stages
    )
    lines = [
        f"{stand_in_label(opts.export, manifest.model.model_id)}, export {opts.export.name}, "
        f"{manifest.num_stages} stage "
        f"processes ({stages_desc}), 1 inference thread each, "
        + (
            f"flags `{opts.stage_flags}`, otherwise the stages' defaults."
            if opts.stage_flags.strip()
            else "the stages' defaults (paged KV, batch invariance on, fp16 hidden states)."
        ),
        "Systems, one gateway each over the same stage processes, measured side by side (each "
        "user count on every system in turn, round after round): "
        + "; ".join(
            f"{s}: `pipeshard serve {' '.join(SYSTEMS[s]) or '(defaults)'}`" for s in systems
        )
        + (
            f". {opts.delay_ms:g} ms one-way latency added on every hop (a proxy in front of "
            "each stage, benchmarks/latency_proxy.py)"
            if opts.delay_ms > 0
            else ""
        )
        + (
            f". Gateways and HTTP clients pinned to core(s) {opts.gateway_cores} (taskset)"
            if opts.gateway_cores
            else f". Gateways and HTTP clients unpinned (sharing the {os.cpu_count()} cores "
            "with the stages)"
        )
        + f"; {opts.tokens} greedy tokens per user (EOS "
        f"suppressed), each user its own prompt; medians over {opts.rounds} rounds.",
    ]
    if bases:
        lines.append(
            "Baseline: openvino-genai LLMPipeline (optimum-cli int4 export"
            f"{', a stand-in too' if is_stand_in(opts.baseline_dir / 'optimum') else ''}), 1 user, "
            f"core {stage_cores[0]}, "
            f"1 thread, f32, loaded once and measured before every user count of every round "
            f"and after the last: median {base:.2f} tok/s [{min(bases):.2f}, {max(bases):.2f}]. "
            "Each result is divided by the mean of the baselines right before and after it; "
            "the ratios below are the medians of those ratios over the rounds [min, max]."
        )
    if pairs:
        lines.append(
            "Ceiling of this machine: two monolithic copies decoding at the same time, one on "
            f"each stage's core ({', '.join(stage_cores[:2])}), 1 thread each, measured right "
            "after every baseline: median "
            f"{statistics.median(pairs):.2f} tok/s, {fmt(ratios(pairs, bases), 2, 'x')} the "
            "single copy measured just before it. "
            "The column 'vs two copies' divides each result by the mean of the two-copy "
            "figures right before and after it."
        )
    lines += [
        "",
        "| system | users | aggregate decode tok/s [min, max] | vs monolithic 1 user [min, max] | "
        "end-to-end tok/s | TTFT p50 / p95 (ms) | inter-token p50 / p95 (ms) | p95 / p50 | "
        "stage busy fraction | vs two copies [min, max] |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = r["decode_tok_s_range"]
        lines.append(
            f"| {r['system']} | {r['users']} | {r['decode_tok_s']:.2f} [{lo:.2f}, {hi:.2f}] | "
            f"{fmt(r['vs_monolithic_rounds'], 2, 'x')} | {r['e2e_tok_s']:.2f} | "
            f"{r['ttft_p50_ms']:.0f} / {r['ttft_p95_ms']:.0f} | "
            f"{r['itl_p50_ms']:.1f} / {r['itl_p95_ms']:.1f} | {r['itl_ratio']:.2f} | "
            f"{' / '.join(f'{b:.2f}' for b in r['stage_busy'])} | "
            f"{fmt(r['vs_two_copies_rounds'], 2, 'x')} |"
        )
    lines += ["", "Targets:", "", *targets(rows, base)]
    bounded = [r for r in rows if "bound_tok_s" in r]
    if bounded:
        lines += [
            "",
            "The stages' own bound: each stage's mean decode call while these users ran (its "
            "metrics), and the most tok/s calls of that length allow without batching, "
            "min(users / sum of the calls, 1 / the slowest call):",
            "",
            "| system | users | decode call ms per stage | bound tok/s | bound vs monolithic "
            "| measured / bound |",
            "|---|---|---|---|---|---|",
        ]
        for r in bounded:
            cells = " / ".join(f"{c:.1f}" for c in r["decode_call_ms"])
            lines.append(
                f"| {r['system']} | {r['users']} | {cells} | {r['bound_tok_s']:.2f} | "
                f"{r['vs_monolithic_bound']:.2f}x | {r['decode_tok_s'] / r['bound_tok_s']:.3f} |"
            )
    lines += [
        "",
        "CPU time per generated token by process (ms; user + system, all threads):",
        "",
        "| system | users | " + " | ".join(rows[0]["cpu_ms_per_token"]) + " |",
        "|---|---" + "|---" * len(rows[0]["cpu_ms_per_token"]) + "|",
    ]
    for r in rows:
        cells = " | ".join(f"{v:.1f}" for v in r["cpu_ms_per_token"].values())
        lines.append(f"| {r['system']} | {r['users']} | {cells} |")
    data: dict[str, Any] = {
        "baseline_runs": bases,
        "two_copies_at_once": pairs,
        "stage_padding": padding,
        "rows": rows,
        "rounds": {f"{s}/{u}": r for (s, u), r in rounds.items()},
    }
    stem = save(opts.results, "microbatch", "\n".join(lines), data, opts)
    two = statistics.median(pairs) if pairs else float("nan")
    if plot(rows, base, Path(f"{stem}.png"), two_copies=two):
        print(f"plot: {stem}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
