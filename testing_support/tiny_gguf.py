"""Tiny GGUF files written the way llama.cpp's convert_hf_to_gguf.py + llama-quantize would.

``write_gguf`` turns a tiny Hugging Face model folder (llama, qwen2, qwen3, gemma3) into a .gguf
that transformers loads back (``from_pretrained(folder, gguf_file=name)``), and a glm4_moe folder
into one that it cannot (exporter.gguf_reader reads its config and tokenizer): llama.cpp's metadata
keys and tensor names, its conversions (llama's q/k row permutation, gemma's ``norm + 1``, no
``output`` tensor when embeddings are tied) and quantized tensors (Q8_0, Q4_0, Q4_K, Q6_K, or a
Q4_K_M-like mix). gguf-py only quantizes the simple types, so Q4_K and Q6_K are quantized here.

What transformers 5.5's GGUF loader cannot read back (so the tiny models here avoid it):
llama3 rope scaling (llama.cpp stores it as a ``rope_freqs`` tensor, which transformers drops),
qwen3's head_dim (it reads no key_length for qwen3: the default 128 is assumed), gemma3's layer
pattern, sliding-window rope base and query_pre_attn_scalar (defaults assumed: every 6th layer
global, 10000, 256).
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from exporter.families import FAMILIES
from exporter.families.gguf_names import gguf_name
from testing_support.tiny_models import VOCAB, make_tokenizer, randomize_buffers

QK_K = 256  # super-block length of the K-quants
# transformers model_type -> llama.cpp architecture: the families' (exporter/families/)
GGUF_ARCH = {name: f.gguf_arch for name, f in FAMILIES.items() if f.gguf_arch is not None}
_HYBRID_ARCHES = ("qwen35", "qwen35moe", "qwen3next")
TYPE_NAMES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "MXFP4")
# general.file_type as llama-quantize writes it (a pure Q4_K file is labelled Q4_K_S).
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "Q4_K": 14, "Q4_K_M": 15, "Q6_K": 18}


# ---------------------------------------------------------------------------- quantizers


def _f16_up(x: np.ndarray) -> np.ndarray:
    """The smallest f16 >= ``x`` (as f32): a super-block scale the file can hold that still
    lets every sub-block scale fit its 6 (Q4_K) or 8 (Q6_K) bits."""
    r = x.astype(np.float16)
    r = np.where(r.astype(np.float32) < x, np.nextafter(r, np.float16(np.inf)), r)
    return r.astype(np.float32)


def _ceil_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``ceil(a / b)``, 0 where ``b`` is 0 (an all-zero super-block)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, np.ceil(a / np.where(b > 0, b, 1)), 0)


def quantize_q4_k_blocks(x: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks: ``(n, 256)`` floats -> ``(n, 144)`` bytes as
    ``gguf.quants.Q4_K.dequantize_blocks`` reads them: f16 ``d``, f16 ``dmin``, 12 bytes of
    6-bit scales and mins for 8 sub-blocks of 32, then 128 bytes of 4-bit ``q``;
    ``w = d*sc*q - dmin*m``. Scales and mins are rounded up so that nothing clips: the error is
    at most half a step of the sub-block (``d*sc/2``)."""
    n = x.shape[0]
    sub = x.astype(np.float32).reshape(n, 8, 32)
    # The offset -dmin*m can only be <= 0, so the sub-block's range always includes 0.
    mins = -np.minimum(sub.min(axis=-1), 0.0)
    dmin = _f16_up(mins.max(axis=-1) / 63.0)
    m = np.minimum(_ceil_div(mins, dmin[:, None]), 63).astype(np.uint8)
    eff_m = dmin[:, None] * m
    scale = np.maximum(sub.max(axis=-1) + eff_m, 0.0) / 15.0
    d = _f16_up(scale.max(axis=-1) / 63.0)
    sc = np.minimum(_ceil_div(scale, d[:, None]), 63).astype(np.uint8)
    eff_s = d[:, None] * sc
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(eff_s[..., None] > 0, (sub + eff_m[..., None]) / eff_s[..., None], 0)
    q = np.clip(np.rint(q), 0, 15).astype(np.uint8)

    scales = np.empty((n, 12), dtype=np.uint8)
    # bytes 0-3: sc[0:4] + top bits of sc[4:8]; 4-7: m[0:4] + top bits of m[4:8];
    # 8-11: low nibbles of sc[4:8] | low nibbles of m[4:8] << 4
    scales[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    # 4 chunks of 32 bytes: sub-block 2c in the low nibbles, 2c+1 in the high ones
    pairs = q.reshape(n, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate(
        [
            d.astype(np.float16).view(np.uint8).reshape(n, 2),
            dmin.astype(np.float16).view(np.uint8).reshape(n, 2),
            scales,
            qs,
        ],
        axis=1,
    )


def quantize_q6_k_blocks(x: np.ndarray) -> np.ndarray:
    """Q6_K super-blocks: ``(n, 256)`` floats -> ``(n, 210)`` bytes as
    ``gguf.quants.Q6_K.dequantize_blocks`` reads them: 128 bytes of low nibbles, 64 of high
    2-bit pairs, 16 int8 scales (one per 16 values), f16 ``d``; ``w = d*sc*(q - 32)``.
    Scales rounded up, as for Q4_K."""
    n = x.shape[0]
    sub = x.astype(np.float32).reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31.0  # symmetric: q - 32 in [-31, 31]
    d = _f16_up(scale.max(axis=-1) / 127.0)
    sc = np.minimum(_ceil_div(scale, d[:, None]), 127).astype(np.int8)
    eff = (d[:, None] * sc)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(eff > 0, sub / eff, 0)
    q = (np.clip(np.rint(q), -32, 31) + 32).astype(np.uint8)

    # Each half of 128 values v: ql[j] = v[j] | v[j+64] << 4 (j < 64);
    # qh[l] = the top 2 bits of v[l], v[l+32], v[l+64], v[l+96] (l < 32).
    v = q.reshape(n, 2, 4, 32)
    lo, hi = v & 0x0F, v >> 4
    ql = np.concatenate(
        [lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=-1
    ).reshape(n, 128)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate(
        [ql, qh, sc.view(np.uint8), d.astype(np.float16).view(np.uint8).reshape(n, 2)], axis=1
    )


def quantize(w: np.ndarray, type_name: str) -> np.ndarray:
    """``w`` in the GGUF type ``type_name``: floats for F32/F16, else rows of block bytes."""
    import gguf

    w = np.ascontiguousarray(w, dtype=np.float32)
    if type_name == "F32":
        return w
    if type_name == "F16":
        return w.astype(np.float16)
    qtype = gguf.GGMLQuantizationType[type_name]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if w.shape[-1] % block:
        raise ValueError(f"{type_name} needs rows a multiple of {block}, got {w.shape}")
    blockers = {"Q4_K": quantize_q4_k_blocks, "Q6_K": quantize_q6_k_blocks}
    if type_name in blockers:
        rows = w.reshape(-1, w.shape[-1])
        out = blockers[type_name](rows.reshape(-1, QK_K))
        return out.reshape(*w.shape[:-1], -1)
    return gguf.quants.quantize(w, qtype)


def dequantize(data: np.ndarray, type_name: str) -> np.ndarray:
    """Inverse of ``quantize`` by gguf-py's own reader (what transformers uses)."""
    import gguf

    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])


# ---------------------------------------------------------------------------- type choice


def _fits(type_name: str, cols: int) -> bool:
    import gguf

    if type_name in ("F32", "F16"):
        return True
    return cols % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0] == 0


