"""Plans for real models without their files: ``pipeshard plan PRESET --quant Q --hosts 3x32GB``.

A preset is a model's published shape (the hyper-parameters of its config.json, written down
below with where each comes from). From it this module lists the model's tensors as llama.cpp
names and shapes them in a GGUF, gives each the GGML type a quantization (``Q4_K_M``,
``Q8_0``, ``MXFP4``, ...) would store it in, and counts:

- the GGUF file's bytes (the type's block size), and the bytes the stages hold at run time:
  ``--weights gguf`` keeps every block's integer codes as stored with f32 scales
  (exporter/gguf_quant.py), which costs more than the file (``RUNTIME_BYTES`` below);
- the KV cache of a context (f16, 2 bytes a value, as exporter.plan counts it) for the layers
  with attention over the whole sequence, and for the linear-attention layers of the hybrids
  (Qwen3.5) their fixed recurrent state per sequence: a conv state ``[conv_dim, kernel]`` and
  a recurrent state ``[Hv, head_k_dim, head_v_dim]`` in f32, whatever the context;
- the memory of exporting a stage on its own PC (``pipeshard export --stage K``): the export's
  target, ``1.25 x the stage's IR + 1.5 GiB``, measured for a Llama-3-8B-shaped file
  (docs/benchmarks.md, "gguf-export").

The layers are split over the hosts in order so that the fullest host is as empty as it can be
(each host's share follows its memory). A plan that does not fit says what would: the fewest
hosts of the set's largest size, and the other quantizations that fit these hosts.

No model file, no network: the shapes are this table's. The tensor types follow
llama-quantize's rules for its standard mixes (simplified: see ``gguf_type``); other mixes
(e.g. "dynamic" ones) differ, and ``pipeshard export`` prints the real plan of a file.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.state_pool import DEFAULT_STATE_SESSIONS, pool_slots
from exporter.errors import ExportError
from exporter.families.gguf_names import tensor_name
from exporter.plan import (
    KV_BYTES_PER_VALUE,
    MXFP4_EXPERT_BYTES,
    RUNTIME_OVERHEAD_BYTES,
    parse_size,
)

GIB = 2**30
QK_K = 256  # the K-quants' super-block: a row of a K-quant tensor is a multiple of it

# GGUF bytes per weight: block bytes / block length (gguf's GGML_QUANT_SIZES)
FILE_BYTES: dict[str, float] = {
    "F32": 4.0,
    "F16": 2.0,
    "BF16": 2.0,
    "Q8_0": 34 / 32,
    "Q4_0": 18 / 32,
    "Q4_1": 20 / 32,
    "Q5_0": 22 / 32,
    "Q5_1": 24 / 32,
    "Q2_K": 84 / 256,
    "Q3_K": 110 / 256,
    "Q4_K": 144 / 256,
    "Q5_K": 176 / 256,
    "Q6_K": 210 / 256,
    "IQ4_NL": 18 / 32,
    "MXFP4": 17 / 32,
}
# Run-time bytes per weight of MXFP4 experts: i8 codes (the doubled e2m1 value) with an f32
# scale per 32, the exact form the CPU plugin's GatherMatmul runs sparsely (it unpacks f4e2m1
# experts to f32). The gpt-oss export decides the form; this is its cost as measured in a
# compiled stage (9.8 bits a weight: 9 in the constants, the rest the plugin's own copy of the
# scales; pipeshard bench mxfp4-forms), as the export's plan counts it.
MXFP4_RUNTIME_BYTES = MXFP4_EXPERT_BYTES
# Run-time bytes per weight as --weights gguf keeps a matrix (exporter/gguf_quant.py): codes as
# stored (u4/i4 half a byte, u8/i8 one) + an f32 scale per group (32, or 16 for Q2_K, Q3_K,
# Q6_K); the types with a minimum (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) add it in the "split" form as
# u8 codes per group + an f32 dmin per 256 (Q4_1/Q5_1: f16 minimums per 32). IQ4_NL has no
# compressed form: de-quantized to f16. BF16 is widened to f32.
RUNTIME_BYTES: dict[str, float] = {
    "F32": 4.0,
    "F16": 2.0,
    "BF16": 4.0,
    "Q8_0": 1 + 4 / 32,
    "Q4_0": 0.5 + 4 / 32,
    "Q4_1": 0.5 + 4 / 32 + 2 / 32,
    "Q5_0": 1 + 4 / 32,
    "Q5_1": 1 + 4 / 32 + 2 / 32,
    "Q2_K": 0.5 + 4 / 16 + 1 / 16 + 4 / 256,
    "Q3_K": 0.5 + 4 / 16,
    "Q4_K": 0.5 + 4 / 32 + 1 / 32 + 4 / 256,
    "Q5_K": 1 + 4 / 32 + 1 / 32 + 4 / 256,
    "Q6_K": 1 + 4 / 16,
    "IQ4_NL": 2.0,
    "MXFP4": MXFP4_RUNTIME_BYTES,
}
# MoE experts (3-D tensors, GatherMatmul) take the "exact" form of the types with a minimum:
# an f32 zero point per group instead of the split form's second matmul.
EXPERT_RUNTIME_BYTES: dict[str, float] = {
    **RUNTIME_BYTES,
    "Q4_1": 0.5 + 8 / 32,
    "Q5_1": 1 + 8 / 32,
    "Q2_K": 0.5 + 8 / 16,
    "Q4_K": 0.5 + 8 / 32,
    "Q5_K": 1 + 8 / 32,
}
# Exporting one stage: at most this factor x the stage's IR + this allowance (peak RSS)
EXPORT_FACTOR = 1.25
EXPORT_ALLOWANCE = 1.5 * GIB
STATE_BYTES_PER_VALUE = 4  # the linear-attention states are f32
# A hybrid's paged stage (its default backend) keeps up to --state-window + 2 states a sequence
# (its latest, the ones a rollback of up to the window returns to, and the one a step writes)
# and a scratch slot, in every linear-attention layer (common.state_pool), in a pool sized
# for --state-sessions sessions (default: DEFAULT_STATE_SESSIONS, as the stage's max_sessions
# of 64 gives): stage_node/settings.py's defaults (tests/test_presets.py checks that they
# agree). A stateful stage keeps one a sequence.
PAGED_STATE_WINDOW = 8
# The stage's default --kv-cache-size (GiB) and the positions of a KV block on CPU
KV_CACHE_DEFAULT_GIB = 1.0
KV_BLOCK_POSITIONS = 32

# The quantizations a plan can take, smallest first (of the files llama-quantize makes)
QUANTS = ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "MXFP4")
_BASE = {"Q2_K": "Q2_K", "Q3_K_M": "Q3_K", "Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K"}
# A K-quant on a row that is not a multiple of 256 falls back as llama-quantize does
_FALLBACK = {"Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# Matrices llama-quantize leaves unquantized (routers, the shared expert's gate, conv kernels)
_KEPT_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


@dataclass(frozen=True)
class Preset:
    """A model's shape as its config.json gives it (field names: the transformers config's in
    the comments), and the plan's defaults for it."""

    name: str  # what `pipeshard plan` takes
    title: str
    model_type: str  # transformers' model_type
    layers: int  # num_hidden_layers (the NextN/MTP layers not counted)
    hidden: int  # hidden_size
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim
    vocab: int  # vocab_size
    max_context: int  # max_position_embeddings
    source: str  # where the numbers come from
    quants: tuple[str, ...]  # the quantizations offered, as QUANTS names
    default_quants: tuple[str, ...]
    default_hosts: tuple[str, ...]
    intermediate: int = 0  # intermediate_size: a dense layer's MLP channels
    experts: int = 0  # num_local_experts / n_routed_experts / num_experts
    experts_per_token: int = 0  # num_experts_per_tok
    expert_intermediate: int = 0  # moe_intermediate_size (gpt-oss: intermediate_size)
    shared_expert_intermediate: int = 0  # channels of the shared expert (0: none)
    shared_expert_gate: bool = False  # Qwen3.5-MoE: a sigmoid gate [1, hidden] on it
    first_dense: int = 0  # first_k_dense_replace: layers below it have a dense MLP
    # full_attention_interval: every interval-th layer has full attention, the others linear
    # attention (Gated DeltaNet); 0: every layer full attention
    full_attention_interval: int = 0
    gated_query: bool = False  # attn_output_gate: q_proj also gives a gate per head
    linear_key_heads: int = 0  # linear_num_key_heads
    linear_value_heads: int = 0  # linear_num_value_heads
    linear_key_dim: int = 0  # linear_key_head_dim
    linear_value_dim: int = 0  # linear_value_head_dim
    conv_kernel: int = 0  # linear_conv_kernel_dim
    attention_bias: bool = False  # q, k, v biases
    output_bias: bool = False  # an o_proj bias too (gpt-oss)
    qk_norm: bool = False  # use_qk_norm / q_norm, k_norm
    sinks: bool = False  # gpt-oss's attention sinks, one logit per head
    expert_bias: bool = False  # gpt-oss: biased router and experts
    correction_bias: bool = False  # GLM: e_score_correction_bias
    sliding_window: int = 0  # gpt-oss: every other layer attends to the last 128 positions
    nextn_layers: int = 0  # NextN/MTP layers after the last one: in the file, not exported
    aliases: tuple[str, ...] = field(default=())

    def full_attention(self, layer: int) -> bool:
        interval = self.full_attention_interval
        return not interval or (layer + 1) % interval == 0

    def moe(self, layer: int) -> bool:
        return self.experts > 0 and layer >= self.first_dense

    @property
    def conv_dim(self) -> int:
        keys = self.linear_key_heads * self.linear_key_dim
        return 2 * keys + self.linear_value_heads * self.linear_value_dim


