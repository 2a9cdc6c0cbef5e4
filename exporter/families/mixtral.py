"""Mixtral: every layer's MLP is 8 experts, 2 a token, renormalised; a set ``sliding_window``
masks every layer. Its checkpoints name the experts ``block_sparse_moe.experts.{e}.w1/w3/w2``;
llama.cpp writes it as a ``llama`` file with ``llama.expert_count`` (exporter.source reads it
back as Mixtral)."""

from __future__ import annotations

from typing import Any

from exporter.families.base import Family
from exporter.gguf_quant import Weight


def facts(config: Any, num_layers: int, layer_types: list[str]) -> dict[str, Any]:
    """Every layer's MLP is experts; the chosen weights sum to 1."""
    return dict(
        moe_layers=tuple(range(num_layers)),
        num_experts=int(config.num_local_experts),
        experts_per_token=int(config.num_experts_per_tok),
        expert_intermediate_size=int(config.intermediate_size),
        norm_topk_prob=True,
    )


def adapt_source(source: Any, config: Any, gguf: bool) -> Any:
    return source if gguf else MixtralNames(source)


_MIXTRAL_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class MixtralNames:
    """Mixtral's ``block_sparse_moe`` tensors under the names the graph asks for (Qwen3-MoE's:
    ``mlp.gate``, ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` = w1 / w3 / w2)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @staticmethod
    def _name(name: str) -> str:
        parts = name.split(".")
        if parts[:2] != ["model", "layers"] or len(parts) < 5 or parts[3] != "mlp":
            return name
        rest = parts[4:]
        if rest[0] == "experts" and len(rest) == 4 and rest[2] in _MIXTRAL_EXPERT:
            rest = ["experts", rest[1], _MIXTRAL_EXPERT[rest[2]], rest[3]]
        return ".".join([*parts[:3], "block_sparse_moe", *rest])

    def has(self, name: str) -> bool:
        return bool(self.inner.has(self._name(name)))

    def tensor(self, name: str) -> Weight:
        return self.inner.tensor(self._name(name))


FAMILY = Family(
    model_type="mixtral",
    title="Mixtral (experts computed sparsely; a set sliding_window masks every layer)",
    gguf_arch="llama",  # llama.cpp's Mixtral: a llama file with experts
    facts=facts,
    adapt_source=adapt_source,
    sliding_every_layer=True,
)