def tensor_type(name: str, shape: tuple[int, ...], types: str | dict[str, str]) -> str:
    """The GGUF type of tensor ``name`` (GGUF naming) under ``types``.

    1-D tensors (norms, biases, rope_freqs) are always F32, as llama.cpp keeps them. A type name
    applies to every 2-D weight. "Q4_K_M" imitates llama-quantize: Q6_K for token_embd, output
    and every other layer's attn_v and ffn_down (layers 0, 2, ...), Q4_K elsewhere; rows that
    are not a multiple of 256 fall back as llama-quantize does (Q4_K -> Q5_0, Q6_K -> Q8_0, then
    F16). A dict maps name substrings to types, the longest match winning and unmatched 2-D
    weights staying F32: ``{"": "Q8_0", "ffn_down": "Q6_K"}`` is Q8_0 but for ffn_down.
    """
    # llama-quantize keeps MoE routers (and the shared expert's gate), convolutions and biases
    # (gpt-oss's: [E, rows]) F32
    if (
        len(shape) < 2
        or ".ffn_gate_inp" in name
        or ".ssm_conv1d." in name
        or name.endswith(".bias")
    ):
        return "F32"
    if isinstance(types, dict):
        hits = [key for key in types if key in name]
        return types[max(hits, key=len)] if hits else "F32"
    if types != "Q4_K_M":
        if types not in TYPE_NAMES:
            raise ValueError(f"unknown type {types!r}")
        return types
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    more_bits = (".attn_v." in name or ".ffn_down" in name) and layer % 2 == 0  # + _exps
    choice = "Q6_K" if more_bits or name.startswith(("token_embd", "output.")) else "Q4_K"
    fallbacks = {"Q4_K": ["Q4_K", "Q5_0", "F16"], "Q6_K": ["Q6_K", "Q8_0", "F16"]}[choice]
    return next(t for t in fallbacks if _fits(t, shape[-1]))


