"""Split plans: which layers go to which stage, and what each stage costs in memory.

A split gives each stage a share of the layers (``--split 16,12``). A share may be fractional
(``15.7,12.3``): the boundary then falls inside a layer's MLP, for stages as even as the work
allows (layers come in steps of 1/num_layers of the model; an MLP's intermediate channels in
steps of the weights' quantization group). The earlier stage keeps that layer's attention and
KV cache and the first channels of its MLP; the later one computes the rest (see
``protos.manifest.StageEntry``).

Estimates come from the config alone (before any weights load): parameter counts times the
bytes per parameter of the weight format, and the KV cache at a given context in f16
(2 bytes per value; the CPU plugin's default u8 cache needs about half of that).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from exporter.architectures import ArchitectureFacts
from exporter.errors import ExportError
from exporter.families import FAMILIES
from protos.manifest import layer_span

# OpenVINO runtime, Python, activations and scratch per stage process: a conservative allowance.
RUNTIME_OVERHEAD_BYTES = 512 * 2**20
KV_BYTES_PER_VALUE = 2
# Bytes per parameter: decoder-layer matrices and the embedding/head ("edge") matrices.
# "gguf": a Q4_K_M file's blocks as the stages keep them: Q4_K as u4 codes with an f32 scale and
# zero point per 32 (0.75 B), a third of the tensors Q6_K as i8 with an f32 scale per 16
# (1.25 B); embeddings and head Q6_K or Q8_0. Other mixes differ: the export prints the real size.
_LAYER_BYTES = {
    "fp32": 4.0,
    "fp16": 2.0,
    "int8": 1.0 + 4 / 4096,
    "int4": 0.5 + 2.5 / 128,
    "gguf": 0.9,
}
_EDGE_BYTES = {
    "fp32": 4.0,
    "fp16": 2.0,
    "int8": 1.0 + 4 / 4096,
    "int4": 1.0 + 4 / 4096,
    "gguf": 1.2,
}
# gpt-oss's MXFP4 experts from a GGUF as the stages hold them (e2m1 codes as i8, an f32 scale
# per 32): 9.8 bits a weight measured at run time (docs/export.md, "gpt-oss")
MXFP4_EXPERT_BYTES = 9.8 / 8
# Relative decode time per weight byte (see decode_balanced_split); edges are int8 or wider.
_DECODE_COST = {"fp32": 1.0, "fp16": 1.0, "int8": 1.0, "int4": 1.25, "gguf": 1.1}
# "gguf" blocks are kept in groups of at most 32 input channels: an MLP cuts at that step
GGUF_CHANNEL_STEP = 32


@dataclass(frozen=True)
class StagePlan:
    index: int
    layer_start: int
    layer_end: int
    weight_bytes: int
    kv_bytes: int
    mlp_in: int | None = None  # first finishes the previous layer's MLP from this channel on
    mlp_out: int | None = None  # its last layer's MLP stops at this channel

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + RUNTIME_OVERHEAD_BYTES

    def span(self, intermediate_size: int) -> str:
        """The layers it computes as the --split shares count them, e.g. [0, 15.76)."""
        return layer_span(
            self.layer_start, self.layer_end, self.mlp_in, self.mlp_out, intermediate_size
        )


# A boundary: (layer, channels) - after `layer` whole layers, or with channels > 0 inside layer
# `layer`'s MLP after its first `channels` intermediate channels (its attention before it).
Bound = tuple[int, int]


def layer_params(
    facts: ArchitectureFacts, intermediate_size: int, layer: int | None = None, active: bool = False
) -> int:
    """Weights of a decoder layer; of ``layer`` in particular where layers differ (an MoE
    model's expert layers hold every expert and the router, and a decoded token reads only
    ``active`` ones: its experts_per_token, and the shared expert where there is one)."""
    mixer = attention_params(facts)
    if layer is not None and facts.layer_types and facts.is_linear(layer):
        mixer = linear_attention_params(facts)
    if layer is not None and facts.is_moe(layer):
        experts = facts.experts_per_token if active else facts.num_experts
        expert = mlp_params(facts, facts.expert_intermediate_size)
        shared = mlp_params(facts, facts.shared_expert_intermediate_size)
        router = facts.num_experts * facts.hidden_size
        return mixer + experts * expert + shared + router
    return mixer + mlp_params(facts, intermediate_size)


def _layer_params_over_model(facts: ArchitectureFacts, intermediate_size: int) -> list[int]:
    return [layer_params(facts, intermediate_size, i) for i in range(facts.num_layers)]


def _layer_bytes_over_model(
    facts: ArchitectureFacts, intermediate_size: int, weight_format: str
) -> list[float]:
    """Each layer's weight bytes: its parameters at the format's bytes each, but gpt-oss's
    routed experts from a GGUF (MXFP4) at MXFP4_EXPERT_BYTES."""
    per_param = _LAYER_BYTES[weight_format]
    out = []
    for i, params in enumerate(_layer_params_over_model(facts, intermediate_size)):
        size = params * per_param
        if facts.model_type == "gpt_oss" and weight_format == "gguf" and facts.is_moe(i):
            experts = facts.num_experts * mlp_params(facts, facts.expert_intermediate_size)
            size += experts * (MXFP4_EXPERT_BYTES - per_param)
        out.append(size)
    return out


def attention_params(facts: ArchitectureFacts) -> int:
    q = facts.num_heads * facts.head_dim
    kv = facts.num_kv_heads * facts.head_dim
    gate = q if facts.attention_output_gate else 0  # Qwen3.5: q_proj also gives the gate
    return facts.hidden_size * (q + gate + 2 * kv) + q * facts.hidden_size


def linear_attention_params(facts: ArchitectureFacts) -> int:
    """A Gated DeltaNet layer's matrices: in_proj_qkv, in_proj_z, in_proj_a/b, out_proj (the
    convolution and the per-head vectors are small)."""
    value = facts.linear_value_heads * facts.linear_value_dim
    into = facts.linear_conv_channels + value + 2 * facts.linear_value_heads
    return facts.hidden_size * (into + value)


def recurrent_state_bytes(facts: ArchitectureFacts) -> int:
    """A linear-attention layer's state per sequence, whatever the context: the convolution's
    last inputs [C, K] and the recurrent state [Hv, Dk, Dv], in f32."""
    conv = facts.linear_conv_channels * facts.linear_conv_kernel
    state = facts.linear_value_heads * facts.linear_key_dim * facts.linear_value_dim
    return 4 * (conv + state)


def cache_bytes_of_layer(facts: ArchitectureFacts, layer: int, context: int) -> int:
    """What a sequence of ``context`` positions keeps in ``layer``: its KV cache, or a
    linear-attention layer's fixed state."""
    if facts.layer_types and facts.is_linear(layer):
        return recurrent_state_bytes(facts)
    return kv_bytes_per_layer(facts, context)


