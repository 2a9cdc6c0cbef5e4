"""Tiny random decoders (fixed seeds, built from configs) with a tiny BPE tokenizer: no download.

The test suite and the benchmarks that time the machinery rather than a real model build their
models here (the export extra: torch, transformers)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "once upon a time there was a small shard that lived on a desktop computer",
    "pipelines pass hidden states from stage to stage over an ordinary network",
    "every stage keeps its own key value cache for each request it serves",
    "speculative decoding proposes tokens with a draft and verifies them in one pass",
    "hello world, this is pipeshard: split models, serve them, measure them.",
]
VOCAB = 256
# With CORPUS, for models that must be able to write JSON and tool calls (constrained
# decoding): braces, quotes, digits, tags.
JSON_CORPUS = [
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
    '<tool_call>\n{"name": "lookup", "arguments": {"query": "fox"}}\n</tool_call>',
    '[{"id": 0, "ok": true, "score": -1.5e2, "tags": ["a", "b"], "none": null}]',
    "0123456789 ABCDEFGHIJKLMNOPQRSTUVWXYZ _-+*/=<>()[]{}|#@!?'`~^$%&\\\t",
]


def make_tokenizer(
    folder: Path,
    vocab: int = VOCAB,
    chat_template: str | None = None,
    corpus: list[str] = CORPUS,
    special_tokens: Sequence[str] = (),
) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # The alphabet is the corpus's own (ASCII) characters, not all 256 bytes: every token then
    # decodes to readable text, which the gateway tests (stop strings, streaming) need.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<unk>", "<s>", "</s>", *special_tokens],
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    if special_tokens:
        fast.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(folder)


def tiny_config(arch: str, layers: int = 6, vocab: int = VOCAB) -> Any:
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":
        from transformers import Qwen3Config

        # Like the real Qwen3s, head_dim is not hidden_size / heads (q_proj widens, o_proj narrows).
        return Qwen3Config(**common, head_dim=32)
    if arch == "mistral":
        from transformers import MistralConfig

        # a window far shorter than the tests' prompts + generations: every layer slides
        return MistralConfig(**common, sliding_window=5)
    if arch == "ministral":
        from transformers import MinistralConfig

        # sliding (window 5, shorter than the tests' prompts) and full layers, as listed; head_dim
        # stated, as the real configs do (transformers' modeling reads no default)
        types = ["full_attention" if i % 3 == 2 else "sliding_attention" for i in range(layers)]
        return MinistralConfig(**common, head_dim=16, sliding_window=5, layer_types=types)
    if arch == "phi3":
        from transformers import Phi3Config

        # fused qkv and gate_up; like Phi-4-mini, part of each head rotates (here half); like
        # Phi-3-mini, every layer slides (its window is 2047)
        return Phi3Config(**common, sliding_window=5, partial_rotary_factor=0.5)
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        # 8 experts, 2 per token, renormalised; layer 2 keeps a dense MLP (mlp_only_layers)
        return Qwen3MoeConfig(
            **common,
            head_dim=32,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[2],
        )
    if arch == "mixtral":
        from transformers import MixtralConfig

        # 8 experts of 32 channels, 2 per token; every layer slides (window 5)
        mixtral = {**common, "intermediate_size": 32}
        return MixtralConfig(
            **mixtral, num_local_experts=8, num_experts_per_tok=2, sliding_window=5
        )
    if arch == "glm4_moe":
        from transformers import Glm4MoeConfig

        return Glm4MoeConfig(**glm4_moe_fields(common))
    if arch == "gpt_oss":
        from transformers import GptOssConfig

        return GptOssConfig(**gpt_oss_fields(common))
    if arch == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(**qwen3_5_fields(common))
    if arch == "qwen3_5_moe":
        from transformers import Qwen3_5MoeTextConfig

        fields = {k: v for k, v in qwen3_5_fields(common).items() if k != "intermediate_size"}
        return Qwen3_5MoeTextConfig(**fields, **hybrid_experts())
    if arch == "qwen3_next":
        from transformers import Qwen3NextConfig

        # layer 2 keeps a dense MLP (mlp_only_layers), as Qwen3-MoE's tiny model
        return Qwen3NextConfig(**qwen3_5_fields(common), **hybrid_experts(), mlp_only_layers=[2])
    if arch == "phi3-longrope":
        from transformers import Phi3Config

        # Phi-3.5-mini's and Phi-4-mini's LongRoPE, its original context (4) shorter than every
        # test prompt: transformers computes every forward call with the long factors, as the
        # export (256 positions) does
        return Phi3Config(
            **common,
            partial_rotary_factor=0.5,
            original_max_position_embeddings=4,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0, 1.25, 1.5, 2.0],
                "long_factor": [1.0, 2.0, 4.0, 8.0],
            },
        )
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        types = ["sliding_attention" if i % 3 != 2 else "full_attention" for i in range(layers)]
        return Gemma3TextConfig(
            **common,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=5,
            layer_types=types,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        )
    raise ValueError(arch)


def glm4_moe_fields(common: dict[str, Any]) -> dict[str, Any]:
    """A tiny GLM-4.5: layer 0 dense (first_k_dense_replace), then 8 experts in 2 groups of 4
    of which the best 1 is eligible (n_group, topk_group), 2 a token, renormalised and scaled,
    plus the shared expert; like GLM-4.5, head_dim is not hidden_size / heads, half of each
    head rotates, q/k norms and attention biases; one NextN layer named in the config (the
    Hugging Face checkpoint's layer after the last, which transformers ignores)."""
    return dict(
        common,
        head_dim=32,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        use_qk_norm=True,
        attention_bias=True,
        num_nextn_predict_layers=1,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
    )


def gpt_oss_fields(common: dict[str, Any]) -> dict[str, Any]:
    """A tiny gpt-oss: 8 experts of 32 channels (intermediate_size), 2 a token; like gpt-oss,
    head_dim is not hidden_size / heads, layers alternate sliding (window 5, shorter than
    every test prompt) and full attention (the config's default layer_types), and RoPE is
    YaRN (gpt-oss's parameters, its factor 32 over an original context of 8 positions)."""
    return dict(
        common,
        intermediate_size=32,
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 8,
        },
    )


