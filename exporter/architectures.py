"""Which decoder architectures the exporter can split, and the facts it reads from their configs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from exporter.errors import ExportError
from exporter.families import FAMILIES, family

# transformers model_type -> human name: the decoders exporter/graph.py builds, one module each
# under exporter/families/ (see exporter/recipe.py for what differs between them).
SUPPORTED_ARCHITECTURES: dict[str, str] = {name: f.title for name, f in FAMILIES.items()}


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


def read_architecture(config: Any) -> ArchitectureFacts:
    """Check that ``config`` is a supported decoder and read its shape facts."""
    model_type = getattr(config, "model_type", None) or "unknown"
    fam = family(model_type)
    if getattr(config, "attn_logit_softcapping", None):
        raise ExportError(
            f"{model_type}: attention logit soft-capping is not supported by the fused attention"
        )
    num_layers = int(config.num_hidden_layers)
    num_heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
    layer_types = list(getattr(config, "layer_types", None) or [])
    if not layer_types:
        every = fam.sliding_every_layer and getattr(config, "sliding_window", None)
        layer_types = ["sliding_attention" if every else "full_attention"] * num_layers
    uses_sliding = "sliding_attention" in layer_types
    own = fam.facts(config, num_layers, layer_types[:num_layers])  # the family's own facts
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
        **own,
    )


def _intermediate_size(config: Any) -> int:
    """A dense layer's MLP channels; Qwen3.5-MoE has no dense layer (and no such field): its
    shared expert's."""
    size = getattr(config, "intermediate_size", None)
    if size is None:
        size = config.shared_expert_intermediate_size
    return int(size)
