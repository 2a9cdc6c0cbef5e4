"""Which decoder architectures the exporter can split, and the facts it reads from their configs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from exporter.errors import ExportError

# transformers model_type -> human name: the decoders exporter/graph.py builds (see
# exporter/recipe.py for what differs between them).
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "Llama (1, 2, 3.x incl. rope_scaling)",
    "qwen2": "Qwen2 / Qwen2.5",
    "qwen3": "Qwen3 (dense)",
    "gemma3_text": "Gemma 3 (text)",
    "mistral": "Mistral (a set sliding_window applies to every layer)",
    "phi3": "Phi-3, Phi-3.5-mini, Phi-4-mini (fused qkv and gate_up, partial rotary, LongRoPE)",
    "qwen3_moe": "Qwen3-MoE (experts computed sparsely)",
    "mixtral": "Mixtral (experts computed sparsely; a set sliding_window masks every layer)",
    "glm4_moe": "GLM-4.5, 4.5-Air, 4.6, 4.7 (experts computed sparsely, sigmoid grouped routing, "
    "a shared expert, dense first layers, partial rotary; NextN/MTP layers skipped)",
    "gpt_oss": "gpt-oss 20b, 120b (experts computed sparsely, MXFP4 experts kept exact; "
    "attention sinks, alternating sliding/full attention, YaRN RoPE)",
    "qwen3_5_text": "Qwen3.5 / 3.6 dense (hybrid: Gated DeltaNet linear attention, gated full "
    "attention; MTP layers skipped)",
    "qwen3_5_moe_text": "Qwen3.5 / 3.6 MoE (the hybrid of qwen3_5_text, experts computed "
    "sparsely, a gated shared expert)",
    "qwen3_next": "Qwen3-Next (the hybrid of qwen3_5_text with fused in_proj_qkvz/ba, experts "
    "computed sparsely, a gated shared expert)",
}
# Hugging Face folders of these types are vision-language wrappers: their text model's config
# is ``text_config`` and its tensors are under ``model.language_model.`` (exporter.source).
TEXT_CONFIGS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
# Hybrid architectures: Gated DeltaNet ("linear_attention") layers beside gated full attention
HYBRID = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")

# Architectures whose attention and MLP input projections are stored fused (qkv_proj,
# gate_up_proj): the exporter reads each part as its own projection (exporter.weights).
FUSED_PROJECTIONS = ("phi3",)

# Architectures whose ``sliding_window``, when set, applies to every layer (their configs have no
# ``layer_types``): transformers masks all their layers with it.
_SLIDING_EVERY_LAYER = ("mistral", "mixtral", "phi3")


@dataclass(frozen=True)
class ArchitectureFacts:
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    layer_types: list[str]
    sliding_window: int | None
    final_logit_softcapping: float | None
    intermediate_size: int = 0  # MLP channels per layer (a dense layer's, in an MoE model)
    # Mixture of experts: the layers whose MLP is experts (0-based), how many experts, how
    # many each token uses, each expert's channels, and whether the chosen weights are
    # renormalised to sum to 1
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # How the router picks experts: "softmax" (Qwen3-MoE, Mixtral: top-k of the softmax),
    # "sigmoid" (GLM-4.5: top-k of sigmoid scores plus a correction bias, within the best
    # ``topk_group`` of ``n_group`` expert groups; the chosen scores, renormalised if
    # norm_topk_prob, times ``routed_scaling_factor``) or "topk_softmax" (gpt-oss: a router
    # with a bias, the top-k of its logits, softmax over those k)
    router: str = "softmax"
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    # channels of the expert every token also runs beside the routed ones (0: none), ungated
    # (GLM's ``shared_experts``) or scaled by sigmoid(shared_expert_gate(x)) (Qwen3.5-MoE's and
    # Qwen3-Next's ``shared_expert``)
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = False
    # NextN / multi-token-prediction layers stored after the last layer: not part of the
    # model's output, not exported
    nextn_layers: int = 0
    # gpt-oss: a learnt logit per head that every query's softmax also sees (attention sinks),
    # and experts with biases whose gate and up rows interleave, computing
    # (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
    attention_sinks: bool = False
    clamped_swiglu: bool = False
    # Hybrids (Gated DeltaNet): the linear-attention layers' key/value heads, their widths and
    # the causal convolution's kernel; full attention gated by a second half of q_proj
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0
    attention_output_gate: bool = False

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    def is_linear(self, layer: int) -> bool:
        """A Gated DeltaNet layer: a fixed-size state per sequence instead of a KV cache."""
        return self.layer_types[layer] == "linear_attention"

    @property
    def linear_conv_channels(self) -> int:
        """Channels of a linear-attention layer's causal convolution (q, k and v)."""
        return 2 * self.linear_key_heads * self.linear_key_dim + (
            self.linear_value_heads * self.linear_value_dim
        )


# Mixture-of-experts families people ask for that the export does not build, and why: refused
# with the reason rather than the bare list.
NOT_YET = {
    "glm4_moe_lite": "GLM-4.7-Flash's multi-head latent attention (DeepSeek's) is not built",
    "qwen2_moe": "Qwen2-MoE's shared expert (with its sigmoid gate beside the routed experts) "
    "is not built",
    "deepseek_v2": "DeepSeek's multi-head latent attention and shared experts are not built",
    "deepseek_v3": "DeepSeek's multi-head latent attention, shared experts and grouped routing "
    "are not built",
    "llama4": "Llama 4's shared expert, sigmoid routing and chunked attention are not built",
}