def qwen3_5_fields(common: dict[str, Any]) -> dict[str, Any]:
    """A tiny Qwen3.5: its default layer pattern (3 Gated DeltaNet layers, then one of gated
    full attention: 6 layers are L L L F L L), 2 key heads of 4 value heads in the linear
    layers (grouped, as the real ones), a quarter of each attention head rotating."""
    return dict(
        common,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
    )


def hybrid_experts() -> dict[str, Any]:
    """Qwen3.5-MoE's and Qwen3-Next's experts, tiny: 8 of 32 channels, 2 a token, and the
    shared expert (64 channels) every token runs, scaled by its sigmoid gate."""
    return dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    )


# Architectures whose vectors (norm weights around 1 as (1 + w), the Gated DeltaNet's decay and
# time-step bias) start at constants: randomized, so that the tests see each of them count.
_RANDOM_VECTORS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def randomize_vectors(model: Any) -> None:
    import torch

    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.2)


def randomize_buffers(model: Any) -> None:
    """Random values for the weights a model starts at zero or near it (GLM's router correction
    bias; gpt-oss's attention sinks and expert biases), so that the tests see them count; and
    gpt-oss's gate/up pre-activations widened past its SwiGLU's clamp (7)."""
    import torch

    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
        if model.config.model_type != "gpt_oss":
            return
        for name, param in model.named_parameters():
            if name.endswith((".sinks", "_proj_bias", "router.bias")):
                param.copy_(torch.randn_like(param))
            elif name.endswith("experts.gate_up_proj"):  # [E, H, 2I]: ~6 at H = 64
                param.mul_(320.0 / param.shape[1] ** 0.5)
            elif name.endswith("experts.down_proj"):
                param.mul_(4.0)


CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


# A chat template that opens a <think> block for the answer, as the templates of Qwen3's
# thinking models, QwQ and DeepSeek-R1 distills do; with enable_thinking false it writes an
# empty block, closed, as Qwen3's does. It offers tools as Hermes templates do (<tool_call>).
THINK_TEMPLATE = (
    "{% if tools %}<s>tools: {{ tools | map(attribute='function') | map(attribute='name') "
    "| join(', ') }}; call one as <tool_call>\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


# A harmony chat template in the shape of gpt-oss's: tools offered in a developer message,
# calls and their results as commentary messages, the turn left at ``<|start|>assistant``.
HARMONY_TOKENS = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
)
HARMONY_TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|>namespace functions { "
    "{% for t in tools %}type {{ t['function']['name'] }} = (_: any) => any; {% endfor %}}"
    "<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}"
    "{% for c in m['tool_calls'] %}<|start|>assistant to=functions.{{ c['function']['name'] }}"
    "<|channel|>commentary json<|message|>{{ c['function']['arguments'] }}<|call|>{% endfor %}"
    "{% elif m['role'] == 'tool' %}<|start|>functions to=assistant<|channel|>commentary"
    "<|message|>{{ m['content'] }}<|end|>"
    "{% else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def make_model(
    arch: str,
    folder: Path,
    seed: int = 0,
    layers: int = 6,
    vocab: int = VOCAB,
    chat_template: str | None = None,
    corpus: list[str] = CORPUS,
    special_tokens: Sequence[str] = (),
) -> Path:
    """Save a random model of ``arch`` with the tiny tokenizer (trained on ``corpus``: its
    alphabet is the corpus's characters; ``special_tokens`` beside its own) into ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, layers, vocab))
    # Random init gives near-uniform logits; widen them so greedy choices are not near-ties.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.mul_(2.0)
    randomize_buffers(model)
    if arch in _RANDOM_VECTORS:
        randomize_vectors(model)
    model.save_pretrained(folder)
    make_tokenizer(folder, min(vocab, VOCAB), chat_template, corpus, special_tokens)
    return folder


def make_draft(target: Path, folder: Path, noise: float) -> Path:
    """A draft for ``target``: its weights plus noise (same vocabulary, often but not always
    right), saved with its tokenizer files in ``folder``."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(123)
    model = AutoModelForCausalLM.from_pretrained(str(target))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.add_(torch.randn_like(param) * param.std() * noise)
    model.save_pretrained(folder)
    for item in target.iterdir():
        if "token" in item.name or item.suffix == ".jinja":
            shutil.copy(item, folder / item.name)
    return folder
