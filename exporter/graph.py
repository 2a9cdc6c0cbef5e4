"""One stage's OpenVINO model, built op by op from its own layers' weights (no torch).

``Recipe + WeightSource (that stage's tensors only) -> ov.Model with named ports``;
:func:`exporter.stateful.make_stateful` then turns the KV ports into state behind ``beam_idx``.

Inputs (in this order, batch B, new tokens T, past P, total S = P + T):
  stage 0:   ``input_ids`` [B, T] i64          later stages: ``inputs_embeds`` [B, T, H] f32
             ([B, T, 2H] after a cut inside an MLP: the layer's output so far, the MLP's input)
  ``attention_mask`` [B, S] i64   (1 = visible slot; 0 masks a physical slot out)
  ``position_ids``   [B, T] i64   (absolute, logical positions of the new tokens)
  last stage only: ``num_logits`` [] i64 (logits are computed for the last ``num_logits`` tokens)
  ``past_key_values.{i}.key`` / ``.value`` [B, kv_heads, P, head_dim] for each local attention
  layer i; ``cache_params.past.conv.{i}`` [B, C, K] and ``cache_params.past.ssm.{i}``
  [B, Hv, Dk, Dv] for each local linear-attention (Gated DeltaNet) layer i
Outputs: ``logits`` [B, num_logits, V] (last stage) or ``hidden_states`` [B, T, H] ([B, T, 2H]
when its last layer's MLP is cut), then ``present.{i}.key`` / ``.value`` and
``cache_params.present.conv.{i}`` / ``.ssm.{i}``.

The masks are built in the graph: a key slot is visible to a query when its physical index is not
after the query's and its attention_mask is 1; sliding-window layers also need the logical
distance (query position minus the key's logical position, the running count of visible slots)
below the window. The op sequence of norms, RoPE, the GQA expansion and attention follows what
transformers' modules trace to, so that OpenVINO's CPU fusions (RMS, RoPE, SDPA with the KV
cache) and ``paged_attention_transformation`` recognise it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino import Output
from openvino.utils.node_factory import NodeFactory

from exporter.errors import ExportError
from exporter.gguf_quant import (
    DenseWeight,
    Weight,
    embedding,
    expert_weights,
    linear,
    weight_node,
    weight_shape,
)
from exporter.recipe import Recipe

# opset4's Swish with one input: openvino.opset4.swish always adds a beta input, and the CPU
# plugin's MoE fusion (ConvertTiledMoeBlockToGatherMatmuls) matches only the one-input form
_OPSET4 = NodeFactory("opset4")
# opset13's ScaledDotProductAttention with its 6th input (attention sinks): the Python wrapper
# takes 5
_OPSET13 = NodeFactory("opset13")
# gpt-oss's clamped SwiGLU (transformers' GptOssExperts)
_OAI_ALPHA, _OAI_LIMIT = 1.702, 7.0


class WeightSource(Protocol):
    """Tensors by their Hugging Face names (``model.layers.3.mlp.up_proj.weight``), read on
    demand: a stage asks only for its own."""

    def has(self, name: str) -> bool: ...

    def tensor(self, name: str) -> Weight: ...


@dataclass(frozen=True)
class StageSpec:
    """Layers ``[start, end)``; ``mlp_in``: first add the previous layer's MLP channels
    ``[mlp_in, I)``; ``mlp_out``: the last layer's MLP stops at channel ``mlp_out``."""

    start: int
    end: int
    mlp_in: int | None = None
    mlp_out: int | None = None


def _const(value: object, dtype: type = np.float32) -> Output:
    return ops.constant(np.array(value, dtype=dtype)).output(0)


def _i64(value: object) -> Output:
    return _const(value, np.int64)


def _vector(source: WeightSource, name: str) -> np.ndarray:
    weight = source.tensor(name)
    if not isinstance(weight, DenseWeight):
        raise ValueError(f"{name}: expected a plain vector, got a quantized tensor")
    return np.asarray(weight.array, dtype=np.float32).reshape(-1)


