"""How close a GGUF export stays to the file: greedy tokens against transformers on the same GGUF,
side by side with llama.cpp.

The reference is transformers in fp32 on the GGUF's de-quantized weights (the `gguf` package's
de-quantization, which llama.cpp's matches). For each prompt (one user turn through the model's
chat template; ``--prompt`` to give your own), ``--steps`` greedy tokens from:
  - each export (``--export NAME=DIR``: e.g. ``--weights gguf`` against the old NNCF ``int4``
    re-quantization) under each runtime of ``--runtimes``, all stages chained in this process:
      exact    f32 compute, f32 KV cache, dynamic activation quantization off
               (``--inference-precision f32 --kv-cache-precision f32
               --ov-property DYNAMIC_QUANTIZATION_GROUP_SIZE=0``)
      default  pipeshard's CPU defaults (f32 compute where the CPU has no bf16, the plugin's u8
               KV cache, int8 dynamic activation quantization of the FC inputs)
  - llama.cpp (``--llama-server BIN``) on the same file and the same prompt token ids, at
    temperature 0 (greedy), end-of-sequence ignored.
Each is reported as the leading tokens equal to the reference's, per prompt, and how many prompts
match all ``--steps`` tokens. The issue's bar: the exact runtime matches on at least 7 of 8.

  pipeshard bench gguf-fidelity --export gguf=DIR [--export int4=DIR ...]
      [--llama-server /path/to/llama-server] [--threads 2] [--steps 64] [--name gguf-fidelity]
Writes <name>-<date>.{json,md} in --results DIR (default: the current directory).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.processes import Proc, free_port

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash map is in two sentences.",
    "Translate 'Good morning, how are you today?' into French and German.",
    "What causes the seasons on Earth?",
    "Write a haiku about autumn rain.",
    "Give me three tips for writing clean SQL queries.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "What is the difference between a process and a thread?",
]


def runtime_options(name: str, threads: int) -> Any:
    from shard_runtime.runner import RunnerOptions

    if name == "exact":
        return RunnerOptions(
            threads=threads,
            kv_cache_precision="f32",
            inference_precision="f32",
            properties={"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"},
        )
    if name == "default":
        return RunnerOptions(threads=threads)
    raise SystemExit(f"unknown runtime {name!r}: exact or default")


def leading(tokens: list[int], reference: list[int]) -> int:
    n = 0
    while n < min(len(tokens), len(reference)) and tokens[n] == reference[n]:
        n += 1
    return n


def reference_tokens(manifest: Any, prompts: list[list[int]], steps: int) -> list[list[int]]:
    from exporter.verify import load_reference, reference_greedy

    model = load_reference(manifest)
    out = [reference_greedy(model, ids, steps)[0] for ids in prompts]
    del model
    gc.collect()
    return out


def export_tokens(
    export_dir: Path, runtime: str, threads: int, prompts: list[list[int]], steps: int
) -> list[list[int]]:
    from shard_runtime.chain import LocalChain

    chain = LocalChain(export_dir, runtime_options(runtime, threads))
    out = []
    for n, ids in enumerate(prompts):
        out.append(chain.greedy(f"fidelity-{n}", ids, steps)[0])
        chain.release(f"fidelity-{n}")
    del chain
    gc.collect()
    return out


def llama_cpp_tokens(
    binary: Path, gguf: Path, threads: int, prompts: list[list[int]], steps: int, log: Path
) -> list[list[int]]:
    port = free_port()
    proc = Proc(
        [
            str(binary),
            "-m",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-t",
            str(threads),
            "-c",
            "4096",
            "-np",
            "1",
        ],
        log,
    ).start()
    try:
        if not proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=300):
            raise SystemExit(f"llama-server did not start:\n{log.read_text()[-2000:]}")
        out = []
        for ids in prompts:
            body = {
                "prompt": ids,
                "n_predict": steps,
                "temperature": 0,
                "ignore_eos": True,
                "cache_prompt": False,
                "return_tokens": True,
            }
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/completion",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=600) as response:
                out.append([int(t) for t in json.load(response)["tokens"]])
        return out
    finally:
        proc.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pipeshard bench gguf-fidelity",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
    )
    parser.add_argument("--export", action="append", required=True, metavar="NAME=DIR")
    parser.add_argument("--runtimes", default="exact,default")
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--prompt", action="append", default=None)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="inference threads, every runtime")
    parser.add_argument("--name", default="gguf-fidelity")
    report.add_results_option(parser)
    opts = parser.parse_args(argv)

    from exporter.verify import encode_prompts
    from protos.manifest import load_manifest

    exports = {}
    for spec in opts.export:
        name, sep, folder = spec.partition("=")
        if not sep:
            raise SystemExit(f"--export wants NAME=DIR, got {spec!r}")
        exports[name] = Path(folder)
    manifests = {name: load_manifest(folder) for name, folder in exports.items()}
    first_name = next(iter(exports))
    first = manifests[first_name]
    for name, m in manifests.items():
        if m.source.sha256 != first.source.sha256 or m.source.kind != "gguf":
            raise SystemExit(f"{name}: not an export of the same GGUF file as {first_name}")
    texts = opts.prompt or PROMPTS
    encoded = encode_prompts(exports[first_name], first, texts)
    prompts = [ids for _, ids in encoded]
    gguf = Path(first.source.path)

    t0 = time.perf_counter()
    reference = reference_tokens(first, prompts, opts.steps)
    print(f"reference: transformers fp32 on {gguf.name} ({time.perf_counter() - t0:.0f} s)")
    runs: dict[str, list[list[int]]] = {}
    for name, folder in exports.items():
        for runtime in opts.runtimes.split(","):
            t0 = time.perf_counter()
            runs[f"pipeshard {name}, {runtime} runtime"] = export_tokens(
                folder, runtime, opts.threads, prompts, opts.steps
            )
            print(f"{name}/{runtime}: {time.perf_counter() - t0:.0f} s")
    if opts.llama_server is not None:
        log = opts.results / f".{opts.name}-llama-server.log"
        opts.results.mkdir(parents=True, exist_ok=True)
        runs["llama.cpp (llama-server)"] = llama_cpp_tokens(
            opts.llama_server, gguf, opts.threads, prompts, opts.steps, log
        )
        log.unlink(missing_ok=True)

    matched = {
        run: [leading(t, r) for t, r in zip(toks, reference, strict=True)]
        for run, toks in runs.items()
    }
    lines = [
        f"Machine: {report.describe(report.machine())}",
        "",
        f"Model: {first.model.model_id}, {gguf.name} (sha256 {first.source.sha256}); "
        f"{len(prompts)} chat prompts, {opts.steps} greedy tokens each, {opts.threads} inference "
        "threads. Reference: transformers fp32 on the de-quantized GGUF. Cells: leading tokens "
        "equal to the reference's.",
        "",
        "| run | " + " | ".join(f"p{i + 1}" for i in range(len(prompts))) + " | all equal |",
        "|---|" + "---:|" * (len(prompts) + 1),
    ]
    for run, counts in matched.items():
        full = sum(c == opts.steps for c in counts)
        lines.append(
            f"| {run} | " + " | ".join(str(c) for c in counts) + f" | {full}/{len(prompts)} |"
        )
    lines += ["", "Prompts:"] + [f"- p{i + 1}: {text}" for i, text in enumerate(texts)]
    report.save(
        opts.results,
        opts.name,
        "\n".join(lines) + "\n",
        {
            "prompts": texts,
            "prompt_ids": prompts,
            "reference": reference,
            "runs": runs,
            "matched": matched,
        },
        opts,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