_GPT_OSS = (
    "openai/gpt-oss-120b and gpt-oss-20b config.json (GptOssConfig): hidden_size 2880, "
    "num_attention_heads 64, num_key_value_heads 8, head_dim 64, intermediate_size 2880 "
    "(each expert), num_local_experts 128 / 32, num_experts_per_tok 4, num_hidden_layers "
    "36 / 24, vocab_size 201088, sliding_window 128 on alternate layers, attention_bias true, "
    "max_position_embeddings 131072. Written from memory (no model hub is reachable here); "
    "the 120b numbers equal transformers 5.5.4's GptOssConfig defaults, and both give the "
    "published totals (116.8B and 20.9B parameters). The MXFP4 file: experts MXFP4 as OpenAI "
    "released them, every other matrix Q8_0 (inferred: that makes the 20b file 12.1 GB, the "
    "size ggml-org's file is remembered at)"
)
_GLM_AIR = (
    "zai-org/GLM-4.5-Air config.json (Glm4MoeConfig): hidden_size 4096, num_hidden_layers 46, "
    "num_attention_heads 96, num_key_value_heads 8, head_dim 128, intermediate_size 10944, "
    "moe_intermediate_size 1408, n_routed_experts 128, n_shared_experts 1, num_experts_per_tok "
    "8, first_k_dense_replace 1, vocab_size 151552, attention_bias true, use_qk_norm false, "
    "num_nextn_predict_layers 1, max_position_embeddings 131072. From memory; the shape "
    "equals transformers 5.5.4's Glm4MoeConfig defaults (attention_bias there defaults to "
    "false) and gives the published 106B total / 12B active"
)
_GLM_47 = (
    "zai-org/GLM-4.5 config.json (GLM-4.6 and GLM-4.7 keep the shape): hidden_size 5120, "
    "num_hidden_layers 92, num_attention_heads 96, num_key_value_heads 8, head_dim 128, "
    "intermediate_size 12288, moe_intermediate_size 1536, n_routed_experts 160, "
    "n_shared_experts 1, num_experts_per_tok 8, first_k_dense_replace 3, vocab_size 151552, "
    "attention_bias true, use_qk_norm true, num_nextn_predict_layers 1, "
    "max_position_embeddings 131072 (GLM-4.6/4.7: 202752). From memory; checked against the "
    "published 355B total / 32B active"
)
_QWEN35 = (
    "Qwen/{name} config.json text_config (Qwen3_5{cls}TextConfig) and model card: {shape}; "
    "layer_types 3 linear_attention then 1 full_attention (full_attention_interval 4), "
    "head_dim 256 with an output gate, linear_key_head_dim = linear_value_head_dim 128, "
    "linear_conv_kernel_dim 4, vocab_size 248320, mtp_num_hidden_layers 1, "
    "max_position_embeddings 262144. {checked}"
)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="gpt-oss-120b",
            title="gpt-oss-120b",
            model_type="gpt_oss",
            layers=36,
            hidden=2880,
            heads=64,
            kv_heads=8,
            head_dim=64,
            vocab=201088,
            max_context=131072,
            experts=128,
            experts_per_token=4,
            expert_intermediate=2880,
            attention_bias=True,
            output_bias=True,
            sinks=True,
            expert_bias=True,
            sliding_window=128,
            source=_GPT_OSS,
            quants=("MXFP4",),
            default_quants=("MXFP4",),
            default_hosts=("2x64GB", "3x32GB", "4x32GB"),
        ),
        Preset(
            name="gpt-oss-20b",
            title="gpt-oss-20b",
            model_type="gpt_oss",
            layers=24,
            hidden=2880,
            heads=64,
            kv_heads=8,
            head_dim=64,
            vocab=201088,
            max_context=131072,
            experts=32,
            experts_per_token=4,
            expert_intermediate=2880,
            attention_bias=True,
            output_bias=True,
            sinks=True,
            expert_bias=True,
            sliding_window=128,
            source=_GPT_OSS,
            quants=("MXFP4",),
            default_quants=("MXFP4",),
            default_hosts=("2x64GB", "3x32GB", "4x32GB"),
        ),
        Preset(
            name="glm-4.5-air",
            title="GLM-4.5-Air",
            model_type="glm4_moe",
            layers=46,
            hidden=4096,
            heads=96,
            kv_heads=8,
            head_dim=128,
            vocab=151552,
            max_context=131072,
            intermediate=10944,
            experts=128,
            experts_per_token=8,
            expert_intermediate=1408,
            shared_expert_intermediate=1408,
            first_dense=1,
            attention_bias=True,
            correction_bias=True,
            nextn_layers=1,
            source=_GLM_AIR,
            quants=("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"),
            default_quants=("Q4_K_M", "Q8_0"),
            default_hosts=("2x64GB", "3x32GB", "4x32GB"),
        ),
        Preset(
            name="glm-4.7",
            title="GLM-4.7 (the GLM-4.5 / 4.6 shape)",
            model_type="glm4_moe",
            layers=92,
            hidden=5120,
            heads=96,
            kv_heads=8,
            head_dim=128,
            vocab=151552,
            max_context=202752,
            intermediate=12288,
            experts=160,
            experts_per_token=8,
            expert_intermediate=1536,
            shared_expert_intermediate=1536,
            first_dense=3,
            attention_bias=True,
            qk_norm=True,
            correction_bias=True,
            nextn_layers=1,
            source=_GLM_47,
            quants=("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"),
            default_quants=("Q4_K_M", "Q8_0"),
            default_hosts=("2x64GB", "3x32GB", "4x32GB"),
            aliases=("glm-4.5", "glm-4.6"),
        ),
        Preset(
            name="qwen3.5-27b",
            title="Qwen3.5-27B",
            model_type="qwen3_5",
            layers=64,
            hidden=5120,
            heads=24,
            kv_heads=4,
            head_dim=256,
            vocab=248320,
            max_context=262144,
            intermediate=17408,
            full_attention_interval=4,
            gated_query=True,
            linear_key_heads=16,
            linear_value_heads=48,
            linear_key_dim=128,
            linear_value_dim=128,
            conv_kernel=4,
            qk_norm=True,
            nextn_layers=1,
            source=_QWEN35.format(
                name="Qwen3.5-27B",
                cls="",
                shape="hidden_size 5120, num_hidden_layers 64, intermediate_size 17408, "
                "num_attention_heads 24, num_key_value_heads 4, linear_num_key_heads 16, "
                "linear_num_value_heads 48",
                checked="From memory, uncertain: checked only against the published 27B "
                "total (transformers' Qwen3_5TextConfig defaults are another, 32-layer shape)",
            ),
            quants=("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"),
            default_quants=("Q4_K_M", "Q8_0"),
            default_hosts=("2x32GB", "2x64GB", "3x64GB", "4x64GB"),
        ),
        Preset(
            name="qwen3.6-35b-a3b",
            title="Qwen3.6-35B-A3B (the Qwen3.5-35B-A3B shape)",
            model_type="qwen3_5_moe",
            layers=40,
            hidden=2048,
            heads=16,
            kv_heads=2,
            head_dim=256,
            vocab=248320,
            max_context=262144,
            experts=256,
            experts_per_token=8,
            expert_intermediate=512,
            shared_expert_intermediate=512,
            shared_expert_gate=True,
            full_attention_interval=4,
            gated_query=True,
            linear_key_heads=16,
            linear_value_heads=32,
            linear_key_dim=128,
            linear_value_dim=128,
            conv_kernel=4,
            qk_norm=True,
            nextn_layers=1,
            source=_QWEN35.format(
                name="Qwen3.6-35B-A3B (= Qwen3.5-35B-A3B's shape)",
                cls="Moe",
                shape="hidden_size 2048, num_hidden_layers 40, num_attention_heads 16, "
                "num_key_value_heads 2, linear_num_key_heads 16, linear_num_value_heads 32, "
                "num_experts 256, num_experts_per_tok 8, moe_intermediate_size 512, "
                "shared_expert_intermediate_size 512",
                checked="The shape equals transformers 5.5.4's Qwen3_5MoeTextConfig defaults "
                "and gives the published 35B total / 3B active; Qwen3.6-35B-A3B is taken to "
                "keep it (from memory)",
            ),
            quants=("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"),
            default_quants=("Q4_K_M", "Q8_0"),
            default_hosts=("2x32GB", "2x64GB", "3x64GB", "4x64GB"),
            aliases=("qwen3.5-35b-a3b",),
        ),
        Preset(
            name="qwen3.5-122b-a10b",
            title="Qwen3.5-122B-A10B",
            model_type="qwen3_5_moe",
            layers=48,
            hidden=3072,
            heads=32,
            kv_heads=2,
            head_dim=256,
            vocab=248320,
            max_context=262144,
            experts=256,
            experts_per_token=8,
            expert_intermediate=1024,
            shared_expert_intermediate=1024,
            shared_expert_gate=True,
            full_attention_interval=4,
            gated_query=True,
            linear_key_heads=16,
            linear_value_heads=64,
            linear_key_dim=128,
            linear_value_dim=128,
            conv_kernel=4,
            qk_norm=True,
            nextn_layers=1,
            source=_QWEN35.format(
                name="Qwen3.5-122B-A10B",
                cls="Moe",
                shape="hidden_size 3072, num_hidden_layers 48, num_attention_heads 32, "
                "num_key_value_heads 2, linear_num_key_heads 16, linear_num_value_heads 64, "
                "num_experts 256, num_experts_per_tok 8, moe_intermediate_size 1024, "
                "shared_expert_intermediate_size 1024",
                checked="From memory, uncertain: checked only against the published 122B "
                "total / 10B active",
            ),
            quants=("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"),
            default_quants=("Q4_K_M", "Q8_0"),
            default_hosts=("2x32GB", "2x64GB", "3x64GB", "4x64GB"),
        ),
    )
}


