"""`pipeshard bench profile`: a stage's decode step and prefill chunk by op type.

On a tiny GGUF of Qwen3.6-35B-A3B's layout (Gated DeltaNet and gated full-attention layers,
experts and a gated shared expert, llama.cpp's quantized blocks) exported on 2 stages: every
category the issue names shows up where the model has it, and the categories add up to the
counters' total for every call on both KV backends. No timing is checked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.op_categories import (
    ATTENTION,
    ATTENTION_PROJ,
    CATEGORIES,
    DELTANET,
    DELTANET_PROJ,
    EMBEDDING,
    EXPERTS,
    HEAD,
    MATMULS,
    NORMS,
    OTHER,
    ROUTER,
    SHARED,
    runtime_category,
)


@pytest.fixture(scope="module")
def qwen36_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from benchmarks.gguf_export import main as gguf_export_main
    from exporter.export import ExportOptions, export_model

    folder = tmp_path_factory.mktemp("profile")
    path = folder / "qwen36.gguf"
    tiny = ["--hidden=256", "--heads=4", "--kv-heads=2", "--head-dim=64", "--vocab=512"]
    tiny += ["--experts=4", "--experts-per-token=2", "--expert-intermediate=256"]
    tiny += ["--linear-key-heads=2", "--linear-value-heads=4", "--linear-head-dim=64"]
    gguf_export_main(["write", str(path), "--model", "qwen3.6-35b-a3b", "--layers", "8", *tiny])
    out = folder / "export"
    export_model(ExportOptions(model=str(path), out=out, stages=2, quiet=True))
    return out


@pytest.mark.unit
def test_runtime_ops_take_their_type_then_their_ir_names() -> None:
    """A fused kernel's type decides; a FullyConnected goes by the IR ops it came from, or by
    the MatMul those follow; what nothing places is "other"."""
    own = {
        "lm_head": HEAD,
        "MatMul_7": ROUTER,
        "model.layers.0.linear_attn.in_proj_a": DELTANET_PROJ,
    }
    follows = {"Add_8": DELTANET_PROJ, "ReduceSum_9": ROUTER, "Add_10": ATTENTION_PROJ}
    assert runtime_category("GatherMatmul", ["MatMul_3"], own, follows) == EXPERTS
    assert runtime_category("GatherMatmulCompressed", ["MatMul_3"], own, follows) == EXPERTS
    assert runtime_category("FullyConnectedCompressed", ["MatMul_7"], own, follows) == ROUTER
    assert runtime_category("GatherCompressed", ["Gather_5"], own, follows) == EMBEDDING
    assert runtime_category("PagedGatedDeltaNet", ["Loop_1/x"], own, follows) == DELTANET
    assert runtime_category("GatedDeltaNet", ["Loop_1"], own, follows) == DELTANET
    assert runtime_category("PagedAttentionExtension", ["P_1"], own, follows) == ATTENTION
    assert runtime_category("RMS", ["Multiply_4"], own, follows) == NORMS
    assert runtime_category("FullyConnected", ["lm_head", "Swish_2"], own, follows) == HEAD
    assert runtime_category("FullyConnected", ["MatMul_7"], own, follows) == ROUTER
    # a bias add the MatMul's name went to: the MatMul it follows
    fused = ["Add_8", "SoftPlus_9"]
    assert runtime_category("FullyConnected", fused, own, follows) == DELTANET_PROJ
    # an unnamed op following a router or expert MatMul belongs to it; a residual add does not
    assert runtime_category("ReduceSum", ["ReduceSum_9"], own, follows) == ROUTER
    assert runtime_category("Add", ["Add_10"], own, follows) == OTHER
    assert runtime_category("FullyConnected", ["MatMul_99"], own, follows) == MATMULS
    names = ["model.layers.2.mlp.shared_expert.up_proj"]
    assert runtime_category("FullyConnected", names, {}, {}) == SHARED
    names = ["model.layers.2.linear_attn.conv1d/aten::_convolution/GroupConvolution"]
    assert runtime_category("GroupConvolution", names, {}, {}) == DELTANET
    assert runtime_category("Reshape", ["Reshape_1"], own, follows) == OTHER


@pytest.mark.component
def test_profile_puts_every_op_of_both_backends_in_a_category(
    qwen36_export: Path, tmp_path: Path
) -> None:
    from benchmarks.op_profile import main

    args = ["--export", str(qwen36_export), "--chunk", "8", "--steps", "3", "--top", "5"]
    assert main([*args, "--results", str(tmp_path), "--name", "prof"]) == 0
    data: dict[str, Any] = json.loads(next(tmp_path.glob("prof-*.json")).read_text())
    report = next(tmp_path.glob("prof-*.md")).read_text()

    stages = data["stages"]
    assert [s["stage"] for s in stages] == [0, 1]
    for stage in stages:
        assert set(stage["backends"]) == {"paged", "stateful"}
        calls = {
            f"{backend} {phase}": call
            for backend, run in stage["backends"].items()
            for phase, call in run.items()
        }
        assert set(calls) == {
            "paged prefill", "paged decode", "paged decode_solo",
            "stateful prefill", "stateful decode",
        }  # fmt: skip
        for label, call in calls.items():
            assert set(call["categories"]) == set(CATEGORIES), label
            # the counters' own accounting: every executed op in exactly one category
            assert sum(call["categories"].values()) == pytest.approx(call["counters_ms"])
            assert sum(op["ms"] for op in call["ops"]) == pytest.approx(call["counters_ms"])
            assert call["counters_ms"] > 0 and call["infer_ms"] > 0
            # the ops ran inside the infer() call: their times (each a running mean's growth,
            # in whole microseconds) add up to no more than its wall, within that rounding
            assert call["counters_ms"] < call["infer_ms"] + 1.0, label
            assert call["calls"] == (1 if "prefill" in label else 2), label
            ran = {c for c, ms in call["categories"].items() if ms > 0}
            # each layer: experts, their router, the shared expert, a norm, Gated DeltaNet
            # (both stages hold linear-attention layers) and its projections
            for category in (ROUTER, EXPERTS, SHARED, NORMS, DELTANET, DELTANET_PROJ):
                assert category in ran, (stage["stage"], label, category)
            # layers 3 and 7 are full attention: one on each stage
            assert {ATTENTION, ATTENTION_PROJ} <= ran, (stage["stage"], label)
            assert (EMBEDDING in ran) == (stage["stage"] == 0), label
            assert (HEAD in ran) == (stage["stage"] == 1), label
            kinds = {op["type"] for op in call["ops"]}
            assert "GatherMatmulCompressed" in kinds  # the experts, kept in GGUF blocks
            fused = "PagedGatedDeltaNet" if label.startswith("paged") else "GatedDeltaNet"
            assert fused in kinds, label
    assert stages[0]["layers"] == "0-3 (3 linear, 1 full)"
    for k in (0, 1):
        assert f"## Stage {k}: layers " in report
    assert report.count("Decode step:") == 2 and report.count("Prefill chunk:") == 2
    assert report.count("The pad row costs ") == 2
    assert "| **inference (counters' total)** |" in report
    assert "Top 5 ops, stateful decode step (1 row):" in report


@pytest.mark.integration
def test_profile_ring_counts_the_served_steps_of_each_stage(
    qwen36_export: Path, tmp_path: Path
) -> None:
    """--ring: the stages as processes over gRPC; each stage's metrics count exactly the
    measured decode steps, and the report has the time outside inference."""
    from benchmarks.op_profile import main

    args = ["--export", str(qwen36_export), "--chunk", "8", "--steps", "2"]
    args += ["--backends", "paged", "--ring", "--ring-tokens", "5"]
    assert main([*args, "--results", str(tmp_path), "--name", "ring"]) == 0
    data: dict[str, Any] = json.loads(next(tmp_path.glob("ring-*.json")).read_text())
    [ring] = data["ring"]
    assert ring["backend"] == "paged" and ring["tokens"] == 5
    assert [s["decode_calls"] for s in ring["stages"]] == [5, 5]
    assert all(s["busy_ms"] >= s["forward_ms"] > 0 for s in ring["stages"])
    assert ring["step_ms"] > 0
    report = next(tmp_path.glob("ring-*.md")).read_text()
    assert "## A served step: time outside inference" in report and "| paged | " in report