# ---------------------------------------------------------------------------- the writer


def _stack_experts(state: dict[str, Any]) -> dict[str, Any]:
    """convert_hf_to_gguf's MoE merge: ``mlp.experts.{e}.{proj}`` of a layer -> one
    ``mlp.experts.{proj}`` tensor [experts, rows, cols], expert by expert."""
    import re

    import torch

    merged: dict[str, Any] = {}
    experts: dict[str, dict[int, Any]] = {}
    for name, tensor in state.items():
        m = re.fullmatch(
            r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+\.weight)", name
        )
        if m is None:
            merged[name] = tensor
        else:
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = tensor
    for name, parts in experts.items():
        merged[name] = torch.stack([parts[e] for e in sorted(parts)])
    return merged


def _gpt_oss_experts(state: dict[str, Any]) -> dict[str, Any]:
    """convert_hf_to_gguf's GptOssModel for dense (not MXFP4) experts: ``gate_up_proj``
    [E, H, 2I] (x @ W, gate and up columns interleaved) -> ``gate_proj`` and ``up_proj``
    [E, I, H], ``down_proj`` [E, I, H] -> [E, H, I], their biases split likewise (the
    sinks' ``.weight`` is the family's rename: exporter.families.gguf_names)."""
    out: dict[str, Any] = {}
    for name, tensor in state.items():
        stem = name.rsplit(".", 1)[0]
        if name.endswith("experts.gate_up_proj"):
            both = tensor.transpose(-1, -2)
            out[f"{stem}.gate_proj.weight"] = both[:, ::2].contiguous()
            out[f"{stem}.up_proj.weight"] = both[:, 1::2].contiguous()
        elif name.endswith("experts.gate_up_proj_bias"):
            out[f"{stem}.gate_proj.bias"] = tensor[:, ::2].contiguous()
            out[f"{stem}.up_proj.bias"] = tensor[:, 1::2].contiguous()
        elif name.endswith("experts.down_proj"):
            out[f"{stem}.down_proj.weight"] = tensor.transpose(-1, -2).contiguous()
        elif name.endswith("experts.down_proj_bias"):
            out[f"{stem}.down_proj.bias"] = tensor
        else:
            out[name] = tensor
    return out


