"""Shard parity benchmark: is a split, stateful, fused shard as fast as the unsplit model?

Single-stream greedy decode tok/s on the real model, every configuration with the same thread
count, pinned to the same cores (taskset), each measured in its own process, configurations
interleaved round by round so machine noise hits all of them alike:

  (a) openvino-genai LLMPipeline on an optimum-cli export, same weight format   (the baseline)
  (b) the 1-stage pipeshard shard
  (c) the 1-stage shard exported with --no-beam-idx (no KV-cache fusion)
  (d) the 2-stage export, both stages chained in one process

Ratios to (a) are computed round by round and reported as median [min, max].
Usage:  pipeshard bench parity [--model default] [--weights int4] [--threads 1]
Writes shard_parity-<date>.{json,md} in --results DIR (default: the current directory) and prints
the markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import workers
from benchmarks.report import add_results_option, save

# name -> (description, export folder, runtime). Runtimes: "f32" sets INFERENCE_PRECISION_HINT=f32
# (pipeshard's default on CPU: under it a split model computes bit for bit what the unsplit one
# does); "device" keeps the CPU plugin's own default (bf16 where the CPU has it). Both keep the
# plugin's u8 KV cache and dynamic activation quantization.
CONFIGS = {
    "a": ("openvino-genai LLMPipeline (optimum-cli export)", "optimum", "f32"),
    "b": ("1-stage shard", "s1", "f32"),
    "c": ("1-stage shard, no beam_idx", "s1-nobeam", "f32"),
    "d": ("2 stages chained in process", "s2", "f32"),
    "a_dev": ("openvino-genai LLMPipeline, device default precision", "optimum", "device"),
    "b_dev": ("1-stage shard, device default precision", "s1", "device"),
    "d_dev": ("2 stages chained in process, device default precision", "s2", "device"),
}
# Each config's ratio is taken against the genai baseline with the same runtime properties.
BASELINE = {"f32": "a", "device": "a_dev"}
RUNTIME_PROPERTIES: dict[str, dict[str, str]] = {
    "f32": {"INFERENCE_PRECISION_HINT": "f32"},
    "device": {},
}
RUNNER_PRECISION = {"f32": "f32", "device": "default"}


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, text=True, **kw)


def timed_export(args: list[str]) -> dict[str, float]:
    """Run `pipeshard export` in a child; wall time, the child's peak RSS, whether it reused."""
    out = Path(args[args.index("--out") + 1])
    reused = (out / "manifest.json").is_file()  # --reuse may find it up to date
    cmd = [str(Path(sys.executable).parent / "pipeshard"), "export", *args, "--reuse", "--quiet"]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    started = time.perf_counter()
    child = subprocess.Popen(cmd)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"export failed: {' '.join(cmd)}")
    return {
        "seconds": time.perf_counter() - started,
        "peak_rss_kib": float(usage.ru_maxrss),
        "maybe_reused": float(reused),
    }


def ensure_exports(opts: argparse.Namespace, work: Path) -> dict[str, Any]:
    fmt = ["--weights", opts.weights]
    info: dict[str, Any] = {}
    info["b"] = timed_export([opts.model, "--stages", "1", *fmt, "--out", str(work / "s1")])
    info["c"] = timed_export(
        [opts.model, "--stages", "1", *fmt, "--no-beam-idx", "--out", str(work / "s1-nobeam")]
    )
    info["d"] = timed_export([opts.model, "--stages", "2", *fmt, "--out", str(work / "s2")])
    genai_dir = work / "optimum"
    if not (genai_dir / "openvino_model.xml").is_file():
        started = time.perf_counter()
        hf_dir = work / "hf"
        if not (hf_dir / "config.json").is_file():
            # optimum-cli takes a Hugging Face folder: write the same de-quantized fp32 weights
            # the shards were exported from.
            module = [sys.executable, "-m", "benchmarks.shard_parity"]
            run([*module, "--make-hf-dir", str(hf_dir), "--model", opts.model])
        cmd = [
            str(Path(sys.executable).parent / "optimum-cli"),
            "export",
            "openvino",
            "--model",
            str(hf_dir),
            "--task",
            "text-generation-with-past",
            "--weight-format",
            opts.weights,
        ]
        if opts.weights == "int4":
            cmd += ["--group-size", "128", "--ratio", "1.0"]
        run([*cmd, str(genai_dir)])
        shutil.rmtree(hf_dir, ignore_errors=True)
        info["a"] = {"seconds": time.perf_counter() - started}
    return info


