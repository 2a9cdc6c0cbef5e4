"""Split == unsplit: chained stages against transformers, token for token, for each architecture."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from exporter.verify import verify_export
from shard_runtime.runner import RunnerOptions
from tests.conftest import EXACT, ExportFn
from tests.fleets import EIGHT_PROMPTS

pytestmark = pytest.mark.component

# (architecture, stages, weight format): every architecture at 1, 2 and 3 stages, both float
# formats represented. Gemma 3's and Mistral's sliding windows (5) are shorter than every test
# sequence (Mistral's covers every layer).
CASES = [
    ("llama", 1, "fp32"),
    ("llama", 2, "fp16"),
    ("llama", 3, "fp32"),
    ("qwen2", 1, "fp16"),
    ("qwen2", 2, "fp32"),
    ("qwen2", 3, "fp16"),
    ("gemma3", 1, "fp32"),
    ("gemma3", 2, "fp32"),
    ("gemma3", 3, "fp16"),
    ("mistral", 1, "fp32"),
    ("mistral", 2, "fp16"),
    ("mistral", 3, "fp32"),
    # sliding (window 5) and full layers as layer_types lists them, cut at 2 stages
    ("ministral", 2, "fp32"),
    ("phi3", 1, "fp32"),
    ("phi3", 2, "fp16"),
    ("phi3", 3, "fp32"),
    ("phi3-longrope", 2, "fp32"),
    ("qwen3_moe", 1, "fp32"),
    ("qwen3_moe", 2, "fp16"),
    ("qwen3_moe", 3, "fp32"),
    ("mixtral", 1, "fp32"),
    ("mixtral", 2, "fp16"),
    ("mixtral", 3, "fp32"),
    # a dense first layer, then sigmoid grouped routing with a correction bias and a shared
    # expert; partial rotary, q/k norms, attention biases
    ("glm4_moe", 1, "fp32"),
    ("glm4_moe", 2, "fp16"),
    ("glm4_moe", 3, "fp32"),
    # attention sinks, sliding and full layers alternating, YaRN, q/k/v/o biases, the biased
    # router's softmax over the top-k, biased experts with the clamped SwiGLU
    ("gpt_oss", 1, "fp32"),
    ("gpt_oss", 2, "fp16"),
    ("gpt_oss", 3, "fp32"),
    # hybrid: Gated DeltaNet layers (L L L F L L) with gated full attention; 2 and 3 stages cut
    # inside the pattern (L L L | F L L and L L | L F | L L)
    ("qwen3_5", 1, "fp32"),
    ("qwen3_5", 2, "fp16"),
    ("qwen3_5", 3, "fp32"),
    # the same hybrid with experts on every layer (stacked 3-D in the checkpoint) and a gated
    # shared expert; Qwen3-Next's with fused in_proj_qkvz/ba and a dense layer 2
    ("qwen3_5_moe", 1, "fp32"),
    ("qwen3_5_moe", 2, "fp16"),
    ("qwen3_5_moe", 3, "fp32"),
    ("qwen3_next", 1, "fp16"),
    ("qwen3_next", 2, "fp32"),
    ("qwen3_next", 3, "fp32"),
]
# fp32: only the runtime differs from torch. fp16: the reference weights are rounded to fp16 too,
# so the remaining difference is fp16 storage of small constants (norm weights, embedding scale).
TOLERANCE = {"fp32": 1e-4, "fp16": 1e-3}


@pytest.mark.parametrize(("arch", "stages", "weights"), CASES)
def test_chain_matches_transformers(
    tiny_export: ExportFn, arch: str, stages: int, weights: str
) -> None:
    export_dir = tiny_export(arch, stages, weights)
    report = verify_export(export_dir, steps=32, options=EXACT, atol=TOLERANCE[weights])
    assert report.manifest.num_stages == stages
    for result in report.results:
        assert result.prompt_tokens > 5  # longer than the sliding window
        comparison = result.reference
        assert comparison is not None and comparison.strict
        assert comparison.matched == 32, f"{result.prompt!r}: tokens differ at {comparison.matched}"
        assert comparison.max_abs_diff < TOLERANCE[weights]
    assert report.failures() == []


@pytest.mark.parametrize("runtime", ["exact", "default"])
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_split_quantized_equals_unsplit_quantized(
    tiny_export: ExportFn, weights: str, runtime: str
) -> None:
    """Compression is applied per layer the same way whatever the split: 3 stages == 1 stage.

    Also under the default runtime (u8 KV cache, dynamic int8 activations, f32 compute).
    """
    report = verify_export(
        tiny_export("qwen2", 3, weights),
        steps=32,
        against=tiny_export("qwen2", 1, weights),
        reference=False,
        options=EXACT if runtime == "exact" else RunnerOptions(),
    )
    for result in report.results:
        assert result.against is not None
        assert result.against.identical
        assert result.against.max_abs_diff == 0.0


# Fractional splits: a boundary inside a layer's MLP (the stage before computes its first
# channels, the stage after the rest). Against transformers for float weights; int4 against the
# 1-stage int4 export (the parts of a group-wise int4 MLP are the unsplit MLP's groups).
CUT_CASES = [
    ("qwen2", (2.5, 3.5), "fp32"),
    ("llama", (0.25, 4.5, 1.25), "fp16"),
    ("qwen2", (1.75, 4.25), "int4"),
    ("phi3", (3.5, 2.5), "fp32"),  # parts of the fused gate_up's gate and up rows
]


@pytest.mark.parametrize(("arch", "split", "weights"), CUT_CASES)
def test_split_inside_an_mlp_equals_unsplit(
    tiny_export: ExportFn, arch: str, split: tuple[float, ...], weights: str
) -> None:
    export_dir = tiny_export(arch, len(split), weights, split=split)
    quantized = weights == "int4"
    report = verify_export(
        export_dir,
        steps=32,
        options=EXACT,
        reference=not quantized,
        against=tiny_export(arch, 1, weights) if quantized else None,
        atol=TOLERANCE.get(weights, 1e-5),
    )
    stages = report.manifest.stages
    assert [s.mlp_out is not None for s in stages[:-1]] == [True] * (len(split) - 1)
    assert [s.mlp_in for s in stages[1:]] == [s.mlp_out for s in stages[:-1]]
    for result in report.results:
        comparison = result.against if quantized else result.reference
        assert comparison is not None and comparison.strict
        assert comparison.matched == 32, f"{result.prompt!r}: tokens differ at {comparison.matched}"
        # not 0: the MLP's two parts are summed in another order than the whole
        assert comparison.max_abs_diff < TOLERANCE.get(weights, 1e-5)
    assert report.failures() == []


@pytest.mark.parametrize(
    ("arch", "stages"),
    [
        ("glm4_moe", 1),
        ("glm4_moe", 2),
        ("glm4_moe", 3),
        ("gpt_oss", 1),
        ("gpt_oss", 2),
        ("gpt_oss", 3),
    ],
)
def test_moe_families_on_the_paged_backend_equal_transformers(
    tiny_export: ExportFn, tiny_model: Callable[..., Path], arch: str, stages: int
) -> None:
    """GLM-4.5's routing (sigmoid, correction bias, groups, shared expert) and gpt-oss's
    (attention sinks, which the paged attention takes as an input of its own; sliding and full
    layers; biased experts) on 1, 2 and 3 stages of the paged backend (block tables, the paged
    attention transformation): transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    from exporter.verify import reference_greedy
    from protos.manifest import load_manifest
    from shard_runtime.chain import LocalChain

    export = tiny_export(arch, stages)
    assert load_manifest(export).model.num_layers == 6
    eager = {"attn_implementation": "eager"} if arch == "gpt_oss" else {}
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_model(arch)), **eager).eval()
    prompts = [[5, 17, 33, 99, 100, 7, 42, 8], [200, 150, 100, 50], [9, 9, 9, 9, 9, 9]]
    chain = LocalChain(export, EXACT, kv_backend="paged")
    for i, prompt in enumerate(prompts):
        tokens, _ = chain.greedy(f"p{i}", prompt, 24)
        assert tokens == reference_greedy(reference, prompt, 24)[0]


