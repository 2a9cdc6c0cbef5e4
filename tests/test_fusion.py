"""The beam_idx Gather is what makes the CPU plugin fuse the stateful KV cache into SDPA."""

from __future__ import annotations

from collections import Counter

import openvino as ov
import pytest

from protos.manifest import load_manifest
from tests.conftest import ExportFn

pytestmark = pytest.mark.component


def runtime_layer_types(xml: str) -> Counter[str]:
    compiled = ov.Core().compile_model(xml, "CPU")
    return Counter(
        str(op.get_rt_info()["layerType"].astype(str))
        for op in compiled.get_runtime_model().get_ops()
    )


def ir_has_beam_gather(xml: str) -> bool:
    """In the IR: beam_idx feeds a Gather whose data comes from a ReadValue."""
    model = ov.Core().read_model(xml)
    for op in model.get_ops():
        if op.get_type_name() != "Gather":
            continue
        sources = [value.get_node() for value in op.input_values()]
        if sources[0].get_type_name() == "ReadValue" and any(
            "beam_idx" in node.get_friendly_name() for node in sources[1:]
        ):
            return True
    return False


@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "mistral", "phi3"])
def test_every_stage_fuses_attention_with_beam_idx(tiny_export: ExportFn, arch: str) -> None:
    export_dir = tiny_export(arch, 3)
    manifest = load_manifest(export_dir)
    for stage in manifest.stages:
        xml = str(export_dir / stage.model_xml)
        assert stage.beam_idx and "beam_idx" in stage.inputs
        assert ir_has_beam_gather(xml)
        fused = runtime_layer_types(xml)["ScaledDotProductAttention"]
        assert fused == stage.num_layers, f"stage {stage.index}: {fused} fused SDPA nodes"


def test_no_beam_idx_export_does_not_fuse(tiny_export: ExportFn) -> None:
    export_dir = tiny_export("qwen2", 2, beam_idx=False)
    for stage in load_manifest(export_dir).stages:
        xml = str(export_dir / stage.model_xml)
        assert not stage.beam_idx and "beam_idx" not in stage.inputs
        assert not ir_has_beam_gather(xml)
        types = runtime_layer_types(xml)
        assert types["ScaledDotProductAttention"] == 0
        assert types["Softmax"] == stage.num_layers  # attention left as MatMul/Softmax


@pytest.mark.parametrize(
    ("arch", "weights"),
    [
        ("qwen3_moe", "fp32"),
        ("qwen3_moe", "fp16"),
        ("qwen3_moe", "int4"),
        ("mixtral", "fp32"),
        ("glm4_moe", "fp32"),
        ("glm4_moe", "int4"),
        ("gpt_oss", "fp32"),
        ("gpt_oss", "int4"),
    ],
)
def test_moe_experts_are_computed_sparsely(tiny_export: ExportFn, arch: str, weights: str) -> None:
    """Every expert layer of every stage compiles to 3 GatherMatmul nodes (gate, up, down over
    the chosen experts only; gpt-oss: 2, its gate and up one matmul), not to matmuls over
    every expert; NNCF's int4 experts too."""
    export_dir = tiny_export(arch, 3, weights)
    manifest = load_manifest(export_dir)
    # testing_support.tiny_models: qwen3_moe's layer 2 keeps a dense MLP, glm4_moe's layer 0 (its
    # shared expert is a plain MLP beside the GatherMatmuls); every mixtral layer is experts
    moe_layers = {
        "qwen3_moe": {0, 1, 3, 4, 5},
        "glm4_moe": {1, 2, 3, 4, 5},
        "mixtral": set(range(6)),
        "gpt_oss": set(range(6)),
    }[arch]
    per_layer = 2 if arch == "gpt_oss" else 3
    for stage in manifest.stages:
        types = runtime_layer_types(str(export_dir / stage.model_xml))
        local = moe_layers & set(range(stage.layer_start, stage.layer_end))
        assert types["GatherMatmul"] == per_layer * len(local), f"stage {stage.index}: {types}"
        assert types["ScaledDotProductAttention"] == stage.num_layers
        if weights == "fp32":  # the paged backend's transformation keeps them
            from shard_runtime.paged import PagedRunner
            from shard_runtime.runner import RunnerOptions

            paged = PagedRunner(export_dir, stage.index, RunnerOptions(), kv_cache_bytes=1 << 22)
            ops = paged.compiled.get_runtime_model().get_ops()
            kinds = Counter(str(op.get_rt_info()["layerType"].astype(str)) for op in ops)
            assert kinds["GatherMatmul"] == per_layer * len(local), (
                f"paged stage {stage.index}: {kinds}"
            )
            assert kinds["PagedAttention"] == stage.num_layers


