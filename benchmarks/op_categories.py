"""Which part of a model each of a compiled stage's runtime ops computes (for `bench profile`).

``OpenVINO IR (the stage's model.xml) + the compiled runtime model -> {runtime op: category}``

OpenVINO's per-op counters (``InferRequest.get_profiling_info``) name the CPU plugin's runtime
ops: a ``FullyConnected`` that fused a MatMul with its weight decompression and activation, a
``GatherMatmul`` for an MoE layer's experts, ``RMS`` for a norm. Each runtime op lists the IR ops
it came from (``originalLayersNames``). The exporter names the IR's projections after the
Hugging Face tensor they hold (``model.layers.3.mlp.shared_expert.gate_proj``, ``lm_head``,
``embed``); a MatMul it leaves unnamed (an MoE router's) is known by its weight constant's name.
What neither the runtime type nor a name places is ``other`` (reshapes, element-wise ops, rotary
embeddings, conversions), so the categories add up to the counters' total by construction.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

EMBEDDING = "embedding"
HEAD = "LM head"
ROUTER = "router"
EXPERTS = "experts (GatherMatmul)"
SHARED = "shared expert"
DELTANET = "Gated DeltaNet (kernel + conv)"
ATTENTION = "full attention (SDPA / PagedAttention)"
DELTANET_PROJ = "Gated DeltaNet projections"
ATTENTION_PROJ = "full-attention projections"
NORMS = "norms"
MATMULS = "other matmuls (dense MLP)"
OTHER = "other"
CATEGORIES = (
    EMBEDDING,
    HEAD,
    ROUTER,
    EXPERTS,
    SHARED,
    DELTANET,
    DELTANET_PROJ,
    ATTENTION,
    ATTENTION_PROJ,
    NORMS,
    MATMULS,
    OTHER,
)

# runtime op types that say what they compute, whatever their names
_BY_TYPE = {
    "GatherMatmul": EXPERTS,
    "GatedDeltaNet": DELTANET,
    "PagedGatedDeltaNet": DELTANET,
    "PagedCausalConv1D": DELTANET,
    "ScaledDotProductAttention": ATTENTION,
    "ScaledDotProductAttentionWithKVCache": ATTENTION,
    "SDPA": ATTENTION,
    "PagedAttentionExtension": ATTENTION,
    "PagedAttention": ATTENTION,
    "RMS": NORMS,
    "TopK": ROUTER,
    "Softmax": ROUTER,  # the fused attentions hold their own softmax: this is the router's
    "ScatterElementsUpdate": ROUTER,
    # a gather from a compressed table: the embedding's (a GGUF's quantized rows)
    "GatherCompressed": EMBEDDING,
}
_MATMUL_TYPES = ("FullyConnected", "MatMul", "GatherMatmul")
# IR names (a projection's, or its weight constant's) -> category, first match wins
_BY_NAME = (
    (re.compile(r"(^|\.)lm_head(\b|/|$)"), HEAD),
    (re.compile(r"^embed(\b|/|$)|embed_tokens"), EMBEDDING),
    (re.compile(r"shared_expert"), SHARED),
    (re.compile(r"\.experts[./]"), EXPERTS),
    (re.compile(r"\.mlp\.(gate|router)(?![\w])"), ROUTER),
    (re.compile(r"linear_attn\.conv1d"), DELTANET),
    (re.compile(r"linear_attn\."), DELTANET_PROJ),
    (re.compile(r"self_attn\."), ATTENTION_PROJ),
)
# categories an unnamed op takes over from a MatMul it follows closely (the router's
# normalisation, the experts' weighted sum, the shared expert's product): not "other matmuls",
# whose followers are residual adds and reshapes
_INHERITED = {ROUTER, EXPERTS, SHARED, EMBEDDING, HEAD}
_PASS_THROUGH = {"Convert", "Reshape", "Transpose", "Multiply", "Subtract", "Unsqueeze", "Concat"}


def name_category(name: str) -> str | None:
    for pattern, category in _BY_NAME:
        if pattern.search(name):
            return category
    return None


def _weight_name(op: Any, depth: int = 6) -> str | None:
    """The name of the constant a MatMul's weight input comes from (through its
    decompression: Convert, Subtract, Multiply, Reshape), or None."""
    node = op.input_value(1).get_node()
    for _ in range(depth):
        kind = node.get_type_name()
        if kind == "Constant":
            return str(node.get_friendly_name())
        if kind not in _PASS_THROUGH or node.get_input_size() == 0:
            return None
        # the codes are the first input of a decompression's Convert/Subtract/Multiply
        node = node.input_value(0).get_node()
    return None


def ir_categories(model: Any) -> tuple[dict[str, str], dict[str, str]]:
    """Two maps of the IR's op names: the category of each op that has one of its own (a named
    or weight-named MatMul or Gather, a linear-attention state's ReadValue / Assign), and the
    category of the nearest categorised MatMul each other op follows (within three ops)."""
    own: dict[str, str] = {}
    for op in model.get_ordered_ops():
        kind, name = op.get_type_name(), str(op.get_friendly_name())
        category = name_category(name)
        if category is None and kind == "MatMul":
            weight = _weight_name(op)
            category = name_category(weight) if weight else None
            category = category or MATMULS
        if category is None and kind in ("ReadValue", "Assign"):
            variable = str(op.get_variable_id()) if hasattr(op, "get_variable_id") else ""
            if "cache_params" in variable:
                category = DELTANET
            elif "past_key_values" in variable or "key_values" in variable:
                category = ATTENTION
        if category is not None:
            own[name] = category
    follows: dict[str, str] = {}
    for op in model.get_ordered_ops():
        name = str(op.get_friendly_name())
        if name in own:
            continue
        frontier, seen = [op], 0
        found = None
        while frontier and seen < 3 and found is None:
            nxt = []
            for node in frontier:
                for value in node.input_values():
                    parent = value.get_node()
                    parent_name = str(parent.get_friendly_name())
                    if parent.get_type_name() == "MatMul" and parent_name in own:
                        found = own[parent_name]
                        break
                    nxt.append(parent)
                if found:
                    break
            frontier, seen = nxt, seen + 1
        if found is not None:
            follows[name] = found
    return own, follows


def runtime_category(
    node_type: str,
    names: Iterable[str],
    own: dict[str, str],
    follows: dict[str, str],
) -> str:
    """The category of one runtime op: its type where that says it, else the IR ops it came
    from (``names``: its own name and its ``originalLayersNames``)."""
    names = [n for n in names if n]
    if node_type in _BY_TYPE:
        return _BY_TYPE[node_type]
    # the CPU plugin's forms over compressed weights (FullyConnectedCompressed, ...)
    node_type = node_type.removesuffix("Compressed")
    if node_type in _BY_TYPE:
        return _BY_TYPE[node_type]
    for name in names:
        if name in own:
            return own[name]
    for name in names:
        category = name_category(name)
        if category is not None:
            return category
    for name in names:
        category = follows.get(name)
        if category is not None and (node_type in _MATMUL_TYPES or category in _INHERITED):
            return category
    if node_type in _MATMUL_TYPES:
        return MATMULS
    return OTHER


def runtime_sources(compiled: Any) -> dict[str, list[str]]:
    """Each runtime op's name -> the IR op names it came from (its own name first)."""
    sources: dict[str, list[str]] = {}
    for op in compiled.get_runtime_model().get_ops():
        name = str(op.get_friendly_name())
        info = op.get_rt_info()
        original = info["originalLayersNames"].astype(str) if "originalLayersNames" in info else ""
        sources[name] = [name, *(n for n in original.split(",") if n)]
    return sources