def make_hf_dir(model: str, out: Path) -> None:
    from exporter.source import resolve_source

    source = resolve_source(model, progress=False)
    loaded = source.load_model()
    loaded.save_pretrained(out)
    source.load_tokenizer().save_pretrained(out)


def measure(config: str, work: Path, opts: argparse.Namespace) -> dict[str, float]:
    """One configuration in its own pinned process (benchmarks/workers.py)."""
    _, folder, runtime = CONFIGS[config]
    return workers.measure(
        "genai-decode" if folder == "optimum" else "chain-decode",
        work / folder,
        cores=opts.cores,
        threads=opts.threads,
        tokens=opts.tokens,
        props=RUNTIME_PROPERTIES[runtime],
        precision=RUNNER_PRECISION[runtime],
    )


def summarize(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    table: dict[str, dict[str, float]] = {}
    for config, (_, _, runtime) in CONFIGS.items():
        base = BASELINE[runtime]
        speeds = [r[config]["decode_tok_s"] for r in rounds]
        ratios = [r[config]["decode_tok_s"] / r[base]["decode_tok_s"] for r in rounds]
        table[config] = {
            "tok_s_median": statistics.median(speeds),
            "tok_s_min": min(speeds),
            "tok_s_max": max(speeds),
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "ttft_ms_median": statistics.median(r[config]["ttft_ms"] for r in rounds),
        }
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pipeshard bench parity",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--model", default="default")
    p.add_argument("--weights", default="int4", choices=["fp16", "int8", "int4"])
    p.add_argument("--threads", type=int, default=1, help="inference threads, every config")
    p.add_argument("--cores", default="0", help="taskset core list for every worker ('' = none)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work-dir", type=Path, default=Path("benchmarks/out/shard_parity"))
    add_results_option(p)
    p.add_argument("--make-hf-dir", type=Path, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)

    work = opts.work_dir.resolve()
    if opts.make_hf_dir:
        make_hf_dir(opts.model, opts.make_hf_dir)
        return 0

    work.mkdir(parents=True, exist_ok=True)
    exports = ensure_exports(opts, work)
    rounds = []
    for n in range(opts.rounds):
        rounds.append({config: measure(config, work, opts) for config in CONFIGS})
        print(
            f"round {n + 1}: "
            + ", ".join(f"{c} {rounds[-1][c]['decode_tok_s']:.2f}" for c in CONFIGS),
            file=sys.stderr,
        )
    table = summarize(rounds)

    lines = [
        f"Decode tok/s, {opts.model}, {opts.weights} weights, {opts.threads} inference thread(s), "
        f"cores {opts.cores or 'unpinned'}, {opts.tokens} new tokens, {opts.rounds} rounds; "
        "f32 = INFERENCE_PRECISION_HINT f32 (pipeshard's CPU default), device = the plugin's own "
        "default (bf16 on this CPU); u8 KV cache and dynamic quantization in both",
        "",
        "| config | tok/s median [min, max] | ratio to genai, same runtime [min, max] | TTFT ms |",
        "|---|---|---|---|",
    ]
    for config, (name, _, _) in CONFIGS.items():
        t = table[config]
        lines.append(
            f"| ({config}) {name} | {t['tok_s_median']:.2f} [{t['tok_s_min']:.2f}, "
            f"{t['tok_s_max']:.2f}] | {t['ratio_median']:.3f} [{t['ratio_min']:.3f}, "
            f"{t['ratio_max']:.3f}] | {t['ttft_ms_median']:.0f} |"
        )
    lines.append("")
    lines.append(
        "Export in this run (pipeshard export --reuse; 'reused' = an up-to-date export was "
        "found, so the time is only the check): "
        + ", ".join(
            f"({c}) {e['seconds']:.0f}s"
            + (f", peak RSS {e['peak_rss_kib'] / 2**20:.2f} GiB" if "peak_rss_kib" in e else "")
            + (" (reused)" if e.get("maybe_reused") else "")
            for c, e in exports.items()
        )
    )
    report = "\n".join(lines)
    data = {"rounds": rounds, "summary": table, "exports": exports, "report": report}
    stem = save(opts.results, "shard_parity", report, data, opts)
    print(f"wrote {stem}.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