def find_preset(name: str) -> Preset:
    key = name.lower()
    for preset in PRESETS.values():
        if key == preset.name or key in preset.aliases:
            return preset
    raise ExportError(f"no preset {name!r}; presets: {', '.join(PRESETS)} (see --list)")


# ------------------------------------------------------------------------------ tensors


@dataclass(frozen=True)
class Tensor:
    name: str  # llama.cpp's GGUF name
    shape: tuple[int, ...]  # numpy order: (rows, cols), (experts, rows, cols) or (n,)
    layer: int | None  # None: token_embd, output_norm, output

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def cols(self) -> int:
        return self.shape[-1]

    @property
    def matrix(self) -> bool:
        return len(self.shape) >= 2


def tensors(p: Preset) -> list[Tensor]:
    """The model's tensors as llama.cpp writes them into a GGUF (the NextN layers left out),
    named by gguf-py's table (exporter.families.gguf_names)."""
    h = p.hidden
    out = [Tensor(tensor_name("TOKEN_EMBD"), (p.vocab, h), None)]
    for i in range(p.layers):

        def t(kind: str, *shape: int, suffix: str = "weight", layer: int = i) -> Tensor:
            return Tensor(tensor_name(kind, layer, suffix), shape, layer)

        out.append(t("ATTN_NORM", h))
        if p.full_attention(i):
            q = p.heads * p.head_dim
            kv = p.kv_heads * p.head_dim
            rows = 2 * q if p.gated_query else q
            out += [
                t("ATTN_Q", rows, h),
                t("ATTN_K", kv, h),
                t("ATTN_V", kv, h),
                t("ATTN_OUT", h, q),
            ]
            if p.attention_bias:
                out += [
                    t("ATTN_Q", rows, suffix="bias"),
                    t("ATTN_K", kv, suffix="bias"),
                    t("ATTN_V", kv, suffix="bias"),
                ]
            if p.output_bias:
                out.append(t("ATTN_OUT", h, suffix="bias"))
            if p.qk_norm:
                out += [t("ATTN_Q_NORM", p.head_dim), t("ATTN_K_NORM", p.head_dim)]
            if p.sinks:
                out.append(t("ATTN_SINKS", p.heads))
        else:  # Gated DeltaNet (Qwen3.5): llama.cpp's qwen35 names
            values = p.linear_value_heads * p.linear_value_dim
            out += [
                t("ATTN_QKV", p.conv_dim, h),
                t("ATTN_GATE", values, h),
                t("SSM_ALPHA", p.linear_value_heads, h),
                t("SSM_BETA", p.linear_value_heads, h),
                t("SSM_CONV1D", p.conv_dim, p.conv_kernel),
                t("SSM_A", p.linear_value_heads, suffix=""),
                t("SSM_DT", p.linear_value_heads, suffix="bias"),
                t("SSM_NORM", p.linear_value_dim),
                t("SSM_OUT", h, values),
            ]
        out.append(t("ATTN_POST_NORM", h))
        if not p.moe(i):
            m = p.intermediate
            out += [t("FFN_GATE", m, h), t("FFN_UP", m, h), t("FFN_DOWN", h, m)]
            continue
        e, m = p.experts, p.expert_intermediate
        out += [
            t("FFN_GATE_INP", e, h),
            t("FFN_GATE_EXP", e, m, h),
            t("FFN_UP_EXP", e, m, h),
            t("FFN_DOWN_EXP", e, h, m),
        ]
        if p.expert_bias:
            out += [
                t("FFN_GATE_INP", e, suffix="bias"),
                t("FFN_GATE_EXP", e, m, suffix="bias"),
                t("FFN_UP_EXP", e, m, suffix="bias"),
                t("FFN_DOWN_EXP", e, h, suffix="bias"),
            ]
        if p.correction_bias:
            out.append(t("FFN_EXP_PROBS_B", e, suffix="bias"))
        if s := p.shared_expert_intermediate:
            out += [
                t("FFN_GATE_SHEXP", s, h),
                t("FFN_UP_SHEXP", s, h),
                t("FFN_DOWN_SHEXP", h, s),
            ]
            if p.shared_expert_gate:
                out.append(t("FFN_GATE_INP_SHEXP", 1, h))
    out += [
        Tensor(tensor_name("OUTPUT_NORM"), (h,), None),
        Tensor(tensor_name("OUTPUT"), (p.vocab, h), None),
    ]
    return out


