"""llama.cpp's GGUF tensor names, from the ``gguf`` package's own tables.

One place answers every "what is this tensor called in a GGUF" of the product, its tests and
its benchmarks: the reader (exporter.weights.GGUFSource), the tiny test writer
(testing_support/tiny_gguf.py), the plans of big models (exporter.presets) and the benchmark
writer (benchmarks/gguf_export.py). Names come from gguf-py's ``TENSOR_NAMES`` (GGUF side) and
its per-architecture ``TensorNameMap`` (Hugging Face side, as llama.cpp's converter maps
them); a family adds only the converter's renames and the few tensors gguf-py's map lacks
(:attr:`~exporter.families.base.Family.gguf_renames`, ``gguf_extra_tensors``).
"""

from __future__ import annotations

import functools
import re
from typing import Any

from exporter.families import family
from exporter.families.base import Family

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@functools.cache
def _name_map(arch: str) -> Any:
    """gguf-py's Hugging Face -> GGUF map of ``arch`` for block 0 (a layer's name is looked up
    as layer 0's and given its own number back)."""
    import gguf

    by_name = {name: arch_id for arch_id, name in gguf.MODEL_ARCH_NAMES.items()}
    return gguf.get_tensor_name_map(by_name[arch], 1)


def tensor_name(kind: str, layer: int | None = None, suffix: str = "weight") -> str:
    """llama.cpp's name of tensor ``kind`` (a ``gguf.MODEL_TENSOR`` name: ``ATTN_Q``,
    ``FFN_DOWN_EXP``, ``SSM_A``) of block ``layer``, with its ``.weight`` / ``.bias`` suffix
    ("" for none): ``tensor_name("ATTN_Q", 3)`` is ``blk.3.attn_q.weight``."""
    import gguf

    base = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[kind]]
    name = base.format(bid=layer) if layer is not None else base
    return f"{name}.{suffix}" if suffix else name


def gguf_name(hf_name: str, model_type: str | Family) -> str:
    """llama.cpp's name of a Hugging Face tensor name of ``model_type``'s family; KeyError for
    a tensor its GGUF files do not have."""
    fam = model_type if isinstance(model_type, Family) else family(model_type)
    if fam.gguf_arch is None:
        raise KeyError(hf_name)
    name = hf_name
    for old, new in fam.gguf_renames:
        if name.endswith(old):
            name = name[: -len(old)] + new
    match = _LAYER.match(name)
    layer = match[1] if match else None
    if match:
        name = f"model.layers.0.{match[2]}"
    found = _name_map(fam.gguf_arch).get_name(name, try_suffixes=(".weight", ".bias"))
    if found is None and name.rpartition(".")[2] not in ("weight", "bias"):
        found = _name_map(fam.gguf_arch).get_name(name)  # a tensor named without a suffix
    if found is None and match:
        stem, _, suffix = match[2].rpartition(".")
        extra = fam.gguf_extra_tensors.get(stem)
        if extra is not None:
            return tensor_name(extra, int(match[1]), suffix)
    if found is None:
        raise KeyError(hf_name)
    if layer is not None:
        if not found.startswith("blk.0."):
            raise KeyError(hf_name)
        found = f"blk.{layer}.{found[len('blk.0.') :]}"
    return str(found)