def test_glm4_moe_sessions_interleaved_on_the_stateful_backend_equal_each_alone(
    tiny_export: ExportFn, tiny_model: Callable[..., Path]
) -> None:
    """Eight GLM sessions on 3 stateful stages, decoded in turn (a step of each before the
    next step of any, so that every stage switches its KV state between sessions at every
    call): each one's tokens are transformers' greedy tokens for its prompt alone."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from exporter.verify import reference_greedy
    from shard_runtime.chain import LocalChain

    prompts = EIGHT_PROMPTS
    steps = 12
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_model("glm4_moe"))).eval()
    expected = [reference_greedy(reference, p, steps)[0] for p in prompts]
    assert len({tuple(t) for t in expected}) > 1  # the prompts lead to different outputs
    chain = LocalChain(tiny_export("glm4_moe", 3), EXACT)
    logits = [chain.forward(f"s{i}", np.asarray(p))[-1] for i, p in enumerate(prompts)]
    tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(steps):
        for i in range(len(prompts)):
            tokens[i].append(int(np.argmax(logits[i])))
            if step + 1 < steps:
                logits[i] = chain.forward(f"s{i}", np.asarray(tokens[i][-1:]))[-1]
    assert tokens == expected
    for i in range(len(prompts)):
        chain.release(f"s{i}")
