"""Qwen3 (dense): per-head q/k norms, a head_dim that need not be hidden_size / heads."""

from exporter.families.base import Family, no_gguf_config

FAMILY = Family(
    model_type="qwen3",
    title="Qwen3 (dense)",
    gguf_arch="qwen3",
    gguf_config=no_gguf_config,
    qk_norm=True,
    cuttable_mlp=True,
)
