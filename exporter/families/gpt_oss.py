"""gpt-oss 20b and 120b: every layer's MLP is experts with biases (a biased router, the top-k
of its logits, softmax over those k) computing a clamped SwiGLU, MXFP4 experts kept exact;
attention sinks, alternating sliding/full attention, YaRN RoPE. The gateway reads its answers
as harmony whatever its template says."""

from __future__ import annotations

from typing import Any

import numpy as np

from exporter.errors import ExportError
from exporter.families.base import Family
from exporter.gguf_quant import DenseWeight, Weight, mxfp4_weight, stack_rows


def facts(config: Any, num_layers: int, layer_types: list[str]) -> dict[str, Any]:
    """transformers' GptOssMLP: every layer's MLP is experts."""
    return dict(
        moe_layers=tuple(range(num_layers)),
        num_experts=int(config.num_local_experts),
        experts_per_token=int(config.num_experts_per_tok),
        expert_intermediate_size=int(config.intermediate_size),
        router="topk_softmax",
        attention_sinks=True,
        clamped_swiglu=True,
    )


def adapt_source(source: Any, config: Any, gguf: bool) -> Any:
    return GptOssExperts(source, config)


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


def gguf_config(meta: Any, layers: int, nextn: int) -> dict[str, Any]:
    """GptOssConfig's fields (conversion/gpt_oss.py): experts, the sliding window of every
    other layer (llama.cpp: SWA pattern 2, the first layer sliding, as HF's layer_types); its
    YaRN RoPE is read by exporter.gguf_reader."""
    m = meta.model
    out: dict[str, Any] = {
        "num_local_experts": int(m("expert_count")),
        "num_experts_per_tok": int(m("expert_used_count")),
        "sliding_window": int(m("attention.sliding_window")),
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ],
        "attention_bias": "blk.0.attn_q.bias" in meta.tensors,
    }
    if (width := m("expert_feed_forward_length")) is not None:
        out["intermediate_size"] = int(width)
    return out


FAMILY = Family(
    model_type="gpt_oss",
    title="gpt-oss 20b, 120b (experts computed sparsely, MXFP4 experts kept exact; attention "
    "sinks, alternating sliding/full attention, YaRN RoPE)",
    gguf_arch="gpt-oss",
    facts=facts,
    gguf_config=gguf_config,
    adapt_source=adapt_source,
    # convert_hf_to_gguf's GptOssModel names the sinks ``.weight``; its fused gate_up experts
    # (fuse_gate_up_exps) are a tensor gguf's name map has no Hugging Face name for
    gguf_renames=((".self_attn.sinks", ".self_attn.sinks.weight"),),
    gguf_extra_tensors={"mlp.experts.gate_up_proj": "FFN_GATE_UP_EXP"},
    gguf_reference=True,
    reasoning="harmony",
)
