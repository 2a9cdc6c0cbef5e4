"""Qwen3.5 / 3.6 dense: the hybrid. Three Gated DeltaNet (linear attention) layers, then one
gated full-attention layer (q_proj also gives a gate per head), q/k norms, norms that scale by
(1 + w); its checkpoints are vision-language wrappers (``text_config``, tensors under
``model.language_model.``) with MTP layers the export skips. llama.cpp's converter tiles its
value heads (exporter.graph repeats the key heads to match)."""

from __future__ import annotations

from typing import Any

import numpy as np

from exporter.errors import ExportError
from exporter.families.base import Family
from exporter.gguf_quant import DenseWeight, Weight


def hybrid_facts(config: Any, num_layers: int, layer_types: list[str]) -> dict[str, Any]:
    """Qwen3.5's Gated DeltaNet sizes (Qwen3_5GatedDeltaNet) and its gated attention: every
    hybrid's."""
    model_type = str(config.model_type)
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


def adapt_source(source: Any, config: Any, gguf: bool) -> Any:
    """A Hugging Face checkpoint: the text model's names, experts stored stacked."""
    return source if gguf else StackedExperts(LanguageModelNames(source))


def hybrid_gguf_config(meta: Any, layers: int, nextn: int) -> dict[str, Any]:
    """Qwen3-Next / Qwen3.5(-MoE): Gated DeltaNet sizes from the ``ssm.*`` keys
    (conversion/qwen.py's Qwen3NextModel), the layer pattern, and the MoE fields."""
    m = meta.model
    value_heads = int(m("ssm.time_step_rank"))
    out: dict[str, Any] = {
        "linear_conv_kernel_dim": int(m("ssm.conv_kernel")),
        "linear_key_head_dim": int(m("ssm.state_size")),
        "linear_num_key_heads": int(m("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(m("ssm.inner_size")) // value_heads,
    }
    recurrent = m("attention.recurrent_layers")
    if isinstance(recurrent, list) and len(recurrent) >= layers:
        kinds = [bool(r) for r in recurrent[:layers]]
    else:
        interval = int(m("full_attention_interval", 4))
        kinds = [(i + 1) % interval != 0 for i in range(layers)]
    out["layer_types"] = ["linear_attention" if r else "full_attention" for r in kinds]
    if (experts := m("expert_count")) is not None:
        out.update(
            num_experts=int(experts),
            num_experts_per_tok=int(m("expert_used_count")),
            moe_intermediate_size=int(m("expert_feed_forward_length")),
        )
        if (shared := m("expert_shared_feed_forward_length")) is not None:
            out["shared_expert_intermediate_size"] = int(shared)
        if meta.arch == "qwen3next":
            out["norm_topk_prob"] = True
    if nextn:  # as Qwen3.5's config.json names its MTP layers (skipped by the export)
        out["mtp_num_hidden_layers"] = nextn
    return out


# llama.cpp's converter (conversion/qwen.py's Qwen3NextModel) stores dt_bias as dt_proj.bias
HYBRID_GGUF_RENAMES = ((".linear_attn.dt_bias", ".linear_attn.dt_proj.bias"),)


class LanguageModelNames:
    """A text model stored inside a vision-language checkpoint (Qwen3.5: ``model.language_model.
    layers.3...``; transformers also saves its text-only Qwen3.5 so) under the names the graph
    asks for (``model.layers.3...``); the vision tower and the MTP layers are never asked for."""

    PREFIX = "model.language_model."

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def _name(self, name: str) -> str:
        if name.startswith("model.") and not self.inner.has(name):
            return self.PREFIX + name[len("model.") :]
        return name

    def has(self, name: str) -> bool:
        return bool(self.inner.has(self._name(name)))

    def tensor(self, name: str) -> Weight:
        return self.inner.tensor(self._name(name))


class StackedExperts:
    """Experts stored as one 3-D tensor a layer (Qwen3.5-MoE's Hugging Face checkpoints:
    ``mlp.experts.gate_up_proj`` [E, 2I, H], gate rows then up rows, and ``mlp.experts.
    down_proj`` [E, H, I]) under the stacked names the graph asks for (``mlp.experts.
    gate_proj.weight`` [E * I, H], as a GGUF's ``ffn_gate_exps``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @staticmethod
    def _source(name: str) -> tuple[str, str] | None:
        """(the stored tensor's name, the part asked for) or None for any other tensor."""
        stem, dot, part = name.rpartition(".experts.")
        if not dot or part not in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
            return None
        stored = "down_proj" if part == "down_proj.weight" else "gate_up_proj"
        return f"{stem}.experts.{stored}", part.split(".")[0]

    def has(self, name: str) -> bool:
        found = self._source(name)
        if found is not None and self.inner.has(found[0]):
            return True
        return bool(self.inner.has(name))

    def tensor(self, name: str) -> Weight:
        found = self._source(name)
        if found is None or not self.inner.has(found[0]):
            return self.inner.tensor(name)
        stored, part = found
        weight = self.inner.tensor(stored)
        if not isinstance(weight, DenseWeight) or weight.array.ndim != 3:
            raise ExportError(f"{stored}: expected a 3-D float tensor [experts, rows, cols]")
        array = weight.array
        if part != "down_proj":
            half = array.shape[1] // 2
            array = array[:, :half] if part == "gate_proj" else array[:, half:]
        experts, rows, cols = array.shape
        return DenseWeight(np.ascontiguousarray(array).reshape(experts * rows, cols))


FAMILY = Family(
    model_type="qwen3_5_text",
    title="Qwen3.5 / 3.6 dense (hybrid: Gated DeltaNet linear attention, gated full attention; "
    "MTP layers skipped)",
    gguf_arch="qwen35",
    facts=hybrid_facts,
    gguf_config=hybrid_gguf_config,
    adapt_source=adapt_source,
    wrapper_model_type="qwen3_5",
    hybrid=True,
    qk_norm=True,
    norms_plus_one=True,
    gguf_renames=HYBRID_GGUF_RENAMES,
    gguf_tiled_value_heads=True,
)
