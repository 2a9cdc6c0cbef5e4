"""The model families the exporter splits, one module each, found by transformers' model_type.

Each module (``exporter/families/<family>.py``) defines ``FAMILY``, a
:class:`~exporter.families.base.Family`; docs/adding-a-model-family.md walks through adding one.
"""

from __future__ import annotations

from exporter.errors import ExportError
from exporter.families import (
    gemma3,
    glm4_moe,
    gpt_oss,
    llama,
    ministral,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from exporter.families.base import Family

# In the order `pipeshard export` lists them; a GGUF architecture that several families write
# (``llama``: Llama, Mistral, Mixtral) reads back as the first (exporter.source makes a llama
# file with experts Mixtral)
FAMILIES: dict[str, Family] = {
    module.FAMILY.model_type: module.FAMILY
    for module in (
        llama,
        qwen2,
        qwen3,
        gemma3,
        mistral,
        ministral,
        phi3,
        qwen3_moe,
        mixtral,
        glm4_moe,
        gpt_oss,
        qwen3_5,
        qwen3_5_moe,
        qwen3_next,
    )
}

# Families people ask for that the export does not build, and why: refused with the reason
# rather than the bare list.
NOT_YET = {
    "glm4_moe_lite": "GLM-4.7-Flash's multi-head latent attention (DeepSeek's) is not built",
    "qwen2_moe": "Qwen2-MoE's shared expert (with its sigmoid gate beside the routed experts) "
    "is not built",
    "deepseek_v2": "DeepSeek's multi-head latent attention and shared experts are not built",
    "deepseek_v3": "DeepSeek's multi-head latent attention, shared experts and grouped routing "
    "are not built",
    "llama4": "Llama 4's shared expert, sigmoid routing and chunked attention are not built",
}

# A vision-language wrapper's model_type -> its text model's family (Qwen3.5)
WRAPPERS: dict[str, str] = {
    f.wrapper_model_type: f.model_type for f in FAMILIES.values() if f.wrapper_model_type
}

# llama.cpp's general.architecture -> the model_type a GGUF of it reads back as
GGUF_MODEL_TYPES: dict[str, str] = {}
for _family in FAMILIES.values():
    if _family.gguf_arch is not None:
        GGUF_MODEL_TYPES.setdefault(_family.gguf_arch, _family.model_type)


def family(model_type: str) -> Family:
    """The family of ``model_type``; ExportError names the supported ones (and, for a family
    that is asked for but not built, why)."""
    found = FAMILIES.get(model_type)
    if found is None:
        supported = ", ".join(sorted(FAMILIES))
        why = f" ({NOT_YET[model_type]})" if model_type in NOT_YET else ""
        raise ExportError(
            f"architecture {model_type!r} is not supported{why}; supported: {supported}"
        )
    return found


def gguf_family(arch: str) -> Family | None:
    """The family a GGUF file of llama.cpp architecture ``arch`` reads back as, or None."""
    model_type = GGUF_MODEL_TYPES.get(arch)
    return FAMILIES[model_type] if model_type else None


__all__ = ["FAMILIES", "GGUF_MODEL_TYPES", "NOT_YET", "WRAPPERS", "Family", "family", "gguf_family"]
