"""Phi-3, Phi-3.5-mini, Phi-4-mini: q, k, v stored fused (``qkv_proj``) and gate and up fused
(``gate_up_proj``, which llama.cpp keeps fused as ``ffn_up``), part of each head rotating,
LongRoPE; a set ``sliding_window`` masks every layer."""

from __future__ import annotations

from typing import Any

from exporter.errors import ExportError
from exporter.families.base import Family
from exporter.gguf_quant import Weight, weight_shape


def adapt_source(source: Any, config: Any, gguf: bool) -> Any:
    return FusedProjections(source, config)


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


FAMILY = Family(
    model_type="phi3",
    title="Phi-3, Phi-3.5-mini, Phi-4-mini (fused qkv and gate_up, partial rotary, LongRoPE)",
    gguf_arch="phi3",
    adapt_source=adapt_source,
    sliding_every_layer=True,
    cuttable_mlp=True,
)
