"""Mistral: Llama whose set ``sliding_window`` masks every layer. Its GGUF is a llama file."""

from exporter.families.base import Family

FAMILY = Family(
    model_type="mistral",
    title="Mistral (a set sliding_window applies to every layer)",
    gguf_arch="llama",
    sliding_every_layer=True,
    cuttable_mlp=True,
)
