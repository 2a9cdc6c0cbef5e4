"""Measurements that run in a process of their own, pinned with taskset.

Each kind loads one model, warms it up, measures, and prints one JSON line:

  genai-decode  openvino-genai LLMPipeline on an optimum-cli export: single-stream decode tok/s
  chain-decode  every stage of a pipeshard export chained in one process: the same
  genai-ttft    LLMPipeline: time to first token of the given prompts (token ids), one by one
  genai-repeat  genai-decode, loaded once: one measurement per line read on stdin (see
                :class:`Repeater`), so a benchmark can measure the baseline between its rounds

The decode kinds take the first of ``--prompts`` as token ids, so that every configuration
decodes from the same ids; without it, PROMPT through the model's own tokenizer.

``measure()`` starts one and returns what it printed. Usage (what ``measure()`` runs):
  python -m benchmarks.workers KIND PATH [--threads 1] [--tokens 64] [--props JSON]
                               [--prompts FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
PROMPT = (
    "Write a Python class that implements a least-recently-used cache with get and put "
    "methods, explain its time complexity, and add a short usage example."
)
# pipeshard's CPU runtime (shard_runtime.runner.RunnerOptions' defaults); the genai baseline
# gets the same so that a ratio compares the split, not two runtimes.
PIPESHARD_CPU = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f16"}


def _genai_pipeline(path: Path, threads: int, props: dict[str, str]) -> Any:
    import openvino_genai

    return openvino_genai.LLMPipeline(str(path), "CPU", INFERENCE_NUM_THREADS=threads, **props)


def _genai_config(tokens: int) -> Any:
    import openvino_genai

    config = openvino_genai.GenerationConfig()
    config.max_new_tokens = tokens
    config.min_new_tokens = tokens
    config.do_sample = False
    config.apply_chat_template = False
    return config


def genai_decode(
    path: Path, threads: int, tokens: int, props: dict[str, str], prompt: list[int] | None = None
) -> dict[str, float]:
    """Decode tok/s of ``prompt`` (token ids; default: PROMPT through genai's tokenizer)."""
    import numpy as np
    import openvino as ov

    pipe = _genai_pipeline(path, threads, props)
    config = _genai_config(tokens)
    # a list of strings gives DecodedResults, token ids EncodedResults: both with perf_metrics
    inputs = [PROMPT] if prompt is None else ov.Tensor(np.array([prompt], dtype=np.int64))
    pipe.generate(inputs, config)  # warm-up
    return _generate(pipe, inputs, config)


def _generate(pipe: Any, inputs: Any, config: Any) -> dict[str, float]:
    metrics = pipe.generate(inputs, config).perf_metrics
    return {
        "decode_tok_s": 1000.0 / metrics.get_tpot().mean,
        "ttft_ms": metrics.get_ttft().mean,
        "prompt_tokens": float(metrics.get_num_input_tokens()),
    }


def genai_repeat(path: Path, threads: int, tokens: int, props: dict[str, str]) -> None:
    """genai-decode once per line on stdin (a JSON line each); ``{"ready": true}`` first."""
    pipe = _genai_pipeline(path, threads, props)
    config = _genai_config(tokens)
    pipe.generate([PROMPT], config)  # warm-up
    print(json.dumps({"ready": True}), flush=True)
    for _ in sys.stdin:
        print(json.dumps(_generate(pipe, [PROMPT], config)), flush=True)


def _command(
    kind: str, path: Path, cores: str, threads: int, tokens: int, props: dict[str, str] | None
) -> tuple[list[str], dict[str, str]]:
    """The command line (behind taskset when ``cores`` is given) and environment of a worker."""
    cmd = [
        *(["taskset", "-c", cores] if cores else []),
        sys.executable, "-m", "benchmarks.workers", kind, str(path),
        "--threads", str(threads), "--tokens", str(tokens),
        "--props", json.dumps(props if props is not None else PIPESHARD_CPU),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return cmd, env


class Repeater:
    """A genai-repeat worker (pinned to ``cores``): :meth:`measure` runs one decode there and
    returns its tok/s. Loaded once, it costs a round only the decode itself, so the baseline
    can be measured next to every round instead of only before and after a long run."""

    def __init__(
        self,
        path: Path,
        *,
        cores: str = "0",
        threads: int = 1,
        tokens: int = 64,
        props: dict[str, str] | None = None,
    ) -> None:
        cmd, env = _command("genai-repeat", path, cores, threads, tokens, props)
        log.info("+ %s", " ".join(cmd))
        self.errors = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errors,
            text=True,
            env=env,
        )
        self._read()  # {"ready": true} once loaded and warmed up

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                result: dict[str, Any] = json.loads(line)
                return result
        code = self.proc.wait()
        self.errors.seek(0)
        raise RuntimeError(
            f"the genai-repeat worker exited ({code}):\n{self.errors.read()[-3000:]}"
        )

    def measure(self) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self._read()["decode_tok_s"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.errors.close()


def genai_ttft(
    path: Path, threads: int, prompts: list[list[int]], props: dict[str, str]
) -> dict[str, list[float]]:
    """Time to first token of each prompt (exact token ids), one by one.

    The warm-up is the first prompt reversed: same length, no shared prefix, so that genai's
    prefix cache (on by default in its continuous-batching pipeline) has nothing to reuse as
    long as the prompts share no prefix either.
    """
    import numpy as np
    import openvino as ov

    pipe = _genai_pipeline(path, threads, props)
    config = _genai_config(1)

    def once(ids: list[int]) -> float:
        result = pipe.generate(ov.Tensor(np.array([ids], dtype=np.int64)), config)
        return float(result.perf_metrics.get_ttft().mean)

    once(prompts[0][::-1])
    return {"ttft_ms": [once(ids) for ids in prompts]}


def chain_decode(
    path: Path,
    threads: int,
    tokens: int,
    precision: str,
    cache_dir: Path | None = None,
    prompt_ids: list[int] | None = None,
) -> dict[str, float]:
    """Decode tok/s of ``prompt_ids`` (default: PROMPT through the export's tokenizer)."""
    import numpy as np

    from shard_runtime.chain import LocalChain
    from shard_runtime.runner import RunnerOptions

    options = RunnerOptions(threads=threads, inference_precision=precision, cache_dir=cache_dir)
    chain = LocalChain(path, options)
    if prompt_ids is None:
        from transformers import AutoTokenizer

        directory = path / chain.manifest.tokenizer.directory
        prompt_ids = list(AutoTokenizer.from_pretrained(str(directory)).encode(PROMPT))
    prompt = np.array(prompt_ids, dtype=np.int64)

    def once(session: str) -> tuple[float, float]:
        start = time.perf_counter()
        logits = chain.forward(session, prompt)
        first = time.perf_counter()
        for _ in range(tokens - 1):
            logits = chain.forward(session, np.array([int(np.argmax(logits[-1]))]))
        end = time.perf_counter()
        chain.release(session)
        return first - start, (end - first) / (tokens - 1)

    once("warm-up")
    ttft, tpot = once("measured")
    return {"decode_tok_s": 1.0 / tpot, "ttft_ms": ttft * 1000, "prompt_tokens": float(len(prompt))}


def measure(
    kind: str,
    path: Path,
    *,
    cores: str = "",
    threads: int = 1,
    tokens: int = 64,
    props: dict[str, str] | None = None,
    prompts: Sequence[Sequence[int]] = (),
    precision: str = "f32",
    cache_dir: Path | None = None,
) -> dict[str, Any]:
    """Run one worker in a child process (pinned to ``cores`` when given); its JSON result."""
    cmd, env = _command(kind, path, cores, threads, tokens, props)
    cmd += ["--precision", precision]
    if cache_dir is not None:
        cmd += ["--cache-dir", str(cache_dir)]
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="bench-prompts-") as file:
        if prompts:
            json.dump([list(p) for p in prompts], file)
            file.flush()
            cmd += ["--prompts", file.name]
        log.info("+ %s", " ".join(cmd))
        out = subprocess.run(cmd, text=True, capture_output=True, env=env)
    if out.returncode:
        raise RuntimeError(f"{kind} worker on {path} failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("kind", choices=["genai-decode", "chain-decode", "genai-ttft", "genai-repeat"])
    p.add_argument("path", type=Path)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--props", default=json.dumps(PIPESHARD_CPU), help="genai properties (JSON)")
    p.add_argument("--precision", default="f32", help="chain: INFERENCE_PRECISION_HINT")
    p.add_argument(
        "--prompts", type=Path, help="a JSON list of token-id lists (decode: the first one)"
    )
    p.add_argument("--cache-dir", type=Path, help="chain: OpenVINO model cache (CACHE_DIR)")
    opts = p.parse_args(argv)
    props = json.loads(opts.props)
    prompts = json.loads(opts.prompts.read_text()) if opts.prompts else None
    result: dict[str, Any]
    if opts.kind == "genai-repeat":
        genai_repeat(opts.path, opts.threads, opts.tokens, props)
        return 0
    if opts.kind == "genai-decode":
        first = prompts[0] if prompts else None
        result = genai_decode(opts.path, opts.threads, opts.tokens, props, first)
    elif opts.kind == "chain-decode":
        first = prompts[0] if prompts else None
        result = chain_decode(
            opts.path, opts.threads, opts.tokens, opts.precision, opts.cache_dir, first
        )
    else:
        assert prompts, "genai-ttft needs --prompts"
        result = genai_ttft(opts.path, opts.threads, prompts, props)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
