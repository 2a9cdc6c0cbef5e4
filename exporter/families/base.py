"""What a model family tells the exporter: the record each module under exporter/families/ fills.

A family is one transformers ``model_type`` (Llama, Qwen3-MoE, GLM-4.5, ...). Its module holds
what is true of it alone: the facts it reads from its config beyond the common ones
(exporter.architectures), how its checkpoints store tensors the shared graph asks for under
other names (weight adapters), how llama.cpp names and converts its tensors in a GGUF, and the
defaults the rest of the product takes from it. The graph (exporter/graph.py,
exporter/gated_delta.py) stays shared: a family switches its pieces on through its facts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# (config, num_layers, layer_types) -> the family's own ArchitectureFacts fields
FactsReader = Callable[[Any, int, list[str]], dict[str, Any]]
# (a weight source, the config, whether it reads a GGUF) -> the source the graph reads
SourceAdapter = Callable[[Any, Any, bool], Any]
# (a GGUF's metadata: exporter.gguf_reader's reader, its layers, its NextN/MTP layers) -> the
# family's own Hugging Face config fields
GGUFConfigReader = Callable[[Any, int, int], dict[str, Any]]


def no_facts(config: Any, num_layers: int, layer_types: list[str]) -> dict[str, Any]:
    """A dense family: the common facts say everything."""
    return {}


def no_gguf_config(meta: Any, layers: int, nextn: int) -> dict[str, Any]:
    """A family whose GGUF says everything in the common keys exporter.gguf_reader reads."""
    return {}


def same_source(source: Any, config: Any, gguf: bool) -> Any:
    """A family whose checkpoints name every tensor as the graph asks for it."""
    return source


@dataclass(frozen=True)
class Family:
    model_type: str  # transformers' model_type (the text model's, for a vision wrapper)
    title: str  # what `pipeshard export` and the docs call it
    # llama.cpp's general.architecture of its GGUF files (Mixtral and Mistral are ``llama``
    # files); None: not read from GGUF
    gguf_arch: str | None = None
    facts: FactsReader = no_facts
    # the config of a GGUF that transformers' own loader cannot read is mapped by
    # exporter.gguf_reader: the common keys there, the family's own fields here (None: not
    # mapped; transformers reads the file or nothing does)
    gguf_config: GGUFConfigReader | None = None
    adapt_source: SourceAdapter = same_source
    # the vision-language wrapper whose ``text_config`` is this family (Qwen3.5: qwen3_5)
    wrapper_model_type: str | None = None
    # a set ``sliding_window`` masks every layer (the config has no ``layer_types``)
    sliding_every_layer: bool = False
    # Gated DeltaNet layers beside gated full attention (exporter.gated_delta)
    hybrid: bool = False
    # per-head RMSNorm of queries and keys; ``qk_norm_key``: a config flag that says so
    qk_norm: bool = False
    qk_norm_key: str | None = None
    # Gemma's layer: (1 + w) norms, sandwich norms, the embedding scaled by sqrt(hidden)
    gemma_layer: bool = False
    # RMSNorm scales by (1 + w), and llama.cpp stores such norm weights plus one
    norms_plus_one: bool = False
    # a fractional --split may cut its MLP's channels (exporter.plan.mlp_channel_step)
    cuttable_mlp: bool = False
    # GGUF: the renames llama.cpp's converter makes before its tensor-name map (suffixes:
    # ``.sinks`` -> ``.sinks.weight``), and the tensors the ``gguf`` package's map lacks for
    # this architecture (``{hf stem: gguf.MODEL_TENSOR name}``)
    gguf_renames: tuple[tuple[str, str], ...] = ()
    gguf_extra_tensors: dict[str, str] = field(default_factory=dict)
    # GGUF: value heads of the Gated DeltaNet stored tiled, not grouped by key head
    gguf_tiled_value_heads: bool = False
    # GGUF: the Hugging Face reference (`pipeshard verify`) is built from the file's tensors,
    # as transformers' own GGUF loader does not read this architecture
    gguf_reference: bool = False
    # the gateway's reasoning parser for this family whatever its template says
    # (server/api/reasoning.py keeps the runtime's copy; tests/test_families.py ties them)
    reasoning: str | None = None
