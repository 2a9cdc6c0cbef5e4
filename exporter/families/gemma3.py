"""Gemma 3 (text): sandwich norms that scale by (1 + w) (llama.cpp stores them plus one), the
embedding scaled by sqrt(hidden), q/k norms, sliding and global layers with their own RoPE
bases, a query scale of its own (query_pre_attn_scalar) and soft-capped final logits."""

from exporter.families.base import Family

FAMILY = Family(
    model_type="gemma3_text",
    title="Gemma 3 (text)",
    gguf_arch="gemma3",
    qk_norm=True,
    gemma_layer=True,
    norms_plus_one=True,
)
