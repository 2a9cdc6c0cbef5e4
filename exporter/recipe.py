"""What a decoder computes, beyond its shapes: read from a transformers config, no torch.

``config -> Recipe`` (norms, activation, attention scale, RoPE frequencies per layer type,
Gemma's extras). :mod:`exporter.graph` builds a stage's OpenVINO graph from a recipe and the
stage's weights; the numbers follow transformers' implementation of each architecture, which is
the reference the tests compare against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from exporter.architectures import ArchitectureFacts, read_architecture
from exporter.errors import ExportError
from exporter.families import family

# transformers' names of the activations the supported MLPs use
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class Rope:
    """Rotary embedding of one layer type: cos/sin of ``position * inv_freq``, times scaling."""

    inv_freq: np.ndarray  # float32 [rotary_dim // 2]: the first rotary_dim channels rotate
    scaling: float = 1.0

    @property
    def rotary_dim(self) -> int:
        return 2 * int(self.inv_freq.shape[0])


@dataclass(frozen=True)
class Recipe:
    facts: ArchitectureFacts
    intermediate_size: int
    rms_eps: float
    activation: str  # "silu" | "gelu_tanh"
    attention_scale: float
    rope: dict[str, Rope]  # by layer type
    qk_norm: bool  # RMSNorm of each head's q and k (Qwen3, Gemma 3, GLM-4.5 with use_qk_norm)
    sandwich_norms: bool  # Gemma 3: norms after attention and around the MLP
    norm_offset: float  # Gemma: a norm multiplies by (1 + weight)
    embed_scale: float | None  # Gemma: embeddings times sqrt(hidden)

    @property
    def model_type(self) -> str:
        return self.facts.model_type


def _inv_freq(
    params: dict[str, Any], head_dim: int, config: Any, context: int
) -> tuple[np.ndarray, float]:
    """inverse frequencies as transformers' ROPE_INIT_FUNCTIONS compute them (in float32), and
    the scaling of cos and sin."""
    base = float(params.get("rope_theta", 10000.0))
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = (1.0 / (np.float64(base) ** exponents.astype(np.float64))).astype(np.float32)
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "longrope":
        return _longrope(params, head_dim, config, context)
    if kind == "yarn":
        return _yarn(params, head_dim, config)
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return (inv / np.float32(params["factor"])).astype(np.float32), 1.0
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv).astype(np.float32)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    raise ExportError(
        f"RoPE type {kind!r} is not supported (default, linear, llama3, longrope and yarn are)"
    )


def _yarn(params: dict[str, Any], dim: int, config: Any) -> tuple[np.ndarray, float]:
    """YaRN (gpt-oss) as transformers' _compute_yarn_parameters computes it, in float32:
    between the channel pairs that rotate more than beta_fast times over the original context
    (kept) and those that rotate less than beta_slow times (divided by the factor), a linear
    ramp; cos and sin scaled by the attention factor (0.1 ln(factor) + 1 unless given)."""
    base = float(params.get("rope_theta", 10000.0))
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:
        factor = int(config.max_position_embeddings) / original
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    fast = float(params.get("beta_fast") or 32)
    slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    powers = (np.float64(base) ** exponents.astype(np.float64)).astype(np.float32)
    extrapolation = (np.float32(1.0) / powers).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(factor) * powers)).astype(np.float32)
    ramp = (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    keep = np.float32(1.0) - np.clip(ramp, 0, 1).astype(np.float32)
    inv = interpolation * (np.float32(1.0) - keep) + extrapolation * keep
    return inv.astype(np.float32), float(attention)


def _longrope(
    params: dict[str, Any], dim: int, config: Any, context: int
) -> tuple[np.ndarray, float]:
    """LongRoPE (Phi-3.5-mini, Phi-4-mini, the 128k Phi-3s) as transformers'
    _compute_longrope_parameters computes it: inverse frequencies divided per channel pair by
    the short or the long factors, cos and sin scaled by the attention factor. transformers
    switches to the long factors while a forward call's positions pass
    original_max_position_embeddings; here, as llama.cpp does, the export's context decides
    once: longer than the original, the long factors for every position (what transformers
    computes once a sequence has passed it), else the short ones (what it computes before)."""
    original = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    if not original:
        raise ExportError("longrope needs original_max_position_embeddings")
    original = int(original)
    factor = params.get("factor")
    if factor is None:  # Phi-3: the ratio of the context lengths (transformers' note)
        factor = int(config.max_position_embeddings) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = np.asarray(
        params["long_factor" if context > original else "short_factor"], dtype=np.float32
    )
    if factors.shape != (dim // 2,):
        raise ExportError(f"longrope: {factors.size} factors for {dim // 2} frequencies")
    base = float(params.get("rope_theta", 10000.0))
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    powers = (np.float64(base) ** exponents.astype(np.float64)).astype(np.float32)
    return (np.float32(1.0) / (factors * powers)).astype(np.float32), float(attention)


def _rope_params(config: Any, layer_type: str) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params and isinstance(params[layer_type], dict):
        params = params[layer_type]
    params = dict(params)
    if "rope_theta" not in params and getattr(config, "rope_theta", None) is not None:
        params["rope_theta"] = config.rope_theta
    return params


def read_recipe(config: Any, context: int | None = None) -> Recipe:
    """The recipe of a supported decoder config; ExportError names what is not supported.
    ``context``: the longest sequence the export serves (LongRoPE picks its factors by it)."""
    facts = read_architecture(config)
    model_type = facts.model_type
    act_name = str(getattr(config, "hidden_activation", None) or config.hidden_act)
    if act_name not in _ACTIVATIONS:
        raise ExportError(f"{model_type}: activation {act_name!r} is not supported")
    fam = family(model_type)
    gemma = fam.gemma_layer
    rope = {}
    for layer_type in dict.fromkeys(facts.layer_types):
        if layer_type == "linear_attention":  # no positions: a recurrence
            continue
        params = _rope_params(config, layer_type)
        # Phi-3's family rotates the first head_dim * partial_rotary_factor channels of each
        # head, the rest pass through (transformers' apply_rotary_pos_emb)
        factor = float(
            params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
            or 1.0
        )
        rotary_dim = int(facts.head_dim * factor)
        if rotary_dim % 2 or not 0 < rotary_dim <= facts.head_dim:
            raise ExportError(f"{model_type}: partial_rotary_factor {factor} is not supported")
        inv, scaling = _inv_freq(params, rotary_dim, config, context or facts.max_context)
        rope[layer_type] = Rope(inv, scaling)
    scale = float(config.query_pre_attn_scalar) ** -0.5 if gemma else facts.head_dim**-0.5
    return Recipe(
        facts=facts,
        intermediate_size=facts.intermediate_size,
        rms_eps=float(config.rms_norm_eps),
        activation=_ACTIVATIONS[act_name],
        attention_scale=scale,
        rope=rope,
        qk_norm=fam.qk_norm
        or (fam.qk_norm_key is not None and bool(getattr(config, fam.qk_norm_key, False))),
        sandwich_norms=gemma,
        # Gemma, Qwen3.5: (1 + weight) (not the Gated DeltaNet's output norm: exporter.graph)
        norm_offset=1.0 if fam.norms_plus_one else 0.0,
        embed_scale=math.sqrt(facts.hidden_size) if gemma else None,
    )
