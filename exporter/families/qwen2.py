"""Qwen2 and Qwen2.5: Llama with q/k/v biases (and, in the small ones, tied embeddings)."""

from exporter.families.base import Family, no_gguf_config

FAMILY = Family(
    model_type="qwen2",
    title="Qwen2 / Qwen2.5",
    gguf_arch="qwen2",
    gguf_config=no_gguf_config,
    cuttable_mlp=True,
)