def use_more_bits(i: int, n: int) -> bool:
    """llama-quantize's pick of the layers whose attn_v / ffn_down get more bits (Q4_K_M,
    Q5_K_M): the first and last eighth, and every third in between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def gguf_type(quant: str, tensor: Tensor, p: Preset, attn_v_index: int = 0) -> str:
    """The GGML type llama-quantize stores ``tensor`` in for ``quant``.

    Its rules, simplified: 1-D tensors, biases (gpt-oss's experts' are 2-D), routers and conv
    kernels stay F32; output.weight is Q6_K (Q8_0 in Q8_0). attn_v: Q6_K on the
    ``use_more_bits`` layers in Q4_K_M / Q5_K_M (counted over the layers that have one), Q5_K
    on the first two in Q3_K_M (Q4_K after), Q4_K in Q2_K (Q3_K with fewer than 4 query heads
    a KV head). ffn_down (experts and shared expert too): Q6_K on the ``use_more_bits`` layers
    in Q4_K_M / Q5_K_M, Q5_K on the first 16th of the layers in Q3_K_M (Q4_K after), Q3_K in
    Q2_K. attn_qkv one step up in Q3_K_M, Q4_K_M, Q5_K_M; attn_output Q3_K in Q2_K and Q4_K in
    Q3_K_M; everything else the mix's base type. A K-quant tensor whose rows are not a multiple
    of 256 falls back (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K/Q3_K -> IQ4_NL).
    ``MXFP4``: gpt-oss as released, experts MXFP4 and every other matrix Q8_0.
    """
    name = tensor.name
    if not tensor.matrix or name.endswith((*_KEPT_F32, ".bias")):
        return "F32"
    if quant == "MXFP4":
        return "MXFP4" if "_exps." in name else "Q8_0"
    if quant == "Q8_0":
        return "Q8_0"
    if quant not in _BASE:
        raise ExportError(f"unknown quantization {quant!r}; known: {', '.join(QUANTS)}")
    kind = _BASE[quant]
    layer = tensor.layer if tensor.layer is not None else 0
    if name == "output.weight":
        kind = "Q6_K"
    elif ".attn_v." in name:
        full = [i for i in range(p.layers) if p.full_attention(i)]
        if quant == "Q2_K":
            kind = "Q4_K" if p.heads // p.kv_heads >= 4 else "Q3_K"
        elif quant == "Q3_K_M":
            kind = "Q5_K" if attn_v_index < 2 else "Q4_K"
        elif quant in ("Q4_K_M", "Q5_K_M") and use_more_bits(attn_v_index, len(full)):
            kind = "Q6_K"
    elif ".ffn_down" in name:
        if quant == "Q2_K":
            kind = "Q3_K"
        elif quant == "Q3_K_M":
            kind = "Q5_K" if layer < p.layers // 16 else "Q4_K"
        elif quant in ("Q4_K_M", "Q5_K_M") and use_more_bits(layer, p.layers):
            kind = "Q6_K"
    elif ".attn_qkv." in name:
        kind = {"Q3_K_M": "Q4_K", "Q4_K_M": "Q5_K", "Q5_K_M": "Q6_K"}.get(quant, kind)
    elif ".attn_output." in name:
        kind = {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K"}.get(quant, kind)
    if kind in _FALLBACK and tensor.cols % QK_K:
        kind = _FALLBACK[kind]
    return kind


@dataclass(frozen=True)
class Typed:
    tensor: Tensor
    type: str

    @property
    def file_bytes(self) -> float:
        return self.tensor.elements * FILE_BYTES[self.type]

    @property
    def runtime_bytes(self) -> float:
        table = EXPERT_RUNTIME_BYTES if len(self.tensor.shape) == 3 else RUNTIME_BYTES
        if not self.tensor.matrix:  # 1-D: de-quantized to f32
            return self.tensor.elements * 4.0
        return self.tensor.elements * table[self.type]


def typed_tensors(p: Preset, quant: str) -> list[Typed]:
    if quant not in p.quants:
        raise ExportError(f"{p.name} has no {quant} plan; its quantizations: {', '.join(p.quants)}")
    out = []
    attn_v = 0
    for t in tensors(p):
        out.append(Typed(t, gguf_type(quant, t, p, attn_v)))
        attn_v += ".attn_v.weight" in t.name
    return out


# ------------------------------------------------------------------------------ memory


def kv_bytes(p: Preset, layer: int, context: int, sequences: int = 1) -> int:
    """The layer's KV cache for ``sequences`` sequences of ``context`` positions (f16). A
    sliding-window layer's cache is counted whole: the stages keep every position and mask."""
    if not p.full_attention(layer):
        return 0
    return 2 * p.kv_heads * p.head_dim * context * KV_BYTES_PER_VALUE * sequences


