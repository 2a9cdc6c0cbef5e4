"""A torch module over one half-open layer range of a decoder, shaped for OpenVINO conversion.

Inputs (in this order, batch B, new tokens T, past P, total S = P + T):
  stage 0:   ``input_ids`` [B, T] i64          later stages: ``inputs_embeds`` [B, T, H] f32
             ([B, T, 2H] after a cut inside an MLP: the layer's output so far, the MLP's input)
  ``attention_mask`` [B, S] i64   (1 = visible slot; 0 masks a physical slot out)
  ``position_ids``   [B, T] i64   (absolute, logical positions of the new tokens)
  last stage only: ``num_logits`` [] i64 (logits are computed for the last ``num_logits`` tokens)
  ``past_key_values.{i}.key`` / ``.value`` [B, kv_heads, P, head_dim] for each local layer i
Outputs: ``logits`` [B, num_logits, V] (last stage) or ``hidden_states`` [B, T, H] ([B, T, 2H]
when its last layer's MLP is cut: see :class:`MlpPart`), then
``present.{i}.key`` / ``.value``. `optimum`'s ``patch_stateful`` later turns the past/present pairs
into ReadValue/Assign state and adds ``beam_idx``.

The masks are built here (not by transformers' mask helpers, which do not trace): a key slot is
visible to a query when its physical index is not after the query's and its attention_mask is 1;
sliding-window layers additionally need the logical distance (query position minus the key's
logical position, the running count of visible slots) below the window.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn

from exporter.architectures import ArchitectureFacts


class _StageCache:
    """The minimal cache the attention modules need: concatenate past and new K/V per layer."""

    def __init__(self, past: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.past = past
        self.present: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        past_key, past_value = self.past[layer_idx]
        key = torch.cat([past_key, key], dim=-2)
        value = torch.cat([past_value, value], dim=-2)
        self.present[layer_idx] = (key, value)
        return key, value


class MlpPart(nn.Module):
    """Intermediate channels ``[lo, hi)`` of a gated MLP (llama, qwen2):
    ``down[:, lo:hi] @ (act(gate[lo:hi] x) * up[lo:hi] x)``. The parts of an MLP add up to it;
    a bias of ``down`` goes with the part from channel 0. Keeps its last input (``seen``): a stage
    that ends inside an MLP passes it on for the next stage's part."""

    def __init__(self, mlp: Any, lo: int, hi: int) -> None:
        super().__init__()
        self.gate_proj = _linear(mlp.gate_proj.weight[lo:hi], _part(mlp.gate_proj.bias, lo, hi))
        self.up_proj = _linear(mlp.up_proj.weight[lo:hi], _part(mlp.up_proj.bias, lo, hi))
        down_bias = mlp.down_proj.bias if lo == 0 else None
        self.down_proj = _linear(mlp.down_proj.weight[:, lo:hi], down_bias)
        self.act_fn = mlp.act_fn
        self.seen: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _part(bias: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    return None if bias is None else bias[lo:hi]


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=bias is not None, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


def _with_mlp(layer: nn.Module, mlp: nn.Module) -> nn.Module:
    """A shallow copy of a decoder layer with another MLP (the source model is left as it is)."""
    clone = copy.copy(layer)
    clone._modules = dict(layer._modules)
    clone._modules["mlp"] = mlp
    return clone


class StageModule(nn.Module):
    """Layers ``[start, end)`` of a causal LM; embeddings only in stage 0, head only in the last.

    ``mlp_in``: first add the previous layer's MLP channels ``[mlp_in, I)`` (the stage before
    computed the rest); ``mlp_out``: the last layer's MLP stops at channel ``mlp_out``.
    """

    def __init__(
        self,
        model: Any,
        facts: ArchitectureFacts,
        start: int,
        end: int,
        mlp_in: int | None = None,
        mlp_out: int | None = None,
    ) -> None:
        super().__init__()
        decoder = model.model
        self.first = start == 0
        self.last = end == facts.num_layers
        self.facts = facts
        self.layer_ids = list(range(start, end))
        self.embed_tokens = decoder.embed_tokens if self.first else None
        layers = [decoder.layers[i] for i in self.layer_ids]
        self.finish: MlpPart | None = None
        if mlp_in is not None:
            previous = decoder.layers[start - 1].mlp
            self.finish = MlpPart(previous, mlp_in, previous.gate_proj.out_features)
        self.head_part: MlpPart | None = None
        if mlp_out is not None:
            self.head_part = MlpPart(layers[-1].mlp, 0, mlp_out)
            layers[-1] = _with_mlp(layers[-1], self.head_part)
        self.input_width = facts.hidden_size * (2 if mlp_in is not None else 1)
        self.layers = nn.ModuleList(layers)
        self.rotary_emb = decoder.rotary_emb
        self.norm = decoder.norm if self.last else None
        self.lm_head = model.lm_head if self.last else None
        self.layer_types = [facts.layer_types[i] for i in self.layer_ids]
        self._rotary_by_type = "layer_type" in inspect.signature(self.rotary_emb.forward).parameters

    # Names of the converted model's inputs/outputs, in forward() order.
    def input_names(self) -> list[str]:
        names = ["input_ids" if self.first else "inputs_embeds", "attention_mask", "position_ids"]
        if self.last:
            names.append("num_logits")
        for i in range(len(self.layer_ids)):
            names += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        return names

    def output_names(self) -> list[str]:
        names = ["logits" if self.last else "hidden_states"]
        for i in range(len(self.layer_ids)):
            names += [f"present.{i}.key", f"present.{i}.value"]
        return names

    def _masks(
        self, attention_mask: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        new_tokens = position_ids.shape[1]
        total = attention_mask.shape[1]
        key_index = torch.arange(total)
        query_index = torch.arange(new_tokens) + (total - new_tokens)
        causal = key_index[None, :] <= query_index[:, None]  # [T, S]
        slot_on = attention_mask > 0
        visible = causal[None, :, :] & slot_on[:, None, :]  # [B, T, S]
        blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype)
        open_ = torch.tensor(0.0, dtype=dtype)
        masks = {"full_attention": torch.where(visible, open_, blocked)[:, None]}
        if "sliding_attention" in self.layer_types:
            window = self.facts.sliding_window
            assert window is not None
            key_pos = torch.cumsum(slot_on.to(torch.int64), dim=-1) - 1  # [B, S]
            distance = position_ids[:, :, None] - key_pos[:, None, :]  # [B, T, S]
            in_window = visible & (distance < window)
            masks["sliding_attention"] = torch.where(in_window, open_, blocked)[:, None]
        return masks

    def forward(
        self,
        main_input: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        *rest: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        num_logits = rest[0] if self.last else None
        flat_past = rest[1:] if self.last else rest
        hidden = self.embed_tokens(main_input) if self.embed_tokens is not None else main_input
        if self.finish is not None:  # the previous layer's output so far + its MLP's other part
            # narrow on axis -1 stays the last axis when the paged transformation re-ranks the
            # input (hidden[..., a:b] would trace as a fixed axis 2)
            width = self.facts.hidden_size
            hidden = hidden.narrow(-1, 0, width) + self.finish(hidden.narrow(-1, width, width))
        past = {
            layer_id: (flat_past[2 * i], flat_past[2 * i + 1])
            for i, layer_id in enumerate(self.layer_ids)
        }
        cache = _StageCache(past)
        masks = self._masks(attention_mask, position_ids, hidden.dtype)
        rotary: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer_type in dict.fromkeys(self.layer_types):
            if self._rotary_by_type:
                rotary[layer_type] = self.rotary_emb(hidden, position_ids, layer_type)
            else:
                rotary[layer_type] = self.rotary_emb(hidden, position_ids)
        for layer, layer_type in zip(self.layers, self.layer_types, strict=True):
            out = layer(
                hidden,
                attention_mask=masks[layer_type],
                position_embeddings=rotary[layer_type],
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
            )
            hidden = out[0] if isinstance(out, tuple) else out
        presents: list[torch.Tensor] = []
        for layer_id in self.layer_ids:
            presents += list(cache.present[layer_id])
        if self.head_part is not None:  # what the next stage's part of the MLP needs
            assert self.head_part.seen is not None
            hidden = torch.cat([hidden, self.head_part.seen], dim=-1)
        if self.norm is None or self.lm_head is None or num_logits is None:
            return (hidden, *presents)
        new_tokens = hidden.shape[1]
        # A tensor bound keeps num_logits dynamic in the traced graph.
        keep = torch.arange(new_tokens - num_logits, new_tokens)  # type: ignore[arg-type]
        logits = self.lm_head(self.norm(hidden.index_select(1, keep))).float()
        softcap = self.facts.final_logit_softcapping
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return (logits, *presents)

    def example_inputs(
        self, batch: int = 1, new: int = 3, past: int = 2
    ) -> tuple[torch.Tensor, ...]:
        facts = self.facts
        if self.first:
            main = torch.randint(0, facts.vocab_size, (batch, new), dtype=torch.int64)
        else:
            main = torch.randn(batch, new, self.input_width, dtype=torch.float32)
        inputs = [
            main,
            torch.ones(batch, past + new, dtype=torch.int64),
            torch.arange(past, past + new, dtype=torch.int64).expand(batch, new).contiguous(),
        ]
        if self.last:
            inputs.append(torch.tensor(1, dtype=torch.int64))
        kv_shape = (batch, facts.num_kv_heads, past, facts.head_dim)
        for _ in self.layer_ids:
            inputs += [torch.randn(kv_shape), torch.randn(kv_shape)]
        return tuple(inputs)
