"""Where a stage's tensors come from, one tensor at a time: a GGUF file or safetensors files.

Both sources answer Hugging Face tensor names (``model.layers.3.self_attn.q_proj.weight``) and
read only the bytes of the tensor asked for (``os.pread``, no memory map), so exporting a stage
holds that stage's weights, never the model's.

- :class:`GGUFSource` keeps each tensor's own blocks (:func:`exporter.gguf_quant.from_gguf`) and
  undoes what llama.cpp's converter did to them, as transformers' GGUF loader does: Llama's q/k
  rows are permuted back (a row permutation moves whole quant blocks: exact), Gemma's norm
  weights are stored plus one.
- :class:`SafetensorsSource` gives float tensors as float32 (fp32 exports) or float16.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from exporter.errors import ExportError
from exporter.gguf_quant import (
    DenseWeight,
    Q4KForm,
    Weight,
    from_gguf,
    mxfp4_weight,
    stack_rows,
    weight_shape,
)
from protos.manifest import GGUFTypeEntry

log = logging.getLogger(__name__)


def read_gguf_header(path: Path) -> Any:
    """The file's metadata and tensor index as a ``gguf.GGUFReader``, parsed once per process.

    The package's reader decodes every element of every metadata array one numpy view at a
    time: the vocabulary and merges of a Qwen2.5 file (300,000 strings) take 7 s on this CPU,
    paid by every reader (the type summary, each stage's builder, the draft). Here arrays are
    stepped over instead (a numeric array is one view, a string array is walked by its length
    prefixes: 0.1 s); their contents are not decoded (``field.data`` is empty), which nothing
    here reads: the export takes the tokenizer and config from transformers' GGUF reader."""
    try:
        stat = path.stat()
        return _read_header(str(path), stat.st_size, stat.st_mtime_ns)
    except (ValueError, OSError) as exc:
        raise ExportError(f"cannot read the GGUF file {path}: {exc}") from exc


@functools.lru_cache(maxsize=4)
def _read_header(path: str, size: int, mtime_ns: int) -> Any:
    from gguf import GGUFReader, GGUFValueType

    class HeaderReader(GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            offs = start = orig_offs + 12
            itype = GGUFValueType(raw_itype[0])
            count = int(alen[0])
            if itype == GGUFValueType.STRING:
                data = np.asarray(self.data).data
                for _ in range(count):
                    offs += 8 + struct.unpack_from("<Q", data, offs)[0]
            elif itype in self.gguf_scalar_to_np:
                offs += count * np.dtype(self.gguf_scalar_to_np[itype]).itemsize
            else:  # arrays of arrays: the package's own walk
                return super()._get_field_parts(orig_offs, raw_type)
            body = self._get(start, np.uint8, offs - start)
            return offs - orig_offs, [raw_itype, alen, body], [], [GGUFValueType.ARRAY, itype]

    return HeaderReader(path)


def _pread(path: Path, offset: int, size: int) -> np.ndarray:
    out = np.empty(size, dtype=np.uint8)
    view = memoryview(out.data)
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < size:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise ExportError(f"{path}: unexpected end of file reading a tensor")
            done += got
    finally:
        os.close(fd)
    return out


# -- GGUF ------------------------------------------------------------------------------------

_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_feedforward_layernorm": "post_ffw_norm",
    # MoE: the router, and every expert's matrices stacked in one 3-D tensor each
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
    # gpt-oss: the router (with a bias), gate and up fused (gate rows, then up rows, when the
    # converter fuses them)
    "mlp.router": "ffn_gate_inp",
    "mlp.experts.gate_up_proj": "ffn_gate_up_exps",
    # GLM-4.5's shared expert
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
    # Phi-3's fused projections (llama.cpp keeps them fused: ffn_up holds gate and up)
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
    # Qwen3.5's / Qwen3-Next's Gated DeltaNet (conversion/qwen.py's Qwen3NextModel) and gated
    # shared expert
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_ba": "ssm_ba",  # Qwen3-Next: b and a grouped by key head
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# The Gated DeltaNet's per-head vectors, which transformers names without a .weight: llama.cpp's
# ssm_a holds -exp(A_log), ssm_dt.bias the dt_bias
_GGUF_LINEAR_VECTORS = {"linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias"}
# GGUF architectures whose converter reorders a Gated DeltaNet's value heads from grouped by key
# head (Hugging Face: v0..v{r-1} of key head 0, then of key head 1, ...) to tiled (v0 of every
# key head, then v1 of every key head, ...): conversion/qwen.py's _LinearAttentionVReorderBase
TILED_VALUE_HEADS = ("qwen35", "qwen35moe")
# Architectures whose post_attention_layernorm llama.cpp stores as post_attention_norm: Gemma
# normalises the attention's output with it, GLM-4.5 the MLP's input (the others: ffn_norm).
_POST_ATTENTION_NORM = (
    "gemma3_text",
    "glm4_moe",
    "gpt_oss",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_next",
)
# Architectures whose norm weights llama.cpp stores plus one (their RMSNorm scales by 1 + w);
# not the Gated DeltaNet's output norm (ssm_norm), which scales by w
_NORMS_PLUS_ONE = ("gemma3_text", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
_GGUF_GLOBAL = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def gguf_name(hf_name: str, model_type: str) -> str:
    """llama.cpp's name of a Hugging Face tensor name."""
    stem, _, kind = hf_name.rpartition(".")
    if stem in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[stem]}.{kind}"
    parts = stem.split(".")
    if parts[:2] != ["model", "layers"] or len(parts) < 4:
        raise KeyError(hf_name)
    layer, rest = parts[2], ".".join(parts[3:])
    if rest == "mlp.gate" and kind == "e_score_correction_bias":  # GLM's router bias
        return f"blk.{layer}.exp_probs_b.bias"
    if rest == "self_attn" and kind == "sinks":  # gpt-oss's attention sinks
        return f"blk.{layer}.attn_sinks.weight"
    if f"{rest}.{kind}" in _GGUF_LINEAR_VECTORS:
        return f"blk.{layer}.{_GGUF_LINEAR_VECTORS[f'{rest}.{kind}']}"
    if rest == "post_attention_layernorm":
        rest_name = "post_attention_norm" if model_type in _POST_ATTENTION_NORM else "ffn_norm"
    elif rest == "pre_feedforward_layernorm":
        rest_name = "ffn_norm"
    elif rest in _GGUF_LAYER:
        rest_name = _GGUF_LAYER[rest]
    else:
        raise KeyError(hf_name)
    return f"blk.{layer}.{rest_name}.{kind}"


class GGUFSource:
    """A GGUF file's tensors by Hugging Face name, each read when asked for."""

    def __init__(
        self, path: Path, config: Any, form: Q4KForm = "exact", dense: str | None = None
    ) -> None:
        """``dense``: a float or NNCF format (fp32, fp16, int8, int4): every tensor
        de-quantized to float32 (float16 for fp16) instead, for NNCF to compress again."""
        self.path = path
        self.model_type = str(config.model_type)
        self.form = form
        self.dense = dense
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        reader = read_gguf_header(path)
        arch_field = reader.fields.get("general.architecture")
        self.arch = arch_field.contents() if arch_field else "unknown"
        self.tensors = {t.name: t for t in reader.tensors}
        # exporter.graph repeats the key heads tiled (not interleaved) for such a file
        self.value_heads_tiled = self.arch in TILED_VALUE_HEADS

    def has(self, name: str) -> bool:
        try:
            return gguf_name(name, self.model_type) in self.tensors
        except KeyError:
            return False

    def tensor(self, name: str) -> Weight:
        try:
            key = gguf_name(name, self.model_type)
            info = self.tensors[key]
        except KeyError:
            raise ExportError(f"{self.path.name} has no tensor for {name}") from None
        raw = _pread(self.path, int(info.data_offset), int(info.n_bytes))
        shape = tuple(int(d) for d in reversed(info.shape))  # GGUF lists the fastest dim first
        form = self.form
        if len(shape) == 3:  # experts [E, rows, cols]: their rows one after another
            shape = (shape[0] * shape[1], shape[2])
            form = "exact"  # GatherMatmul takes a plain decompression, not split's extra matmul
        weight: Weight
        if self.dense is not None:
            from gguf.quants import dequantize

            values = dequantize(raw, info.tensor_type).reshape(shape)
            dtype = np.float16 if self.dense == "fp16" else np.float32
            weight = DenseWeight(values.astype(dtype, copy=False))
        else:
            weight = from_gguf(info.tensor_type, raw, shape, form)
        note = getattr(weight, "note", "")
        if note:  # what was done with a tensor that has no exact compressed form
            log.log(logging.WARNING if "inexact" in note else logging.DEBUG, "%s: %s", key, note)
        if self.arch == "llama" and key.endswith(".weight") and ".attn_" in key:
            if ".attn_q." in key:
                weight = weight.permute_rows(_unpermute_order(shape[0], self.num_heads))
            elif ".attn_k." in key:
                weight = weight.permute_rows(_unpermute_order(shape[0], self.num_kv_heads))
        plus_one = self.model_type in _NORMS_PLUS_ONE and key.endswith("norm.weight")
        if plus_one and ".ssm_norm." not in key and isinstance(weight, DenseWeight):
            weight = DenseWeight(np.asarray(weight.array, np.float32) - np.float32(1), weight.note)
        if key.endswith(".ssm_a") and isinstance(weight, DenseWeight):  # -exp(A_log) -> A_log
            decay = np.asarray(weight.array, np.float64)
            weight = DenseWeight(np.log(-decay).astype(np.float32), weight.note)
        return weight


def gguf_model_field(path: Path, name: str) -> Any:
    """The file's scalar ``{architecture}.{name}`` (e.g. ``expert_count``), or None."""
    fields = read_gguf_header(path).fields
    arch = fields.get("general.architecture")
    field = fields.get(f"{arch.contents()}.{name}") if arch is not None else None
    return field.contents() if field is not None else None


def gguf_type_summary(path: Path, form: Q4KForm) -> list[GGUFTypeEntry]:
    """Each tensor type of the file (matrices and 1-D apart), how many tensors, and what the
    export makes of them: read from the header alone, so every stage's export says the same."""
    from collections import Counter

    from exporter.gguf_quant import describe

    reader = read_gguf_header(path)
    # (type, matrix, experts): an MoE's 3-D expert tensors always take the exact form
    counts = Counter((t.tensor_type, len(t.shape) >= 2, len(t.shape) == 3) for t in reader.tensors)
    entries = []
    for (tensor_type, matrix, experts), count in sorted(
        counts.items(), key=lambda kv: (kv[0][0].name, not kv[0][1], kv[0][2])
    ):
        becomes, exactness = describe(tensor_type, "exact" if experts else form, matrix)
        entries.append(
            GGUFTypeEntry(
                type=tensor_type.name,
                matrix=matrix,
                tensors=count,
                becomes=f"experts (GatherMatmul): {becomes}" if experts else becomes,
                exactness=exactness,
            )
        )
    return entries


def _unpermute_order(rows: int, heads: int) -> np.ndarray:
    """Row order undoing llama.cpp's q/k permutation (transformers' _reverse_permute_weights)."""
    dim = rows // heads // 2
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(-1)


# -- safetensors -------------------------------------------------------------------------------

# Tensors kept in float32 whatever the export's float format, as transformers keeps them
# (``_keep_in_fp32_modules_strict``): GLM's router correction bias, which decides near ties
_KEEP_FP32 = (".e_score_correction_bias",)
_SAFETENSORS_TYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}
_RAW_TYPES = {"U8": np.uint8}  # read as stored (gpt-oss's MXFP4 blocks and scales)


class SafetensorsSource:
    """The tensors of a Hugging Face folder's ``*.safetensors`` files, each read when asked for.

    The headers are parsed here (8-byte length + JSON, the format's whole index) because
    ``safetensors.safe_open(framework="numpy")`` cannot read BF16 tensors (numpy has no
    bfloat16); a BF16 tensor becomes float32 exactly (its bits shifted up)."""

    def __init__(self, folder: Path, dtype: str) -> None:
        self.folder = folder
        self.dtype = np.float16 if dtype == "fp16" else np.float32
        self.entries: dict[str, tuple[Path, int, str, tuple[int, ...], int]] = {}
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ExportError(f"{folder} has no *.safetensors weights")
        for file in files:
            with file.open("rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length))
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                begin, end = entry["data_offsets"]
                shape = tuple(int(d) for d in entry["shape"])
                self.entries[name] = (file, 8 + length + begin, entry["dtype"], shape, end - begin)

    def has(self, name: str) -> bool:
        return name in self.entries

    def raw(self, name: str) -> np.ndarray:
        """An integer tensor as stored (uint8)."""
        if name not in self.entries:
            raise ExportError(f"{self.folder.name} has no tensor {name}")
        file, offset, dtype, shape, size = self.entries[name]
        if dtype not in _RAW_TYPES:
            raise ExportError(f"{name}: safetensors dtype {dtype}, expected one of {_RAW_TYPES}")
        return _pread(file, offset, size).view(_RAW_TYPES[dtype]).reshape(shape)

    def tensor(self, name: str) -> Weight:
        if name not in self.entries:
            raise ExportError(f"{self.folder.name} has no tensor {name}")
        file, offset, dtype, shape, size = self.entries[name]
        if dtype not in _SAFETENSORS_TYPES:
            raise ExportError(f"{name}: safetensors dtype {dtype} is not supported")
        raw = _pread(file, offset, size).view(_SAFETENSORS_TYPES[dtype]).reshape(shape)
        if dtype == "BF16":
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        if name.endswith(_KEEP_FP32):
            return DenseWeight(raw.astype(np.float32, copy=False))
        return DenseWeight(raw.astype(self.dtype, copy=False))


# -- fused projections -------------------------------------------------------------------------

_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class FusedProjections:
    """Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` as the separate projections the graph
    builds: each part is a span of the fused weight's rows (q, then k, then v; gate, then up,
    as transformers slices the fused output), taken without touching a value, so the parts are
    exactly the fused weight (quantized blocks run along the input columns, never across rows).
    """

    def __init__(self, inner: Any, config: Any) -> None:
        self.inner = inner
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        q, kv, mlp = heads * head_dim, kv_heads * head_dim, int(config.intermediate_size)
        self.spans = {
            "self_attn.qkv_proj": [(0, q), (q, q + kv), (q + kv, q + 2 * kv)],
            "mlp.gate_up_proj": [(0, mlp), (mlp, 2 * mlp)],
        }

    def _fused(self, name: str) -> tuple[str, int, int, int] | None:
        """(the fused tensor's name, this part's rows lo and hi, the fused rows) or None."""
        stem, _, kind = name.rpartition(".")
        parts = stem.split(".")
        rest = ".".join(parts[3:])
        if parts[:2] != ["model", "layers"] or rest not in _FUSED:
            return None
        fused, index = _FUSED[rest]
        spans = self.spans[fused]
        lo, hi = spans[index]
        return f"{'.'.join(parts[:3])}.{fused}.{kind}", lo, hi, spans[-1][1]

    def has(self, name: str) -> bool:
        found = self._fused(name)
        return bool(self.inner.has(found[0] if found else name))

    def tensor(self, name: str) -> Weight:
        found = self._fused(name)
        if found is None:
            return self.inner.tensor(name)
        fused_name, lo, hi, total = found
        weight: Weight = self.inner.tensor(fused_name)
        rows = weight_shape(weight)[0]
        if rows != total:
            raise ExportError(f"{fused_name}: {rows} rows, the config makes it {total}")
        return weight.take_rows(lo, hi)


# -- Mixtral's names ---------------------------------------------------------------------------

_MIXTRAL_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class MixtralNames:
    """Mixtral's ``block_sparse_moe`` tensors under the names the graph asks for (Qwen3-MoE's:
    ``mlp.gate``, ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` = w1 / w3 / w2)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @staticmethod
    def _name(name: str) -> str:
        parts = name.split(".")
        if parts[:2] != ["model", "layers"] or len(parts) < 5 or parts[3] != "mlp":
            return name
        rest = parts[4:]
        if rest[0] == "experts" and len(rest) == 4 and rest[2] in _MIXTRAL_EXPERT:
            rest = ["experts", rest[1], _MIXTRAL_EXPERT[rest[2]], rest[3]]
        return ".".join([*parts[:3], "block_sparse_moe", *rest])

    def has(self, name: str) -> bool:
        return bool(self.inner.has(self._name(name)))

    def tensor(self, name: str) -> Weight:
        return self.inner.tensor(self._name(name))


# -- gpt-oss's experts -------------------------------------------------------------------------


class GptOssExperts:
    """gpt-oss's experts under the names the graph asks for, whatever the source stores:
    ``mlp.experts.gate_up_proj.weight`` [E * 2I, H] (each expert's gate and up rows
    interleaved: gate of channel i in row 2i, up in 2i + 1, transformers' ``gate_up[..., ::2]``
    and ``[..., 1::2]``), ``mlp.experts.gate_up_proj.bias`` [E * 2I] likewise,
    ``mlp.experts.down_proj.weight`` [E * H, I] and ``.bias`` [E * H]. From

    - a Hugging Face folder: ``gate_up_proj`` [E, H, 2I] and ``down_proj`` [E, I, H] (x @ W,
      transposed here), or OpenAI's MXFP4 checkpoint's ``*_blocks`` [E, rows, cols / 32, 16]
      and ``*_scales`` (e8m0) as i8 codes with an f32 scale per 32 (exact), and ``*_bias``;
    - a GGUF: ``ffn_gate_exps`` and ``ffn_up_exps`` (llama.cpp's converter de-interleaves them)
      interleaved again, or ``ffn_gate_up_exps`` (gate rows, then up rows, per expert): a row
      permutation, exact for every block type.
    """

    _NAMES = ("gate_up_proj", "down_proj")

    def __init__(self, inner: Any, config: Any) -> None:
        self.inner = inner
        self.experts = int(config.num_local_experts)
        self.width = int(config.intermediate_size)

    def _split(self, name: str) -> tuple[str, str, str] | None:
        """(the layer's ``...mlp.experts`` prefix, gate_up_proj | down_proj, weight | bias)."""
        parts = name.split(".")
        if len(parts) != 7 or parts[:2] != ["model", "layers"] or parts[3:5] != ["mlp", "experts"]:
            return None
        if parts[5] not in self._NAMES or parts[6] not in ("weight", "bias"):
            return None
        return ".".join(parts[:5]), parts[5], parts[6]

    def has(self, name: str) -> bool:
        found = self._split(name)
        if found is None:
            return bool(self.inner.has(name))
        prefix, proj, kind = found
        hf = f"{prefix}.{proj}_bias" if kind == "bias" else f"{prefix}.{proj}"
        if self.inner.has(hf) or self.inner.has(f"{hf}_blocks") or self.inner.has(name):
            return True
        return proj == "gate_up_proj" and self.inner.has(f"{prefix}.gate_proj.{kind}")

    def tensor(self, name: str) -> Weight:
        found = self._split(name)
        if found is None:
            return self.inner.tensor(name)
        prefix, proj, kind = found
        hf = f"{prefix}.{proj}"
        if kind == "bias":
            if self.inner.has(f"{hf}_bias"):
                return self.inner.tensor(f"{hf}_bias")
        elif self.inner.has(f"{hf}_blocks"):  # OpenAI's MXFP4 checkpoint
            blocks = self.inner.raw(f"{hf}_blocks")  # [E, rows, groups, 16]
            scales = self.inner.raw(f"{hf}_scales")  # [E, rows, groups]
            rows = blocks.shape[0] * blocks.shape[1]
            # the low nibble holds the even element (transformers' convert_moe_packed_tensors)
            codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(rows, -1)
            return mxfp4_weight(codes, scales.reshape(rows, -1))
        elif self.inner.has(hf):  # x @ W: [E, in, out] -> [E * out, in]
            weight = self.inner.tensor(hf)
            assert isinstance(weight, DenseWeight)
            array = np.swapaxes(weight.array, 1, 2)
            return DenseWeight(np.ascontiguousarray(array).reshape(-1, array.shape[-1]))
        bias = kind == "bias"
        if proj == "down_proj" or self.inner.has(name):
            weight = _vector(self.inner.tensor(name)) if bias else self.inner.tensor(name)
            if proj == "gate_up_proj":  # a GGUF's fused ffn_gate_up_exps: gate, then up rows
                return _permute(weight, _fused_order(self.experts, self.width))
            return weight
        gate = self.inner.tensor(f"{prefix}.gate_proj.{kind}")
        up = self.inner.tensor(f"{prefix}.up_proj.{kind}")
        if bias:
            gate, up = _vector(gate), _vector(up)
        return _permute(stack_rows(gate, up), _interleave_order(self.experts, self.width))


def _vector(weight: Weight) -> DenseWeight:
    """A bias stored [E, rows] as the vector of its rows."""
    if not isinstance(weight, DenseWeight):
        raise ExportError("gpt-oss: an expert bias stored quantized")
    return DenseWeight(weight.array.reshape(-1), weight.note)


def _permute(weight: Weight, order: np.ndarray) -> Weight:
    """The rows (a vector's values) of ``weight`` in ``order``."""
    if isinstance(weight, DenseWeight) and weight.array.ndim == 1:
        return DenseWeight(weight.array[order], weight.note)
    return weight.permute_rows(order)


def _interleave_order(experts: int, width: int) -> np.ndarray:
    """All gate rows [E * I], then all up rows [E * I] -> per expert gate 0, up 0, gate 1, ..."""
    e = np.arange(experts).reshape(-1, 1)
    i = np.arange(width).reshape(1, -1)
    gate, up = e * width + i, experts * width + e * width + i
    return np.stack([gate, up], axis=-1).reshape(-1)


def _fused_order(experts: int, width: int) -> np.ndarray:
    """Per expert gate rows then up rows [E, 2I] -> interleaved."""
    e = np.arange(experts).reshape(-1, 1)
    i = np.arange(width).reshape(1, -1)
    gate, up = e * 2 * width + i, e * 2 * width + width + i
    return np.stack([gate, up], axis=-1).reshape(-1)


# -- vision-language wrappers ------------------------------------------------------------------


class LanguageModelNames:
    """A text model stored inside a vision-language checkpoint (Qwen3.5: ``model.language_model.
    layers.3...``; transformers also saves its text-only Qwen3.5 so) under the names the graph
    asks for (``model.layers.3...``); the vision tower and the MTP layers are never asked for."""

    PREFIX = "model.language_model."

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def _name(self, name: str) -> str:
        if name.startswith("model.") and not self.inner.has(name):
            return self.PREFIX + name[len("model.") :]
        return name

    def has(self, name: str) -> bool:
        return bool(self.inner.has(self._name(name)))

    def tensor(self, name: str) -> Weight:
        return self.inner.tensor(self._name(name))


# -- Qwen3.5-MoE's stacked experts -------------------------------------------------------------


class StackedExperts:
    """Experts stored as one 3-D tensor a layer (Qwen3.5-MoE's Hugging Face checkpoints:
    ``mlp.experts.gate_up_proj`` [E, 2I, H], gate rows then up rows, and ``mlp.experts.
    down_proj`` [E, H, I]) under the stacked names the graph asks for (``mlp.experts.
    gate_proj.weight`` [E * I, H], as a GGUF's ``ffn_gate_exps``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @staticmethod
    def _source(name: str) -> tuple[str, str] | None:
        """(the stored tensor's name, the part asked for) or None for any other tensor."""
        stem, dot, part = name.rpartition(".experts.")
        if not dot or part not in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
            return None
        stored = "down_proj" if part == "down_proj.weight" else "gate_up_proj"
        return f"{stem}.experts.{stored}", part.split(".")[0]

    def has(self, name: str) -> bool:
        found = self._source(name)
        if found is not None and self.inner.has(found[0]):
            return True
        return bool(self.inner.has(name))

    def tensor(self, name: str) -> Weight:
        found = self._source(name)
        if found is None or not self.inner.has(found[0]):
            return self.inner.tensor(name)
        stored, part = found
        weight = self.inner.tensor(stored)
        if not isinstance(weight, DenseWeight) or weight.array.ndim != 3:
            raise ExportError(f"{stored}: expected a 3-D float tensor [experts, rows, cols]")
        array = weight.array
        if part != "down_proj":
            half = array.shape[1] // 2
            array = array[:, :half] if part == "gate_proj" else array[:, half:]
        experts, rows, cols = array.shape
        return DenseWeight(np.ascontiguousarray(array).reshape(experts * rows, cols))


# -- Qwen3-Next's fused linear-attention projections ---------------------------------------------


class GroupedLinearProjections:
    """Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba``, whose rows are grouped by key head
    (each group: q, k, then its value heads' v and z; b then a), as the separate projections
    of Qwen3.5 that the graph asks for (``in_proj_qkv``: every q row, every k row, every v
    row; ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), as transformers'
    ``fix_query_key_value_ordering`` regroups their outputs. Rows are only reordered and
    taken, never touched (quantized blocks run along the input columns)."""

    def __init__(self, inner: Any, config: Any) -> None:
        self.inner = inner
        hk, hv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
        dk, dv = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
        group = hv // hk
        width = 2 * dk + 2 * group * dv
        span = np.arange(width)
        parts = [span[:dk], span[dk : 2 * dk], span[2 * dk : 2 * dk + group * dv]]
        parts.append(span[2 * dk + group * dv :])
        self.qkvz = np.concatenate([g * width + p for p in parts for g in range(hk)])
        self.qkv_rows = 2 * hk * dk + hv * dv
        ba = np.arange(2 * group)
        self.ba = np.concatenate(
            [g * 2 * group + p for p in (ba[:group], ba[group:]) for g in range(hk)]
        )
        self.value_heads = hv

    @staticmethod
    def _split(name: str) -> tuple[str, str] | None:
        stem, dot, part = name.rpartition(".linear_attn.")
        if not dot:
            return None
        if part in ("in_proj_qkv.weight", "in_proj_z.weight"):
            return f"{stem}.linear_attn.in_proj_qkvz.weight", part
        if part in ("in_proj_b.weight", "in_proj_a.weight"):
            return f"{stem}.linear_attn.in_proj_ba.weight", part
        return None

    def _fused(self, name: str) -> tuple[str, str] | None:
        """Where ``name`` is to be cut from a fused tensor: a GGUF holds in_proj_qkv and _z
        as they are (llama.cpp's converter regroups in_proj_qkvz) and b and a fused."""
        found = self._split(name)
        return None if found is None or self.inner.has(name) else found

    def has(self, name: str) -> bool:
        found = self._fused(name)
        return bool(self.inner.has(found[0] if found else name))

    def tensor(self, name: str) -> Weight:
        found = self._fused(name)
        if found is None:
            return self.inner.tensor(name)
        fused_name, part = found
        fused: Weight = self.inner.tensor(fused_name)
        order = self.qkvz if "qkvz" in fused_name else self.ba
        if weight_shape(fused)[0] != len(order):
            raise ExportError(
                f"{fused_name}: {weight_shape(fused)[0]} rows, the config makes it {len(order)}"
            )
        grouped = fused.permute_rows(order)
        if part == "in_proj_qkv.weight":
            return grouped.take_rows(0, self.qkv_rows)
        if part == "in_proj_z.weight":
            return grouped.take_rows(self.qkv_rows, len(order))
        if part == "in_proj_b.weight":
            return grouped.take_rows(0, self.value_heads)
        return grouped.take_rows(self.value_heads, 2 * self.value_heads)
