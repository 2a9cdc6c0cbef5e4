"""Llama 1, 2 and 3.x (llama3 rope scaling included): the plain decoder every other family
departs from. llama.cpp permutes its q/k rows in a GGUF (undone by exporter.weights)."""

from exporter.families.base import Family, no_gguf_config

FAMILY = Family(
    model_type="llama",
    title="Llama (1, 2, 3.x incl. rope_scaling)",
    gguf_arch="llama",
    gguf_config=no_gguf_config,
    cuttable_mlp=True,
)
