"""pipeshard against llama.cpp on the 2026 families' stand-ins, in one command.

For each model in --models: its --layers-layer random-weight stand-in (written by ``pipeshard
bench gguf-export write --model M --layers N`` into --standins, unless it is there already),
``llama-server -m FILE -t 2 -np 8 -c 16384`` (the binary given with --llama-server: pipeshard
neither downloads nor builds llama.cpp) and ``pipeshard up --model FILE --no-draft`` (the
exports cached in --standins/exports) on the same machine and the same cores (--cores pins
both), then ``pipeshard bench compare`` between them (--users, ``--ignore-eos``, the time to
first token of a --ttft-tokens prompt) and ``pipeshard bench llama-agree`` (greedy tokens on
the same prompt ids: where they first differ, the top-2 gap). The servers of one model are
stopped before the next model's start. Reports: ``<name>-<model>-compare-<date>.{md,json}``
and ``<name>-<model>-agree-<date>.{md,json}`` in --results.

Usage:
  pipeshard bench llamacpp --llama-server /path/to/llama-server
      [--models qwen3.6-35b-a3b,glm-4.5-air,gpt-oss-20b] [--layers 8] [--standins DIR]
      [--users 1,4,8] [--rounds 4] [--tokens 64] [--ttft-tokens 2000] [--cores 0,1]
      [--llama-arg=-fa --llama-arg=on ...] [--up-arg=--kv-backend --up-arg=stateful ...]

Memory: both servers hold the model at once (llama-server maps the file, pipeshard's stages
hold their compiled weights, about 1.3x the file): the 8-layer GLM-4.5-Air cut (11.75 GB)
needs about 30 GB; the Qwen3.6-35B-A3B (4.8 GB) and gpt-oss-20b (4.86 GB) cuts about 12 GB.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from benchmarks import llama_agree, servers
from benchmarks.processes import PIPESHARD, Proc, free_port
from benchmarks.report import add_results_option

MODELS = ("qwen3.6-35b-a3b", "glm-4.5-air", "gpt-oss-20b")


def standin(opts: argparse.Namespace, model: str) -> Path:
    """The model's stand-in file, written first if it is not there."""
    path = opts.standins / f"{model}-{opts.layers}L.gguf"
    if not path.exists():
        opts.standins.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        argv = [PIPESHARD, "bench", "gguf-export", "write", str(partial), "--model", model]
        subprocess.run([*argv, "--layers", str(opts.layers)], check=True)
        partial.rename(path)
    return path


def pinned(opts: argparse.Namespace, argv: list[str]) -> list[str]:
    return ["taskset", "-c", opts.cores, *argv] if opts.cores else argv


def start_llama(opts: argparse.Namespace, gguf: Path, log: Path) -> tuple[Proc, str]:
    port = free_port()
    argv = [
        str(opts.llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "-t", str(opts.threads), "-np", str(opts.parallel), "-c", str(opts.context),
        *opts.llama_arg,
    ]  # fmt: skip
    proc = Proc(pinned(opts, argv), log).start()
    url = f"http://127.0.0.1:{port}"
    if not proc.wait_http(f"{url}/health", timeout=opts.start_timeout):
        proc.stop()
        raise SystemExit(f"llama-server did not start:\n{log.read_text()[-3000:]}")
    return proc, url


def start_pipeshard(opts: argparse.Namespace, gguf: Path, log: Path) -> tuple[Proc, str]:
    port = free_port()
    stage_port = free_port(8)
    argv = [
        PIPESHARD, "up", "--model", str(gguf), "--no-draft", "--port", str(port),
        "--stage-port", str(stage_port), "--exports-dir", str(opts.standins / "exports"),
        *opts.up_arg,
    ]  # fmt: skip
    proc = Proc(pinned(opts, argv), log).start()
    url = f"http://127.0.0.1:{port}"
    if not proc.wait_http(f"{url}/ready", timeout=opts.start_timeout):
        proc.stop()
        raise SystemExit(f"pipeshard up did not start:\n{log.read_text()[-3000:]}")
    return proc, url


def run_model(opts: argparse.Namespace, model: str) -> int:
    gguf = standin(opts, model)
    opts.results.mkdir(parents=True, exist_ok=True)
    name = f"{opts.name}-{model}"
    llama, llama_url = start_llama(opts, gguf, opts.results / f".{name}-llama-server.log")
    try:
        ours, our_url = start_pipeshard(opts, gguf, opts.results / f".{name}-pipeshard.log")
        try:
            users = ",".join(str(u) for u in opts.users)
            common = ["--results", str(opts.results)]
            compared = servers.main(
                [
                    "--server", f"pipeshard={our_url}", "--server", f"llama-server={llama_url}",
                    "--users", users, "--rounds", str(opts.rounds), "--tokens", str(opts.tokens),
                    "--ignore-eos", "--ttft-tokens", str(opts.ttft_tokens),
                    "--name", f"{name}-compare", *common,
                ]
            )  # fmt: skip
            agreed = llama_agree.main(
                [
                    "--pipeshard", our_url, "--llama-server", llama_url,
                    "--tokens", str(opts.tokens), "--name", f"{name}-agree", *common,
                ]
            )  # fmt: skip
        finally:
            ours.stop(timeout=60)
    finally:
        llama.stop(timeout=60)
    # compare's 1: the greedy texts differ (random weights: expected); agree's 1: a clear gap
    return agreed or (0 if compared in (0, 1) else compared)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pipeshard bench llamacpp", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--llama-server", type=Path, required=True, help="llama-server binary")
    parser.add_argument(
        "--models",
        type=lambda s: s.split(","),
        default=list(MODELS),
        help=f"stand-ins to run (default {','.join(MODELS)})",
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--standins", type=Path, default=Path("standins"))
    parser.add_argument("--users", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--ttft-tokens", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t")
    parser.add_argument("--parallel", type=int, default=8, help="llama-server -np")
    parser.add_argument("--context", type=int, default=16384, help="llama-server -c")
    parser.add_argument("--cores", help="pin both servers to these cores (taskset -c)")
    parser.add_argument("--llama-arg", action="append", default=[], help="more llama-server args")
    parser.add_argument("--up-arg", action="append", default=[], help="more `pipeshard up` args")
    parser.add_argument("--start-timeout", type=float, default=3600.0, help="seconds (export)")
    parser.add_argument("--name", default="llamacpp", help="results file names start so")
    add_results_option(parser)
    opts = parser.parse_args(argv)
    unknown = [m for m in opts.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {', '.join(MODELS)}")
    if not opts.llama_server.is_file():
        parser.error(f"--llama-server {opts.llama_server}: no such file")
    status = 0
    for model in opts.models:
        status = run_model(opts, model) or status
    return status


if __name__ == "__main__":
    sys.exit(main())
