"""Ministral: Mistral whose config lists each layer's attention (``layer_types``), sliding
(the last ``sliding_window`` positions) or full; Llama's weights and names otherwise.

The family docs/adding-a-model-family.md was written by adding: the common facts read its
``layer_types`` and ``sliding_window``, the shared graph masks each sliding layer, so the family
needs no facts, adapters or graph piece of its own. Its GGUF form is not read (``gguf_arch``
unset): llama.cpp writes such a model as a ``llama`` file.
"""

from exporter.families.base import Family

FAMILY = Family(
    model_type="ministral",
    title="Ministral (sliding and full layers as its layer_types list them)",
)
