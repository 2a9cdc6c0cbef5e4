"""exporter.gguf_reader against transformers' GGUF loader and the tokenizers the files came from.

- Config: tiny llama, qwen2, qwen3 and qwen3_moe GGUFs (testing_support/tiny_gguf.py) give the
  config transformers reads, field for field; glm4moe, gpt-oss, qwen35moe, qwen35 and qwen3next
  files written as llama.cpp's converter writes them give back the transformers config they came
  from.
- Tokenizer: a byte-level BPE trained here on a varied corpus (code, unicode, emoji, digits,
  whitespace runs), with the split rules of each ``tokenizer.ggml.pre`` family, is written into a
  GGUF the way convert_hf_to_gguf.py writes a vocabulary; the reader's tokenizer must give the
  original's token ids. For qwen2-family files also transformers' own GGUF tokenizer's ids and
  chat rendering.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from exporter.errors import ExportError
from exporter.gguf_reader import read_config, read_tokenizer

pytestmark = pytest.mark.unit

# Split rules as the models' tokenizer.json files have them. Qwen2's is transformers' own
# (convert_slow_tokenizer.Qwen2Converter); None is GPT-2's (ByteLevel's built-in regex).
REGEX = {
    "gpt-2": None,
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "glm4": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "gpt-4o": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
NFC = {"qwen2", "qwen35"}  # Qwen's tokenizer.json normalizes first
IGNORE_MERGES = {"llama-bpe"}  # Llama 3's tokenizer.json: a word in the vocabulary is one token
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = "<tool_call>"  # an added, non-special token (as Qwen2.5's)
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    'for (int i = 0; i < 100; ++i) { printf("%d\\n", i * 31337); }',
    "The quick brown fox jumps over the lazy dog. I've said it's 'RE' and we'll see.",
    "Ünïcödé: naïve café, façade, Straße, Ελληνικά, русский текст, 中文字符, 日本語のテキスト, "
    "नमस्ते दुनिया, हिन्दी भाषा (combining marks)",
    "Emoji: 😀 👍🏽 🚀🚀 👨‍👩‍👧 ✅ and numbers 1234567890 3.14159 2024-12-31 0x1F600",
    "Whitespace:\t\ttabs   spaces\n\n\nnewlines    \r\n   trailing   ",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '<html><body><p class="x">Hello, World!</p></body></html>',
]
TEXT = (
    "<|im_start|>user\nWrite fibonacci(12) in C++ 👍🏽 — naïve Straße 中文 "
    "123456789 3.14\t\t x  \n\n\n   y नमस्ते, हिन्दी!<|im_end|>\n<|im_start|>assistant\n"
    "int f(int n) { return n < 2 ? n : f(n-1)+f(n-2); }  // 😀🚀 I'LL 'Ve<|endoftext|>"
)
MESSAGES = [
    {"role": "system", "content": "You are terse. Ünïcödé 😀"},
    {"role": "user", "content": "print(1234 + 5678)\n\n   # spaces"},
]


# ---------------------------------------------------------------------------- writers


def train_tokenizer(pre: str, vocab_size: int = 700) -> Any:
    """A byte-level BPE trained on CORPUS with ``pre``'s split rules, Qwen-style special tokens
    and one user-defined token, as a transformers fast tokenizer (the original)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(ignore_merges=pre in IGNORE_MERGES))
    if pre in NFC:
        tok.normalizer = normalizers.NFC()
    regex = REGEX[pre]
    if regex is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Learnt on unsplit text, the merges cross every family's split points (digit runs,
    # letters after punctuation, spaces before newlines): a wrong split shows in the ids.
    split = tok.pre_tokenizer
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.pre_tokenizer = split
    tok.add_tokens([AddedToken(USER_DEFINED, special=False, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


def write_tokenizer_gguf(
    path: Path,
    original: Any,
    pre: str,
    arch: str = "qwen2",
    add_bos: bool | None = None,
    keys: Any = None,
) -> Path:
    """``original``'s vocabulary as convert_hf_to_gguf.py writes it (_set_vocab_gpt2): tokens by
    id, special added tokens CONTROL, other added tokens USER_DEFINED, merges "a b"; eos
    <|im_end|>, bos/pad <|endoftext|>, the chat template; and a tiny model's metadata (``keys``
    writes another's)."""
    import gguf

    vocab = original.get_vocab()
    added = original.added_tokens_decoder
    by_id = {i: t for t, i in vocab.items()}
    tokens = [by_id[i] for i in range(len(by_id))]
    kinds = [
        (gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        if i in added
        else gguf.TokenType.NORMAL
        for i in range(len(tokens))
    ]
    model = json.loads(original.backend_tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]

    w = gguf.GGUFWriter(path, arch)
    if keys is not None:
        keys(w)
    else:
        w.add_context_length(128)
        w.add_embedding_length(8)
        w.add_block_count(1)
        w.add_feed_forward_length(16)
        w.add_head_count(2)
        w.add_head_count_kv(1)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(2.0**-20)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(kinds)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template(TEMPLATE)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------------------- config


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_config_matches_transformers(arch: str, tmp_path: Path) -> None:
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from testing_support.tiny_gguf import make_gguf_model

    path = make_gguf_model(arch, tmp_path, types="F32", layers=2)
    ours = read_config(path)
    theirs = load_gguf_checkpoint(str(path))["config"]
    # every field both set is the same (transformers keeps rope_theta flat, we nest it)
    assert ours["rope_parameters"]["rope_theta"] == theirs.pop("rope_theta")
    shared = (set(ours) & set(theirs)) - {"rope_parameters"}
    assert len(shared) >= 12
    assert {k: ours[k] for k in shared} == {k: theirs[k] for k in shared}
    # and the config objects agree on every field (names apart)
    mine = AutoConfig.for_model(**ours).to_dict()
    reference = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    for values in (mine, reference):
        values.pop("_name_or_path", None)
        values.pop("_model_name_or_path", None)
    assert mine == reference


def _model_keys(w: Any, hf: dict[str, Any], blocks: int) -> None:
    """TextModel.set_gguf_parameters (conversion/base.py) for the keys every family has."""
    w.add_block_count(blocks)
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    if "intermediate_size" in hf:
        w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_key_length(hf["head_dim"])
    w.add_value_length(hf["head_dim"])


def _write_model_gguf(path: Path, arch: str, keys: Any, tensors: list[str]) -> Path:
    import gguf

    w = gguf.GGUFWriter(path, arch)
    keys(w)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(64)])
    w.add_eos_token_id(3)
    for name in tensors:
        w.add_tensor(name, np.zeros((2,), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _check(path: Path, reference: Any) -> Any:
    """read_config gives the reference's class and every one of its structural fields."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(**read_config(path))
    assert type(config) is type(reference)
    mine, theirs = config.to_dict(), reference.to_dict()
    skip = {"_name_or_path", "bos_token_id", "eos_token_id", "pad_token_id", "vocab_size"}
    assert {k: v for k, v in mine.items() if k not in skip} == {
        k: v for k, v in theirs.items() if k not in skip
    }
    return config


def glm4moe_model(tmp_path: Path) -> tuple[Any, Any]:
    """A tiny Glm4MoeConfig and the writer of its metadata as conversion/glm.py writes it."""
    from transformers import Glm4MoeConfig

    ref = Glm4MoeConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        attention_bias=True, moe_intermediate_size=48, num_experts_per_tok=2, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=2.5, n_group=1, topk_group=1,
        first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=False,
        tie_word_embeddings=False, num_nextn_predict_layers=1,
    )  # fmt: skip
    hf = ref.to_dict()

    def keys(w: Any) -> None:  # conversion/glm.py: Glm4MoeModel
        import gguf

        _model_keys(w, hf, ref.num_hidden_layers + 1)  # + the NextN block
        w.add_rope_dimension_count(16)
        w.add_expert_count(8)
        w.add_expert_used_count(2)
        w.add_expert_group_count(1)
        w.add_expert_group_used_count(1)
        w.add_expert_feed_forward_length(48)
        w.add_expert_shared_count(1)
        w.add_leading_dense_block_count(1)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(2.5)
        w.add_expert_weights_norm(True)
        w.add_nextn_predict_layers(1)

    return ref, keys


def test_glm4moe_config(tmp_path: Path) -> None:
    ref, model_keys = glm4moe_model(tmp_path)

    def keys(w: Any) -> None:
        model_keys(w)
        w.add_eot_token_id(5)

    path = _write_model_gguf(
        tmp_path / "glm.gguf", "glm4moe", keys, ["output.weight", "blk.0.attn_q.bias"]
    )
    config = _check(path, ref)
    assert config.eos_token_id == [3, 5]  # eos and eot: both end a reply


def test_source_falls_back_where_transformers_refuses(tmp_path: Path) -> None:
    """exporter.source reads a glm4moe GGUF's config and tokenizer here (transformers refuses
    the architecture), caches them, and reads the cache back the same."""
    from exporter.source import CONFIG_CACHE, TOKENIZER_CACHE, ModelSource

    ref, keys = glm4moe_model(tmp_path)
    original = train_tokenizer("glm4")
    path = write_tokenizer_gguf(tmp_path / "glm.gguf", original, "glm4", "glm4moe", keys=keys)
    cache = tmp_path / "cache"
    for _ in range(2):  # read, then from the cache
        source = ModelSource("gguf", path, "glm", None, cache)
        config = source.load_config()
        assert type(config) is type(ref)
        assert config.n_routed_experts == 8 and config.num_hidden_layers == 3
        tokenizer = source.load_tokenizer()
        assert tokenizer.encode(TEXT) == original.encode(TEXT)
        assert tokenizer.chat_template == TEMPLATE
        assert len(list((cache / CONFIG_CACHE).iterdir())) == 1
        assert len(list((cache / TOKENIZER_CACHE).iterdir())) == 1


def test_gpt_oss_config(tmp_path: Path) -> None:
    from transformers import GptOssConfig

    yarn = {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0,
    }  # fmt: skip
    ref = GptOssConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=131072, rms_norm_eps=1e-5,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=128, rope_parameters=yarn,
    )  # fmt: skip
    hf = ref.to_dict()

    def keys(w: Any) -> None:  # conversion/gpt_oss.py + the base's YaRN keys
        import gguf

        _model_keys(w, hf, 4)
        w.add_sliding_window(128)
        w.add_expert_feed_forward_length(64)
        w.add_expert_count(4)
        w.add_expert_used_count(2)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
        w.add_rope_scaling_yarn_beta_fast(32.0)
        w.add_rope_scaling_yarn_beta_slow(1.0)

    path = _write_model_gguf(
        tmp_path / "oss.gguf", "gpt-oss", keys, ["output.weight", "blk.0.attn_q.bias"]
    )
    config = _check(path, ref)
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen35", "qwen3next"])
def test_hybrid_configs(arch: str, tmp_path: Path) -> None:
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    rope: dict[str, Any] = {
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
    }  # fmt: skip
    if arch != "qwen3next":
        rope.update(mrope_section=[2, 1, 1], mrope_interleaved=True)
    common: dict[str, Any] = dict(
        hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6, rope_parameters=rope,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, tie_word_embeddings=False,
    )  # fmt: skip
    moe = dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=32,
    )  # fmt: skip
    ref: Any
    if arch == "qwen35moe":
        ref = Qwen3_5MoeTextConfig(**common, **moe)
    elif arch == "qwen35":
        ref = Qwen3_5TextConfig(**common, intermediate_size=96)
    else:
        ref = Qwen3NextConfig(**common, **moe, intermediate_size=96)
    hf = ref.to_dict()

    def keys(w: Any) -> None:  # conversion/qwen.py: Qwen3NextModel and the Qwen3.5 classes
        _model_keys(w, hf, 8)
        if arch != "qwen35":
            w.add_expert_count(8)
            w.add_expert_used_count(2)
            w.add_expert_feed_forward_length(24)
            w.add_expert_shared_feed_forward_length(32)
        w.add_ssm_conv_kernel(4)
        w.add_ssm_state_size(16)
        w.add_ssm_group_count(2)
        w.add_ssm_time_step_rank(4)
        w.add_ssm_inner_size(32)
        w.add_full_attention_interval(4)
        w.add_rope_dimension_count(8)
        if arch != "qwen3next":
            w.add_rope_dimension_sections([2, 1, 1, 0])

    path = _write_model_gguf(tmp_path / f"{arch}.gguf", arch, keys, ["output.weight"])
    config = _check(path, ref)
    assert config.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]


def test_unknown_architecture_is_named(tmp_path: Path) -> None:
    def keys(w: Any) -> None:
        w.add_block_count(1)

    path = _write_model_gguf(tmp_path / "x.gguf", "deepseek2", keys, [])
    with pytest.raises(ExportError, match="deepseek2"):
        read_config(path)


# ---------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("pre", list(REGEX))
def test_tokenizer_gives_the_original_ids(pre: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    original = train_tokenizer(pre)
    path = write_tokenizer_gguf(tmp_path / "tok.gguf", original, pre, add_bos=False)
    ours = read_tokenizer(path)
    expected = original.encode(TEXT)
    assert len(expected) < 0.6 * len(TEXT.encode())  # merges learnt: not byte by byte
    assert ours.encode(TEXT) == expected
    for text in CORPUS:
        assert ours.encode(text) == original.encode(text)
    assert ours.encode(f"a {USER_DEFINED} b") == original.encode(f"a {USER_DEFINED} b")
    assert ours.decode(ours.encode(TEXT)) == TEXT
    assert ours.eos_token == "<|im_end|>"
    assert ours.pad_token == "<|endoftext|>"
    assert ours.chat_template == TEMPLATE
    # as the export keeps it: saved, then read back by transformers
    ours.save_pretrained(tmp_path / "saved")
    again = AutoTokenizer.from_pretrained(str(tmp_path / "saved"))
    assert again.encode(TEXT) == expected
    assert again.chat_template == TEMPLATE


def test_tokenizer_add_bos(tmp_path: Path) -> None:
    """llama-bpe files (Llama 3) start every encoding with BOS unless the file says not to."""
    from transformers import AutoTokenizer

    original = train_tokenizer("llama-bpe")
    bos = original.get_vocab()["<|endoftext|>"]
    body = original.encode(TEXT)
    path = write_tokenizer_gguf(tmp_path / "tok.gguf", original, "llama-bpe")
    ours = read_tokenizer(path)
    assert ours.encode(TEXT) == [bos, *body]
    ours.save_pretrained(tmp_path / "saved")
    assert AutoTokenizer.from_pretrained(str(tmp_path / "saved")).encode(TEXT) == [bos, *body]
    path = write_tokenizer_gguf(tmp_path / "nobos.gguf", original, "llama-bpe", add_bos=False)
    assert read_tokenizer(path).encode(TEXT) == body


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3moe"])
def test_tokenizer_matches_transformers(arch: str, tmp_path: Path) -> None:
    """Where transformers reads the file (its Qwen2 converter: the qwen2 split, NFC and the
    three Qwen special tokens), the same ids and the same chat rendering."""
    from transformers import AutoTokenizer

    original = train_tokenizer("qwen2")
    path = write_tokenizer_gguf(tmp_path / "tok.gguf", original, "qwen2", arch=arch)
    ours = read_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert ours.encode(TEXT) == theirs.encode(TEXT)
    for text in CORPUS:
        assert ours.encode(text) == theirs.encode(text)
    chat = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat == theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.encode(chat) == theirs.encode(chat)
    assert ours.decode(ours.encode(chat)) == chat


def test_unknown_pre_tokenizer_is_named(tmp_path: Path) -> None:
    original = train_tokenizer("gpt-2", vocab_size=300)
    path = write_tokenizer_gguf(tmp_path / "tok.gguf", original, "some-new-pre")
    with pytest.raises(ExportError, match="some-new-pre"):
        read_tokenizer(path)