def round_weights(folder: Path, types: str | dict[str, str]) -> None:
    """Round a tiny Hugging Face model's weights (in place) to the values ``write_gguf(folder,
    ..., types)`` stores: quantized and de-quantized along each row of llama.cpp's layout (for
    gpt-oss's experts, the transposed matrices), so that the file and the folder hold the same
    model and transformers on the folder is the file's exact reference."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(folder).model_type
    file = folder / "model.safetensors"
    state = load_file(str(file))
    for name, tensor in state.items():
        if name.endswith(("_bias", ".bias")):
            continue  # F32 in the file
        transposed = model_type == "gpt_oss" and name.endswith("_proj")
        w = tensor.float().numpy()
        if transposed:
            w = np.swapaxes(w, -1, -2)
        gguf_like = ("blk.0.ffn_gate_exps.weight" if transposed else name).replace(
            "model.layers.", "blk."
        )
        if name.endswith((".gate.weight", "router.weight")):
            gguf_like = "blk.0.ffn_gate_inp.weight"
        kind = tensor_type(gguf_like, w.shape, types)
        if kind == "F32" or w.ndim < 2:
            continue
        exact = dequantize(quantize(w.reshape(-1, w.shape[-1]), kind), kind).reshape(w.shape)
        if transposed:
            exact = np.swapaxes(exact, -1, -2)
        state[name] = torch.from_numpy(np.ascontiguousarray(exact, dtype=np.float32))
    save_file(state, str(file), metadata={"format": "pt"})


def _nextn_block(config: Any, first: int, count: int) -> dict[str, Any]:
    """Random NextN/MTP tensors (some of those GLM-4.5's checkpoint has in its layer after the
    last), which llama.cpp writes as blocks ``first`` ... ``first + count - 1``: a reader must
    skip them."""
    import torch

    hidden = config.hidden_size
    generator = torch.Generator().manual_seed(7)
    out: dict[str, Any] = {}
    for layer in range(first, first + count):
        prefix = f"model.layers.{layer}"
        out[f"{prefix}.eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator)
        out[f"{prefix}.enorm.weight"] = torch.randn(hidden, generator=generator)
        out[f"{prefix}.hnorm.weight"] = torch.randn(hidden, generator=generator)
        out[f"{prefix}.input_layernorm.weight"] = torch.randn(hidden, generator=generator)
        out[f"{prefix}.shared_head.norm.weight"] = torch.randn(hidden, generator=generator)
    return out


def _mtp_block(state: dict[str, Any], layer: int, last_full: int) -> dict[str, Any]:
    """A Qwen3.5 MTP layer as llama.cpp writes it after the trunk (block ``layer``): here a
    copy of the trunk's last full-attention layer with random norms, which a reader must skip."""
    import torch

    generator = torch.Generator().manual_seed(11)
    prefix = f"model.layers.{last_full}."
    out = {}
    for name, tensor in state.items():
        if name.startswith(prefix):
            copy = tensor.clone()
            if copy.dim() == 1:
                copy = torch.randn(copy.shape, generator=generator)
            out[f"model.layers.{layer}." + name[len(prefix) :]] = copy
    return out


def _tiled(w: Any, dim: int, key_heads: int, per_key: int, head_dim: int) -> Any:
    """conversion/qwen.py's _reorder_v_heads: value heads along ``dim`` from grouped by key
    head (Hugging Face's order) to tiled (the first value head of every key head, ...)."""
    shape = list(w.shape)
    grouped = w.reshape(*shape[:dim], key_heads, per_key, head_dim, *shape[dim + 1 :])
    return grouped.transpose(dim, dim + 1).contiguous().reshape(shape)


