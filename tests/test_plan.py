"""Split plans and memory budgets (no model needed)."""

from __future__ import annotations

import pytest

from exporter.architectures import ArchitectureFacts
from exporter.errors import ExportError
from exporter.plan import (
    check_fits,
    check_split,
    decode_balanced_split,
    even_split,
    format_plan,
    layer_params,
    mlp_channel_step,
    mlp_params,
    parse_size,
    plan_stages,
    split_bounds,
    split_for_memory,
)

pytestmark = pytest.mark.unit

# The shape of Qwen2.5-Coder-1.5B.
QWEN15 = ArchitectureFacts(
    model_type="qwen2",
    num_layers=28,
    hidden_size=1536,
    num_heads=12,
    num_kv_heads=2,
    head_dim=128,
    vocab_size=151936,
    max_context=32768,
    layer_types=["full_attention"] * 28,
    sliding_window=None,
    final_logit_softcapping=None,
)
INTERMEDIATE = 8960


def test_default_split_balances_decode_work() -> None:
    # The int8 lm_head on the last stage weighs ~10 int4 layers: it gets fewer layers.
    split = decode_balanced_split(QWEN15, 2, "int4", INTERMEDIATE)
    assert split == [18, 10]
    plans = plan_stages(QWEN15, split, "int4", INTERMEDIATE, 4096)
    head = QWEN15.vocab_size * QWEN15.hidden_size
    work = [plans[0].weight_bytes - head, plans[1].weight_bytes]  # stage 0's embedding is a lookup
    assert max(work) / min(work) < 1.5  # bytes; in decode time (int4 x1.25) within 2%
    assert decode_balanced_split(QWEN15, 1, "int4", INTERMEDIATE) == [28]
    three = decode_balanced_split(QWEN15, 3, "int4", INTERMEDIATE)
    assert sum(three) == 28 and three[-1] < three[0]
    # A head smaller than a layer changes nothing: the split stays even.
    small = ArchitectureFacts(**{**QWEN15.__dict__, "vocab_size": 256})
    assert decode_balanced_split(small, 2, "int4", INTERMEDIATE) == [14, 14]
    assert decode_balanced_split(small, 3, "int4", INTERMEDIATE) == [10, 9, 9]


def test_even_split() -> None:
    assert even_split(28, 2) == [14, 14]
    assert even_split(28, 3) == [10, 9, 9]
    assert even_split(6, 6) == [1] * 6
    with pytest.raises(ExportError, match="cannot split 6 layers into 7 stages"):
        even_split(6, 7)
    with pytest.raises(ExportError):
        even_split(6, 0)


def test_check_split() -> None:
    assert check_split(28, [20, 8]) == [20, 8]
    with pytest.raises(ExportError, match="adds up to 27"):
        check_split(28, [20, 7])
    with pytest.raises(ExportError, match="every stage needs a layer"):
        check_split(28, [28, 0])
    assert check_split(28, [15.7, 12.3]) == [15.7, 12.3]
    with pytest.raises(ExportError, match=r"adds up to 27\.9"):
        check_split(28, [15.7, 12.2])


def test_fractional_split_cuts_inside_an_mlp() -> None:
    # 15.76: layers 0-14, layer 15's attention and its first 0.76 * 8960 channels (rounded to
    # a group of 128: 6784) in stage 0; the other 2176 channels and layers 16-27 in stage 1.
    assert split_bounds(28, [15.76, 12.24], INTERMEDIATE, 128) == [
        (0, 16, None, 6784),
        (16, 28, 6784, None),
    ]
    assert split_bounds(28, [16, 12], INTERMEDIATE, 128) == [
        (0, 16, None, None),
        (16, 28, None, None),
    ]
    # two cuts, one of them inside the first layer
    assert split_bounds(6, [0.5, 4.25, 1.25], 128, 32) == [
        (0, 1, None, 64),
        (1, 5, 64, 96),
        (5, 6, 96, None),
    ]
    with pytest.raises(ExportError, match=r"rounds to a whole layer.*give 16 instead"):
        split_bounds(28, [15.999, 12.001], INTERMEDIATE, 128)
    with pytest.raises(ExportError, match="every stage needs a layer's attention"):
        split_bounds(28, [15.3, 0.4, 12.3], INTERMEDIATE, 1)


def test_fractional_split_needs_summable_mlp_parts() -> None:
    assert mlp_channel_step("qwen2", "int4", 128) == 128
    assert mlp_channel_step("llama", "fp16", None) == 1
    with pytest.raises(ExportError, match="not supported for gemma3_text"):
        mlp_channel_step("gemma3_text", "fp32", None)
    with pytest.raises(ExportError, match="group-wise int4"):
        mlp_channel_step("qwen2", "int8", None)
    with pytest.raises(ExportError, match="group-wise int4"):
        mlp_channel_step("qwen2", "int4", -1)


