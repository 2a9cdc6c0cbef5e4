"""Qwen3-Next: the hybrid of Qwen3.5 with its linear attention's projections fused and grouped
by key head (``in_proj_qkvz``, ``in_proj_ba``), Qwen3-MoE's experts (dense layers allowed by
``mlp_only_layers``) plus a gated shared expert."""

from __future__ import annotations

from typing import Any

import numpy as np

from exporter.errors import ExportError
from exporter.families.base import Family
from exporter.families.qwen3_5 import HYBRID_GGUF_RENAMES, hybrid_facts, hybrid_gguf_config
from exporter.families.qwen3_5 import adapt_source as hybrid_source
from exporter.families.qwen3_moe import qwen3_moe_facts
from exporter.gguf_quant import Weight, weight_shape


def facts(config: Any, num_layers: int, layer_types: list[str]) -> dict[str, Any]:
    """Qwen3-MoE's experts, Qwen3NextSparseMoeBlock's gated shared expert, the hybrid's sizes."""
    return {
        **qwen3_moe_facts(config, num_layers),
        "shared_expert_intermediate_size": int(config.shared_expert_intermediate_size),
        "shared_expert_gated": True,
        **hybrid_facts(config, num_layers, layer_types),
    }


def adapt_source(source: Any, config: Any, gguf: bool) -> Any:
    return GroupedLinearProjections(hybrid_source(source, config, gguf), config)


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


FAMILY = Family(
    model_type="qwen3_next",
    title="Qwen3-Next (the hybrid of qwen3_5_text with fused in_proj_qkvz/ba, experts computed "
    "sparsely, a gated shared expert)",
    gguf_arch="qwen3next",
    facts=facts,
    gguf_config=hybrid_gguf_config,
    adapt_source=adapt_source,
    hybrid=True,
    qk_norm=True,
    norms_plus_one=True,
    gguf_renames=HYBRID_GGUF_RENAMES,
)
