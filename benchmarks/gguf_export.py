"""Peak memory of exporting one stage straight from a big GGUF file (``--weights gguf``).

The issue's target: exporting stage K of a split holds at most
``1.25 x (stage-K/model.bin + model.xml) + 1.5 GiB`` (peak RSS), i.e. one stage's weights and a
fixed allowance, never the model's. This checks it on a Llama-3-8B-shaped Q4_K_M file without
downloading one: random but valid quantized blocks, packed directly (no float quantization),
with a tiny BPE tokenizer padded to the model's 128256 rows and a chat template, so the export
and a served ring run as they would on the real file (the text is meaningless).

  pipeshard bench gguf-export write FILE.gguf [--layers 32 --hidden 4096 ...]
      a Llama-3-8B-shaped Q4_K_M GGUF (~4.9 GB), streamed in chunks of --chunk-mib;
      ``--model qwen3-30b-a3b`` a Qwen3-MoE file; ``--model glm-4.5-air`` a glm4moe file of
      exporter.presets' GLM-4.5-Air (the first layer dense, 128 experts of 1408 channels, 8 a
      token, a shared expert, sigmoid routing with its correction bias, q/k/v biases, half of
      each head rotating; ~1.4 GB a layer), cut to --layers N; --experts, --experts-per-token,
      --expert-intermediate (and --first-dense) reshape the experts for tests;
      ``--model qwen3.6-35b-a3b`` a qwen35moe file of exporter.presets' Qwen3.6-35B-A3B (3
      Gated DeltaNet layers then 1 gated full-attention layer, 256 experts of 512 channels, 8 a
      token, a gated shared expert; ~0.5 GB a layer), cut to --layers N; --linear-key-heads,
      --linear-value-heads, --linear-head-dim reshape its linear attention for tests;
      ``--model gpt-oss-20b`` a gpt-oss file of exporter.presets' gpt-oss-20b as ggml-org's
      MXFP4 release stores it (32 experts of 2880 channels, 4 a token, MXFP4 experts with F32
      biases, every other matrix Q8_0, attention sinks, sliding window on every other layer,
      YaRN RoPE; ~0.45 GB a layer), cut to --layers N
  pipeshard bench gguf-export measure FILE.gguf --out DIR [--stages 4] [--serve]
      for each stage K, in a fresh process: ``/usr/bin/time -v pipeshard export FILE --stages 4
      --stage K --out DIR --quiet``; peak RSS (and an RSS timeline sampled every 0.2 s), the
      stage's IR bytes, wall time, the bound; a markdown table + JSON in --results DIR
      (``<name>-<date>.md/.json``, default: the current directory). --serve then starts the
      stages (``pipeshard stage --threads 1``) and a gateway (``pipeshard serve``), sends one
      8-token chat completion and reports that it answered and each stage's RSS.
  pipeshard bench gguf-export plan [--model qwen3-30b-a3b] [--node-memory 16GB,16GB]
      no file: the split a ``--stages 4`` (or ``--node-memory``) export of a Llama-3-70B-,
      Qwen3-30B-A3B- or Qwen3-235B-A22B-shaped Q4_K_M GGUF would use, each stage's GGUF and
      IR bytes from its tensors' types (IR: Q4_K 0.67 B/weight as u4 codes + f32 scale per
      32 + u8 minimum codes per 32 and an f32 dmin per 256 (experts: 0.75, the exact form),
      Q6_K 1.25 as i8 + f32 scale per 16, Q8_0 1.125, F16 2, F32 4), what a decoded token
      reads, and the export memory the target allows it (1.25 x IR + 1.5 GiB).
  pipeshard bench gguf-export dense-moe EXPORT --out DIR
      a copy of an MoE export in the dense form: each expert block's one-input Swish becomes
      the two-input form (beta 1.0), the same arithmetic, which OpenVINO's CPU MoE fusion
      (ConvertTiledMoeBlockToGatherMatmuls) does not match, so every expert is computed for
      every token as the tiled graph says; time it against the export with
      ``pipeshard bench gguf-speed`` to see what the sparse GatherMatmul form saves.

Types follow llama-quantize's Q4_K_M: token_embd Q4_K, output Q6_K, attn_v and ffn_down Q6_K on
the layers its ``use_more_bits`` picks (the first and last eighth, every third in between), the
other matrices Q4_K (a hybrid's attn_qkv Q5_K), norms, biases, routers and convolutions F32; a
row that is not a multiple of 256 (GLM's 1408-channel experts, a dense 12672-channel ffn_down)
takes Q5_0 for Q4_K, Q5_1 for Q5_K and Q8_0 for Q6_K. gpt-oss is written as released (MXFP4).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from benchmarks.processes import PIPESHARD
from benchmarks.report import add_results_option, describe, machine, save

GIB = 2**30
QK_K = 256
# GGUF bytes per weight (block bytes / block length)
GGUF_BYTES = {
    "Q4_K": 144 / 256,
    "Q5_K": 176 / 256,
    "Q6_K": 210 / 256,
    "Q5_0": 22 / 32,
    "Q5_1": 24 / 32,
    "Q8_0": 34 / 32,
    "MXFP4": 17 / 32,
    "F16": 2.0,
    "F32": 4.0,
}
# Elements a block holds (the K-quants' super-block, or 32)
BLOCK = {
    "Q4_K": QK_K, "Q5_K": QK_K, "Q6_K": QK_K, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "MXFP4": 32
}  # fmt: skip
# llama-quantize's types for a row that is not a multiple of 256 (a K-quant's super-block)
K_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}
# IR bytes per weight as the exporter keeps the blocks (--gguf-form split)
# Q4_K: u4 codes 0.5 + f32 scale per 32 + the minimums as u8 codes per 32 and an f32 dmin per 256
IR_BYTES = {
    "Q4_K": 0.5 + 4 / 32 + 1 / 32 + 4 / 256,
    "Q5_K": 1 + 4 / 32 + 1 / 32 + 4 / 256,
    "Q6_K": 1.25,
    "Q5_0": 1.125,
    "Q5_1": 1 + 4 / 32 + 2 / 32,
    "Q8_0": 1.125,
    "MXFP4": 1.125,  # i8 codes + an f32 scale per 32 (the experts' exact form)
    "F16": 2.0,
    "F32": 4.0,
}
# MoE experts take the exact form (GatherMatmul): u4 codes + f32 scale and f32 zero point per 32
EXPERT_Q4_K_IR_BYTES = 0.5 + 4 / 32 + 4 / 32
BOUND_FACTOR = 1.25
BOUND_ALLOWANCE = 1.5 * GIB


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float = 1e-5
    # mixture of experts (Qwen3-MoE): every layer's MLP is this many experts of this width
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    # a dense Qwen3 instead of a Llama: per-head q/k norms, and heads x head_dim need not be
    # hidden (transformers refuses such a Llama config, e.g. GLM-4.5-Air's 96 x 128 over 4096)
    qwen3: bool = False


LLAMA3_8B = Shape(32, 4096, 14336, 32, 8, 128, 128256, 8192, 500000.0)
LLAMA3_70B = Shape(80, 8192, 28672, 64, 8, 128, 128256, 8192, 500000.0)
QWEN3_30B_A3B = Shape(48, 2048, 6144, 32, 4, 128, 151936, 8192, 1e6, 1e-6, 128, 8, 768)
QWEN3_235B_A22B = Shape(94, 4096, 12288, 64, 4, 128, 151936, 8192, 1e6, 1e-6, 128, 8, 1536)
PLAN_SHAPES = {
    "llama3-70b": ("Llama-3-70B", LLAMA3_70B),
    "qwen3-30b-a3b": ("Qwen3-30B-A3B", QWEN3_30B_A3B),
    "qwen3-235b-a22b": ("Qwen3-235B-A22B", QWEN3_235B_A22B),
}


@dataclass(frozen=True)
class Tensor:
    name: str  # llama.cpp's name
    shape: tuple[int, ...]  # numpy order: (rows, cols) or (n,)
    type: str  # GGML type name
    layer: int | None  # None: token_embd, output_norm, output

    @property
    def elements(self) -> int:
        return int(np.prod(self.shape))

    @property
    def gguf_bytes(self) -> int:
        return round(self.elements * GGUF_BYTES[self.type])

    @property
    def ir_bytes(self) -> int:
        if len(self.shape) == 3 and self.type == "Q4_K":  # experts: the exact form
            return round(self.elements * EXPERT_Q4_K_IR_BYTES)
        return round(self.elements * IR_BYTES[self.type])


# ------------------------------------------------------------------------------ the layout


def use_more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's rule for the layers whose attn_v and ffn_down get Q6_K in Q4_K_M."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2


def q4_k_m_tensors(shape: Shape) -> list[Tensor]:
    """The tensors of a Llama GGUF quantized as Q4_K_M, in file order (llama.cpp's names from
    exporter.families.gguf_names)."""
    from exporter.families.gguf_names import tensor_name

    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out = [Tensor(tensor_name("TOKEN_EMBD"), (shape.vocab, h), "Q4_K", None)]
    for i in range(shape.layers):
        more = "Q6_K" if use_more_bits(i, shape.layers) else "Q4_K"

        def t(kind: str, dims: tuple[int, ...], type_name: str, layer: int = i) -> Tensor:
            return Tensor(tensor_name(kind, layer), dims, type_name, layer)

        out += [
            t("ATTN_NORM", (h,), "F32"),
            t("ATTN_Q", (q, h), "Q4_K"),
            t("ATTN_K", (kv, h), "Q4_K"),
            t("ATTN_V", (kv, h), more),
            t("ATTN_OUT", (h, q), "Q4_K"),
            t("FFN_NORM", (h,), "F32"),
        ]
        if shape.experts or shape.qwen3:  # Qwen3(-MoE): q/k norms
            out += [
                t("ATTN_Q_NORM", (shape.head_dim,), "F32"),
                t("ATTN_K_NORM", (shape.head_dim,), "F32"),
            ]
        if shape.experts:  # llama.cpp's stacked experts, router F32
            e, mid = shape.experts, shape.expert_intermediate
            out += [
                t("FFN_GATE_INP", (e, h), "F32"),
                t("FFN_GATE_EXP", (e, mid, h), "Q4_K"),
                t("FFN_UP_EXP", (e, mid, h), "Q4_K"),
                t("FFN_DOWN_EXP", (e, h, mid), more),
            ]
            continue
        out += [
            t("FFN_GATE", (shape.intermediate, h), "Q4_K"),
            t("FFN_UP", (shape.intermediate, h), "Q4_K"),
            t("FFN_DOWN", (h, shape.intermediate), more),
        ]
    out += [
        Tensor(tensor_name("OUTPUT_NORM"), (h,), "F32", None),
        Tensor(tensor_name("OUTPUT"), (shape.vocab, h), "Q6_K", None),
    ]
    return [_fallback(t) for t in out]


def _fallback(t: Tensor) -> Tensor:
    """A K-quant tensor whose rows are not a multiple of 256 (e.g. an ffn_down of 12672
    channels) as llama-quantize stores it: Q4_K -> Q5_0, Q6_K -> Q8_0."""
    if t.type in K_FALLBACK and t.shape[-1] % QK_K:
        return Tensor(t.name, t.shape, K_FALLBACK[t.type], t.layer)
    return t


def preset_tensors(preset: Any) -> list[Tensor]:
    """A preset's GGUF tensors in llama-quantize's Q4_K_M mix (exporter.presets' table; GLM: the
    first layers dense, experts and the shared expert, q/k/v biases, the router's correction
    bias, ffn_down of 1408 or 10944 channels falling back to Q5_0 / Q8_0; Qwen3.5: Gated
    DeltaNet and gated full-attention layers, a gated shared expert), the NextN/MTP layers left
    out."""
    from exporter.presets import typed_tensors

    return [
        Tensor(t.tensor.name, t.tensor.shape, t.type, t.tensor.layer)
        for t in typed_tensors(preset, "Q4_K_M")
    ]


def stage_tensors(tensors: list[Tensor], start: int, end: int, last: bool) -> list[Tensor]:
    """What a stage of layers [start, end) reads: its layers, + the embedding on the first,
    + the final norm and head on the last."""
    picked = []
    for t in tensors:
        if t.layer is not None:
            if start <= t.layer < end:
                picked.append(t)
        elif t.name == "token_embd.weight":
            if start == 0:
                picked.append(t)
        elif last:
            picked.append(t)
    return picked


# ------------------------------------------------------------------------------ write


def _k_quant_blocks(
    rng: np.random.Generator, n: int, size: int, d_range: tuple[float, float], centre: float
) -> np.ndarray:
    """``n`` random Q4_K / Q5_K blocks of ``size`` bytes: f16 ``d`` drawn from ``d_range`` and
    f16 ``dmin = centre * d``, which centres the weights; every other bit random."""
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    d = rng.uniform(*d_range, n).astype(np.float16)
    blocks[:, 0:2] = d.view(np.uint8).reshape(n, 2)
    blocks[:, 2:4] = (d.astype(np.float32) * centre).astype(np.float16).view(np.uint8).reshape(n, 2)
    return blocks


def _random_blocks(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    """``n`` valid blocks of ``kind`` with weights of roughly +-0.02."""
    if kind == "Q5_0":
        # f16 d, 4 bytes of high bits, 16 bytes of nibbles; w = d*(q-16), q in 0..31
        blocks = rng.integers(0, 256, (n, 22), dtype=np.uint8)
        d = (rng.uniform(0.8e-3, 1.6e-3, n)).astype(np.float16)
        blocks[:, 0:2] = d.view(np.uint8).reshape(n, 2)
        return blocks
    if kind == "Q8_0":
        # f16 d, 32 int8; w = d*q
        blocks = rng.integers(0, 256, (n, 34), dtype=np.uint8)
        d = (rng.uniform(1e-4, 2e-4, n)).astype(np.float16)
        blocks[:, 0:2] = d.view(np.uint8).reshape(n, 2)
        return blocks
    if kind == "Q4_K":
        # f16 d, f16 dmin, 12 bytes of 6-bit scales/mins (any bits are valid), 128 nibbles;
        # w = d*sc*q - dmin*m: dmin = 7.5 d centres it (sc, m average 31.5, q 7.5)
        return _k_quant_blocks(rng, n, 144, (2e-5, 6e-5), 7.5)
    if kind == "Q5_1":
        # f16 d, f16 m, 4 bytes of high bits, 16 bytes of nibbles; w = d*q + m, q in 0..31
        blocks = rng.integers(0, 256, (n, 24), dtype=np.uint8)
        d = (rng.uniform(0.8e-3, 1.6e-3, n)).astype(np.float16)
        blocks[:, 0:2] = d.view(np.uint8).reshape(n, 2)
        blocks[:, 2:4] = (
            (-15.5 * d.astype(np.float32)).astype(np.float16).view(np.uint8).reshape(n, 2)
        )
        return blocks
    if kind == "Q5_K":
        # as Q4_K with a fifth bit (32 bytes qh before the 128 of nibbles): q in 0..31,
        # dmin = 15.5 d centres it
        return _k_quant_blocks(rng, n, 176, (1e-5, 3e-5), 15.5)
    if kind == "Q6_K":
        # 128 bytes ql, 64 qh, 16 int8 scales, f16 d; w = d*sc*(q-32)
        blocks = rng.integers(0, 256, (n, 210), dtype=np.uint8)
        d = (rng.uniform(0.5e-5, 1.5e-5, n)).astype(np.float16)
        blocks[:, 208:210] = d.view(np.uint8).reshape(n, 2)
        return blocks
    if kind == "MXFP4":
        # e8m0 exponent e, 16 bytes of e2m1 nibbles; w = 2^(e-128) * doubled value (0..12):
        # e 119..121 gives about +-0.02 (gpt-oss's released experts are of that size)
        blocks = rng.integers(0, 256, (n, 17), dtype=np.uint8)
        blocks[:, 0] = rng.integers(119, 122, n, dtype=np.uint8)
        return blocks
    raise ValueError(kind)


def _chunks(rng: np.random.Generator, t: Tensor, chunk_bytes: int) -> Iterator[np.ndarray]:
    """The tensor's data, a few rows at a time."""
    if t.type == "F32":  # norms: around 1, as trained models have them; routers, biases: small
        if t.name.endswith(".ssm_a"):  # Gated DeltaNet's A as stored, -exp(A_log): a decay < 1
            yield -np.exp(rng.normal(0.0, 0.5, t.shape)).astype(np.float32)
            return
        small = (
            "ffn_gate_inp" in t.name
            or t.name.endswith((".bias", "attn_sinks.weight"))
            or "ssm_conv1d" in t.name
        )
        mean, spread = (0.0, 0.02) if small else (1.0, 0.1)
        yield rng.normal(mean, spread, t.shape).astype(np.float32)
        return
    rows, cols = int(np.prod(t.shape[:-1])), t.shape[-1]  # experts: their rows one after another
    if cols % BLOCK[t.type]:
        raise SystemExit(f"{t.name}: {cols} columns is not a multiple of {t.type}'s block")
    row_blocks = cols // BLOCK[t.type]
    row_bytes = round(cols * GGUF_BYTES[t.type])
    step = max(1, chunk_bytes // row_bytes)
    for lo in range(0, rows, step):
        n = min(rows, lo + step) - lo
        yield _random_blocks(rng, n * row_blocks, t.type)


def write_gguf(path: Path, shape: Shape, seed: int, chunk_mib: int) -> int:
    """Write a Llama (or, with experts, Qwen3-MoE) file, tensor data streamed chunk by chunk;
    its size in bytes."""
    import gguf

    if shape.hidden % QK_K or shape.intermediate % 32:
        raise SystemExit("--hidden must be a multiple of 256 (K-quants), --intermediate of 32")
    arch = "qwen3moe" if shape.experts else "qwen3" if shape.qwen3 else "llama"

    def metadata(writer: Any) -> None:
        writer.add_context_length(shape.context)
        writer.add_embedding_length(shape.hidden)
        writer.add_block_count(shape.layers)
        writer.add_feed_forward_length(shape.intermediate)
        writer.add_head_count(shape.heads)
        writer.add_head_count_kv(shape.kv_heads)
        writer.add_rope_freq_base(shape.rope_theta)
        writer.add_layer_norm_rms_eps(shape.rms_eps)
        if shape.head_dim != shape.hidden // shape.heads or arch != "llama":
            writer.add_key_length(shape.head_dim)
            writer.add_value_length(shape.head_dim)
        if shape.experts:
            writer.add_expert_count(shape.experts)
            writer.add_expert_used_count(shape.experts_per_token)
            writer.add_expert_feed_forward_length(shape.expert_intermediate)
        elif arch == "llama":
            writer.add_vocab_size(shape.vocab)
            writer.add_rope_dimension_count(shape.head_dim)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    name = f"{arch}-shaped-{shape.layers}L-random"
    tensors = q4_k_m_tensors(shape)
    return _write_file(path, arch, name, shape.vocab, tensors, metadata, seed, chunk_mib)


@dataclass(frozen=True)
class GlmFile:
    """What a glm4moe GGUF states besides exporter.presets' shape: GLM-4.5-Air's config.json
    (rope_theta 1e6, rms_norm_eps 1e-5, partial_rotary_factor 0.5, routed_scaling_factor 1.0,
    n_group = topk_group = 1, norm_topk_prob true; from memory), and a shorter context than its
    131072, as the Qwen3 cut has (the weights do not depend on it)."""

    context: int = 8192
    rope_theta: float = 1e6
    rms_eps: float = 1e-5
    rotary_fraction: float = 0.5
    routed_scaling: float = 1.0


def write_glm_gguf(path: Path, preset: Any, file: GlmFile, seed: int, chunk_mib: int) -> int:
    """Write a glm4moe file of ``preset``'s shape (exporter.presets, e.g. GLM-4.5-Air cut to a
    few layers) with the metadata convert_hf_to_gguf's Glm4MoeModel writes; its size in bytes."""
    import gguf

    if preset.hidden % QK_K:
        raise SystemExit("--hidden must be a multiple of 256 (K-quants)")

    def metadata(writer: Any) -> None:
        writer.add_context_length(file.context)
        writer.add_embedding_length(preset.hidden)
        writer.add_block_count(preset.layers)  # no NextN layer after them
        writer.add_feed_forward_length(preset.intermediate)
        writer.add_head_count(preset.heads)
        writer.add_head_count_kv(preset.kv_heads)
        writer.add_rope_freq_base(file.rope_theta)
        writer.add_layer_norm_rms_eps(file.rms_eps)
        writer.add_key_length(preset.head_dim)
        writer.add_value_length(preset.head_dim)
        writer.add_rope_dimension_count(int(preset.head_dim * file.rotary_fraction))
        writer.add_expert_count(preset.experts)
        writer.add_expert_used_count(preset.experts_per_token)
        writer.add_expert_feed_forward_length(preset.expert_intermediate)
        writer.add_expert_shared_count(1 if preset.shared_expert_intermediate else 0)
        writer.add_leading_dense_block_count(preset.first_dense)
        writer.add_expert_weights_scale(file.routed_scaling)
        writer.add_expert_weights_norm(True)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_group_count(1)
        writer.add_expert_group_used_count(1)
        writer.add_nextn_predict_layers(0)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    name = f"glm4moe-shaped-{preset.layers}L-random"
    tensors = preset_tensors(preset)
    return _write_file(path, "glm4moe", name, preset.vocab, tensors, metadata, seed, chunk_mib)


@dataclass(frozen=True)
class HybridFile:
    """What a qwen35moe GGUF states besides exporter.presets' shape: Qwen3.5-MoE's config.json
    (rope_theta 1e7, rms_norm_eps 1e-6, partial_rotary_factor 0.25, M-RoPE sections 11/11/10,
    interleaved; from memory), and a shorter context than its 262144, as the other cuts have
    (the weights do not depend on it)."""

    context: int = 32768
    rope_theta: float = 1e7
    rms_eps: float = 1e-6
    rotary_fraction: float = 0.25
    sections: tuple[int, ...] = (11, 11, 10, 0)


def write_hybrid_gguf(path: Path, preset: Any, file: HybridFile, seed: int, chunk_mib: int) -> int:
    """Write a qwen35moe file of ``preset``'s shape (exporter.presets, e.g. Qwen3.6-35B-A3B cut
    to a few layers) with the metadata llama.cpp's converter writes for Qwen3.5-MoE
    (conversion/qwen.py: Qwen3NextModel's ssm keys, Qwen2MoeModel's experts), no MTP layer;
    its size in bytes."""
    import gguf

    if preset.hidden % QK_K:
        raise SystemExit("--hidden must be a multiple of 256 (K-quants)")
    if preset.model_type != "qwen3_5_moe":
        raise SystemExit(f"{preset.name}: no hybrid writer for {preset.model_type}")

    def metadata(writer: Any) -> None:
        writer.add_context_length(file.context)
        writer.add_embedding_length(preset.hidden)
        writer.add_block_count(preset.layers)  # no MTP layer after them
        writer.add_head_count(preset.heads)
        writer.add_head_count_kv(preset.kv_heads)
        writer.add_rope_freq_base(file.rope_theta)
        writer.add_layer_norm_rms_eps(file.rms_eps)
        writer.add_key_length(preset.head_dim)
        writer.add_value_length(preset.head_dim)
        writer.add_ssm_conv_kernel(preset.conv_kernel)
        writer.add_ssm_state_size(preset.linear_key_dim)
        writer.add_ssm_group_count(preset.linear_key_heads)
        writer.add_ssm_time_step_rank(preset.linear_value_heads)
        writer.add_ssm_inner_size(preset.linear_value_dim * preset.linear_value_heads)
        writer.add_full_attention_interval(preset.full_attention_interval)
        writer.add_rope_dimension_count(int(preset.head_dim * file.rotary_fraction))
        writer.add_rope_dimension_sections(list(file.sections))
        writer.add_nextn_predict_layers(0)
        writer.add_expert_count(preset.experts)
        writer.add_expert_used_count(preset.experts_per_token)
        writer.add_expert_feed_forward_length(preset.expert_intermediate)
        writer.add_expert_shared_feed_forward_length(preset.shared_expert_intermediate)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    name = f"qwen35moe-shaped-{preset.layers}L-random"
    tensors = preset_tensors(preset)
    return _write_file(path, "qwen35moe", name, preset.vocab, tensors, metadata, seed, chunk_mib)


@dataclass(frozen=True)
class GptOssFile:
    """What a gpt-oss GGUF states besides exporter.presets' shape: gpt-oss's config.json
    (rope_theta 150000, rms_norm_eps 1e-5, YaRN factor 32 over 4096 original positions,
    beta_fast 32, beta_slow 1, sliding_window 128; from memory), and a shorter context than its
    131072, as the other cuts have (the weights do not depend on it)."""

    context: int = 32768
    rope_theta: float = 150000.0
    rms_eps: float = 1e-5
    yarn_factor: float = 32.0
    yarn_original_context: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0


def write_gpt_oss_gguf(path: Path, preset: Any, file: GptOssFile, seed: int, chunk_mib: int) -> int:
    """Write a gpt-oss file of ``preset``'s shape (exporter.presets, e.g. gpt-oss-20b cut to a
    few layers) with the metadata convert_hf_to_gguf's GptOssModel writes, the tensors typed
    as ggml-org's MXFP4 release (experts MXFP4, their biases F32, other matrices Q8_0); its
    size in bytes."""
    import gguf

    if preset.model_type != "gpt_oss":
        raise SystemExit(f"{preset.name}: no gpt-oss writer for {preset.model_type}")
    if preset.hidden % 32 or preset.expert_intermediate % 32:
        raise SystemExit("--hidden and --expert-intermediate must be multiples of 32 (MXFP4)")

    def metadata(writer: Any) -> None:
        writer.add_context_length(file.context)
        writer.add_embedding_length(preset.hidden)
        writer.add_block_count(preset.layers)
        writer.add_feed_forward_length(preset.expert_intermediate)  # intermediate_size
        writer.add_head_count(preset.heads)
        writer.add_head_count_kv(preset.kv_heads)
        writer.add_rope_freq_base(file.rope_theta)
        writer.add_layer_norm_rms_eps(file.rms_eps)
        writer.add_key_length(preset.head_dim)
        writer.add_value_length(preset.head_dim)
        writer.add_expert_count(preset.experts)
        writer.add_expert_used_count(preset.experts_per_token)
        writer.add_expert_feed_forward_length(preset.expert_intermediate)
        writer.add_sliding_window(preset.sliding_window)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(file.yarn_factor)
        writer.add_rope_scaling_orig_ctx_len(file.yarn_original_context)
        writer.add_rope_scaling_yarn_beta_fast(file.yarn_beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(file.yarn_beta_slow)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    from exporter.presets import typed_tensors

    tensors = [
        Tensor(t.tensor.name, t.tensor.shape, t.type, t.tensor.layer)
        for t in typed_tensors(preset, "MXFP4")
    ]
    name = f"gpt-oss-shaped-{preset.layers}L-random"
    file_type = int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    return _write_file(
        path, "gpt-oss", name, preset.vocab, tensors, metadata, seed, chunk_mib, file_type
    )


def _write_file(
    path: Path,
    arch: str,
    name: str,
    vocab: int,
    tensors: list[Tensor],
    metadata: Any,
    seed: int,
    chunk_mib: int,
    file_type: int | None = None,
) -> int:
    import gguf

    from benchmarks.fixtures import use_testing_support

    use_testing_support()
    from testing_support.tiny_gguf import FILE_TYPES, write_tokenizer
    from testing_support.tiny_models import CHAT_TEMPLATE, VOCAB, make_tokenizer

    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name)
    metadata(writer)
    writer.add_file_type(FILE_TYPES["Q4_K_M"] if file_type is None else file_type)
    with tempfile.TemporaryDirectory() as tmp:
        # the tiny BPE tokenizer, padded to the model's rows with placeholders as llama.cpp does
        make_tokenizer(Path(tmp), VOCAB, CHAT_TEMPLATE)
        write_tokenizer(writer, Path(tmp), vocab)
    for t in tensors:
        writer.add_tensor_info(
            t.name, t.shape, np.dtype(np.float32), t.gguf_bytes, gguf.GGMLQuantizationType[t.type]
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None
    fout = writer.fout[0]
    writer.write_padding(fout, fout.tell())
    rng = np.random.default_rng(seed)
    total = sum(t.gguf_bytes for t in tensors)
    done, started = 0, time.monotonic()
    for t in tensors:
        written = 0
        for chunk in _chunks(rng, t, chunk_mib << 20):
            chunk.tofile(fout)
            written += chunk.nbytes
        if written != t.gguf_bytes:
            raise AssertionError(f"{t.name}: wrote {written} bytes, expected {t.gguf_bytes}")
        writer.write_padding(fout, written)
        done += written
        if t.name.endswith(("ffn_down.weight", "ffn_down_exps.weight")) or t.layer is None:
            print(
                f"\r{done / 1e9:6.2f} / {total / 1e9:.2f} GB  {time.monotonic() - started:5.0f} s",
                end="",
                flush=True,
            )
    writer.close()
    print()
    return path.stat().st_size


# ------------------------------------------------------------------------------ measure


def _bound(ir_bytes: int) -> float:
    return BOUND_FACTOR * ir_bytes + BOUND_ALLOWANCE


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                text = Path(f"/proc/{pid}/task/{task}/children").read_text()
                kids += [int(k) for k in text.split()]
    return kids


def _status_kib(pid: int, key: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


class _Sampler(threading.Thread):
    """RSS of a process and its descendants every ``period`` seconds."""

    def __init__(self, pid: int, period: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pid, self.period = pid, period
        self.samples: list[tuple[float, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        while not self.done.is_set():
            pids, todo = [], [self.pid]
            while todo:
                p = todo.pop()
                pids.append(p)
                todo += _children(p)
            rss = sum(_status_kib(p, "VmRSS") for p in pids if p != self.pid) * 1024
            self.samples.append((round(time.monotonic() - started, 2), rss))
            self.done.wait(self.period)


def _time_field(text: str, label: str) -> str:
    match = re.search(rf"^\s*{re.escape(label)}.*?:\s*(\S+)\s*$", text, re.MULTILINE)
    if not match:
        raise RuntimeError(f"/usr/bin/time printed no {label!r}:\n{text[-2000:]}")
    return match.group(1)


def _seconds(clock: str) -> float:
    total = 0.0
    for part in clock.split(":"):
        total = total * 60 + float(part)
    return total


def _export_env(cache: Path) -> dict[str, str]:
    return {**os.environ, "PIPESHARD_CACHE_DIR": str(cache)}


def measure_stage(
    gguf_file: Path, out: Path, stages: int, stage: int, cache: Path, extra: list[str]
) -> dict[str, Any]:
    """One ``pipeshard export --stage`` run under /usr/bin/time -v."""
    command = [
        "/usr/bin/time",
        "-v",
        PIPESHARD,
        "export",
        str(gguf_file),
        "--stages",
        str(stages),
        "--stage",
        str(stage),
        "--out",
        str(out),
        "--quiet",
        *extra,
    ]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_export_env(cache)
    )
    sampler = _Sampler(proc.pid)
    sampler.start()
    stdout, stderr = proc.communicate()
    sampler.done.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"stage {stage} export failed ({proc.returncode}):\n{stdout}\n{stderr}")
    peak = int(_time_field(stderr, "Maximum resident set size")) * 1024
    wall = _seconds(_time_field(stderr, "Elapsed (wall clock) time"))
    folder = out / f"stage-{stage}"
    ir = sum((folder / n).stat().st_size for n in ("model.bin", "model.xml"))
    peak_at = max(sampler.samples, key=lambda s: s[1])[0] if sampler.samples else None
    return {
        "stage": stage,
        "command": " ".join(command[2:]),
        "ir_bytes": ir,
        "peak_rss_bytes": peak,
        "bound_bytes": int(_bound(ir)),
        "passed": peak <= _bound(ir),
        "wall_s": wall,
        "user_s": float(_time_field(stderr, "User time (seconds)")),
        "system_s": float(_time_field(stderr, "System time (seconds)")),
        "peak_sampled_at_s": peak_at,
        # the RSS timeline, thinned to at most ~300 points
        "rss_timeline": sampler.samples[:: max(1, len(sampler.samples) // 300)],
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_ring(out: Path, stages: int, kv_cache_gib: float, timeout: float) -> dict[str, Any]:
    """Start the stages and a gateway, send one chat completion, report it and the RSS."""
    import httpx

    pipeshard = PIPESHARD
    logs = out.parent / f"{out.name}-serve-logs"
    logs.mkdir(parents=True, exist_ok=True)
    ports = [_free_port() for _ in range(stages)]
    http_port = _free_port()
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []
    commands = []
    result: dict[str, Any] = {"answered": False}
    started = time.monotonic()
    try:
        for k, port in enumerate(ports):
            cmd = [
                pipeshard,
                "stage",
                "--shards",
                str(out),
                "--stage",
                str(k),
                "--listen",
                f"127.0.0.1:{port}",
                "--threads",
                "1",
                "--kv-cache-size",
                str(kv_cache_gib),
            ]
            commands.append(" ".join(cmd[1:]))
            log = (logs / f"stage-{k}.log").open("wb")
            procs.append((f"stage {k}", subprocess.Popen(cmd, stdout=log, stderr=log)))
        cmd = [
            pipeshard,
            "serve",
            "--stages",
            ",".join(f"127.0.0.1:{p}" for p in ports),
            "--listen",
            f"127.0.0.1:{http_port}",
            "--speculation",
            "off",
            "--start-timeout",
            str(timeout),
        ]
        commands.append(" ".join(cmd[1:]))
        log = (logs / "gateway.log").open("wb")
        procs.append(("gateway", subprocess.Popen(cmd, stdout=log, stderr=log)))
        result["commands"] = commands
        url = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + timeout
        while True:
            for name, p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited ({p.returncode}); logs in {logs}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the ring was not ready in {timeout:.0f} s; logs in {logs}")
            time.sleep(2)
        result["ready_s"] = round(time.monotonic() - started, 1)
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8,
            "temperature": 0,
        }
        t0 = time.monotonic()
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)
        result["request_s"] = round(time.monotonic() - t0, 2)
        result["status"] = reply.status_code
        data = reply.json()
        result["reply"] = data
        result["answered"] = reply.status_code == 200 and bool(data.get("choices"))
        if result["answered"]:
            result["text"] = data["choices"][0]["message"]["content"]
            result["usage"] = data.get("usage")
        result["rss"] = {
            name: {
                "rss_bytes": _status_kib(p.pid, "VmRSS") * 1024,
                "peak_rss_bytes": _status_kib(p.pid, "VmHWM") * 1024,
            }
            for name, p in procs
        }
    except (RuntimeError, httpx.HTTPError, ValueError, KeyError) as exc:
        result["error"] = str(exc)
    finally:
        for _, p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for _, p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    result["logs"] = str(logs)
    return result


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def measure_report(rows: list[dict[str, Any]], layers: dict[int, str], info: str) -> str:
    lines = [
        "# GGUF export: peak memory per stage",
        "",
        f"Host: {info}",
        "",
        "Target per stage: peak RSS <= 1.25 x IR (stage-K/model.bin + model.xml) + 1.5 GiB.",
        "",
        "| stage | layers | IR GiB | IR GiB (estimate) | peak RSS GiB | bound GiB | result "
        "| seconds |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | :--- | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['stage']} | {layers[r['stage']]} | {_gib(r['ir_bytes'])} | "
            f"{_gib(r['ir_estimate_bytes'])} | {_gib(r['peak_rss_bytes'])} | "
            f"{_gib(r['bound_bytes'])} | {'pass' if r['passed'] else 'FAIL'} | "
            f"{r['wall_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def serve_report(serve: dict[str, Any]) -> str:
    lines = ["", "## The ring served from the export", ""]
    if not serve.get("answered"):
        lines.append(f"No answer: {serve.get('error') or serve.get('reply')}")
        return "\n".join(lines) + "\n"
    usage = serve.get("usage") or {}
    lines += [
        f"Answered one chat completion (max_tokens 8, greedy) in {serve['request_s']} s, "
        f"{usage.get('completion_tokens')} tokens (random weights: the text means nothing: "
        f"{serve['text']!r}); the ring was ready {serve['ready_s']} s after the start.",
        "",
        "| process | RSS GiB | peak RSS GiB |",
        "| :--- | ---: | ---: |",
    ]
    for name, rss in serve["rss"].items():
        lines.append(f"| {name} | {_gib(rss['rss_bytes'])} | {_gib(rss['peak_rss_bytes'])} |")
    lines += ["", "Commands:", ""] + [f"    pipeshard {c}" for c in serve["commands"]]
    return "\n".join(lines) + "\n"


def read_shape(gguf_file: Path) -> Shape:
    """The shape facts of a GGUF written by ``write`` (metadata only)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_file))

    def field(key: str) -> Any:
        f = reader.fields[key]
        return f.parts[f.data[0]].tolist()[0]

    heads = int(field("llama.attention.head_count"))
    hidden = int(field("llama.embedding_length"))
    return Shape(
        layers=int(field("llama.block_count")),
        hidden=hidden,
        intermediate=int(field("llama.feed_forward_length")),
        heads=heads,
        kv_heads=int(field("llama.attention.head_count_kv")),
        head_dim=int(field("llama.rope.dimension_count")),
        vocab=int(field("llama.vocab_size")),
        context=int(field("llama.context_length")),
        rope_theta=float(field("llama.rope.freq_base")),
    )


def run_measure(opts: argparse.Namespace) -> None:
    from protos.manifest import load_manifest

    gguf_file: Path = opts.file.resolve()
    out: Path = opts.out.resolve()
    if out.exists():
        if not opts.clean:
            raise SystemExit(f"{out} exists: give --clean to delete it first")
        shutil.rmtree(out)
    cache = out.parent / f"{out.name}-cache"  # PIPESHARD_CACHE_DIR: the file's hash and config
    shape = read_shape(gguf_file)
    plans = plan_for(shape, opts.stages)
    tensors = q4_k_m_tensors(shape)
    info = machine()
    rows = []
    layers = {}
    for plan in plans:
        if opts.only is not None and plan.index not in opts.only:
            continue
        print(f"stage {plan.index}: exporting layers {plan.layer_start}-{plan.layer_end - 1}")
        row = measure_stage(gguf_file, out, opts.stages, plan.index, cache, opts.export_arg)
        entry = load_manifest(out).stages[plan.index]
        if (entry.layer_start, entry.layer_end) != (plan.layer_start, plan.layer_end):
            raise RuntimeError(
                f"stage {plan.index}: the export has layers {entry.layer_start}-"
                f"{entry.layer_end - 1}, this script planned "
                f"{plan.layer_start}-{plan.layer_end - 1}"
            )
        last = plan.index == len(plans) - 1
        picked = stage_tensors(tensors, plan.layer_start, plan.layer_end, last)
        row["ir_estimate_bytes"] = sum(t.ir_bytes for t in picked)
        row["gguf_bytes"] = sum(t.gguf_bytes for t in picked)
        row["layers"] = [plan.layer_start, plan.layer_end]
        layers[plan.index] = f"{plan.layer_start}-{plan.layer_end - 1}"
        rows.append(row)
        print(
            f"  IR {_gib(row['ir_bytes'])} GiB, peak RSS {_gib(row['peak_rss_bytes'])} GiB, "
            f"bound {_gib(row['bound_bytes'])} GiB: {'pass' if row['passed'] else 'FAIL'}, "
            f"{row['wall_s']:.1f} s",
            flush=True,
        )
    report = measure_report(rows, layers, describe(info))
    report += (
        f"\nFile: {gguf_file.name}, {gguf_file.stat().st_size / 1e9:.2f} GB "
        f"({shape.layers} layers, hidden {shape.hidden}, intermediate {shape.intermediate}, "
        f"{shape.heads}/{shape.kv_heads} heads, vocab {shape.vocab}; random Q4_K_M blocks).\n"
        "Each stage in a fresh process: `/usr/bin/time -v pipeshard export FILE --stages "
        f"{opts.stages} --stage K --out OUT --quiet` (peak: its 'Maximum resident set size'; "
        "the file's sha256 and config are cached in PIPESHARD_CACHE_DIR after the first "
        "stage).\n"
    )
    data: dict[str, Any] = {"file": str(gguf_file), "shape": asdict(shape), "stages": rows}
    if opts.serve:
        if opts.only is not None:
            raise SystemExit("--serve needs every stage (no --only)")
        serve = serve_ring(out, opts.stages, opts.kv_cache_gib, opts.serve_timeout)
        data["serve"] = serve
        report += serve_report(serve)
    save(opts.results, opts.name, report, data, opts)


# ------------------------------------------------------------------------------ plan


def facts_for(shape: Shape) -> Any:
    from exporter.architectures import ArchitectureFacts

    moe: dict[str, Any] = {}
    if shape.experts:
        moe = dict(
            moe_layers=tuple(range(shape.layers)),
            num_experts=shape.experts,
            experts_per_token=shape.experts_per_token,
            expert_intermediate_size=shape.expert_intermediate,
            norm_topk_prob=True,
        )
    return ArchitectureFacts(
        model_type="qwen3_moe" if shape.experts else "llama",
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab,
        max_context=shape.context,
        layer_types=["full_attention"] * shape.layers,
        sliding_window=None,
        final_logit_softcapping=None,
        intermediate_size=shape.intermediate,
        **moe,
    )


def plan_for(shape: Shape, stages: int, node_memory: list[int] | None = None) -> list[Any]:
    """The exporter's own plan for a GGUF (``--weights gguf``) of this shape: the split it picks
    when given only --stages, or --node-memory (then checked to fit)."""
    from exporter.plan import check_fits, decode_balanced_split, plan_stages, split_for_memory

    facts = facts_for(shape)
    if node_memory:
        split = split_for_memory(facts, node_memory, "gguf", shape.intermediate, shape.context)
    else:
        split = decode_balanced_split(facts, stages, "gguf", shape.intermediate)
    plans = plan_stages(facts, split, "gguf", shape.intermediate, shape.context)
    if node_memory:
        check_fits(plans, node_memory, shape.context)
    return plans


def run_plan(opts: argparse.Namespace) -> None:
    from exporter.errors import ExportError
    from exporter.plan import layer_params, parse_size

    title, default = PLAN_SHAPES[opts.model]
    shape = shape_from(opts, default)
    budgets = [parse_size(s) for s in opts.node_memory.split(",")] if opts.node_memory else None
    stages = len(budgets) if budgets else opts.stages
    tensors = q4_k_m_tensors(shape)
    gguf_total = sum(t.gguf_bytes for t in tensors)
    mlp = (
        f"{shape.experts} experts of {shape.expert_intermediate} channels, "
        f"{shape.experts_per_token} a token"
        if shape.experts
        else f"intermediate {shape.intermediate}"
    )
    on = f"PCs of {opts.node_memory}" if budgets else "the exporter's split for --stages alone"
    lines = [
        f"Export plan: {title}-shaped Q4_K_M GGUF, {shape.layers} layers, hidden "
        f"{shape.hidden}, {mlp}, {shape.heads}/{shape.kv_heads} heads, vocab {shape.vocab}: "
        f"{gguf_total / 1e9:.1f} GB of GGUF, over {stages} stages ({on}, context "
        f"{shape.context}).",
        "",
    ]
    try:
        plans = plan_for(shape, stages, budgets)
    except ExportError as exc:
        print("\n".join([*lines, f"Does not fit: {exc}"]))
        return
    facts = facts_for(shape)
    lines += [
        "| stage | layers | count | GGUF GiB | IR GiB (estimate) | planner's weights GiB "
        "| planner's total GiB (+ KV, runtime) | read a token GiB | export memory GiB "
        "(1.25 x IR + 1.5) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in plans:
        last = p.index == len(plans) - 1
        picked = stage_tensors(tensors, p.layer_start, p.layer_end, last)
        ir = sum(t.ir_bytes for t in picked)
        ratio = ir / max(
            1,
            sum(
                layer_params(facts, shape.intermediate, i)
                for i in range(p.layer_start, p.layer_end)
            ),
        )
        active = ratio * sum(
            layer_params(facts, shape.intermediate, i, active=True)
            for i in range(p.layer_start, p.layer_end)
        )
        if last:
            active += shape.vocab * shape.hidden * IR_BYTES["Q6_K"]
        lines.append(
            f"| {p.index} | {p.layer_start}-{p.layer_end - 1} | {p.layer_end - p.layer_start} | "
            f"{_gib(sum(t.gguf_bytes for t in picked))} | {_gib(ir)} | "
            f"{_gib(p.weight_bytes)} | {_gib(p.total_bytes)} | {_gib(active)} | "
            f"{_gib(_bound(ir))} |"
        )
    lines += [
        "",
        "IR bytes per weight: "
        + ", ".join(f"{k} {v:.4g}" for k, v in IR_BYTES.items())
        + f" (MoE experts' Q4_K: {EXPERT_Q4_K_IR_BYTES:.4g}, the exact form); the planner's "
        "columns are exporter.plan's own estimates (0.9 B per layer weight, 1.2 B per "
        "embedding or head weight; 'read a token': the attention, the token's experts and, "
        "last, the head).",
    ]
    print("\n".join(lines))


# ------------------------------------------------------------------------------ cli


def add_shape_args(p: argparse.ArgumentParser, default: Shape) -> None:
    for name, kind in (
        ("layers", int),
        ("hidden", int),
        ("intermediate", int),
        ("heads", int),
        ("kv-heads", int),
        ("head-dim", int),
        ("vocab", int),
        ("context-length", int),
        ("rope-theta", float),
    ):
        key = name.replace("-", "_")
        value = getattr(default, "context" if key == "context_length" else key)
        p.add_argument(f"--{name}", type=kind, default=None, help=f"default {value}")


def write_dense_moe(export: Path, out: Path) -> None:
    import openvino as ov
    from openvino import opset4

    if out.exists():
        raise SystemExit(f"{out} exists")
    shutil.copytree(export, out, ignore=shutil.ignore_patterns("model.bin", "model.xml", "draft"))
    core = ov.Core()
    for xml in sorted(export.glob("stage-*/model.xml")):
        model = core.read_model(xml)
        swishes = [
            op
            for op in model.get_ordered_ops()
            if op.get_type_name() == "Swish" and op.get_input_size() == 1
        ]
        for op in swishes:
            beta = opset4.constant(np.float32(1.0))
            op.output(0).replace(opset4.swish(op.input_value(0), beta).output(0))
        ov.save_model(model, out / xml.parent.name / "model.xml", compress_to_fp16=False)
        print(f"{xml.parent.name}: {len(swishes)} expert blocks made dense")
    if not any(out.glob("stage-*/model.xml")):
        raise SystemExit(f"{export}: no stage-*/model.xml")


_EXPERT_FLAGS = ("experts", "experts_per_token", "expert_intermediate")


def shape_from(opts: argparse.Namespace, default: Shape) -> Shape:
    """The default shape with the flags given; head_dim follows hidden / heads unless given."""
    values = asdict(default)
    keys = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "rope_theta")
    for key in keys + _EXPERT_FLAGS:
        if getattr(opts, key, None) is not None:
            values[key] = getattr(opts, key)
    if opts.context_length is not None:
        values["context"] = opts.context_length
    reshaped = opts.hidden is not None or opts.heads is not None
    values["head_dim"] = opts.head_dim or (
        values["hidden"] // values["heads"] if reshaped else default.head_dim
    )
    return Shape(**values)


# `write --model NAME`: files of exporter.presets' shapes (glm4moe, qwen35moe)
GLM_PRESETS = {"glm-4.5-air": "glm-4.5-air"}
HYBRID_PRESETS = {"qwen3.6-35b-a3b": "qwen3.6-35b-a3b"}
GPT_OSS_PRESETS = {"gpt-oss-20b": "gpt-oss-20b"}
_LINEAR_FLAGS = ("linear_key_heads", "linear_value_heads")


def _given(opts: argparse.Namespace, keys: tuple[str, ...]) -> dict[str, Any]:
    """The shape flags among ``keys`` that were given, by name."""
    return {key: getattr(opts, key) for key in keys if getattr(opts, key) is not None}


def _cut(preset: Any, values: dict[str, Any]) -> Any:
    """``preset`` with ``values``, refused where no MoE model has that shape."""
    preset = dataclasses.replace(preset, **values)
    if preset.layers < 1 or preset.experts_per_token > preset.experts:
        raise SystemExit("--layers must be at least 1, --experts-per-token at most --experts")
    return preset


_F = TypeVar("_F", HybridFile, GptOssFile, GlmFile)


def _file_flags(file: _F, opts: argparse.Namespace) -> _F:
    """The file's metadata with --context-length and --rope-theta where given."""
    values = {"context": opts.context_length, "rope_theta": opts.rope_theta}
    return dataclasses.replace(file, **{k: v for k, v in values.items() if v is not None})


def hybrid_from(opts: argparse.Namespace) -> tuple[Any, HybridFile]:
    """exporter.presets' Qwen3.5-MoE shape cut to --layers (3 linear-attention layers then a
    full-attention one, as in the model), with the shape flags given (the shared expert keeps
    the routed experts' width)."""
    from exporter.presets import PRESETS

    if opts.first_dense is not None or opts.intermediate is not None:
        raise SystemExit("--first-dense and --intermediate are for the glm shapes")
    if opts.qwen3:
        raise SystemExit("--qwen3 is for the dense shapes")
    preset = PRESETS[HYBRID_PRESETS[opts.model]]
    values = _given(opts, ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab"))
    values |= _given(opts, _EXPERT_FLAGS + _LINEAR_FLAGS)
    if opts.expert_intermediate is not None:
        values["shared_expert_intermediate"] = opts.expert_intermediate
    if opts.linear_head_dim is not None:
        values["linear_key_dim"] = values["linear_value_dim"] = opts.linear_head_dim
    preset = _cut(preset, values)
    if preset.linear_value_heads % preset.linear_key_heads:
        raise SystemExit("--linear-value-heads must be a multiple of --linear-key-heads")
    return preset, _file_flags(HybridFile(), opts)


def gpt_oss_from(opts: argparse.Namespace) -> tuple[Any, GptOssFile]:
    """exporter.presets' gpt-oss shape cut to --layers (sliding and full attention alternate,
    the first sliding, as in the model), with the shape flags given (--expert-intermediate is
    its intermediate_size)."""
    from exporter.presets import PRESETS

    if any(getattr(opts, key) is not None for key in (*_LINEAR_FLAGS, "linear_head_dim")):
        raise SystemExit("--linear-* are for the hybrid shapes")
    if opts.first_dense is not None or opts.intermediate is not None:
        raise SystemExit("--first-dense and --intermediate are for the glm shapes")
    if opts.qwen3:
        raise SystemExit("--qwen3 is for the dense shapes")
    preset = PRESETS[GPT_OSS_PRESETS[opts.model]]
    keys = ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", *_EXPERT_FLAGS)
    return _cut(preset, _given(opts, keys)), _file_flags(GptOssFile(), opts)


def glm_from(opts: argparse.Namespace) -> tuple[Any, GlmFile]:
    """exporter.presets' shape cut to --layers (the first layer dense as in the model), with
    the shape flags given (the shared expert keeps the routed experts' width)."""
    from exporter.presets import PRESETS

    if any(getattr(opts, key) is not None for key in (*_LINEAR_FLAGS, "linear_head_dim")):
        raise SystemExit("--linear-* are for the hybrid shapes")
    preset = PRESETS[GLM_PRESETS[opts.model]]
    keys = ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab")
    values = _given(opts, keys) | _given(opts, _EXPERT_FLAGS)
    if opts.expert_intermediate is not None:
        values["shared_expert_intermediate"] = opts.expert_intermediate
    if opts.first_dense is not None:
        values["first_dense"] = opts.first_dense
    return _cut(preset, values), _file_flags(GlmFile(), opts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="pipeshard bench gguf-export",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    w = sub.add_parser("write", help="write a Llama-3-8B-shaped Q4_K_M GGUF of random blocks")
    w.add_argument("file", type=Path)
    w.add_argument(
        "--model",
        choices=[
            "llama3-8b",
            *sorted(PLAN_SHAPES),
            *sorted(GLM_PRESETS),
            *sorted(HYBRID_PRESETS),
            *sorted(GPT_OSS_PRESETS),
        ],
        default="llama3-8b",
        help="the shape (cut with --layers; glm-4.5-air: exporter.presets' GLM-4.5-Air, glm4moe; "
        "qwen3.6-35b-a3b: its Qwen3.6-35B-A3B, qwen35moe; gpt-oss-20b: its gpt-oss-20b, MXFP4)",
    )
    add_shape_args(w, LLAMA3_8B)
    w.add_argument("--experts", type=int, help="routed experts a layer (MoE shapes)")
    w.add_argument("--experts-per-token", type=int)
    w.add_argument("--expert-intermediate", type=int, help="an expert's channels")
    w.add_argument("--first-dense", type=int, help="glm: the layers below it are dense")
    w.add_argument("--linear-key-heads", type=int, help="hybrid: Gated DeltaNet key heads")
    w.add_argument("--linear-value-heads", type=int, help="hybrid: Gated DeltaNet value heads")
    w.add_argument("--linear-head-dim", type=int, help="hybrid: their key and value head size")
    w.add_argument(
        "--qwen3",
        action="store_true",
        help="a dense shape as Qwen3 (q/k norms; heads x head-dim may differ from hidden)",
    )
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--chunk-mib", type=int, default=64, help="bytes generated at a time")

    m = sub.add_parser("measure", help="peak RSS of exporting each stage, against the target")
    m.add_argument("file", type=Path)
    m.add_argument("--out", type=Path, required=True, help="export folder (scratch)")
    m.add_argument("--clean", action="store_true", help="delete --out first if it exists")
    m.add_argument("--stages", type=int, default=4)
    m.add_argument("--only", type=int, nargs="+", help="only these stages")
    m.add_argument(
        "--export-arg", action="append", default=[], help="extra `pipeshard export` argument"
    )
    m.add_argument("--serve", action="store_true", help="then serve the ring, send a request")
    m.add_argument("--kv-cache-gib", type=float, default=0.25, help="--serve: paged KV per stage")
    m.add_argument("--serve-timeout", type=float, default=1200.0)
    add_results_option(m)
    m.add_argument("--name", default="gguf-export-8b")

    p = sub.add_parser("plan", help="the export plan of a big model's shape (no file)")
    p.add_argument("--model", choices=sorted(PLAN_SHAPES), default="llama3-70b")
    add_shape_args(p, LLAMA3_70B)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--node-memory", help="the PCs' memory, e.g. 16GB,16GB (sets the stages)")

    d = sub.add_parser("dense-moe", help="a copy of an MoE export, experts computed densely")
    d.add_argument("export", type=Path)
    d.add_argument("--out", type=Path, required=True)

    opts = parser.parse_args(argv)
    if opts.command == "dense-moe":
        write_dense_moe(opts.export, opts.out)
    elif opts.command == "write":
        started = time.monotonic()
        if opts.model in GPT_OSS_PRESETS:
            oss, oss_file = gpt_oss_from(opts)
            layers = oss.layers
            size = write_gpt_oss_gguf(opts.file, oss, oss_file, opts.seed, opts.chunk_mib)
        elif opts.model in HYBRID_PRESETS:
            hybrid, hybrid_file = hybrid_from(opts)
            layers = hybrid.layers
            size = write_hybrid_gguf(opts.file, hybrid, hybrid_file, opts.seed, opts.chunk_mib)
        elif opts.model in GLM_PRESETS:
            if opts.qwen3:
                raise SystemExit("--qwen3 is for the dense shapes")
            preset, file = glm_from(opts)
            layers = preset.layers
            size = write_glm_gguf(opts.file, preset, file, opts.seed, opts.chunk_mib)
        else:
            if opts.first_dense is not None:
                raise SystemExit("--first-dense is for the glm shapes")
            if any(getattr(opts, key) is not None for key in (*_LINEAR_FLAGS, "linear_head_dim")):
                raise SystemExit("--linear-* are for the hybrid shapes")
            default = LLAMA3_8B if opts.model == "llama3-8b" else PLAN_SHAPES[opts.model][1]
            shape = shape_from(opts, default)
            if opts.qwen3:
                if shape.experts:
                    raise SystemExit("--qwen3 is for the dense shapes")
                shape = dataclasses.replace(shape, qwen3=True)
            layers = shape.layers
            size = write_gguf(opts.file, shape, opts.seed, opts.chunk_mib)
        print(
            f"wrote {opts.file}: {size / 1e9:.2f} GB ({layers} layers) in "
            f"{time.monotonic() - started:.0f} s"
        )
    elif opts.command == "measure":
        run_measure(opts)
    else:
        run_plan(opts)


if __name__ == "__main__":
    main()
