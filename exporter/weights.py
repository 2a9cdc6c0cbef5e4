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
from exporter.families import family, gguf_family
from exporter.families.gguf_names import gguf_name
from exporter.gguf_quant import (
    DenseWeight,
    Q4KForm,
    Weight,
    from_gguf,
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


class GGUFSource:
    """A GGUF file's tensors by Hugging Face name, each read when asked for."""

    def __init__(
        self, path: Path, config: Any, form: Q4KForm = "exact", dense: str | None = None
    ) -> None:
        """``dense``: a float or NNCF format (fp32, fp16, int8, int4): every tensor
        de-quantized to float32 (float16 for fp16) instead, for NNCF to compress again."""
        self.path = path
        self.family = family(str(config.model_type))
        self.form = form
        self.dense = dense
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        reader = read_gguf_header(path)
        arch_field = reader.fields.get("general.architecture")
        self.arch = arch_field.contents() if arch_field else "unknown"
        self.tensors = {t.name: t for t in reader.tensors}
        # exporter.graph repeats the key heads tiled (not interleaved) for such a file
        tiled = gguf_family(self.arch)
        self.value_heads_tiled = tiled is not None and tiled.gguf_tiled_value_heads

    def has(self, name: str) -> bool:
        try:
            return gguf_name(name, self.family) in self.tensors
        except KeyError:
            return False

    def tensor(self, name: str) -> Weight:
        try:
            key = gguf_name(name, self.family)
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
        plus_one = self.family.norms_plus_one and key.endswith("norm.weight")
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
