"""GLM-4.5, 4.5-Air, 4.6, 4.7: dense first layers (first_k_dense_replace), then experts picked
by sigmoid grouped routing with a correction bias, plus an ungated shared expert; q/k/v
biases, optional q/k norms (use_qk_norm), half of each head rotating; the NextN/MTP layers
after the last are not exported."""

from __future__ import annotations

from typing import Any

from exporter.errors import ExportError
from exporter.families.base import Family


def facts(config: Any, num_layers: int, layer_types: list[str]) -> dict[str, Any]:
    """transformers' Glm4MoeDecoderLayer: a dense MLP below first_k_dense_replace, experts
    (Glm4MoeMoE: sigmoid grouped routing and a shared expert) from there on."""
    experts = int(config.n_routed_experts)
    groups, used_groups = int(config.n_group or 1), int(config.topk_group or 1)
    if experts % groups or not 0 < used_groups <= groups:
        raise ExportError(
            f"glm4_moe: {experts} experts in n_group {groups} with topk_group {used_groups}"
        )
    if experts // groups < 2:  # transformers scores a group by its two best experts
        raise ExportError(f"glm4_moe: n_group {groups} leaves fewer than 2 experts a group")
    width = int(config.moe_intermediate_size)
    return dict(
        moe_layers=tuple(range(int(config.first_k_dense_replace or 0), num_layers)),
        num_experts=experts,
        experts_per_token=int(config.num_experts_per_tok),
        expert_intermediate_size=width,
        norm_topk_prob=bool(config.norm_topk_prob),
        router="sigmoid",
        routed_scaling_factor=float(config.routed_scaling_factor),
        n_group=groups,
        topk_group=used_groups,
        shared_expert_intermediate_size=width * int(getattr(config, "n_shared_experts", 0) or 0),
        nextn_layers=int(getattr(config, "num_nextn_predict_layers", 0) or 0),
    )


def gguf_config(meta: Any, layers: int, nextn: int) -> dict[str, Any]:
    """Glm4MoeConfig's fields (GLM-4.5/4.6/4.7, conversion/glm.py's Glm4MoeModel)."""
    m = meta.model
    out: dict[str, Any] = {
        "n_routed_experts": int(m("expert_count")),
        "num_experts_per_tok": int(m("expert_used_count")),
        "moe_intermediate_size": int(m("expert_feed_forward_length")),
        "n_shared_experts": int(m("expert_shared_count", 0)),
        "first_k_dense_replace": int(m("leading_dense_block_count", 0)),
        "routed_scaling_factor": meta.real(m("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(m("expert_weights_norm", False)),
        "n_group": int(m("expert_group_count", 1)),
        "topk_group": int(m("expert_group_used_count", 1)),
        # not in the metadata: the tensors say
        "attention_bias": "blk.0.attn_q.bias" in meta.tensors,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in meta.tensors,
        "num_nextn_predict_layers": nextn,
    }
    gating = m("expert_gating_func")
    if gating is not None and int(gating) != 2:  # ExpertGatingFuncType.SIGMOID
        raise ExportError(f"{meta.path.name}: glm4moe with expert gating {gating} (not sigmoid)")
    return out


FAMILY = Family(
    model_type="glm4_moe",
    title="GLM-4.5, 4.5-Air, 4.6, 4.7 (experts computed sparsely, sigmoid grouped routing, a "
    "shared expert, dense first layers, partial rotary; NextN/MTP layers skipped)",
    gguf_arch="glm4moe",
    facts=facts,
    gguf_config=gguf_config,
    qk_norm_key="use_qk_norm",
    # the router's correction bias under the name gguf-py's map knows (exp_probs_b.bias)
    gguf_renames=((".mlp.gate.e_score_correction_bias", ".mlp.gate.e_score_correction.bias"),),
    gguf_reference=True,
)
