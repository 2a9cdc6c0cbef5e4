"""`pipeshard plan`: plans for real models from their published shapes, no file needed.

The arithmetic is checked against numbers computed by hand from the configs (tensor by
tensor), the byte tables against gguf's block sizes and the exporter's own weight forms, the
split against every alternative, and the command line's output and errors.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from common.state_pool import DEFAULT_STATE_SESSIONS
from exporter.errors import ExportError
from exporter.plan import RUNTIME_OVERHEAD_BYTES
from exporter.plan_sessions import format_sessions, kv_gib_for, stage_sessions, stage_total
from exporter.presets import (
    EXPERT_RUNTIME_BYTES,
    FILE_BYTES,
    PAGED_STATE_WINDOW,
    PRESETS,
    RUNTIME_BYTES,
    Tensor,
    find_preset,
    format_preset_plan,
    gguf_type,
    kv_bytes,
    parse_hosts,
    plan_preset,
    state_bytes,
    state_slots,
    tensors,
)
from pipeshard.cli import main
from stage_node.settings import StageSettings

pytestmark = pytest.mark.unit

GIB = 2**30
MODELS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "models.md"


def test_gpt_oss_20b_mxfp4_bytes_by_hand() -> None:
    """gpt-oss-20b in its MXFP4 file: experts MXFP4 (17 bytes a 32; at run time i8 + an f32
    scale a 32, 9.8 bits measured), other matrices Q8_0 (34 bytes a 32; 1.125 B at run time), the
    router, biases, sinks and norms F32."""
    experts = 3 * 32 * 2880 * 2880  # gate, up, down of 32 experts
    attention = (4096 + 512 + 512 + 4096) * 2880  # q, k, v, o
    router = 32 * 2880
    small = 2880 + 2880 + 4096 + 512 + 512 + 2880 + 64 + 32 + 3 * 32 * 2880  # norms, biases
    edge = 201088 * 2880
    runtime = 24 * (experts * 9.8 / 8 + attention * 1.125 + (router + small) * 4)
    runtime += 2 * edge * 1.125 + 2880 * 4
    file = 24 * (experts * 17 / 32 + attention * 34 / 32 + (router + small) * 4)
    file += 2 * edge * 34 / 32 + 2880 * 4
    plan = plan_preset(PRESETS["gpt-oss-20b"], "MXFP4", "1x1TB")
    assert plan.runtime_bytes == round(runtime) == plan.stages[0].weight_bytes
    assert plan.file_bytes == round(file)
    assert 12.0e9 < plan.file_bytes < 12.2e9  # the released file's size
    # all 24 layers have a KV cache (sliding ones whole): 2 x 8 heads x 64 x 32768 x 2 bytes
    assert plan.stages[0].kv_bytes == 24 * 2 * 8 * 64 * 32768 * 2 == 1.5 * GIB
    assert plan.stages[0].total_bytes == round(runtime) + 1.5 * GIB + RUNTIME_OVERHEAD_BYTES
    assert plan.stages[0].export_bytes == int(1.25 * round(runtime) + 1.5 * GIB)


def test_parameter_counts_are_the_published_totals() -> None:
    totals = {
        "gpt-oss-120b": 116.8e9,
        "gpt-oss-20b": 20.9e9,
        "glm-4.5-air": 106.9e9,  # 106B + the NextN layer (not counted here) = 110B listed
        "glm-4.7": 352.8e9,  # 355B with its NextN layer
        "qwen3.5-27b": 26.9e9,
        "qwen3.6-35b-a3b": 34.7e9,
        "qwen3.5-122b-a10b": 122.1e9,
    }
    for name, total in totals.items():
        count = sum(t.elements for t in tensors(PRESETS[name]))
        assert abs(count - total) < 0.06e9, (name, count)


def test_byte_tables_agree_with_gguf_and_the_exporters_weight_forms() -> None:
    """FILE_BYTES are gguf's block sizes; RUNTIME_BYTES what exporter/gguf_quant.py keeps:
    codes as stored + an f32 scale a group, and for the types with a minimum the split form's
    u8 minimum codes a group + an f32 dmin a 256 (dense) or an f32 zero point (experts)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from exporter.gguf_quant import _AFFINE, _SPECS

    for name, per_weight in FILE_BYTES.items():
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        assert per_weight == size / block, name
    for kind, spec in _SPECS.items():
        if kind.name == "MXFP4":  # counted as measured (below), not as its constants
            continue
        codes = 0.5 if spec.code_type in ("u4", "i4") else 1.0
        plain = codes + 4 / spec.group
        if kind in _AFFINE:
            minimum = 2 / 32 if kind.name in ("Q4_1", "Q5_1") else 1 / spec.group + 4 / 256
            assert RUNTIME_BYTES[kind.name] == plain + minimum, kind.name
            assert EXPERT_RUNTIME_BYTES[kind.name] == plain + 4 / spec.group, kind.name
        else:
            assert RUNTIME_BYTES[kind.name] == EXPERT_RUNTIME_BYTES[kind.name] == plain
    # i8 codes + f32 scale a 32: 9 bits a weight in the constants, 9.8 measured at run time
    assert RUNTIME_BYTES["MXFP4"] == 9.8 / 8


