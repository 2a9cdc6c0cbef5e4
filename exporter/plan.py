"""Split plans: which layers go to which stage, and what each stage costs in memory.

Estimates come from the config alone (before any weights load): parameter counts times the
bytes per parameter of the weight format, and the KV cache at a given context in f16
(2 bytes per value; the CPU plugin's default u8 cache needs about half of that).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from exporter.architectures import ArchitectureFacts
from exporter.errors import ExportError

# OpenVINO runtime, Python, activations and scratch per stage process: a conservative allowance.
RUNTIME_OVERHEAD_BYTES = 512 * 2**20
KV_BYTES_PER_VALUE = 2
# Bytes per parameter: decoder-layer matrices and the embedding/head ("edge") matrices.
_LAYER_BYTES = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0 + 4 / 4096, "int4": 0.5 + 2.5 / 128}
_EDGE_BYTES = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0 + 4 / 4096, "int4": 1.0 + 4 / 4096}
# Relative decode time per weight byte (see decode_balanced_split); edges are int8 or wider.
_DECODE_COST = {"fp32": 1.0, "fp16": 1.0, "int8": 1.0, "int4": 1.25}


@dataclass(frozen=True)
class StagePlan:
    index: int
    layer_start: int
    layer_end: int
    weight_bytes: int
    kv_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + RUNTIME_OVERHEAD_BYTES


def layer_params(facts: ArchitectureFacts, intermediate_size: int) -> int:
    q = facts.num_heads * facts.head_dim
    kv = facts.num_kv_heads * facts.head_dim
    attention = facts.hidden_size * (q + 2 * kv) + q * facts.hidden_size
    mlp = 3 * facts.hidden_size * intermediate_size
    return attention + mlp


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
    (they are unpacked on the fly): measured with 1 thread on the benchmark machine, an int4
    decoder layer of Qwen2.5 1.5B (24 MB) takes 1.74 ms and the int8 head (233 MB) 13.4 ms,
    i.e. ``_DECODE_COST`` 1.25 per int4 byte against 1.0. On that model an even 14/14 split
    leaves the last stage ~50% slower and idles the first half the time when users are
    interleaved; this gives 18/10 (measured: 17/11 left the last stage 10% slower). Earlier
    stages get the extra layer when the rest does not divide evenly.
    """
    even = even_split(facts.num_layers, stages)
    if stages == 1:
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


def check_split(num_layers: int, split: list[int]) -> list[int]:
    if any(count < 1 for count in split):
        raise ExportError(f"--split {','.join(map(str, split))}: every stage needs a layer")
    if sum(split) != num_layers:
        raise ExportError(
            f"--split {','.join(map(str, split))} adds up to {sum(split)}, "
            f"the model has {num_layers} layers"
        )
    return split


def plan_stages(
    facts: ArchitectureFacts,
    split: list[int],
    weight_format: str,
    intermediate_size: int,
    context: int,
    tied_embeddings: bool = False,
) -> list[StagePlan]:
    per_layer = layer_params(facts, intermediate_size) * _LAYER_BYTES[weight_format]
    edge = facts.vocab_size * facts.hidden_size * _EDGE_BYTES[weight_format]
    plans = []
    start = 0
    for index, count in enumerate(split):
        weight = per_layer * count
        if index == 0:
            weight += edge
        if index == len(split) - 1 and not (tied_embeddings and len(split) == 1):
            weight += edge
        plans.append(
            StagePlan(
                index=index,
                layer_start=start,
                layer_end=start + count,
                weight_bytes=int(weight),
                kv_bytes=kv_bytes_per_layer(facts, context) * count,
            )
        )
        start += count
    return plans


def split_for_memory(
    facts: ArchitectureFacts,
    budgets: list[int],
    weight_format: str,
    intermediate_size: int,
    context: int,
) -> list[int]:
    """Give each node layers in proportion to what its memory budget holds; refuse if none fits."""
    per_layer = layer_params(facts, intermediate_size) * _LAYER_BYTES[weight_format]
    per_layer += kv_bytes_per_layer(facts, context)
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


def format_plan(plans: list[StagePlan], context: int) -> str:
    lines = [f"{'stage':>5}  {'layers':>10}  {'weights':>11}  {'KV @' + str(context):>12}  total"]
    for plan in plans:
        lines.append(
            f"{plan.index:>5}  {f'[{plan.layer_start}, {plan.layer_end})':>10}  "
            f"{format_bytes(plan.weight_bytes):>11}  {format_bytes(plan.kv_bytes):>12}  "
            f"{format_bytes(plan.total_bytes)}"
        )
    return "\n".join(lines)