def _hybrid_tensors(state: dict[str, Any], config: Any, arch: str) -> dict[str, Any]:
    """What llama.cpp's converter does to Qwen3.5's and Qwen3-Next's tensors (conversion/qwen.py:
    Qwen3NextModel, _LinearAttentionVReorderBase): the text model's names; value heads tiled
    (qwen35, qwen35moe, where there are more value heads than key heads); A_log stored as
    -exp(A_log) (dt_bias as dt_proj.bias: the family's rename), the convolution squeezed, the
    norms plus one (not the Gated DeltaNet's own); Qwen3-Next's in_proj_qkvz regrouped into
    qkv and z; stacked experts (Qwen3.5-MoE's gate_up_proj) split into gate and up."""
    import torch

    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    per_key = hv // hk
    tile = arch in ("qwen35", "qwen35moe") and hk != hv
    out: dict[str, Any] = {}
    for name, w in state.items():
        name = name.replace("model.language_model.", "model.")
        w = w.float()
        if tile and ".linear_attn." in name:
            if ".in_proj_qkv." in name:
                w = torch.cat([w[: 2 * hk * dk], _tiled(w[2 * hk * dk :], 0, hk, per_key, dv)])
            elif ".in_proj_z." in name:
                w = _tiled(w, 0, hk, per_key, dv)
            elif ".in_proj_a." in name or ".in_proj_b." in name:
                w = _tiled(w, 0, hk, per_key, 1)
            elif name.endswith((".A_log", ".dt_bias")):
                w = _tiled(w[:, None], 0, hk, per_key, 1)[:, 0]
            elif ".conv1d." in name:
                w = torch.cat([w[: 2 * hk * dk], _tiled(w[2 * hk * dk :], 0, hk, per_key, dv)])
            elif ".out_proj." in name:
                w = _tiled(w, 1, hk, per_key, dv)
        if name.endswith(".A_log"):
            w = -torch.exp(w)
        elif ".conv1d." in name:
            w = w.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            w = w + 1
        if name.endswith(".in_proj_qkvz.weight"):  # [q, k, v, z] per key head -> qkv, z
            widths = [dk, dk, per_key * dv, per_key * dv]
            q, k, v, z = torch.split(w.reshape(hk, sum(widths), -1), widths, dim=1)
            stem = name.replace(".in_proj_qkvz.weight", "")
            out[f"{stem}.in_proj_qkv.weight"] = torch.cat(
                [t.reshape(-1, w.shape[1]) for t in (q, k, v)]
            )
            out[f"{stem}.in_proj_z.weight"] = z.reshape(-1, w.shape[1])
            continue
        if name.endswith(".experts.gate_up_proj"):
            half = w.shape[1] // 2
            stem = name.replace(".gate_up_proj", "")
            out[f"{stem}.gate_proj.weight"], out[f"{stem}.up_proj.weight"] = (
                w[:, :half],
                w[:, half:],
            )
            continue
        if name.endswith(".experts.down_proj"):
            name += ".weight"
        out[name] = w
    return out


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: HF's half-split rotary rows -> interleaved."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp writes for llama3 rope scaling (LlamaModel)."""
    base = float(rope.get("rope_theta", 10000.0))
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old_ctx = float(rope.get("original_max_position_embeddings", 8192))
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_tokenizer(writer: Any, folder: Path, vocab_size: int) -> None:
    """convert_hf_to_gguf's _set_vocab_gpt2 for a ByteLevel BPE tokenizer.json: tokens and
    their types here, then gguf's SpecialVocab (merges, special ids, add_bos/eos, template)."""
    import gguf

    tok_json = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tok_json["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok_json["added_tokens"] if t["special"]}
    vocab.update(special)
    by_id = {i: t for t, i in vocab.items()}
    tokens, kinds = [], []
    for i in range(max(vocab_size, len(by_id))):
        if i not in by_id:  # llama.cpp pads the vocabulary up to the model's rows
            tokens.append(f"[PAD{i}]")
            kinds.append(gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            kinds.append(gguf.TokenType.CONTROL if by_id[i] in special else gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    # GPT-2's split regex: the one a ByteLevel(use_regex=True) pre-tokenizer applies.
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


def write_gguf(
    hf_folder: Path,
    out: Path,
    types: str | dict[str, str] = "Q4_K_M",
    extra: dict[str, int] | None = None,
    names: Callable[[str, str, int], str] | None = None,
) -> Path:
    """Write the HF model in ``hf_folder`` (config, safetensors, tokenizer) as the GGUF ``out``.

    ``types``: "F32", "F16", "Q8_0", "Q4_0", "Q4_K", "Q6_K" for every 2-D weight, "Q4_K_M" for
    llama-quantize's mix, or a dict of name substring -> type (see ``tensor_type``). ``extra``:
    more uint32 metadata, e.g. ``{"llama.expert_count": 8}``. ``names``: (Hugging Face name,
    llama.cpp architecture, blocks) -> the tensor's GGUF name (KeyError: none), instead of the
    reader's own (exporter.families.gguf_names): a test names the tensors from outside.
    """
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    hf_folder, out = Path(hf_folder), Path(out)
    config = AutoConfig.from_pretrained(hf_folder)
    if config.model_type not in GGUF_ARCH:
        raise ValueError(f"no GGUF writer for {config.model_type}")
    arch = GGUF_ARCH[config.model_type]
    n_layers, n_head = config.num_hidden_layers, config.num_attention_heads
    n_kv = config.num_key_value_heads
    raw_cfg = json.loads((hf_folder / "config.json").read_text())
    head_dim = raw_cfg.get("head_dim") or config.hidden_size // n_head
    rope = config.rope_parameters or {}
    if arch == "gemma3":
        rope = rope.get("full_attention", rope)  # the global layers' base; sliding ones: 10000

    # GLM's NextN/MTP layers: llama.cpp writes them as blocks after the trunk's
    nextn = int(getattr(config, "num_nextn_predict_layers", 0) or 0) if arch == "glm4moe" else 0
    if arch in _HYBRID_ARCHES[:2]:
        nextn = 1  # Qwen3.5's checkpoints hold an MTP layer, which llama.cpp writes after
    intermediate = getattr(config, "intermediate_size", None)
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(n_layers + nextn)
    if intermediate is not None:
        writer.add_feed_forward_length(intermediate)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if "head_dim" in raw_cfg or arch == "gemma3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_vocab_size(config.vocab_size)
    if arch in ("llama", "phi3"):
        writer.add_rope_dimension_count(head_dim)
    if arch == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if config.model_type == "mixtral":
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if arch == "glm4moe":  # convert_hf_to_gguf's Glm4MoeModel.set_gguf_parameters
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.5)))
        writer.add_expert_count(config.n_routed_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_count(config.n_shared_experts)
        writer.add_leading_dense_block_count(config.first_k_dense_replace)
        writer.add_expert_weights_scale(config.routed_scaling_factor)
        writer.add_expert_weights_norm(config.norm_topk_prob)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_group_count(config.n_group)
        writer.add_expert_group_used_count(config.topk_group)
        writer.add_nextn_predict_layers(nextn)
    if arch == "gpt-oss":  # convert_hf_to_gguf's GptOssModel and the base's YaRN keys
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_sliding_window(config.sliding_window)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if arch in _HYBRID_ARCHES:  # Qwen3NextModel.set_gguf_parameters (+ Qwen2MoeModel's)
        writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
        writer.add_ssm_state_size(config.linear_key_head_dim)
        writer.add_ssm_group_count(config.linear_num_key_heads)
        writer.add_ssm_time_step_rank(config.linear_num_value_heads)
        writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
        writer.add_full_attention_interval(4)
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
        if arch != "qwen3next":
            writer.add_rope_dimension_sections([11, 11, 10, 0])
            writer.add_nextn_predict_layers(nextn)
        if arch != "qwen35":
            writer.add_expert_count(config.num_experts)
            writer.add_expert_used_count(config.num_experts_per_tok)
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
    label = types if isinstance(types, str) else "custom"
    # A custom mix has no llama-quantize name: label it as the closest mix, Q4_K_M.
    writer.add_file_type(FILE_TYPES.get(label, FILE_TYPES["Q4_K_M"]))
    if label not in ("F32", "F16"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    write_tokenizer(writer, hf_folder, config.vocab_size)
    for key, value in (extra or {}).items():
        writer.add_uint32(key, value)

    if arch == "llama" and rope.get("rope_type") == "llama3":
        # llama.cpp's generate_extra_tensors: written first, before the model's own.
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(rope, head_dim))
    tied = bool(config.tie_word_embeddings)
    state = load_file(str(hf_folder / "model.safetensors"))
    state = _stack_experts(state)
    if arch == "glm4moe":
        state.update(_nextn_block(config, n_layers, nextn))
    if arch == "gpt-oss":
        state = _gpt_oss_experts(state)
    if arch in _HYBRID_ARCHES:
        state = _hybrid_tensors(state, config, arch)
        if nextn:
            last_full = max(i for i, t in enumerate(config.layer_types) if t == "full_attention")
            state.update(_mtp_block(state, n_layers, last_full))
    for hf_name, tensor in state.items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp reuses token_embd as the output head
        try:  # the reader's names (gguf-py's map and the family's converter renames)
            if names is None:
                name = gguf_name(hf_name, config.model_type)
            else:
                name = names(hf_name, arch, n_layers + nextn)
        except KeyError:
            raise ValueError(f"no GGUF name for {hf_name}") from None
        w = tensor.float().numpy()
        if arch == "llama" and name.endswith("attn_q.weight"):
            w = _permute(w, n_head)
        elif arch == "llama" and name.endswith("attn_k.weight"):
            w = _permute(w, n_kv)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w + np.float32(1.0)  # Gemma3RMSNorm scales by (1 + weight)
        kind = tensor_type(name, w.shape, types)
        data = quantize(w, kind)
        if kind in ("F32", "F16"):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# ---------------------------------------------------------------------------- tiny models


def gguf_config(arch: str, layers: int = 4, vocab: int = VOCAB) -> Any:
    """A tiny config whose every field survives transformers' GGUF loader, with rows (hidden
    and intermediate sizes) that are multiples of 256 for the K-quants.

    testing_support.tiny_models.tiny_config cannot serve: its llama uses llama3 rope scaling and its
    gemma3 a layer pattern and query scale that GGUF does not carry back.
    """
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        # GGUF stores the epsilon as f32: 2**-20 (~1e-6) reads back exactly.
        rms_norm_eps=2.0**-20,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":
        from transformers import Qwen3Config

        # 128: the head_dim transformers assumes for a qwen3 GGUF (it reads no key_length).
        return Qwen3Config(**common, head_dim=128)
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        # transformers' GGUF loader reads no expert width: keep its default (768, as
        # Qwen3-30B-A3B's); norm_topk_prob True is what it assumes for a GGUF
        return Qwen3MoeConfig(
            **common,
            head_dim=64,
            moe_intermediate_size=768,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        )
    if arch == "mixtral":
        from transformers import MixtralConfig

        # no sliding window: a GGUF carries none
        return MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, sliding_window=None
        )
    if arch == "phi3":
        from transformers import Phi3Config

        # transformers' GGUF loader reads no sliding window or partial rotary for phi3: full
        # attention, every channel rotating (as Phi-3-mini's GGUFs are read)
        return Phi3Config(**common)
    if arch == "gpt_oss":
        from transformers import GptOssConfig

        from testing_support.tiny_models import gpt_oss_fields

        # the tiny Hugging Face gpt-oss's layers, routing and YaRN; experts of 256 channels
        return GptOssConfig(**{**gpt_oss_fields(common), "head_dim": 64, "intermediate_size": 256})
    if arch == "glm4_moe":
        from transformers import Glm4MoeConfig

        from testing_support.tiny_models import glm4_moe_fields

        # the tiny Hugging Face GLM's routing and layer types, with K-quant-sized experts
        return Glm4MoeConfig(
            **{**glm4_moe_fields(common), "head_dim": 64, "moe_intermediate_size": 256}
        )
    if arch in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        from testing_support.tiny_models import hybrid_experts, qwen3_5_fields

        # the tiny Hugging Face hybrid's heads, with value heads of 32 channels (out_proj's
        # columns move by whole value heads when llama.cpp tiles them: whole Q8_0 blocks)
        fields = {
            **qwen3_5_fields(common),
            "head_dim": 64,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
        }
        if arch == "qwen3_5":
            from transformers import Qwen3_5TextConfig

            return Qwen3_5TextConfig(**fields)
        experts = {**hybrid_experts(), "moe_intermediate_size": 256}
        if arch == "qwen3_next":
            from transformers import Qwen3NextConfig

            return Qwen3NextConfig(**fields, **experts)
        from transformers import Qwen3_5MoeTextConfig

        del fields["intermediate_size"]
        return Qwen3_5MoeTextConfig(**fields, **experts)
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        # head_dim 256 = query_pre_attn_scalar: both the defaults transformers falls back to, and
        # llama.cpp's 1/sqrt(head_dim) attention scale agrees. Every 6th layer is global (the
        # default pattern): give it 6 layers to have one.
        return Gemma3TextConfig(**common, head_dim=256, query_pre_attn_scalar=256, sliding_window=4)
    raise ValueError(arch)


