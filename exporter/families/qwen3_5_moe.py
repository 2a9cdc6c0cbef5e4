"""Qwen3.5 / 3.6 MoE: the Qwen3.5 hybrid whose every MLP is experts (renormalised top-k) plus
a shared expert gated by sigmoid(shared_expert_gate(x)); its checkpoints store each layer's
experts stacked (``mlp.experts.gate_up_proj`` [E, 2I, H])."""

from __future__ import annotations

from typing import Any

from exporter.families.base import Family
from exporter.families.qwen3_5 import (
    HYBRID_GGUF_RENAMES,
    adapt_source,
    hybrid_facts,
    hybrid_gguf_config,
)


def facts(config: Any, num_layers: int, layer_types: list[str]) -> dict[str, Any]:
    """Qwen3_5MoeSparseMoeBlock on every layer, and the hybrid's sizes."""
    return dict(
        moe_layers=tuple(range(num_layers)),
        num_experts=int(config.num_experts),
        experts_per_token=int(config.num_experts_per_tok),
        expert_intermediate_size=int(config.moe_intermediate_size),
        norm_topk_prob=True,
        shared_expert_intermediate_size=int(config.shared_expert_intermediate_size),
        shared_expert_gated=True,
        **hybrid_facts(config, num_layers, layer_types),
    )


FAMILY = Family(
    model_type="qwen3_5_moe_text",
    title="Qwen3.5 / 3.6 MoE (the hybrid of qwen3_5_text, experts computed sparsely, a gated "
    "shared expert)",
    gguf_arch="qwen35moe",
    facts=facts,
    gguf_config=hybrid_gguf_config,
    adapt_source=adapt_source,
    wrapper_model_type="qwen3_5_moe",
    hybrid=True,
    qk_norm=True,
    norms_plus_one=True,
    gguf_renames=HYBRID_GGUF_RENAMES,
    gguf_tiled_value_heads=True,
)