def test_fractional_plan_moves_mlp_bytes() -> None:
    whole = plan_stages(QWEN15, [16, 12], "int4", INTERMEDIATE, 4096)
    cut = plan_stages(QWEN15, [15.76, 12.24], "int4", INTERMEDIATE, 4096, channel_step=128)
    moved = whole[0].weight_bytes - cut[0].weight_bytes
    assert moved > 0 and cut[1].weight_bytes - whole[1].weight_bytes == pytest.approx(moved, abs=2)
    assert [p.kv_bytes for p in cut] == [p.kv_bytes for p in whole]  # layer 15's KV stays
    table = format_plan(cut, 4096, INTERMEDIATE)
    assert "[0, 15.76)" in table and "[15.76, 28)" in table


def test_parse_size() -> None:
    assert parse_size("16GB") == 16 * 10**9
    assert parse_size("8GiB") == 8 * 2**30
    assert parse_size("512M") == 512 * 10**6
    assert parse_size("1.5 gb") == 1_500_000_000
    with pytest.raises(ExportError):
        parse_size("lots")


def test_plan_bytes_add_up() -> None:
    plans = plan_stages(QWEN15, [14, 14], "int4", INTERMEDIATE, 4096)
    assert [(p.layer_start, p.layer_end) for p in plans] == [(0, 14), (14, 28)]
    assert plans[0].weight_bytes == plans[1].weight_bytes  # embedding vs head: same size
    assert plans[0].kv_bytes == 14 * 2 * 2 * 128 * 4096 * 2
    fp16 = plan_stages(QWEN15, [14, 14], "fp16", INTERMEDIATE, 4096)
    assert fp16[0].weight_bytes > 3 * plans[0].weight_bytes


