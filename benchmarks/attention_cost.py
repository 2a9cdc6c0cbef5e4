"""A hybrid model's two kinds of attention layer side by side: one Gated DeltaNet (linear
attention) layer against one gated full-attention layer of the same model, on the CPU.

Both layers come from a Qwen3.5 / Qwen3.6 GGUF (``qwen35``, ``qwen35moe``: a real file, or the
stand-in ``pipeshard bench gguf-export write --model qwen3.6-35b-a3b`` writes) and are built
by the exporter's own layer builders (exporter/graph.py: ``linear_attention``, which
exporter/gated_delta.py makes one fused ``GatedDeltaNet`` node, and ``attention``, the gated
query and SDPA over a KV cache), from the file's own blocks as ``--weights gguf`` keeps them,
each as a stateful OpenVINO model of its own (exporter/stateful.py, as the stages are):
``inputs_embeds`` -> the layer's input RMSNorm -> the attention -> its output projection. The
MLP that follows either kind (the same experts in both) is left out.

Each round, for each layer in turn (the rounds interleave the two, so that other load on the
machine hits both alike), one sequence from empty state: prefill in chunks of ``--chunk``
tokens up to each context in ``--contexts``, and at each context ``--steps`` decode steps of
one token. Reported: the median decode step (ms a token) at each context and the ratio full /
linear, and prefill ms a token: the first chunk (a prefill of ``--chunk`` tokens from empty)
and the last chunk before each context (where the full-attention layer attends to the most).
The inputs are random hidden states (what a layer costs does not depend on the values); the
compile is pipeshard's CPU default (f32 compute, f16 KV cache), ``--threads`` inference
threads, the process pinned to ``--cores``.

Usage: pipeshard bench attention-cost FILE.gguf [--linear-layer N] [--full-layer N]
       [--contexts 1024,16384] [--chunk 1024] [--steps 16] [--rounds 3] [--threads 1]
       [--cores 0] [--name attention_cost]
Writes <name>-<date>.{md,json} in --results DIR (default: the current directory).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.report import add_results_option, describe, machine, save

KINDS = ("linear_attention", "full_attention")
LABEL = {"linear_attention": "linear (Gated DeltaNet)", "full_attention": "full (gated, SDPA)"}


def load(path: Path, context: int) -> tuple[Any, Any, Any]:
    """(config, recipe, weight source) of a GGUF, as `pipeshard export --weights gguf` reads it
    (the split form)."""
    from transformers import AutoConfig

    from exporter.errors import ExportError
    from exporter.gguf_reader import read_config
    from exporter.recipe import read_recipe
    from exporter.weights import GGUFSource

    config = AutoConfig.for_model(**read_config(path))
    recipe = read_recipe(config, context)
    if "linear_attention" not in recipe.facts.layer_types:
        raise ExportError(f"{path.name}: no linear-attention layer (not a hybrid model)")
    return config, recipe, GGUFSource(path, config, "split")


def build_layer(recipe: Any, source: Any, layer: int) -> Any:
    """Layer ``layer``'s input norm and attention (either kind) as a stateful model
    (exporter.graph.build_attention_layer, then exporter.stateful as for a stage): its KV cache
    or conv and recurrent state held as the model's state, behind ``beam_idx``."""
    from exporter.graph import build_attention_layer
    from exporter.stateful import make_stateful

    model = build_attention_layer(recipe, source, layer)
    make_stateful(model)
    return model


def fused_ops(compiled: Any) -> dict[str, int]:
    """How many GatedDeltaNet and ScaledDotProductAttention nodes the compiled layer runs."""
    counts = {"GatedDeltaNet": 0, "ScaledDotProductAttention": 0}
    for op in compiled.get_runtime_model().get_ops():
        kind = str(op.get_rt_info()["layerType"].astype(str))
        if kind in counts:
            counts[kind] += 1
    return counts