def test_tensor_names_are_llama_cpps_for_each_architecture() -> None:
    """Every tensor a plan counts is one gguf-py lists for the model's GGUF architecture, and
    every one it lists is counted, but the NextN block's, the fused alternatives and the
    q/k norms of a model without them (GLM-4.5-Air)."""
    import re

    from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES

    archs = {
        "gpt_oss": MODEL_ARCH.GPT_OSS,
        "glm4_moe": MODEL_ARCH.GLM4_MOE,
        "qwen3_5": MODEL_ARCH.QWEN35,
        "qwen3_5_moe": MODEL_ARCH.QWEN35MOE,
    }
    for preset in PRESETS.values():
        known = {TENSOR_NAMES[t] for t in MODEL_TENSORS[archs[preset.model_type]]}
        counted = {
            re.sub(r"^blk\.\d+\.", "blk.{bid}.", t.name)
            .removesuffix(".weight")
            .removesuffix(".bias")
            for t in tensors(preset)
        }
        assert counted <= known, (preset.name, counted - known)
        optional = ("nextn.", "gate_up_exps") + (
            () if preset.qk_norm else ("attn_q_norm", "attn_k_norm")
        )
        left = {k for k in known - counted if not any(o in k for o in optional)}
        assert left == set(), (preset.name, left)


