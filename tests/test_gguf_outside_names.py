"""GGUF files whose tensor names come from outside the exporter: gguf-py's own tables.

The families that only llama.cpp reads as GGUF (glm4moe, gpt-oss, qwen35, qwen35moe, qwen3next:
transformers' GGUF loader knows none of them) are tested elsewhere with files our tiny writer
names through exporter.families.gguf_names, the reader's own names: a naming mistake shared by
both would pass there. Here the writer names every tensor as llama.cpp's converter does,
written out below from its source (a few renames, then gguf-py's ``TensorNameMap`` of the
architecture), without the exporter's table; the file (F32, so it holds the folder's values)
exports at 2 stages to the Hugging Face folder's greedy tokens in transformers.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gguf
import pytest

from exporter.export import ExportOptions, export_model
from protos.manifest import load_manifest
from shard_runtime.chain import LocalChain
from shard_runtime.runner import RunnerOptions

pytestmark = pytest.mark.component

# f32 compute, f32 KV cache, no dynamic int8 activations: what transformers computes
EXACT = RunnerOptions(
    kv_cache_precision="f32",
    inference_precision="f32",
    properties={"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"},
)
PROMPTS = [[1, 17, 42, 99, 7, 130, 64, 5, 200], [1, 3, 250, 11, 11, 90, 31, 140]]


@functools.cache
def _gguf_py_map(arch: str, blocks: int) -> Any:
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    return gguf.get_tensor_name_map(arch_id, blocks)


def converter_name(hf_name: str, arch: str, blocks: int) -> str:
    """llama.cpp's convert_hf_to_gguf.py naming a Hugging Face tensor: its modify_tensors
    renames (conversion/gpt_oss.py: ``if "sinks" in name: name += ".weight"``;
    conversion/base.py: ``e_score_correction_bias`` -> ``e_score_correction.bias``;
    conversion/qwen.py: ``.dt_bias`` -> ``.dt_proj.bias``), then gguf-py's map of the
    architecture, keeping the suffix."""
    name = hf_name
    if arch == "gpt-oss" and "sinks" in name:
        name += ".weight"
    if name.endswith("e_score_correction_bias"):
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
    if name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    found = _gguf_py_map(arch, blocks).get_name(name, try_suffixes=(".weight", ".bias"))
    if found is None:
        raise KeyError(hf_name)
    return str(found)


@pytest.mark.parametrize(
    ("arch", "gguf_arch"),
    [
        ("glm4_moe", "glm4moe"),
        ("gpt_oss", "gpt-oss"),
        ("qwen3_5", "qwen35"),
        ("qwen3_5_moe", "qwen35moe"),
        ("qwen3_next", "qwen3next"),
    ],
)
def test_a_gguf_named_by_gguf_py_alone_exports_to_the_folder_s_greedy_tokens(
    tmp_path: Path, arch: str, gguf_arch: str
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from exporter.verify import reference_greedy
    from testing_support.tiny_gguf import make_hf_model, write_gguf

    hf = make_hf_model(arch, tmp_path / "hf", layers=4)
    outside = write_gguf(hf, tmp_path / "outside.gguf", "F32", names=converter_name)
    reader = gguf.GGUFReader(outside)
    assert reader.fields["general.architecture"].contents() == gguf_arch
    named = {t.name for t in reader.tensors}
    # the exporter's own writer names the same tensors the same way
    ours = write_gguf(hf, tmp_path / "ours.gguf", "F32")
    assert {t.name for t in gguf.GGUFReader(ours).tensors} == named

    out = tmp_path / "out"
    export_model(ExportOptions(model=str(outside), out=out, stages=2, quiet=True))
    manifest = load_manifest(out)
    assert manifest.num_stages == 2 and manifest.model.num_layers == 4
    reference = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    chain = LocalChain(out, EXACT)
    for i, prompt in enumerate(PROMPTS):
        tokens, _ = chain.greedy(f"p{i}", prompt, 12)
        expected, _ = reference_greedy(reference, prompt, 12)
        assert tokens == expected, f"{arch}: {tokens} != {expected}"