def state_slots(sequences: int, window: int = PAGED_STATE_WINDOW) -> int:
    """The state slots a paged stage holds for ``sequences`` sequences at most: ``window`` + 2
    each, and its scratch slot (common.state_pool)."""
    return pool_slots(sequences, window)


def state_sessions(sequences: int) -> int:
    """The sessions a paged stage's state pool is sized for when ``sequences`` are held at
    once: its default (DEFAULT_STATE_SESSIONS), or more with ``--state-sessions``."""
    return max(sequences, DEFAULT_STATE_SESSIONS)


def state_bytes(p: Preset, layer: int, sequences: int = 1) -> int:
    """A linear-attention layer's fixed state per sequence: conv [conv_dim, kernel] and
    recurrent [Hv, head_k_dim, head_v_dim], f32 (one state; a paged stage holds
    ``state_slots`` of them)."""
    if p.full_attention(layer):
        return 0
    conv = p.conv_dim * p.conv_kernel
    recurrent = p.linear_value_heads * p.linear_key_dim * p.linear_value_dim
    return (conv + recurrent) * STATE_BYTES_PER_VALUE * sequences


@dataclass(frozen=True)
class StageCost:
    index: int
    layer_start: int
    layer_end: int
    weight_bytes: int  # at run time
    file_bytes: int  # of those tensors in the GGUF
    kv_bytes: int
    state_bytes: int  # the state slots of a paged stage (state_slots)
    budget: int
    kv_position_bytes: int = 0  # one position's KV in every layer of the stage
    slot_bytes: int = 0  # one state slot: a state of every linear-attention layer

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.state_bytes + RUNTIME_OVERHEAD_BYTES

    @property
    def export_bytes(self) -> int:
        return int(EXPORT_FACTOR * self.weight_bytes + EXPORT_ALLOWANCE)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget


