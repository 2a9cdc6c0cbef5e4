"""Qwen3-MoE: Qwen3 whose MLPs are experts (softmax top-k, renormalised when norm_topk_prob),
except the layers listed in ``mlp_only_layers``."""

from __future__ import annotations

from typing import Any

from exporter.families.base import Family


def qwen3_moe_facts(config: Any, num_layers: int) -> dict[str, Any]:
    """transformers' Qwen3MoeDecoderLayer (and Qwen3NextDecoderLayer): experts unless listed
    in mlp_only_layers, on every decoder_sparse_step-th layer."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    experts = int(config.num_experts)
    return dict(
        moe_layers=tuple(
            i for i in range(num_layers) if i not in dense and experts > 0 and (i + 1) % step == 0
        ),
        num_experts=experts,
        experts_per_token=int(config.num_experts_per_tok),
        expert_intermediate_size=int(config.moe_intermediate_size),
        norm_topk_prob=bool(config.norm_topk_prob),
    )


def facts(config: Any, num_layers: int, layer_types: list[str]) -> dict[str, Any]:
    return qwen3_moe_facts(config, num_layers)


def gguf_config(meta: Any, layers: int, nextn: int) -> dict[str, Any]:
    """Qwen3MoeConfig's expert fields from a qwen3moe GGUF."""
    m = meta.model
    out: dict[str, Any] = {
        "num_experts": int(m("expert_count")),
        "num_experts_per_tok": int(m("expert_used_count")),
        "norm_topk_prob": True,  # llama.cpp's qwen3moe always renormalizes the top-k
    }
    if (width := m("expert_feed_forward_length")) is not None:
        out["moe_intermediate_size"] = int(width)
    return out


FAMILY = Family(
    model_type="qwen3_moe",
    title="Qwen3-MoE (experts computed sparsely)",
    gguf_arch="qwen3moe",
    facts=facts,
    gguf_config=gguf_config,
    qk_norm=True,
)