def layer_file_bytes(path: Path, layer: int) -> int:
    """The GGUF bytes of the layer's attention tensors (its norm, projections, state weights)."""
    from exporter.weights import read_gguf_header

    prefix = f"blk.{layer}."
    return sum(
        int(t.n_bytes)
        for t in read_gguf_header(path).tensors
        if t.name.startswith(prefix) and (".attn_" in t.name or ".ssm_" in t.name)
    )


class Layer:
    """A compiled layer and the one sequence it runs."""

    def __init__(self, compiled: Any, kind: str, hidden: int, seed: int) -> None:
        self.request = compiled.create_infer_request()
        self.kind, self.hidden = kind, hidden
        self.rng = np.random.default_rng(seed)
        self.length = 0

    def reset(self) -> None:
        self.request.reset_state()
        self.length = 0

    def step(self, count: int) -> float:
        """Feed ``count`` new tokens; seconds the call took."""
        inputs: dict[str, Any] = {
            "inputs_embeds": self.rng.standard_normal((1, count, self.hidden), np.float32),
            "beam_idx": np.zeros(1, np.int32),
        }
        if self.kind == "full_attention":
            total = self.length + count
            inputs["attention_mask"] = np.ones((1, total), np.int64)
            inputs["position_ids"] = np.arange(self.length, total, dtype=np.int64)[None]
        started = time.perf_counter()
        self.request.infer(inputs)
        elapsed = time.perf_counter() - started
        self.length += count
        return elapsed

    def state_bytes(self) -> int:
        """What the sequence's state holds: a KV cache in f16 (the compile's precision), a
        linear-attention layer's conv and recurrent state in f32."""
        total = 0
        for state in self.request.query_state():
            values = int(np.prod(list(state.state.shape)))
            total += values * (2 if state.name.startswith("past_key_values") else 4)
        return total


def run_sequence(layer: Layer, contexts: list[int], chunk: int, steps: int) -> dict[str, Any]:
    """One sequence from empty: prefill chunks up to each context, then decode steps there."""
    layer.reset()
    out: dict[str, Any] = {"contexts": []}
    for context in contexts:
        chunks: list[tuple[int, float]] = []
        while layer.length < context:
            count = min(chunk, context - layer.length)
            chunks.append((count, layer.step(count)))
        if "first_chunk" not in out and chunks:
            out["first_chunk"] = {"tokens": chunks[0][0], "s": chunks[0][1]}
        decode = [layer.step(1) for _ in range(steps)]
        out["contexts"].append(
            {
                "context": context,
                "prefill_chunks": chunks,
                "last_chunk": {"tokens": chunks[-1][0], "s": chunks[-1][1]} if chunks else None,
                "decode_s": decode,
                "state_bytes": layer.state_bytes(),
            }
        )
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def summarise(rounds: list[dict[str, Any]], contexts: list[int]) -> dict[str, Any]:
    """Medians over the rounds: decode ms a token and prefill ms a token (first chunk, last
    chunk before each context) per kind, and the ratios full / linear round by round."""
    summary: dict[str, Any] = {"decode": [], "prefill_first": {}, "prefill_last": []}
    for i, context in enumerate(contexts):
        row: dict[str, Any] = {"context": context}
        last: dict[str, Any] = {"context": context}
        for kind in KINDS:
            per_round = [statistics.median(r[kind]["contexts"][i]["decode_s"]) for r in rounds]
            row[kind] = statistics.median(per_round)
            row[f"{kind}_rounds"] = per_round
            row[f"{kind}_state_bytes"] = rounds[0][kind]["contexts"][i]["state_bytes"]
            chunks = [r[kind]["contexts"][i]["last_chunk"] for r in rounds]
            if all(chunks):
                last[kind] = statistics.median(c["s"] / c["tokens"] for c in chunks)
                last["tokens"] = chunks[0]["tokens"]
        ratios = [
            statistics.median(r["full_attention"]["contexts"][i]["decode_s"])
            / statistics.median(r["linear_attention"]["contexts"][i]["decode_s"])
            for r in rounds
        ]
        row["ratio"], row["ratio_rounds"] = statistics.median(ratios), ratios
        summary["decode"].append(row)
        if all(k in last for k in KINDS):
            last["ratio"] = last["full_attention"] / last["linear_attention"]
            summary["prefill_last"].append(last)
    first = summary["prefill_first"]
    for kind in KINDS:
        chunks = [r[kind]["first_chunk"] for r in rounds]
        first[kind] = statistics.median(c["s"] / c["tokens"] for c in chunks)
        first["tokens"] = chunks[0]["tokens"]
    first["ratio"] = first["full_attention"] / first["linear_attention"]
    return summary