def test_q4_k_m_types_follow_llama_quantize() -> None:
    air = PRESETS["glm-4.5-air"]  # 46 layers: use_more_bits picks 0-4, 40-45, 7, 10, ...
    types = {t.name: gguf_type("Q4_K_M", t, air, 0) for t in tensors(air)}
    assert types["token_embd.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    assert types["blk.1.ffn_gate_inp.weight"] == "F32"  # routers stay F32
    assert types["blk.1.exp_probs_b.bias"] == "F32"
    assert types["blk.6.ffn_gate_exps.weight"] == "Q4_K"
    # experts' ffn_down has rows of 1408, not a multiple of 256: Q4_K -> Q5_0, Q6_K -> Q8_0
    assert types["blk.6.ffn_down_exps.weight"] == "Q5_0"
    assert types["blk.7.ffn_down_exps.weight"] == "Q8_0"
    assert types["blk.0.ffn_down.weight"] == "Q8_0"  # the dense layer: 10944 columns
    assert types["blk.6.ffn_down_shexp.weight"] == "Q5_0"
    qwen = PRESETS["qwen3.5-27b"]  # 16 full-attention layers: 3, 7, 11, ...
    attn_v = 0
    picked = {}
    for t in tensors(qwen):
        picked[t.name] = gguf_type("Q4_K_M", t, qwen, attn_v)
        attn_v += t.name.endswith("attn_v.weight")
    # attn_v counted over the layers that have one: index 0 and 1 (of 16) more bits, 2 not
    assert [picked[f"blk.{i}.attn_v.weight"] for i in (3, 7, 11)] == ["Q6_K", "Q6_K", "Q4_K"]
    assert picked["blk.0.attn_qkv.weight"] == "Q5_K"  # one step up in Q4_K_M
    assert picked["blk.0.ssm_conv1d.weight"] == "F32"
    assert picked["blk.0.attn_gate.weight"] == "Q4_K"
    oss = PRESETS["gpt-oss-120b"]
    assert gguf_type("MXFP4", Tensor("blk.0.ffn_up_exps.weight", (128, 2880, 2880), 0), oss) == (
        "MXFP4"
    )
    assert gguf_type("MXFP4", Tensor("blk.0.ffn_up_exps.bias", (128, 2880), 0), oss) == "F32"
    assert gguf_type("MXFP4", Tensor("blk.0.attn_q.weight", (4096, 2880), 0), oss) == "Q8_0"


def test_kv_cache_only_on_full_attention_and_fixed_state_on_linear_attention() -> None:
    """Qwen3.5-35B-A3B: 10 of 40 layers full attention (2 KV heads of 256), 30 Gated
    DeltaNet layers with a conv state [8192, 4] and a recurrent state [32, 128, 128] in f32."""
    p = PRESETS["qwen3.6-35b-a3b"]
    full = [i for i in range(p.layers) if p.full_attention(i)]
    assert full == list(range(3, 40, 4))
    assert kv_bytes(p, 3, 32768) == 2 * 2 * 256 * 32768 * 2 == 64 * 2**20
    assert kv_bytes(p, 0, 32768) == 0
    assert p.conv_dim == 2 * 16 * 128 + 32 * 128 == 8192
    assert state_bytes(p, 0) == (8192 * 4 + 32 * 128 * 128) * 4 == 2_228_224
    assert state_bytes(p, 3) == 0
    plan = plan_preset(p, "Q4_K_M", "2x32GB", context=32768, sequences=2)
    assert sum(s.kv_bytes for s in plan.stages) == 2 * 10 * 64 * 2**20
    # as a paged stage holds them with its defaults: a pool for 8 sessions, 10 states a
    # session (--state-window 8 + 2) and a scratch slot, in every linear-attention layer
    assert sum(s.state_bytes for s in plan.stages) == 30 * (8 * 10 + 1) * 2_228_224
    twice = plan_preset(p, "Q4_K_M", "2x32GB", context=65536)
    assert sum(s.state_bytes for s in twice.stages) == 30 * 81 * 2_228_224  # whatever the context
    more = plan_preset(p, "Q4_K_M", "2x32GB", sequences=12)  # --state-sessions 12
    assert sum(s.state_bytes for s in more.stages) == 30 * (12 * 10 + 1) * 2_228_224


def test_the_state_column_is_what_a_paged_stage_holds() -> None:
    """The plan counts a hybrid's state as the paged backend keeps it with its defaults:
    the window and the pool's sessions it assumes are the stage's defaults (state_sessions
    unset: max_sessions, at most 8), and the slots are those the stage's pool needs for them
    (common.state_pool: sessions x (window + 2) + 1, the prefix states aside, which are
    evicted when sessions need the room)."""
    fields = StageSettings.model_fields
    assert fields["state_window"].default == PAGED_STATE_WINDOW
    assert fields["state_sessions"].default is None
    assert min(fields["max_sessions"].default, DEFAULT_STATE_SESSIONS) == 8
    assert state_slots(1) == 11 and state_slots(8) == 81 and state_slots(8, window=0) == 25
    p = PRESETS["qwen3.6-35b-a3b"]
    plan = plan_preset(p, "Q4_K_M", "2x32GB", sequences=2)
    first = plan.stages[0]
    linear = [i for i in range(first.layer_start, first.layer_end) if not p.full_attention(i)]
    assert first.state_bytes == len(linear) * 81 * 2_228_224
    assert first.slot_bytes == len(linear) * 2_228_224
    text = format_preset_plan(plan)
    total = sum(s.state_bytes for s in plan.stages)
    assert f"recurrent state {total / 2**20:.0f} MiB, as paged stages hold it" in text
    assert "(the default --state-sessions 8: 81 states a layer" in text
    assert f"stateful stages hold 2: {2 * 30 * 2_228_224 / 2**20:.0f} MiB)" in text


def test_the_sessions_a_stage_holds_with_the_defaults() -> None:
    """The whole Qwen3.6-35B-A3B in Q4_K_M on 2 x 32 GB: each stage of 20 layers (15 Gated
    DeltaNet, 5 full attention) holds 8 sessions in its default state pool (31.9 MiB a slot,
    81 slots: 2.5 GiB); its default KV pool of 1 GiB, in blocks of 32 positions of 5 layers x
    2 KV heads x 256 x 2 (K and V) x 2 bytes, holds 104,832 positions: 3 sessions of 32768.
    8 sessions of 32768 need --kv-cache-size 2.5, and then each stage holds 19.2 GiB at most:
    they fit."""
    p = PRESETS["qwen3.6-35b-a3b"]
    plan = plan_preset(p, "Q4_K_M", "2x32GB")
    assert [(s.layer_start, s.layer_end) for s in plan.stages] == [(0, 20), (20, 40)]
    slot = 15 * 2_228_224
    assert f"{slot / 2**20:.1f}" == "31.9"
    position = 5 * 2 * 256 * 2 * 2
    for stage in plan.stages:
        assert stage.slot_bytes == slot and stage.kv_position_bytes == position
        assert stage.state_bytes == 81 * slot
    positions = GIB // (32 * position) * 32
    assert positions == 104_832
    rows = stage_sessions(plan)
    assert [(r.state_sessions, r.kv_positions, r.at(32768)) for r in rows] == [
        (8, positions, 3),
        (8, positions, 3),
    ]
    assert kv_gib_for(plan, 8) == 2.5  # 8 x 32768 x 10240 bytes = 2.5 GiB
    fullest = max(stage_total(s, 2.5) for s in plan.stages)
    last = plan.stages[1]
    assert fullest == last.weight_bytes + int(2.5 * GIB) + 81 * slot + RUNTIME_OVERHEAD_BYTES
    assert fullest <= last.budget
    text = format_sessions(plan)
    assert "| 0 | 8 | 104,832 | 3 |" in text and "| 1 | 8 | 104,832 | 3 |" in text
    assert f"--kv-cache-size 2.5 on every stage (then at most {fullest / GIB:.1f} GiB" in text
    assert "a stage: fits its host); the default KV pool holds 8 sessions of up to 13,088" in text
    assert 104_832 // 32 // 8 * 32 == 13_088
    # a stage of linear-attention layers only (its placeholder attention costs nothing) and
    # a dense model's stage (no state pool)
    three = plan_preset(PRESETS["qwen3.5-27b"], "Q4_K_M", "64GB,64GB,64GB", sequences=16)
    assert {r.state_sessions for r in stage_sessions(three)} == {16}
    assert "--state-sessions 16: 161 states a layer" in format_preset_plan(three)
    dense = plan_preset(PRESETS["gpt-oss-20b"], "MXFP4", "2x16GB")
    assert all(r.state_sessions is None for r in stage_sessions(dense))
    assert "state pool" not in format_sessions(dense)


def test_the_split_is_the_best_over_every_alternative() -> None:
    """Over hosts of different sizes the fullest host (total / its memory) is as empty as any
    contiguous split makes it; the stages cover every layer once, in order, and each stage's
    total is its tensors' bytes counted one by one."""
    p = PRESETS["gpt-oss-20b"]
    hosts = "16GB,8GB,4GB"
    plan = plan_preset(p, "MXFP4", hosts)
    bounds = [(s.layer_start, s.layer_end) for s in plan.stages]
    assert bounds[0][0] == 0 and bounds[-1][1] == p.layers
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    budgets = parse_hosts(hosts)
    for k, (a, b) in enumerate(bounds):
        assert abs(plan.stages[k].total_bytes - _stage_total(p, a, b, k, 3)) <= 1
    worst = max(s.total_bytes / s.budget for s in plan.stages)
    every = [
        max(_stage_total(p, a, b, k, 3) / budgets[k] for k, (a, b) in enumerate(cuts))
        for i, j in itertools.combinations(range(1, p.layers), 2)
        for cuts in [[(0, i), (i, j), (j, p.layers)]]
    ]
    assert worst <= min(every) + 1e-6
    sizes = [b - a for a, b in bounds]
    assert sizes[0] > sizes[1] > sizes[2]  # more layers where there is more memory


def _stage_total(p: object, start: int, end: int, index: int, stages: int) -> float:
    """A stage's run-time total from the tensors, independently of the planner's sums."""
    from exporter.presets import Preset, typed_tensors

    assert isinstance(p, Preset)
    total = float(RUNTIME_OVERHEAD_BYTES)
    for typed in typed_tensors(p, "MXFP4"):
        layer, name = typed.tensor.layer, typed.tensor.name
        if layer is not None:
            mine = start <= layer < end
        else:  # the embedding on the first stage, the final norm and head on the last
            mine = index == 0 if name == "token_embd.weight" else index == stages - 1
        total += typed.runtime_bytes if mine else 0.0
    return total + sum(kv_bytes(p, i, 32768) for i in range(start, end))


def test_what_does_not_fit_says_what_would() -> None:
    oss = PRESETS["gpt-oss-120b"]
    three = plan_preset(oss, "MXFP4", "3x32GB")
    assert not three.fits and three.more_hosts == "6x32GB" and three.smaller_quants == ()
    assert plan_preset(oss, "MXFP4", "3x64GB").fits  # 9.8 bits measured: 3 x 64 GB
    assert plan_preset(oss, "MXFP4", "2x64GB").more_hosts == "3x64GB"
    air = PRESETS["glm-4.5-air"]
    q8 = plan_preset(air, "Q8_0", "4x32GB")
    assert not q8.fits and "Q4_K_M" in q8.smaller_quants and q8.more_hosts == "5x32GB"
    assert plan_preset(air, "Q4_K_M", "4x32GB").fits
    mixed = plan_preset(air, "Q8_0", "64GB,32GB")
    assert not mixed.fits and mixed.more_hosts == "64GB,32GB,64GB"
    assert plan_preset(air, "Q8_0", "2x48GiB").more_hosts == "3x48GiB"


def test_bad_input_names_the_problem() -> None:
    with pytest.raises(ExportError, match="no preset 'llama-9000'"):
        find_preset("llama-9000")
    assert find_preset("GLM-4.5") is PRESETS["glm-4.7"]  # same shape
    with pytest.raises(ExportError, match="gpt-oss-20b has no Q4_K_M plan; its quantizations"):
        plan_preset(PRESETS["gpt-oss-20b"], "Q4_K_M", "2x32GB")
    with pytest.raises(ExportError, match="cannot read memory size"):
        plan_preset(PRESETS["gpt-oss-20b"], "MXFP4", "2xlots")
    with pytest.raises(ExportError, match="cannot split 24 layers over 25 hosts"):
        plan_preset(PRESETS["gpt-oss-20b"], "MXFP4", "25x32GB")
    with pytest.raises(ExportError, match="every host needs some memory"):
        parse_hosts("32GB,0GB")
    assert parse_hosts("3x32GB") == [32_000_000_000] * 3
    assert parse_hosts("64GB,32GiB") == [64_000_000_000, 32 * GIB]


def test_the_command_prints_every_stage_and_the_verdict(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", "gpt-oss-120b", "--hosts", "3x32GB", "--hosts", "3x64GB"]) == 0
    out = capsys.readouterr().out
    assert "| MXFP4 | 63.4 | 133.2 | no: 6x32GB | fits (45.9 GiB at most) |" in out
    assert "#### gpt-oss-120b MXFP4 on 3x32GB: does not fit" in out
    assert "Would fit: 6x32GB (MXFP4)." in out
    assert "#### gpt-oss-120b MXFP4 on 3x64GB: fits" in out
    rows = [line for line in out.splitlines() if line.startswith("| 2 | 24-35 |")]
    assert len(rows) == 2  # the third stage of each plan
    assert main(["plan", "qwen3.6-35b-a3b", "--quant", "q4_k_m,Q8_0", "--hosts", "2x32GB"]) == 0
    out = capsys.readouterr().out
    assert "| stage | layers | GGUF GiB | weights GiB | KV GiB | state MiB |" in out
    assert "Q4_K_M on 2x32GB: fits" in out and "Q8_0 on 2x32GB: fits" in out
    assert "| stage | state pool: sessions | KV pool: positions | sessions at 32768" in out
    assert main(["plan", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(f"  source: {p.source}" in listed for p in PRESETS.values())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan"], "name a model"),
        (["plan", "gpt-5"], "no preset 'gpt-5'"),
        (["plan", "gpt-oss-20b", "--quant", "Q4_K_M"], "gpt-oss-20b has no Q4_K_M plan"),
        (["plan", "glm-4.7", "--hosts", "0x32GB"], "at least one host"),
        (["plan", "glm-4.7", "--context", "0"], "--context and --sequences must be at least 1"),
    ],
)
def test_the_command_refuses_bad_input_in_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_the_models_page_holds_the_commands_output() -> None:
    """docs/models.md's plans are what `pipeshard plan` prints for the commands shown, as
    docs/generate_models.py writes them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "generate_models", MODELS_PAGE.parent / "generate_models.py"
    )
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    page = MODELS_PAGE.read_text()
    assert generator.render(page) == page, (
        "docs/models.md is out of date: run .venv/bin/python docs/generate_models.py"
    )