@dataclass(frozen=True)
class PresetPlan:
    preset: Preset
    quant: str
    hosts: str  # as given, e.g. "3x32GB"
    budgets: list[int]
    context: int
    sequences: int
    stages: list[StageCost]
    file_bytes: int  # the whole GGUF (the NextN layers not counted)
    runtime_bytes: int  # every stage's weights at run time
    more_hosts: str | None = None  # what would fit, where this does not
    smaller_quants: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)


@dataclass(frozen=True)
class _Layers:
    """Per layer (and the edges): run-time bytes, file bytes, KV, state."""

    weights: list[float]
    files: list[float]
    kv: list[int]
    state: list[int]
    first: tuple[float, float]  # token_embd: run time, file
    last: tuple[float, float]  # output_norm + output


def _layer_costs(p: Preset, quant: str, context: int, sequences: int) -> _Layers:
    weights = [0.0] * p.layers
    files = [0.0] * p.layers
    first = [0.0, 0.0]
    last = [0.0, 0.0]
    for typed in typed_tensors(p, quant):
        t = typed.tensor
        if t.layer is not None:
            weights[t.layer] += typed.runtime_bytes
            files[t.layer] += typed.file_bytes
        else:
            edge = first if t.name == "token_embd.weight" else last
            edge[0] += typed.runtime_bytes
            edge[1] += typed.file_bytes
    return _Layers(
        weights,
        files,
        [kv_bytes(p, i, context, sequences) for i in range(p.layers)],
        [state_bytes(p, i) * state_slots(state_sessions(sequences)) for i in range(p.layers)],
        (first[0], first[1]),
        (last[0], last[1]),
    )