def test_memory_split_follows_budgets() -> None:
    gib = 2**30
    split = split_for_memory(QWEN15, [3 * gib, 1 * gib + gib // 2], "int4", INTERMEDIATE, 4096)
    assert sum(split) == 28 and split[0] > split[1] >= 1
    plans = plan_stages(QWEN15, split, "int4", INTERMEDIATE, 4096)
    check_fits(plans, [3 * gib, 1 * gib + gib // 2], 4096)


def test_memory_split_refuses_what_cannot_fit() -> None:
    with pytest.raises(ExportError, match="does not fit"):
        split_for_memory(QWEN15, [600 * 2**20, 600 * 2**20], "fp32", INTERMEDIATE, 32768)
    plans = plan_stages(QWEN15, [27, 1], "fp32", INTERMEDIATE, 4096)
    with pytest.raises(ExportError, match="stage 0 needs"):
        check_fits(plans, [2 * 2**30, 8 * 2**30], 4096)


def test_moe_layers_count_every_expert_and_decode_reads_the_active_ones() -> None:
    """Qwen3-30B-A3B's shape: 48 expert layers of 128 experts (768 channels), 8 per token.
    A plan holds every expert (30.5 B parameters in all, as published); a token reads ~3.3 B."""
    a3b = ArchitectureFacts(
        model_type="qwen3_moe",
        num_layers=48,
        hidden_size=2048,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        vocab_size=151936,
        max_context=40960,
        layer_types=["full_attention"] * 48,
        sliding_window=None,
        final_logit_softcapping=None,
        intermediate_size=6144,
        moe_layers=tuple(range(48)),
        num_experts=128,
        experts_per_token=8,
        expert_intermediate_size=768,
        norm_topk_prob=True,
    )
    plans = plan_stages(a3b, [24, 24], "fp16", a3b.intermediate_size, 4096)
    params = sum(p.weight_bytes for p in plans) / 2  # fp16: 2 bytes a parameter
    assert 30.0e9 < params < 31.0e9
    active = (
        sum(layer_params(a3b, a3b.intermediate_size, i, active=True) for i in range(48))
        + 2 * a3b.vocab_size * a3b.hidden_size
    )
    assert 3.0e9 < active < 3.6e9
    # split for memory: even layers (balancing the few experts a token reads would give the
    # head's stage far fewer layers, and the first stage most of the model's memory)
    assert decode_balanced_split(a3b, 2, "fp16", a3b.intermediate_size) == [24, 24]
    assert decode_balanced_split(a3b, 3, "int4", a3b.intermediate_size) == [16, 16, 16]
    # a dense layer among expert layers (mlp_only_layers) is the smaller one
    mixed = ArchitectureFacts(**{**a3b.__dict__, "moe_layers": tuple(range(1, 48))})
    assert layer_params(mixed, 6144, 0) < layer_params(mixed, 6144, 1)


def test_big_model_plans_print_per_stage_memory(capsys: pytest.CaptureFixture[str]) -> None:
    """pipeshard bench gguf-export plan: Qwen3-30B-A3B fits two 16 GB PCs; Qwen3-235B-A22B does
    not fit four 32 GB ones and says so."""
    from benchmarks.gguf_export import main as gguf_export_main

    gguf_export_main(["plan", "--model", "qwen3-30b-a3b", "--node-memory", "16GB,16GB"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 0 ") or line.startswith("| 1 ")]
    assert len(rows) == 2 and "128 experts of 768 channels, 8 a token" in out
    totals = [float(row.split("|")[7]) for row in rows]  # planner's total GiB
    assert all(t < 16e9 / 2**30 for t in totals)
    gguf_export_main(["plan", "--model", "qwen3-235b-a22b", "--node-memory", "32GB,32GB,32GB,32GB"])
    assert "Does not fit: the model does not fit" in capsys.readouterr().out


def test_gpt_oss_gguf_plans_its_mxfp4_experts_at_their_run_time_size() -> None:
    """gpt-oss-120b's shape from its MXFP4 GGUF: every routed expert weight costs what the
    stages hold at run time (i8 codes + an f32 scale per 32, 9.8 bits measured), not the
    generic GGUF allowance; over 3 stages each needs ~45 GiB (fits 64 GB PCs), over 2 each
    more than 64 GB."""
    from transformers import GptOssConfig

    from exporter.architectures import read_architecture
    from exporter.plan import MXFP4_EXPERT_BYTES

    config = GptOssConfig(num_hidden_layers=36, num_local_experts=128, num_experts_per_tok=4)
    facts = read_architecture(config)
    expert_weights = 128 * 3 * 2880 * 2880
    assert facts.num_experts * mlp_params(facts, facts.expert_intermediate_size) == expert_weights
    plans = plan_stages(facts, [12, 12, 12], "gguf", facts.intermediate_size, 32768)
    for plan in plans:
        experts = 12 * expert_weights * MXFP4_EXPERT_BYTES
        assert experts < plan.weight_bytes < experts + 2 * 2**30
        assert 40 * 2**30 < plan.total_bytes < 64e9
    two = plan_stages(facts, [18, 18], "gguf", facts.intermediate_size, 32768)
    assert all(plan.total_bytes > 64e9 for plan in two)
    dense = plan_stages(facts, [12, 12, 12], "int8", facts.intermediate_size, 32768)
    assert dense[1].weight_bytes < plans[1].weight_bytes  # int8 experts: 8 bits + a scale a row


def test_a_hybrids_linear_layers_keep_a_fixed_state_whatever_the_context() -> None:
    """Qwen3.5's shapes (the config's defaults, 8 layers: L L L F L L L F): a Gated DeltaNet
    layer keeps a conv state [C, 4] and a recurrent state [Hv, Dk, Dv] in f32 per sequence,
    at any context; the full-attention layers their KV; its gated q_proj is twice as wide."""
    facts = ArchitectureFacts(
        model_type="qwen3_5_text",
        num_layers=8,
        hidden_size=4096,
        num_heads=16,
        num_kv_heads=4,
        head_dim=256,
        vocab_size=248320,
        max_context=32768,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
        sliding_window=None,
        final_logit_softcapping=None,
        intermediate_size=12288,
        linear_key_heads=16,
        linear_value_heads=32,
        linear_key_dim=128,
        linear_value_dim=128,
        linear_conv_kernel=4,
        attention_output_gate=True,
    )
    state = 4 * (8192 * 4 + 32 * 128 * 128)  # 128 KiB + 2 MiB
    kv = 2 * 4 * 256 * 2  # K and V, 4 heads of 256, f16: bytes per position
    for context in (1024, 32768):
        first, second = plan_stages(facts, [3, 5], "fp16", 12288, context)
        assert first.kv_bytes == 3 * state
        assert second.kv_bytes == 3 * state + 2 * kv * context
    mlp = 3 * 4096 * 12288
    assert layer_params(facts, 12288, 3) == 4096 * (2 * 4096 + 2 * 1024) + 4096 * 4096 + mlp
    linear = 4096 * (8192 + 4096 + 64) + 4096 * 4096
    assert layer_params(facts, 12288, 0) == linear + mlp