def read_architecture(config: Any) -> ArchitectureFacts:
    """Check that ``config`` is a supported decoder and read its shape facts."""
    model_type = getattr(config, "model_type", None) or "unknown"
    if model_type not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        why = f" ({NOT_YET[model_type]})" if model_type in NOT_YET else ""
        raise ExportError(
            f"architecture {model_type!r} is not supported{why}; supported: {supported}"
        )
    if getattr(config, "attn_logit_softcapping", None):
        raise ExportError(
            f"{model_type}: attention logit soft-capping is not supported by the fused attention"
        )
    num_layers = int(config.num_hidden_layers)
    num_heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
    layer_types = list(getattr(config, "layer_types", None) or [])
    if not layer_types:
        every = model_type in _SLIDING_EVERY_LAYER and getattr(config, "sliding_window", None)
        layer_types = ["sliding_attention" if every else "full_attention"] * num_layers
    uses_sliding = "sliding_attention" in layer_types
    moe: dict[str, Any] = {}
    if model_type in ("qwen3_moe", "qwen3_next"):
        # transformers' Qwen3MoeDecoderLayer (and Qwen3NextDecoderLayer): experts unless listed
        # in mlp_only_layers, on every decoder_sparse_step-th layer
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(config, "mlp_only_layers", None) or [])
        experts = int(config.num_experts)
        moe = dict(
            moe_layers=tuple(
                i
                for i in range(num_layers)
                if i not in dense and experts > 0 and (i + 1) % step == 0
            ),
            num_experts=experts,
            experts_per_token=int(config.num_experts_per_tok),
            expert_intermediate_size=int(config.moe_intermediate_size),
            norm_topk_prob=bool(config.norm_topk_prob),
        )
    if model_type == "qwen3_next":  # Qwen3NextSparseMoeBlock's gated shared expert
        moe.update(
            shared_expert_intermediate_size=int(config.shared_expert_intermediate_size),
            shared_expert_gated=True,
        )
    if model_type == "qwen3_5_moe_text":  # Qwen3_5MoeSparseMoeBlock on every layer
        moe = dict(
            moe_layers=tuple(range(num_layers)),
            num_experts=int(config.num_experts),
            experts_per_token=int(config.num_experts_per_tok),
            expert_intermediate_size=int(config.moe_intermediate_size),
            norm_topk_prob=True,
            shared_expert_intermediate_size=int(config.shared_expert_intermediate_size),
            shared_expert_gated=True,
        )
    if model_type == "mixtral":  # every layer's MLP is experts; the chosen weights sum to 1
        moe = dict(
            moe_layers=tuple(range(num_layers)),
            num_experts=int(config.num_local_experts),
            experts_per_token=int(config.num_experts_per_tok),
            expert_intermediate_size=int(config.intermediate_size),
            norm_topk_prob=True,
        )
    if model_type == "glm4_moe":
        moe = _glm4_moe(config, num_layers)
    if model_type == "gpt_oss":  # transformers' GptOssMLP: every layer's MLP is experts
        moe = dict(
            moe_layers=tuple(range(num_layers)),
            num_experts=int(config.num_local_experts),
            experts_per_token=int(config.num_experts_per_tok),
            expert_intermediate_size=int(config.intermediate_size),
            router="topk_softmax",
            attention_sinks=True,
            clamped_swiglu=True,
        )
    if model_type in HYBRID:
        moe.update(_hybrid(config, model_type, layer_types[:num_layers]))
    return ArchitectureFacts(
        model_type=model_type,
        num_layers=num_layers,
        hidden_size=int(config.hidden_size),
        num_heads=num_heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
        head_dim=head_dim,
        vocab_size=int(config.vocab_size),
        max_context=int(getattr(config, "max_position_embeddings", 0) or 4096),
        layer_types=layer_types[:num_layers],
        sliding_window=int(config.sliding_window) if uses_sliding else None,
        final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
        intermediate_size=_intermediate_size(config),
        **moe,
    )


def _intermediate_size(config: Any) -> int:
    """A dense layer's MLP channels; Qwen3.5-MoE has no dense layer (and no such field): its
    shared expert's."""
    size = getattr(config, "intermediate_size", None)
    if size is None:
        size = config.shared_expert_intermediate_size
    return int(size)


def _glm4_moe(config: Any, num_layers: int) -> dict[str, Any]:
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


def _hybrid(config: Any, model_type: str, layer_types: list[str]) -> dict[str, Any]:
    """Qwen3.5's Gated DeltaNet sizes (Qwen3_5GatedDeltaNet) and its gated attention."""
    unknown = sorted(set(layer_types) - {"linear_attention", "full_attention"})
    if unknown:
        raise ExportError(f"{model_type}: layer types {unknown} are not supported")
    key_heads = int(config.linear_num_key_heads)
    value_heads = int(config.linear_num_value_heads)
    if value_heads % key_heads:
        raise ExportError(
            f"{model_type}: {value_heads} linear value heads are not a multiple of "
            f"{key_heads} key heads"
        )
    return dict(
        linear_key_heads=key_heads,
        linear_value_heads=value_heads,
        linear_key_dim=int(config.linear_key_head_dim),
        linear_value_dim=int(config.linear_value_head_dim),
        linear_conv_kernel=int(config.linear_conv_kernel_dim),
        attention_output_gate=True,
        nextn_layers=int(getattr(config, "mtp_num_hidden_layers", 0) or 0),
    )