def mlp_params(facts: ArchitectureFacts, intermediate_size: int) -> int:
    return 3 * facts.hidden_size * intermediate_size


def kv_bytes_per_layer(facts: ArchitectureFacts, context: int) -> int:
    return 2 * facts.num_kv_heads * facts.head_dim * context * KV_BYTES_PER_VALUE


def even_split(num_layers: int, stages: int) -> list[int]:
    """Layer counts for ``stages`` stages as even as possible, the larger ones first."""
    if stages < 1:
        raise ExportError(f"--stages must be at least 1, got {stages}")
    if stages > num_layers:
        raise ExportError(f"cannot split {num_layers} layers into {stages} stages")
    base, extra = divmod(num_layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def decode_balanced_split(
    facts: ArchitectureFacts, stages: int, weight_format: str, intermediate_size: int
) -> list[int]:
    """Layer counts that even out each stage's work per decoded token.

    A decode step reads every weight of a stage once, so its time follows the stage's weight
    bytes: decoder layers everywhere, plus the lm_head on the last stage (the first stage's
    embedding is one row per token and costs nothing). int4 bytes cost more than int8 bytes
    (they are unpacked on the fly): ``_DECODE_COST`` weighs them 1.25 against 1.0. The ratio
    depends on the machine; `pipeshard bench batch-cost --side-by-side` measures one and
    prints the (fractional) ``--split`` that evens its stages out (the numbers:
    docs/benchmarks.md, "Decode-balanced split"). Earlier stages get the extra layer when the
    rest does not divide evenly.
    """
    even = even_split(facts.num_layers, stages)
    if stages == 1 or facts.moe_layers:
        # An MoE model is split for its memory: a token reads a few of a layer's experts, so
        # balancing decode work would pile the layers onto the first stages. Even layers,
        # even memory.
        return even
    per_layer = (
        layer_params(facts, intermediate_size)
        * _LAYER_BYTES[weight_format]
        * _DECODE_COST[weight_format]
    )
    head = facts.vocab_size * facts.hidden_size * _EDGE_BYTES[weight_format]
    best: tuple[float, int, list[int]] | None = None
    for last in range(1, facts.num_layers - stages + 2):
        split = [*even_split(facts.num_layers - last, stages - 1), last]
        cost = max(max(split[:-1]) * per_layer, last * per_layer + head)
        spread = max(split) - min(split)
        if best is None or (cost, spread) < best[:2]:
            best = (cost, spread, split)
    assert best is not None
    return best[2]


def format_split(split: Sequence[float]) -> str:
    return ",".join(f"{share:g}" for share in split)


def check_split(num_layers: int, split: Sequence[float]) -> list[float]:
    if any(share <= 0 for share in split):
        raise ExportError(f"--split {format_split(split)}: every stage needs a layer")
    if not math.isclose(sum(split), num_layers, abs_tol=1e-6):
        raise ExportError(
            f"--split {format_split(split)} adds up to {sum(split):g}, "
            f"the model has {num_layers} layers"
        )
    return list(split)


def is_fractional(split: Sequence[float]) -> bool:
    return any(not math.isclose(share, round(share), abs_tol=1e-9) for share in split)


# The architectures whose MLP output is added as it is, so that it can be summed from parts
# the families whose MLP a fractional split may cut (exporter/families/: cuttable_mlp)
CUTTABLE_MLP = tuple(sorted(name for name, f in FAMILIES.items() if f.cuttable_mlp))


def mlp_channel_step(model_type: str, weight_format: str, group_size: int | None) -> int:
    """The step in which a fractional split may cut an MLP's channels, or why it cannot.

    The earlier stage's part plus the later stage's part must be the unsplit MLP with the same
    weights: in int4 each group of input channels has its own scale, so cuts fall on group
    edges; int8 (and per-channel int4) scales each output channel over all the MLP's channels,
    which a cut would change. Gemma 3 normalizes the MLP's output before adding it, so its
    MLP cannot be summed from parts.
    """
    if model_type not in CUTTABLE_MLP:
        raise ExportError(
            f"a fractional --split is not supported for {model_type} "
            f"({', '.join(CUTTABLE_MLP)} only)"
        )
    if weight_format == "gguf":
        return GGUF_CHANNEL_STEP
    if weight_format == "int8" or (weight_format == "int4" and (group_size or 0) <= 0):
        raise ExportError(
            "a fractional --split needs fp32, fp16 or group-wise int4 weights "
            "(per-channel scales span the whole MLP)"
        )
    return (group_size or 128) if weight_format == "int4" else 1


def split_bounds(
    num_layers: int, split: Sequence[float], intermediate_size: int, channel_step: int = 1
) -> list[tuple[int, int, int | None, int | None]]:
    """Per stage (layer_start, layer_end, mlp_in, mlp_out) from its --split shares."""
    bounds: list[Bound] = [(0, 0)]
    total = 0.0
    for share in split[:-1]:
        total += share
        layer = math.floor(total + 1e-9)
        fraction = total - layer
        channels = 0
        if fraction > 1e-9:
            channels = round(fraction * intermediate_size / channel_step) * channel_step
            if not 0 < channels < intermediate_size:
                raise ExportError(
                    f"--split {format_split(split)}: the boundary at {total:g} rounds to a whole "
                    f"layer (an MLP's {intermediate_size} channels are cut in steps of "
                    f"{channel_step}); give {round(total)} instead"
                )
        bounds.append((layer, channels))
    bounds.append((num_layers, 0))
    stages = []
    for (start, start_ch), (end, end_ch) in itertools.pairwise(bounds):
        # a cut inside layer L's MLP leaves L's attention (and KV) to the earlier stage
        first, last = start + (start_ch > 0), end + (end_ch > 0)
        if last <= first:
            raise ExportError(
                f"--split {format_split(split)}: every stage needs a layer's attention"
            )
        stages.append((first, last, start_ch or None, end_ch or None))
    return stages


def plan_stages(
    facts: ArchitectureFacts,
    split: Sequence[float],
    weight_format: str,
    intermediate_size: int,
    context: int,
    tied_embeddings: bool = False,
    channel_step: int = 1,
) -> list[StagePlan]:
    layers = _layer_bytes_over_model(facts, intermediate_size, weight_format)
    per_channel = mlp_params(facts, 1) * _LAYER_BYTES[weight_format]
    edge = facts.vocab_size * facts.hidden_size * _EDGE_BYTES[weight_format]
    plans = []
    bounds = split_bounds(facts.num_layers, split, intermediate_size, channel_step)
    for index, (start, end, mlp_in, mlp_out) in enumerate(bounds):
        weight = sum(layers[start:end])
        if mlp_in is not None:  # the rest of the layer before
            weight += per_channel * (intermediate_size - mlp_in)
        if mlp_out is not None:  # part of its last layer's MLP
            weight -= per_channel * (intermediate_size - mlp_out)
        if index == 0:
            weight += edge
        if index == len(split) - 1 and not (tied_embeddings and len(split) == 1):
            weight += edge
        plans.append(
            StagePlan(
                index=index,
                layer_start=start,
                layer_end=end,
                weight_bytes=int(weight),
                kv_bytes=sum(cache_bytes_of_layer(facts, i, context) for i in range(start, end)),
                mlp_in=mlp_in,
                mlp_out=mlp_out,
            )
        )
    return plans


def split_for_memory(
    facts: ArchitectureFacts,
    budgets: list[int],
    weight_format: str,
    intermediate_size: int,
    context: int,
) -> list[int]:
    """Give each node layers in proportion to what its memory budget holds; refuse if none fits.
    Layers of different sizes (an MoE model's dense ones) are all counted as the largest."""
    per_layer = max(_layer_bytes_over_model(facts, intermediate_size, weight_format))
    per_layer += max(cache_bytes_of_layer(facts, i, context) for i in range(facts.num_layers))
    edge = facts.vocab_size * facts.hidden_size * _EDGE_BYTES[weight_format]
    capacity = []
    for index, budget in enumerate(budgets):
        edges = (index == 0) + (index == len(budgets) - 1)
        fixed = RUNTIME_OVERHEAD_BYTES + edge * edges
        capacity.append(max(0, math.floor((budget - fixed) / per_layer)))
    if sum(capacity) < facts.num_layers or min(capacity) < 1:
        raise ExportError(
            f"the model does not fit: nodes hold {','.join(map(str, capacity))} layers at "
            f"context {context}, the model has {facts.num_layers}"
        )
    share = [facts.num_layers * c / sum(capacity) for c in capacity]
    split = [max(1, min(c, math.floor(s))) for c, s in zip(capacity, share, strict=True)]
    order = sorted(range(len(split)), key=lambda i: share[i] - math.floor(share[i]), reverse=True)
    while sum(split) < facts.num_layers:
        for i in order:
            if sum(split) < facts.num_layers and split[i] < capacity[i]:
                split[i] += 1
    while sum(split) > facts.num_layers:
        i = max(range(len(split)), key=lambda j: split[j] - share[j])
        split[i] -= 1
    return split


def check_fits(plans: list[StagePlan], budgets: list[int], context: int) -> None:
    if len(budgets) != len(plans):
        raise ExportError(f"--node-memory names {len(budgets)} nodes for {len(plans)} stages")
    for plan, budget in zip(plans, budgets, strict=True):
        if plan.total_bytes > budget:
            raise ExportError(
                f"stage {plan.index} needs {format_bytes(plan.total_bytes)} at context {context}, "
                f"its node has {format_bytes(budget)}"
            )


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'16GB' -> 16e9, '8GiB' -> 8 * 2**30, '512M' -> 512e6."""
    match = _SIZE.match(text)
    if not match:
        raise ExportError(f"cannot read memory size {text!r} (use e.g. 16GB, 8GiB, 512MB)")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    binary = "i" in unit
    prefix = unit[:1] if unit[:1] in "kmgt" else ""
    scale = (1024 if binary else 1000) ** ("kmgt".index(prefix) + 1) if prefix else 1
    return int(number * scale)


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1024
    return f"{count:.2f} GiB"


def format_plan(plans: list[StagePlan], context: int, intermediate_size: int) -> str:
    lines = [f"{'stage':>5}  {'layers':>14}  {'weights':>11}  {'KV @' + str(context):>12}  total"]
    for plan in plans:
        lines.append(
            f"{plan.index:>5}  {plan.span(intermediate_size):>14}  "
            f"{format_bytes(plan.weight_bytes):>11}  {format_bytes(plan.kv_bytes):>12}  "
            f"{format_bytes(plan.total_bytes)}"
        )
    return "\n".join(lines)