@pytest.mark.parametrize(
    ("arch", "weights"),
    [
        ("qwen3_5", "fp32"),
        ("qwen3_5", "int4"),
        ("qwen3_5_moe", "fp32"),
        ("qwen3_5_moe", "int4"),
        ("qwen3_next", "fp32"),
    ],
)
def test_linear_attention_layers_compile_to_gated_delta_net(
    tiny_export: ExportFn, arch: str, weights: str
) -> None:
    """Every Gated DeltaNet layer of every stage of a hybrid compiles to one fused
    GatedDeltaNet node (no TensorIterator stepping token by token), its states behind the
    beam_idx Gather; every gated full-attention layer to SDPA; every expert layer to 3
    GatherMatmul (the gated shared expert is a plain MLP beside them)."""
    export_dir = tiny_export(arch, 3, weights)
    manifest = load_manifest(export_dir)
    layer_types = manifest.model.layer_types
    # testing_support.tiny_models: qwen3_5_moe's every layer is experts, qwen3_next's but layer 2
    moe_layers = {"qwen3_5": set(), "qwen3_5_moe": set(range(6)), "qwen3_next": {0, 1, 3, 4, 5}}
    for stage in manifest.stages:
        xml = str(export_dir / stage.model_xml)
        assert ir_has_beam_gather(xml)
        kinds = layer_types[stage.layer_start : stage.layer_end]
        types = runtime_layer_types(xml)
        assert types["GatedDeltaNet"] == kinds.count("linear_attention"), f"{stage.index}: {types}"
        assert types["TensorIterator"] == types["Loop"] == 0
        assert types["ScaledDotProductAttention"] == kinds.count("full_attention")
        local = moe_layers[arch] & set(range(stage.layer_start, stage.layer_end))
        assert types["GatherMatmul"] == 3 * len(local), f"stage {stage.index}: {types}"
        if weights == "fp32":  # the paged backend's transformation keeps them
            from shard_runtime.paged import PagedRunner
            from shard_runtime.runner import RunnerOptions

            paged = PagedRunner(export_dir, stage.index, RunnerOptions(), kv_cache_bytes=1 << 22)
            ops = paged.compiled.get_runtime_model().get_ops()
            fused = Counter(str(op.get_rt_info()["layerType"].astype(str)) for op in ops)
            linear = kinds.count("linear_attention")
            assert fused["PagedGatedDeltaNet"] == fused["PagedCausalConv1D"] == linear, fused
            assert fused["GatherMatmul"] == 3 * len(local), f"paged stage {stage.index}: {fused}"
            # a stage without full attention gets the placeholder one (shard_runtime.paged)
            assert fused["PagedAttention"] == max(1, kinds.count("full_attention"))


def test_the_benchmarks_dense_moe_form_computes_every_expert_alike(
    tiny_export: ExportFn, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``pipeshard bench gguf-export dense-moe`` (what the sparse form is timed against): the
    same tokens as the export, with no GatherMatmul left (every expert computed)."""
    from benchmarks.gguf_export import main as gguf_export_main
    from shard_runtime.chain import LocalChain
    from tests.conftest import EXACT

    export_dir = tiny_export("qwen3_moe", 2)
    dense_dir = tmp_path_factory.mktemp("dense-moe") / "export"
    gguf_export_main(["dense-moe", str(export_dir), "--out", str(dense_dir)])
    for stage in load_manifest(dense_dir).stages:
        types = runtime_layer_types(str(dense_dir / stage.model_xml))
        assert types["GatherMatmul"] == 0, f"stage {stage.index}: {types}"
    prompt = [5, 17, 3, 99, 42, 8, 61]
    sparse, sparse_logits = LocalChain(export_dir, EXACT).greedy("s", prompt, 16)
    dense, dense_logits = LocalChain(dense_dir, EXACT).greedy("d", prompt, 16)
    assert dense == sparse
    assert abs(dense_logits - sparse_logits).max() < 1e-4