def _stage(
    p: Preset, costs: _Layers, index: int, start: int, end: int, stages: int, budget: int
) -> StageCost:
    weight = sum(costs.weights[start:end])
    file = sum(costs.files[start:end])
    if index == 0:
        weight += costs.first[0]
        file += costs.first[1]
    if index == stages - 1:
        weight += costs.last[0]
        file += costs.last[1]
    return StageCost(
        index,
        start,
        end,
        round(weight),
        round(file),
        sum(costs.kv[start:end]),
        sum(costs.state[start:end]),
        budget,
        sum(kv_bytes(p, i, 1) for i in range(start, end)),
        sum(state_bytes(p, i) for i in range(start, end)),
    )


def balanced_split(costs: _Layers, budgets: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous layer ranges, one per host in order, that make the fullest host (run-time
    total / its memory) as empty as possible; every host gets a layer."""
    n, hosts = len(costs.weights), len(budgets)
    if hosts > n:
        raise ExportError(f"cannot split {n} layers over {hosts} hosts")
    per_layer = [w + k + s for w, k, s in zip(costs.weights, costs.kv, costs.state, strict=True)]
    prefix = [0.0]
    for value in per_layer:
        prefix.append(prefix[-1] + value)

    def load(k: int, i: int, j: int) -> float:
        total = prefix[j] - prefix[i] + RUNTIME_OVERHEAD_BYTES
        total += costs.first[0] if k == 0 else 0.0
        total += costs.last[0] if k == hosts - 1 else 0.0
        return total / budgets[k]

    inf = float("inf")
    # best[k][j]: the least fullest-host ratio of hosts 0..k holding layers [0, j)
    best = [[inf] * (n + 1) for _ in range(hosts)]
    cut = [[0] * (n + 1) for _ in range(hosts)]
    for j in range(1, n + 1):
        best[0][j] = load(0, 0, j)
    for k in range(1, hosts):
        for j in range(k + 1, n + 1):
            for i in range(k, j):
                ratio = max(best[k - 1][i], load(k, i, j))
                if ratio < best[k][j]:
                    best[k][j], cut[k][j] = ratio, i
    bounds = []
    j = n
    for k in range(hosts - 1, 0, -1):
        i = cut[k][j]
        bounds.append((i, j))
        j = i
    bounds.append((0, j))
    return bounds[::-1]


_HOSTS = re.compile(r"^\s*(\d+)\s*[x*]\s*(.+)$", re.IGNORECASE)


def parse_hosts(text: str) -> list[int]:
    """'3x32GB' -> three budgets of 32e9 bytes; '64GB,32GB' -> one budget each."""
    match = _HOSTS.match(text)
    if match:
        count = int(match.group(1))
        if count < 1:
            raise ExportError(f"--hosts {text}: at least one host")
        budgets = [parse_size(match.group(2))] * count
    else:
        budgets = [parse_size(part) for part in text.split(",")]
    if min(budgets) <= 0:
        raise ExportError(f"--hosts {text}: every host needs some memory")
    return budgets


def plan_preset(
    preset: Preset,
    quant: str,
    hosts: str,
    context: int = 32768,
    sequences: int = 1,
    suggest: bool = True,
) -> PresetPlan:
    """The plan of ``preset`` in ``quant`` over ``hosts`` (e.g. "3x32GB"), at ``context``
    positions for each of ``sequences`` sequences; where it does not fit, what would."""
    if context < 1 or sequences < 1:
        raise ExportError("--context and --sequences must be at least 1")
    budgets = parse_hosts(hosts)
    costs = _layer_costs(preset, quant, context, sequences)
    bounds = balanced_split(costs, budgets)
    stages = [
        _stage(preset, costs, k, start, end, len(bounds), budgets[k])
        for k, (start, end) in enumerate(bounds)
    ]
    file_bytes = round(sum(costs.files) + costs.first[1] + costs.last[1])
    runtime = round(sum(costs.weights) + costs.first[0] + costs.last[0])
    plan = PresetPlan(
        preset, quant, hosts, budgets, context, sequences, stages, file_bytes, runtime
    )
    if plan.fits or not suggest:
        return plan
    largest = max(budgets)
    more = None
    for count in range(len(budgets) + 1, min(preset.layers, 64) + 1):
        bigger = [*budgets, *[largest] * (count - len(budgets))]
        spec = ",".join(_size_text(b) for b in bigger)
        if len(set(bigger)) == 1:
            spec = f"{count}x{_size_text(largest)}"
        if plan_preset(preset, quant, spec, context, sequences, suggest=False).fits:
            more = spec
            break
    smaller = tuple(
        q
        for q in preset.quants
        if q != quant
        and _layer_total(preset, q) < _layer_total(preset, quant)
        and plan_preset(preset, q, hosts, context, sequences, suggest=False).fits
    )
    return PresetPlan(
        preset,
        quant,
        hosts,
        budgets,
        context,
        sequences,
        stages,
        file_bytes,
        runtime,
        more,
        smaller,
    )


def _layer_total(p: Preset, quant: str) -> float:
    return sum(t.runtime_bytes for t in typed_tensors(p, quant))


def _size_text(budget: int) -> str:
    """A budget as parse_size reads it back: 32000000000 -> '32GB', 2**35 -> '32GiB'."""
    units = (("TB", 10**12), ("GB", 10**9), ("GiB", 2**30), ("MB", 10**6), ("MiB", 2**20))
    for unit, scale in units:
        if budget % scale == 0:
            return f"{budget // scale}{unit}"
    return f"{budget}B"


# ------------------------------------------------------------------------------ output


def _gib(count: float) -> str:
    return f"{count / GIB:.1f}"


def format_preset_plan(plan: PresetPlan) -> str:
    """The plan as markdown: a heading with the verdict, the totals, one row per stage (with
    the recurrent state's column for a hybrid), and what would fit where it does not."""
    p = plan.preset
    verdict = "fits" if plan.fits else "does not fit"
    kv_total = sum(s.kv_bytes for s in plan.stages)
    state_total = sum(s.state_bytes for s in plan.stages)
    seqs = f" x {plan.sequences} sequences" if plan.sequences > 1 else ""
    state_head, state_rule = (" state MiB |", " ---: |") if state_total else ("", "")
    sessions = state_sessions(plan.sequences)
    setting = (
        f"--state-sessions {sessions}"
        if sessions > DEFAULT_STATE_SESSIONS
        else f"the default --state-sessions {sessions}"
    )
    one = sum(s.slot_bytes for s in plan.stages)
    lines = [
        f"#### {p.title} {plan.quant} on {plan.hosts}: {verdict}",
        "",
        f"GGUF {plan.file_bytes / 1e9:.1f} GB ({_gib(plan.file_bytes)} GiB); weights at run "
        f"time {_gib(plan.runtime_bytes)} GiB; KV cache at {plan.context} positions{seqs} "
        f"{_gib(kv_total)} GiB"
        + (
            f"; recurrent state {state_total / 2**20:.0f} MiB, as paged stages hold it "
            f"({setting}: {state_slots(sessions)} states a layer, --state-window "
            f"{PAGED_STATE_WINDOW} + 2 a session and a scratch slot; stateful stages hold "
            f"{plan.sequences}: {one * plan.sequences / 2**20:.0f} MiB)"
            if state_total
            else ""
        )
        + "."
        + (
            f" The file's {p.nextn_layers} NextN/MTP layer(s) after the last layer are not "
            "counted (not exported)."
            if p.nextn_layers
            else ""
        ),
        "",
        f"| stage | layers | GGUF GiB | weights GiB | KV GiB |{state_head} total GiB | host GiB "
        "| export GiB |",
        f"| ---: | ---: | ---: | ---: | ---: |{state_rule} ---: | ---: | ---: |",
    ]
    for s in plan.stages:
        mark = "" if s.fits else " (over)"
        state = f" {s.state_bytes / 2**20:.0f} |" if state_total else ""
        lines.append(
            f"| {s.index} | {s.layer_start}-{s.layer_end - 1} | {_gib(s.file_bytes)} | "
            f"{_gib(s.weight_bytes)} | {_gib(s.kv_bytes)} |{state} "
            f"{_gib(s.total_bytes)}{mark} | {_gib(s.budget)} | {_gib(s.export_bytes)}"
            f"{'' if s.export_bytes <= s.budget else ' (over)'} |"
        )
    if not plan.fits:
        would = []
        if plan.more_hosts:
            would.append(f"{plan.more_hosts} ({plan.quant})")
        if plan.smaller_quants:
            would.append(f"{' or '.join(plan.smaller_quants)} on {plan.hosts}")
        lines.append("")
        lines.append(
            "Would fit: " + "; ".join(would) + "."
            if would
            else "Would fit: nothing on more hosts of this size or in a smaller quantization."
        )
    return "\n".join(lines)


def summary_table(plans: Sequence[PresetPlan]) -> str:
    """One row per quantization, one column per host set: fits (the fullest stage's total)
    or what would."""
    hosts = list(dict.fromkeys(p.hosts for p in plans))
    quants = list(dict.fromkeys(p.quant for p in plans))
    by = {(p.quant, p.hosts): p for p in plans}
    lines = [
        "| quant | GGUF GB | weights at run time GiB | " + " | ".join(hosts) + " |",
        "| :--- | ---: | ---: | " + " | ".join(":---" for _ in hosts) + " |",
    ]
    for q in quants:
        first = by[q, hosts[0]]
        cells = []
        for h in hosts:
            plan = by[q, h]
            fullest = max(s.total_bytes for s in plan.stages)
            if plan.fits:
                cells.append(f"fits ({_gib(fullest)} GiB at most)")
            elif plan.more_hosts or plan.smaller_quants:
                options = ([plan.more_hosts] if plan.more_hosts else []) + list(plan.smaller_quants)
                cells.append("no: " + " or ".join(options))
            else:
                cells.append("no")
        lines.append(
            f"| {q} | {first.file_bytes / 1e9:.1f} | {_gib(first.runtime_bytes)} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def describe_preset(p: Preset) -> str:
    active = p.experts_per_token
    kind = f"{p.experts} experts ({active} a token)" if p.experts else "dense"
    if p.full_attention_interval:
        kind += f", linear attention with full attention every {p.full_attention_interval}"
    return f"{p.model_type}, {p.layers} layers, {kind}"
