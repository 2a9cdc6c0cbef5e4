"""The family registry (exporter/families/): one module per family, found by model_type, and
llama.cpp's tensor names from the ``gguf`` package's own tables."""

from __future__ import annotations

import importlib
from pathlib import Path

import gguf
import pytest

from exporter.architectures import SUPPORTED_ARCHITECTURES
from exporter.errors import ExportError
from exporter.families import FAMILIES, GGUF_MODEL_TYPES, WRAPPERS, family, gguf_family
from exporter.families.gguf_names import gguf_name, tensor_name

pytestmark = pytest.mark.unit

FAMILY_DIR = Path(__file__).resolve().parents[1] / "exporter" / "families"
SHARED = {"__init__", "base", "gguf_names"}


def test_every_family_module_is_registered_under_its_model_type() -> None:
    modules = sorted(p.stem for p in FAMILY_DIR.glob("*.py") if p.stem not in SHARED)
    assert len(modules) >= 13
    registered = []
    for name in modules:
        module = importlib.import_module(f"exporter.families.{name}")
        fam = module.FAMILY
        assert FAMILIES[fam.model_type] is fam
        registered.append(fam.model_type)
    assert sorted(registered) == sorted(FAMILIES)
    assert {name: f.title for name, f in FAMILIES.items()} == SUPPORTED_ARCHITECTURES


def test_an_unknown_family_is_refused_with_the_list_and_a_known_gap_with_its_reason() -> None:
    with pytest.raises(ExportError, match="'falcon' is not supported; supported: gemma3_text"):
        family("falcon")
    with pytest.raises(ExportError, match="multi-head latent attention"):
        family("deepseek_v3")


def test_gguf_architectures_read_back_as_their_family() -> None:
    # llama files are written for Llama, Mistral and Mixtral: they read back as Llama
    assert GGUF_MODEL_TYPES["llama"] == "llama"
    assert GGUF_MODEL_TYPES["qwen35moe"] == "qwen3_5_moe_text"
    assert gguf_family("gpt-oss") is FAMILIES["gpt_oss"]
    assert gguf_family("falcon") is None
    assert WRAPPERS == {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
    known = set(gguf.MODEL_ARCH_NAMES.values())
    for fam in FAMILIES.values():
        assert fam.gguf_arch is None or fam.gguf_arch in known, fam.model_type


@pytest.mark.parametrize(
    ("model_type", "hf_name", "expected"),
    [
        ("llama", "model.layers.12.post_attention_layernorm.weight", "blk.12.ffn_norm.weight"),
        ("gemma3_text", "model.layers.3.post_attention_layernorm.weight",
         "blk.3.post_attention_norm.weight"),
        ("gemma3_text", "model.layers.3.pre_feedforward_layernorm.weight",
         "blk.3.ffn_norm.weight"),
        ("glm4_moe", "model.layers.3.post_attention_layernorm.weight",
         "blk.3.post_attention_norm.weight"),
        ("glm4_moe", "model.layers.7.mlp.gate.e_score_correction_bias", "blk.7.exp_probs_b.bias"),
        ("glm4_moe", "model.layers.2.mlp.shared_experts.down_proj.weight",
         "blk.2.ffn_down_shexp.weight"),
        ("gpt_oss", "model.layers.5.self_attn.sinks", "blk.5.attn_sinks.weight"),
        ("gpt_oss", "model.layers.5.mlp.router.bias", "blk.5.ffn_gate_inp.bias"),
        ("gpt_oss", "model.layers.5.mlp.experts.gate_up_proj.weight",
         "blk.5.ffn_gate_up_exps.weight"),
        ("qwen3_5_text", "model.layers.0.linear_attn.dt_bias", "blk.0.ssm_dt.bias"),
        ("qwen3_5_text", "model.layers.0.linear_attn.A_log", "blk.0.ssm_a"),
        ("qwen3_5_moe_text", "model.layers.1.mlp.shared_expert_gate.weight",
         "blk.1.ffn_gate_inp_shexp.weight"),
        ("qwen3_next", "model.layers.1.linear_attn.in_proj_ba.weight", "blk.1.ssm_ba.weight"),
        ("phi3", "model.layers.1.mlp.gate_up_proj.weight", "blk.1.ffn_up.weight"),
        ("mixtral", "model.layers.1.mlp.experts.down_proj.weight", "blk.1.ffn_down_exps.weight"),
        ("qwen2", "lm_head.weight", "output.weight"),
    ],
)  # fmt: skip
def test_gguf_names_come_from_gguf_py_and_the_family_renames(
    model_type: str, hf_name: str, expected: str
) -> None:
    assert gguf_name(hf_name, model_type) == expected


def test_a_tensor_a_family_s_gguf_does_not_have_has_no_name() -> None:
    with pytest.raises(KeyError):
        gguf_name("model.layers.0.self_attn.sinks", "llama")  # gpt-oss's only
    with pytest.raises(KeyError):
        gguf_name("model.layers.0.linear_attn.in_proj_b.weight", "qwen3_next")  # fused there
    assert tensor_name("SSM_A", 4, "") == "blk.4.ssm_a"
    assert tensor_name("OUTPUT_NORM") == "output_norm.weight"


def test_every_family_has_a_row_in_the_export_docs() -> None:
    docs = (FAMILY_DIR.parents[1] / "docs" / "export.md").read_text()
    assert [name for name in FAMILIES if f"| `{name}` |" not in docs] == []


def test_the_gateway_s_reasoning_defaults_are_the_families() -> None:
    """The runtime does not import the exporter: server/api/reasoning.py keeps its own copy of
    the families' reasoning defaults, which must say the same."""
    from server.api.reasoning import choose_reasoning

    for name, fam in FAMILIES.items():
        assert choose_reasoning("auto", "", name) == (fam.reasoning or "none"), name