def report(
    path: Path,
    layers: dict[str, int],
    facts: Any,
    file_bytes: dict[str, int],
    ops_seen: dict[str, dict[str, int]],
    summary: dict[str, Any],
    opts: argparse.Namespace,
    info: dict[str, Any],
) -> str:
    f = facts
    lines = [
        f"# Linear against full attention: one layer of each of {path.name}",
        "",
        f"Host: {describe(info)}.",
        "",
        f"- linear: layer {layers['linear_attention']}, Gated DeltaNet, {f.linear_key_heads} key "
        f"heads of {f.linear_key_dim} and {f.linear_value_heads} value heads of "
        f"{f.linear_value_dim} over hidden {f.hidden_size}, a {f.linear_conv_kernel}-wide conv; "
        f"{file_bytes['linear_attention'] / 2**20:.1f} MiB of GGUF weights; compiled with "
        f"{ops_seen['linear_attention']['GatedDeltaNet']} GatedDeltaNet node(s)",
        f"- full: layer {layers['full_attention']}, {f.num_heads} query heads (each with an "
        f"output gate) over {f.num_kv_heads} KV heads of {f.head_dim}; "
        f"{file_bytes['full_attention'] / 2**20:.1f} MiB of GGUF weights; compiled with "
        f"{ops_seen['full_attention']['ScaledDotProductAttention']} "
        "ScaledDotProductAttention node(s)",
        f"- each: its input RMSNorm, the attention and its output projection, a stateful model "
        f"of its own; {opts.threads} inference thread(s), pinned to cores {opts.cores or 'any'}; "
        f"{opts.rounds} rounds interleaving the two, each a sequence prefilled in chunks of "
        f"{opts.chunk} up to each context, then {opts.steps} decode steps there; medians over "
        "the rounds (the ratio: round by round, then the median)",
        "",
        "## Decode: one token after the context",
        "",
        "| context | linear ms/token | full ms/token | full / linear (rounds) | linear state "
        "| full KV cache |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in summary["decode"]:
        rounds = ", ".join(f"{r:.2f}" for r in row["ratio_rounds"])
        lines.append(
            f"| {row['context']} | {_ms(row['linear_attention'])} | "
            f"{_ms(row['full_attention'])} | {row['ratio']:.2f}x ({rounds}) | "
            f"{row['linear_attention_state_bytes'] / 2**20:.2f} MiB | "
            f"{row['full_attention_state_bytes'] / 2**20:.2f} MiB |"
        )
    first = summary["prefill_first"]
    lines += [
        "",
        "## Prefill: ms a token within a chunk",
        "",
        "| chunk | linear ms/token | full ms/token | full / linear |",
        "| :--- | ---: | ---: | ---: |",
        f"| the first {first['tokens']} tokens (from empty) | {_ms(first['linear_attention'])} | "
        f"{_ms(first['full_attention'])} | {first['ratio']:.2f}x |",
    ]
    for last in summary["prefill_last"]:
        if last["context"] <= first["tokens"]:
            continue
        lines.append(
            f"| the last {last['tokens']} before {last['context']} | "
            f"{_ms(last['linear_attention'])} | {_ms(last['full_attention'])} | "
            f"{last['ratio']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def _pick(layer_types: list[str], kind: str, given: int | None) -> int:
    from exporter.errors import ExportError

    if given is None:
        return layer_types.index(kind)
    if not 0 <= given < len(layer_types) or layer_types[given] != kind:
        raise ExportError(f"layer {given} is not a {kind} layer")
    return given


def _numbers(text: str) -> list[int]:
    values = sorted({int(v) for v in text.split(",") if v.strip()})
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError("positive numbers, comma-separated")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pipeshard bench attention-cost",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("gguf", type=Path, help="a qwen35 / qwen35moe GGUF")
    parser.add_argument("--linear-layer", type=int, help="default: the first linear one")
    parser.add_argument("--full-layer", type=int, help="default: the first full-attention one")
    parser.add_argument("--contexts", type=_numbers, default=[1024, 16384])
    parser.add_argument("--chunk", type=int, default=1024, help="prefill tokens a call")
    parser.add_argument("--steps", type=int, default=16, help="decode steps at each context")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cores", help="pin this process to these CPUs, e.g. 0 or 0,1")
    parser.add_argument("--name", default="attention_cost")
    add_results_option(parser)
    opts = parser.parse_args(argv)
    if opts.chunk < 1 or opts.steps < 1 or opts.rounds < 1 or opts.threads < 1:
        parser.error("--chunk, --steps, --rounds and --threads must be at least 1")
    if opts.cores:
        os.sched_setaffinity(0, {int(c) for c in opts.cores.split(",")})

    import openvino as ov

    from exporter.errors import ExportError
    from shard_runtime.runner import RunnerOptions

    info = machine()
    try:
        _, recipe, source = load(opts.gguf, max(opts.contexts) + opts.steps * len(opts.contexts))
        types = recipe.facts.layer_types
        layers = {
            "linear_attention": _pick(types, "linear_attention", opts.linear_layer),
            "full_attention": _pick(types, "full_attention", opts.full_layer),
        }
    except ExportError as exc:
        parser.error(str(exc))
    core = ov.Core()
    properties = RunnerOptions(threads=opts.threads).compile_properties()
    compiled: dict[str, Any] = {}
    ops_seen: dict[str, dict[str, int]] = {}
    runs: dict[str, Layer] = {}
    for seed, kind in enumerate(KINDS):
        started = time.perf_counter()
        model = build_layer(recipe, source, layers[kind])
        compiled[kind] = core.compile_model(model, "CPU", properties)
        ops_seen[kind] = fused_ops(compiled[kind])
        runs[kind] = Layer(compiled[kind], kind, recipe.facts.hidden_size, seed)
        print(f"{kind}: layer {layers[kind]} built and compiled in "
              f"{time.perf_counter() - started:.1f} s, {ops_seen[kind]}", flush=True)  # fmt: skip
    rounds: list[dict[str, Any]] = []
    for i in range(opts.rounds):
        done: dict[str, Any] = {}
        for kind in KINDS if i % 2 == 0 else KINDS[::-1]:
            started = time.perf_counter()
            done[kind] = run_sequence(runs[kind], opts.contexts, opts.chunk, opts.steps)
            print(f"round {i + 1}: {kind} in {time.perf_counter() - started:.1f} s, load "
                  f"{os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
        rounds.append(done)
    summary = summarise(rounds, opts.contexts)
    file_bytes = {kind: layer_file_bytes(opts.gguf, layers[kind]) for kind in KINDS}
    text = report(opts.gguf, layers, recipe.facts, file_bytes, ops_seen, summary, opts, info)
    text += f"\nLoad average at the end: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}.\n"
    data = {
        "file": str(opts.gguf),
        "layers": layers,
        "fused_ops": ops_seen,
        "file_bytes": file_bytes,
        "summary": summary,
        "rounds": rounds,
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
    }
    save(opts.results, opts.name, text, data, opts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