def make_hf_model(
    arch: str,
    folder: Path,
    seed: int = 0,
    layers: int = 4,
    chat_template: str | None = None,
) -> Path:
    """Save a random ``gguf_config`` model with the tiny tokenizer into ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(gguf_config(arch, layers))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.mul_(2.0)  # as testing_support.tiny_models.make_model: avoid near-tied logits
            elif param.dim() == 3 and arch == "gpt_oss":
                pass  # its stacked experts: widened by randomize_buffers instead
            else:
                # Norms start at 1 (gemma: 0): randomize them so the +1 rule and q/k norms count.
                param.add_(torch.randn_like(param) * 0.1)
    randomize_buffers(model)
    model.save_pretrained(folder)
    make_tokenizer(folder, VOCAB, chat_template)
    return folder


def make_gguf_model(
    arch: str,
    folder: Path,
    types: str | dict[str, str] = "Q4_K_M",
    seed: int = 0,
    layers: int = 4,
    chat_template: str | None = None,
) -> Path:
    """Write a tiny random ``arch`` model as ``folder/tiny-{arch}-{types}.gguf`` (the folder
    gets nothing else) and return the file's path. The same ``seed`` and ``layers`` given to
    ``make_hf_model`` rebuild the HF model it came from."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    label = types if isinstance(types, str) else "custom"
    with tempfile.TemporaryDirectory() as tmp:
        make_hf_model(arch, Path(tmp), seed, layers, chat_template)
        return write_gguf(Path(tmp), folder / f"tiny-{arch}-{label}.gguf", types)