class _Builder:
    def __init__(self, recipe: Recipe, source: WeightSource, stage: StageSpec) -> None:
        self.r = recipe
        self.f = recipe.facts
        self.src = source
        self.stage = stage
        self.first = stage.start == 0
        self.last = stage.end == self.f.num_layers

    # -- small pieces ----------------------------------------------------------------------
    def norm(self, x: Output, name: str, offset: float | None = None) -> Output:
        """RMSNorm as transformers computes it: x / sqrt(mean(x^2) + eps) * (offset + w)
        (the recipe's offset unless given)."""
        offset = self.r.norm_offset if offset is None else offset
        weight = _vector(self.src, name) + np.float32(offset)
        mean = ops.reduce_mean(ops.power(x, _const(2.0)), _i64([-1]), keep_dims=True)
        inv = ops.divide(_const(1.0), ops.sqrt(ops.add(mean, _const(self.r.rms_eps))))
        return ops.multiply(_const(weight.astype(np.float32)), ops.multiply(x, inv)).output(0)

    def proj(self, x: Output, name: str) -> Output:
        bias = self.src.tensor(f"{name}.bias") if self.src.has(f"{name}.bias") else None
        return linear(x, self.src.tensor(f"{name}.weight"), name, bias)

    def mlp(self, x: Output, prefix: str, lo: int, hi: int, size: int | None = None) -> Output:
        """Intermediate channels ``[lo, hi)`` of a gated MLP of ``size`` channels (the config's
        intermediate_size unless given); a ``down`` bias goes with the part from channel 0, so
        the parts of an MLP add up to it."""
        whole = lo == 0 and hi == (size or self.r.intermediate_size)

        def part(name: str, rows: bool) -> tuple[Weight, Weight | None]:
            weight = self.src.tensor(f"{prefix}.{name}.weight")
            bias_name = f"{prefix}.{name}.bias"
            bias = self.src.tensor(bias_name) if self.src.has(bias_name) else None
            if whole:
                return weight, bias
            if rows:
                return weight.take_rows(lo, hi), bias.take_rows(lo, hi) if bias else None
            return weight.take_cols(lo, hi), bias if lo == 0 else None

        gate_w, gate_b = part("gate_proj", True)
        up_w, up_b = part("up_proj", True)
        gate = linear(x, gate_w, f"{prefix}.gate_proj", gate_b)
        if self.r.activation == "silu":
            act = ops.swish(gate).output(0)
        else:
            act = ops.gelu(gate, approximation_mode="tanh").output(0)
        product = ops.multiply(act, linear(x, up_w, f"{prefix}.up_proj", up_b)).output(0)
        down_w, down_b = part("down_proj", False)
        return linear(product, down_w, f"{prefix}.down_proj", down_b)

    def experts(self, prefix: str, name: str, rows: int, cols: int) -> Output:
        """Every expert's ``name`` weight stacked: [E, rows, cols] f32, kept compressed: a
        GGUF's 3-D tensor as it is, or a Hugging Face folder's experts one after another."""
        experts = self.f.num_experts
        stacked_name = f"{prefix}.experts.{name}.weight"
        if self.src.has(stacked_name):
            weight = self.src.tensor(stacked_name)
        else:
            arrays = []
            for e in range(experts):
                part = self.src.tensor(f"{prefix}.experts.{e}.{name}.weight")
                if not isinstance(part, DenseWeight):
                    raise ExportError(f"{prefix}: experts stored quantized one by one")
                arrays.append(part.array)
            weight = DenseWeight(np.concatenate(arrays))
        if weight_shape(weight) != (experts * rows, cols):
            raise ExportError(
                f"{stacked_name}: shape {weight_shape(weight)}, the config makes it "
                f"{experts} experts x [{rows}, {cols}]"
            )
        return expert_weights(weight, experts, f"{prefix}.experts.{name}")

    def moe(self, x: Output, prefix: str) -> Output:
        """A sparse MoE block as transformers' Qwen3MoeSparseMoeBlock (softmax router) or
        Glm4MoeMoE (sigmoid router, see :meth:`sigmoid_routing`) computes it, in the tiled form
        (every expert's gate, up and down as one batched matmul over a dense routing matrix)
        that the CPU plugin turns into GatherMatmul nodes computing only the chosen experts;
        plus a shared expert where the model has one: ungated (GLM), or scaled by
        sigmoid(shared_expert_gate(x)) (Qwen3.5-MoE, Qwen3-Next)."""
        f = self.f
        experts, k, hidden = f.num_experts, f.experts_per_token, f.hidden_size
        rows = ops.reshape(x, _i64([-1, hidden]), False)  # [N, H]
        if f.router == "topk_softmax":  # gpt-oss: mlp.router, with a bias
            logits = self.proj(rows.output(0), f"{prefix}.router")
        else:
            router = weight_node(self.src.tensor(f"{prefix}.gate.weight"), f"{prefix}.gate")
            logits = ops.matmul(rows, router, False, True).output(0)  # [N, E]
        if f.router == "sigmoid":
            probs, chosen, index = self.sigmoid_routing(logits, prefix)
        elif f.router == "topk_softmax":  # the top-k logits, softmax over those k
            probs = logits
            top = ops.topk(logits, _i64(k), -1, "max", "value", ov.Type.i64)
            chosen, index = ops.softmax(top.output(0), -1).output(0), top.output(1)
        else:
            probs = ops.softmax(logits, -1).output(0)
            top = ops.topk(probs, _i64(k), -1, "max", "value", ov.Type.i64)
            chosen, index = top.output(0), top.output(1)
            if f.norm_topk_prob:
                chosen = ops.divide(chosen, ops.reduce_sum(chosen, _i64([-1]), True)).output(0)
        zeros = ops.broadcast(_const(0.0), ops.shape_of(probs))
        routing = ops.scatter_elements_update(zeros, index, chosen, _i64(1))  # [N, E]
        tiled = ops.reshape(ops.tile(rows, _i64([experts, 1])), _i64([experts, -1, hidden]), False)
        size = f.expert_intermediate_size
        if f.clamped_swiglu:
            down = self.clamped_swiglu_experts(tiled.output(0), prefix)
        else:
            gate = ops.matmul(tiled, self.experts(prefix, "gate_proj", size, hidden), False, True)
            up = ops.matmul(tiled, self.experts(prefix, "up_proj", size, hidden), False, True)
            act = _OPSET4.create("Swish", [gate.output(0)], {})
            down = ops.matmul(
                ops.multiply(act, up), self.experts(prefix, "down_proj", hidden, size), False, True
            ).output(0)
        batch = ops.gather(ops.shape_of(x), _i64([0]), _i64(0))
        per_expert = ops.reshape(
            down, ops.concat([_i64([experts]), batch, _i64([-1, hidden])], 0), False
        )  # [E, B, T, H]
        weights = ops.reshape(
            ops.transpose(routing, _i64([1, 0])),
            ops.concat([_i64([experts]), batch, _i64([-1])], 0),
            False,
        )  # [E, B, T]
        weighted = ops.multiply(per_expert, ops.unsqueeze(weights, _i64(-1)))
        routed = ops.reduce_sum(weighted, _i64(0), False).output(0)
        shared = f.shared_expert_intermediate_size
        if not shared:
            return routed
        if not f.shared_expert_gated:
            return ops.add(
                routed, self.mlp(x, f"{prefix}.shared_experts", 0, shared, shared)
            ).output(0)
        expert = self.mlp(x, f"{prefix}.shared_expert", 0, shared, shared)
        gate = ops.sigmoid(self.proj(x, f"{prefix}.shared_expert_gate"))  # [B, T, 1]
        return ops.add(routed, ops.multiply(expert, gate)).output(0)

    def expert_bias(self, prefix: str, name: str, width: int) -> Output:
        """Every expert's ``name`` bias as a constant [E, 1, width] (the CPU plugin folds only
        a constant bias into GatherMatmul)."""
        bias = _vector(self.src, f"{prefix}.experts.{name}.bias")
        if bias.size != self.f.num_experts * width:
            raise ExportError(f"{prefix}.experts.{name}.bias: {bias.size} values")
        return _const(bias.reshape(self.f.num_experts, 1, width))

    def clamped_swiglu_experts(self, tiled: Output, prefix: str) -> Output:
        """gpt-oss's experts (transformers' GptOssExperts) on the tiled rows [E, N, H]: one
        matmul for gate and up, whose rows interleave (gate of channel i in row 2i, up in
        2i + 1), plus bias; (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7);
        then down plus bias. The CPU plugin's ConvertTiledMoeBlockTo2GatherMatmuls matches
        exactly this form (strided slices of the interleaved rows; 2 GatherMatmul a layer)."""
        hidden, size = self.f.hidden_size, self.f.expert_intermediate_size
        gate_up = self.experts(prefix, "gate_up_proj", 2 * size, hidden)
        both = ops.matmul(tiled, gate_up, False, True)
        both = ops.add(both, self.expert_bias(prefix, "gate_up_proj", 2 * size))
        end = np.iinfo(np.int64).max

        def every_other(start: int) -> Output:
            return ops.slice(both, _i64([start]), _i64([end]), _i64([2]), _i64([2])).output(0)

        gate, up = every_other(0), every_other(1)
        up = ops.add(ops.clamp(up, -_OAI_LIMIT, _OAI_LIMIT), _const(1.0))
        glu = ops.swish(ops.minimum(gate, _const(_OAI_LIMIT)), _const(_OAI_ALPHA))
        down = ops.matmul(
            ops.multiply(up, glu), self.experts(prefix, "down_proj", hidden, size), False, True
        )
        return ops.add(down, self.expert_bias(prefix, "down_proj", hidden)).output(0)

    def sigmoid_routing(self, logits: Output, prefix: str) -> tuple[Output, Output, Output]:
        """Glm4MoeMoE.route_tokens_to_experts: sigmoid scores; the experts are chosen by the
        scores plus ``e_score_correction_bias``, within the ``topk_group`` groups whose two best
        biased scores sum highest (the other groups' biased scores set to 0, as
        ``masked_fill`` does); their weights are the unbiased scores, renormalised (+1e-20) if
        norm_topk_prob, times routed_scaling_factor. Returns (scores, weights, indices)."""
        f = self.f
        experts = f.num_experts
        scores = ops.sigmoid(logits).output(0)  # [N, E]
        bias = _vector(self.src, f"{prefix}.gate.e_score_correction_bias")
        choice = ops.add(scores, _const(bias)).output(0)
        if f.n_group > 1 and f.topk_group < f.n_group:
            per_group = experts // f.n_group
            grouped = ops.reshape(choice, _i64([-1, f.n_group, per_group]), False)
            best_two = ops.topk(grouped, _i64(2), -1, "max", "value", ov.Type.i64).output(0)
            group_scores = ops.reduce_sum(best_two, _i64([-1]), False)  # [N, G]
            picked = ops.topk(
                group_scores, _i64(f.topk_group), -1, "max", "none", ov.Type.i64
            ).output(1)
            mask = ops.scatter_elements_update(
                ops.broadcast(_const(0.0), ops.shape_of(group_scores)),
                picked,
                ops.broadcast(_const(1.0), ops.shape_of(picked)),
                _i64(1),
            )
            kept = ops.unsqueeze(ops.greater(mask, _const(0.0)), _i64(-1))  # [N, G, 1]
            masked = ops.select(kept, grouped, _const(0.0))
            choice = ops.reshape(masked, _i64([-1, experts]), False).output(0)
        top = ops.topk(choice, _i64(f.experts_per_token), -1, "max", "value", ov.Type.i64)
        index = top.output(1)
        chosen = ops.gather_elements(scores, index, 1).output(0)
        if f.norm_topk_prob:
            total = ops.add(ops.reduce_sum(chosen, _i64([-1]), True), _const(1e-20))
            chosen = ops.divide(chosen, total).output(0)
        if f.routed_scaling_factor != 1.0:
            chosen = ops.multiply(chosen, _const(f.routed_scaling_factor)).output(0)
        return scores, chosen, index

    # -- per-stage pieces ------------------------------------------------------------------
    def masks(self, attention_mask: Output, position_ids: Output) -> dict[str, Output]:
        total = ops.gather(ops.shape_of(attention_mask), _i64(1), _i64(0))
        new = ops.gather(ops.shape_of(position_ids), _i64(1), _i64(0))
        key_index = ops.unsqueeze(ops.range(_i64(0), total, _i64(1), "i64"), _i64(0))
        offset = ops.subtract(total, new)
        query_index = ops.add(ops.range(_i64(0), new, _i64(1), "i64"), offset)
        causal = ops.less_equal(key_index, ops.unsqueeze(query_index, _i64(1)))  # [T, S]
        slot_on = ops.greater(attention_mask, _i64(0))  # [B, S]
        visible = ops.logical_and(
            ops.unsqueeze(causal, _i64(0)), ops.unsqueeze(slot_on, _i64(1))
        )  # [B, T, S]
        blocked = _const(np.finfo(np.float32).min)
        open_ = _const(0.0)
        masks = {"full_attention": ops.unsqueeze(ops.select(visible, open_, blocked), _i64(1))}
        if "sliding_attention" in self.r.facts.layer_types[self.stage.start : self.stage.end]:
            window = self.f.sliding_window
            assert window is not None
            counted = ops.cumsum(ops.convert(slot_on, ov.Type.i64), _i64(-1))
            key_pos = ops.subtract(counted, _i64(1))  # [B, S]
            distance = ops.subtract(
                ops.unsqueeze(position_ids, _i64(2)), ops.unsqueeze(key_pos, _i64(1))
            )  # [B, T, S]
            in_window = ops.logical_and(visible, ops.less(distance, _i64(window)))
            masks["sliding_attention"] = ops.unsqueeze(
                ops.select(in_window, open_, blocked), _i64(1)
            )
        return {k: v.output(0) for k, v in masks.items()}

    def rotary(self, position_ids: Output, layer_type: str) -> tuple[Output, Output, int]:
        """cos and sin [B, 1, T, R] (R: the rotary channels of a head): (inv_freq [R/2, 1] @
        positions [B, 1, T]) transposed; and R."""
        rope = self.r.rope[layer_type]
        inv = _const(rope.inv_freq.reshape(1, -1, 1))
        batch = ops.gather(ops.shape_of(position_ids), _i64([0]), _i64(0))
        half = rope.inv_freq.shape[0]
        inv = ops.broadcast(inv, ops.concat([batch, _i64([half]), _i64([1])], 0))
        positions = ops.convert(ops.unsqueeze(position_ids, _i64(1)), ov.Type.f32)
        freqs = ops.transpose(ops.matmul(inv, positions, False, False), _i64([0, 2, 1]))
        emb = ops.concat([freqs, freqs], -1)
        cos, sin = ops.cos(emb).output(0), ops.sin(emb).output(0)
        if rope.scaling != 1.0:
            cos = ops.multiply(cos, _const(rope.scaling)).output(0)
            sin = ops.multiply(sin, _const(rope.scaling)).output(0)
        return (
            ops.unsqueeze(cos, _i64(1)).output(0),
            ops.unsqueeze(sin, _i64(1)).output(0),
            rope.rotary_dim,
        )

    def apply_rope(self, x: Output, cos: Output, sin: Output, rotary_dim: int) -> Output:
        """x * cos + rotate_half(x) * sin over the first ``rotary_dim`` channels of each head;
        the others pass through (partial rotary)."""
        end = np.iinfo(np.int64).max
        rot = x
        if rotary_dim < self.f.head_dim:
            rot = ops.slice(x, _i64([0]), _i64([rotary_dim]), _i64([1]), _i64([3])).output(0)
        half = rotary_dim // 2
        upper = ops.slice(rot, _i64([half]), _i64([end]), _i64([1]), _i64([3]))
        lower = ops.slice(rot, _i64([0]), _i64([half]), _i64([1]), _i64([3]))
        rotated = ops.concat([ops.multiply(upper, _const(-1.0)), lower], -1)
        out = ops.add(ops.multiply(rot, cos), ops.multiply(rotated, sin)).output(0)
        if rotary_dim < self.f.head_dim:
            rest = ops.slice(x, _i64([rotary_dim]), _i64([end]), _i64([1]), _i64([3]))
            out = ops.concat([out, rest], -1).output(0)
        return out

    def heads(self, x: Output, count: int) -> Output:
        """[B, T, count * D] -> [B, T, count, D]."""
        return ops.reshape(x, _i64([0, 0, count, self.f.head_dim]), True).output(0)

    def attention(
        self,
        x: Output,
        layer: int,
        local: int,
        mask: Output,
        rotary: tuple[Output, Output, int],
        params: list[ov.Node],
        presents: list[Output],
    ) -> Output:
        f, prefix = self.f, f"model.layers.{layer}.self_attn"
        gate: Output | None = None
        if f.attention_output_gate:  # Qwen3.5: q_proj gives each head's [query | gate]
            both = self.proj(x, f"{prefix}.q_proj")
            q = ops.reshape(both, _i64([0, 0, f.num_heads, 2 * f.head_dim]), True).output(0)
            half = ops.slice(q, _i64([f.head_dim]), _i64([2 * f.head_dim]), _i64([1]), _i64([3]))
            gate = ops.reshape(half, _i64([0, 0, f.num_heads * f.head_dim]), True).output(0)
            q = ops.slice(q, _i64([0]), _i64([f.head_dim]), _i64([1]), _i64([3])).output(0)
        else:
            q = self.heads(self.proj(x, f"{prefix}.q_proj"), f.num_heads)
        k = self.heads(self.proj(x, f"{prefix}.k_proj"), f.num_kv_heads)
        v = self.heads(self.proj(x, f"{prefix}.v_proj"), f.num_kv_heads)
        if self.r.qk_norm:
            q = self.norm(q, f"{prefix}.q_norm.weight")
            k = self.norm(k, f"{prefix}.k_norm.weight")
        to_heads_first = _i64([0, 2, 1, 3])
        q, k, v = (ops.transpose(t, to_heads_first).output(0) for t in (q, k, v))
        q = self.apply_rope(q, *rotary)
        k = self.apply_rope(k, *rotary)
        kv_shape = ov.PartialShape([-1, f.num_kv_heads, -1, f.head_dim])
        merged = []
        for kind, new in (("key", k), ("value", v)):
            past = ops.parameter(kv_shape, ov.Type.f32, name=f"past_key_values.{local}.{kind}")
            past.output(0).get_tensor().set_names({f"past_key_values.{local}.{kind}"})
            params.append(past)
            full = ops.concat([past, new], 2).output(0)
            full.get_tensor().set_names({f"present.{local}.{kind}"})
            presents.append(full)
            merged.append(self.expand_kv(full))
        scale = _const(self.r.attention_scale)
        if f.attention_sinks:
            # gpt-oss: the sink logits [1, H, 1, 1], a Constant (the CPU plugin takes no other
            # sink), join every row's softmax and are dropped after it (transformers' eager
            # attention); the fused stateful and paged attention take them as they are
            sinks = _vector(self.src, f"{prefix}.sinks").reshape(1, f.num_heads, 1, 1)
            attended = _OPSET13.create(
                "ScaledDotProductAttention",
                [q, merged[0], merged[1], mask, scale, _const(sinks)],
                {"causal": False},
            ).output(0)
        else:
            attended = ops.scaled_dot_product_attention(
                q, merged[0], merged[1], mask, scale, causal=False
            ).output(0)
        attended = ops.transpose(attended, to_heads_first)
        flat = ops.reshape(attended, _i64([0, 0, f.num_heads * f.head_dim]), True).output(0)
        if gate is not None:
            flat = ops.multiply(flat, ops.sigmoid(gate)).output(0)
        return self.proj(flat, f"{prefix}.o_proj")

    def state_port(self, name: str, shape: list[int], params: list[ov.Node]) -> ov.Node:
        """A past-state input ``cache_params.past.{name}`` (exporter.stateful makes it state)."""
        port = ops.parameter(
            ov.PartialShape([-1, *shape]), ov.Type.f32, name=f"cache_params.past.{name}"
        )
        port.output(0).get_tensor().set_names({f"cache_params.past.{name}"})
        params.append(port)
        return port

    def linear_attention(
        self, x: Output, layer: int, local: int, params: list[ov.Node], presents: list[Output]
    ) -> Output:
        """Qwen3_5GatedDeltaNet: a causal depthwise convolution over [q | k | v] with its last
        ``K`` inputs as state (``cache_params.past.conv.{local}`` [B, C, K]), SiLU, l2-normed
        q and k (repeated per value-head group), the gated delta rule over a recurrent state
        (``cache_params.past.ssm.{local}`` [B, Hv, Dk, Dv]), then an RMSNorm of each head
        gated by SiLU(z) and the output projection. The ops follow optimum-intel's export of
        this layer, which OpenVINO fuses (exporter.gated_delta; the conv state's name holds
        ``.past.conv.``, which its paged transformation looks for)."""
        from exporter.gated_delta import gated_delta_rule

        f, prefix = self.f, f"model.layers.{layer}.linear_attn"
        hk, hv, dk, dv = (
            f.linear_key_heads,
            f.linear_value_heads,
            f.linear_key_dim,
            f.linear_value_dim,
        )
        channels, kernel = f.linear_conv_channels, f.linear_conv_kernel
        mixed = ops.transpose(self.proj(x, f"{prefix}.in_proj_qkv"), _i64([0, 2, 1]))  # [B, C, T]
        past = self.state_port(f"conv.{local}", [channels, kernel], params)
        joined = ops.concat([past, mixed], -1)  # [B, C, K + T]
        end = np.iinfo(np.int64).max
        present = ops.slice(joined, _i64([-kernel]), _i64([end]), _i64([1]), _i64([2])).output(0)
        present.get_tensor().set_names({f"cache_params.present.conv.{local}"})
        presents.append(present)
        conv_w = self.src.tensor(f"{prefix}.conv1d.weight")
        if not isinstance(conv_w, DenseWeight):
            raise ValueError(f"{prefix}.conv1d.weight: expected a plain tensor")
        kernel_w = np.asarray(conv_w.array, np.float32).reshape(channels, 1, 1, kernel)
        conv = ops.group_convolution(joined, _const(kernel_w), [1], [0], [0], [1])
        conv.set_friendly_name(f"{prefix}.conv1d/aten::_convolution/GroupConvolution")
        count = ops.gather(ops.shape_of(mixed), _i64(2), _i64(0))
        conv = ops.slice(
            conv, ops.negative(ops.unsqueeze(count, _i64(0))), _i64([end]), _i64([1]), _i64([2])
        )
        act = ops.transpose(ops.swish(conv), _i64([0, 2, 1]))  # [B, T, C]

        def part(lo: int, hi: int, heads: int, width: int) -> Output:
            piece = ops.slice(act, _i64([lo]), _i64([hi]), _i64([1]), _i64([2]))
            return ops.reshape(piece, _i64([0, 0, heads, width]), True).output(0)

        def l2(t: Output) -> Output:  # transformers' l2norm (eps 1e-6)
            total = ops.reduce_sum(ops.multiply(t, t), _i64(-1), True)
            return ops.multiply(
                t, ops.divide(_const(1.0), ops.sqrt(ops.add(total, _const(1e-6))))
            ).output(0)

        # A value head's q and k: its key head's, the value heads grouped by key head
        # (transformers' repeat_interleave) or, in a GGUF whose converter reordered them,
        # tiled (value head i: key head i % Hk)
        tiled = bool(getattr(self.src, "value_heads_tiled", False))

        def per_value_head(t: Output) -> Output:
            if hv == hk:
                return t
            batch_time = ops.gather(ops.shape_of(t), _i64([0, 1]), _i64(0))
            axis, copies = (2, [hv // hk, hk]) if tiled else (3, [hk, hv // hk])
            wide = ops.broadcast(
                ops.unsqueeze(t, _i64(axis)), ops.concat([batch_time, _i64([*copies, dk])], 0)
            )
            return ops.reshape(wide, _i64([0, 0, hv, dk]), True).output(0)

        key_width = hk * dk
        q = per_value_head(l2(part(0, key_width, hk, dk)))
        k = per_value_head(l2(part(key_width, 2 * key_width, hk, dk)))
        v = part(2 * key_width, channels, hv, dv)
        heads_first = _i64([0, 2, 1, 3])
        q, k, v = (ops.transpose(t, heads_first).output(0) for t in (q, k, v))
        beta = ops.transpose(ops.sigmoid(self.proj(x, f"{prefix}.in_proj_b")), _i64([0, 2, 1]))
        decay = -np.exp(_vector(self.src, f"{prefix}.A_log"))
        a = ops.add(
            self.proj(x, f"{prefix}.in_proj_a"), _const(_vector(self.src, f"{prefix}.dt_bias"))
        )
        g = ops.transpose(
            ops.multiply(_const(decay.astype(np.float32)), ops.softplus(a)), _i64([0, 2, 1])
        )
        state = self.state_port(f"ssm.{local}", [hv, dk, dv], params)
        out, new_state = gated_delta_rule(q, k, v, g.output(0), beta.output(0), state.output(0))
        new_state.get_tensor().set_names({f"cache_params.present.ssm.{local}"})
        presents.append(new_state)
        out = ops.transpose(out, heads_first).output(0)  # [B, T, Hv, Dv]
        z = ops.reshape(self.proj(x, f"{prefix}.in_proj_z"), _i64([0, 0, hv, dv]), True)
        normed = self.norm(out, f"{prefix}.norm.weight", offset=0.0)
        gated = ops.multiply(normed, ops.swish(z))
        flat = ops.reshape(gated, _i64([0, 0, hv * dv]), True).output(0)
        return self.proj(flat, f"{prefix}.out_proj")

    def expand_kv(self, kv: Output) -> Output:
        """Grouped-query attention: repeat each KV head for its query heads (``repeat_kv``)."""
        f = self.f
        groups = f.num_heads // f.num_kv_heads
        if groups == 1:
            return kv
        shape = ops.shape_of(kv)
        target = ops.concat(
            [
                ops.gather(shape, _i64([0]), _i64(0)),
                _i64([f.num_kv_heads, groups]),
                ops.gather(shape, _i64([2]), _i64(0)),
                _i64([f.head_dim]),
            ],
            0,
        )
        # bidirectional, as torch's expand traces: the CPU SDPA fusion matches that mode
        repeated = ops.broadcast(ops.unsqueeze(kv, _i64(2)), target, broadcast_spec="BIDIRECTIONAL")
        return ops.reshape(repeated, _i64([0, f.num_heads, -1, f.head_dim]), True).output(0)

    def build(self) -> ov.Model:
        f, r, stage = self.f, self.r, self.stage
        width = f.hidden_size * (2 if stage.mlp_in is not None else 1)
        # The main input's node is "main_input" whatever its port is called, as the traced
        # stages had it: paged_attention_transformation reshapes a node named input_ids or
        # inputs_embeds itself, and shard_runtime.paged does that for every stage instead.
        if self.first:
            main = ops.parameter([-1, -1], ov.Type.i64, name="main_input")
            main_name = "input_ids"
        else:
            main = ops.parameter([-1, -1, width], ov.Type.f32, name="main_input")
            main_name = "inputs_embeds"
        main.output(0).get_tensor().set_names({main_name})
        attention_mask = ops.parameter([-1, -1], ov.Type.i64, name="attention_mask")
        position_ids = ops.parameter([-1, -1], ov.Type.i64, name="position_ids")
        params: list[ov.Node] = [main, attention_mask, position_ids]
        num_logits = None
        if self.last:
            num_logits = ops.parameter([], ov.Type.i64, name="num_logits")
            params.append(num_logits)
        for param in params[1:]:
            param.output(0).get_tensor().set_names({param.get_friendly_name()})

        if self.first:
            table = self.src.tensor("model.embed_tokens.weight")
            hidden = embedding(main.output(0), table, "embed")
            del table  # its unpacked codes (a byte a weight): the graph holds the packed copy
            if r.embed_scale is not None:
                hidden = ops.multiply(hidden, _const(r.embed_scale)).output(0)
        else:
            hidden = main.output(0)
        if stage.mlp_in is not None:  # the previous layer's output so far + its MLP's rest
            start = _i64([0])
            hidden_part = ops.slice(hidden, start, _i64([f.hidden_size]), _i64([1]), _i64([-1]))
            mlp_input = ops.slice(
                hidden, _i64([f.hidden_size]), _i64([2 * f.hidden_size]), _i64([1]), _i64([-1])
            )
            rest = self.mlp(
                mlp_input.output(0),
                f"model.layers.{stage.start - 1}.mlp",
                stage.mlp_in,
                r.intermediate_size,
            )
            hidden = ops.add(hidden_part, rest).output(0)

        masks = self.masks(attention_mask.output(0), position_ids.output(0))
        layer_types = f.layer_types[stage.start : stage.end]
        rotary = {
            t: self.rotary(position_ids.output(0), t)
            for t in dict.fromkeys(layer_types)
            if t != "linear_attention"
        }
        presents: list[Output] = []
        mlp_seen: Output | None = None
        for local, layer in enumerate(range(stage.start, stage.end)):
            kind = layer_types[local]
            prefix = f"model.layers.{layer}"
            normed = self.norm(hidden, f"{prefix}.input_layernorm.weight")
            if kind == "linear_attention":
                attn = self.linear_attention(normed, layer, local, params, presents)
            else:
                attn = self.attention(
                    normed, layer, local, masks[kind], rotary[kind], params, presents
                )
            if r.sandwich_norms:
                attn = self.norm(attn, f"{prefix}.post_attention_layernorm.weight")
                hidden = ops.add(hidden, attn).output(0)
                normed = self.norm(hidden, f"{prefix}.pre_feedforward_layernorm.weight")
            else:
                hidden = ops.add(hidden, attn).output(0)
                normed = self.norm(hidden, f"{prefix}.post_attention_layernorm.weight")
            cut = layer == stage.end - 1 and stage.mlp_out is not None
            hi = stage.mlp_out if cut and stage.mlp_out is not None else r.intermediate_size
            if f.is_moe(layer):
                out = self.moe(normed, f"{prefix}.mlp")
            else:
                out = self.mlp(normed, f"{prefix}.mlp", 0, hi)
            if r.sandwich_norms:
                out = self.norm(out, f"{prefix}.post_feedforward_layernorm.weight")
            hidden = ops.add(hidden, out).output(0)
            if cut:
                mlp_seen = normed

        if mlp_seen is not None:  # what the next stage's part of the MLP needs
            hidden = ops.concat([hidden, mlp_seen], -1).output(0)
        if num_logits is None:
            result = hidden
            result.get_tensor().set_names({"hidden_states"})
        else:
            new = ops.gather(ops.shape_of(hidden), _i64(1), _i64(0))
            keep = ops.range(ops.subtract(new, num_logits), new, _i64(1), "i64")
            tail = ops.gather(hidden, keep, _i64(1)).output(0)
            normed = self.norm(tail, "model.norm.weight")
            head = "lm_head.weight" if self.src.has("lm_head.weight") else None
            weight = self.src.tensor(head or "model.embed_tokens.weight")
            result = linear(normed, weight, "lm_head")
            if f.final_logit_softcapping:
                cap = _const(f.final_logit_softcapping)
                result = ops.multiply(ops.tanh(ops.divide(result, cap)), cap).output(0)
            result.get_tensor().set_names({"logits"})
        results = [ops.result(result)] + [ops.result(p) for p in presents]
        return ov.Model(results, params, f"stage-{stage.start}-{stage.end}")


def build_stage(recipe: Recipe, source: WeightSource, stage: StageSpec) -> ov.Model:
    """The stage's model with past/present KV ports (not yet stateful)."""
    return _Builder(recipe, source, stage).build()


def build_attention_layer(recipe: Recipe, source: WeightSource, layer: int) -> ov.Model:
    """Layer ``layer``'s input RMSNorm and attention alone (either kind; the MLP left out), with
    past/present state ports as a stage has them (not yet stateful): inputs ``inputs_embeds``
    [B, T, H] and, for a full-attention layer, ``attention_mask`` and ``position_ids``; output
    the attention's [B, T, H]. For timing one kind of layer against another
    (``pipeshard bench attention-cost``)."""
    builder = _Builder(recipe, source, StageSpec(layer, layer + 1))
    facts = recipe.facts
    kind = facts.layer_types[layer]
    x = ops.parameter([-1, -1, facts.hidden_size], ov.Type.f32, name="main_input")
    x.output(0).get_tensor().set_names({"inputs_embeds"})
    params: list[ov.Node] = [x]
    presents: list[Output] = []
    normed = builder.norm(x.output(0), f"model.layers.{layer}.input_layernorm.weight")
    if kind == "linear_attention":
        out = builder.linear_attention(normed, layer, 0, params, presents)
    else:
        mask = ops.parameter([-1, -1], ov.Type.i64, name="attention_mask")
        positions = ops.parameter([-1, -1], ov.Type.i64, name="position_ids")
        for param in (mask, positions):
            param.output(0).get_tensor().set_names({param.get_friendly_name()})
        params += [mask, positions]
        masks = builder.masks(mask.output(0), positions.output(0))
        rotary = builder.rotary(positions.output(0), kind)
        out = builder.attention(normed, layer, 0, masks[kind], rotary, params, presents)
    out.get_tensor().set_names({"hidden_states"})
    results = [ops.result(out)] + [ops.result(p) for p in presents]
    return ov.Model(results, params, f"layer-{layer}-{kind}")
