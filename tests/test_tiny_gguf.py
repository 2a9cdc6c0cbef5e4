"""The tiny GGUF writer (testing_support/tiny_gguf.py) against transformers' own GGUF loader.

F32 files must give the HF model's logits (names, llama's q/k permutation and gemma's +1 norms
right), Q4_K_M files must hold the intended type per tensor in blocks gguf-py decodes, and the
tokenizer must come back encoding the corpus to the same ids.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from testing_support.tiny_gguf import (
    dequantize,
    make_gguf_model,
    make_hf_model,
    quantize,
    write_gguf,
)
from testing_support.tiny_models import CHAT_TEMPLATE, CORPUS, make_model

pytestmark = pytest.mark.component

ARCHES = ["llama", "qwen2", "qwen3", "gemma3"]
# gemma3: five sliding-window layers then a global one (its default pattern, what GGUF implies).
LAYERS = {"gemma3": 6}
# Longer than gemma3's sliding window (4), so the window matters.
IDS = [[1, 5, 9, 30, 77, 100, 3, 200, 44, 12]]

Built = Callable[[str, str], tuple[Path, Path]]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """``built(arch, types)`` -> (HF folder, GGUF path), each made once per module."""
    cache: dict[tuple[str, str], Path] = {}
    root = tmp_path_factory.mktemp("gguf")

    def get(arch: str, types: str) -> tuple[Path, Path]:
        hf = root / arch / "hf"
        if not hf.exists():
            make_hf_model(arch, hf, layers=LAYERS.get(arch, 4), chat_template=CHAT_TEMPLATE)
        if (arch, types) not in cache:
            out = root / arch / types
            out.mkdir()
            cache[arch, types] = write_gguf(hf, out / "model.gguf", types)
        return hf, cache[arch, types]

    return get


def _logits(folder: Path, gguf_file: str | None = None) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file).eval()
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits[0].numpy()


# ---------------------------------------------------------------------------- quantizers


def _awkward_weights() -> np.ndarray:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 512)).astype(np.float32) * 0.05
    w[0, :32] += 1.0  # an all-positive sub-block beside small ones
    w[1, :256] = 0.0  # an all-zero super-block
    w[2, 32:64] = -np.abs(w[2, 32:64]) - 0.5  # all negative
    w[3, 300] = 3.0  # one outlier
    w[4] *= 1e-2  # super-block scales d in f16's subnormal range
    return w


@pytest.mark.parametrize(
    ("kind", "block_bytes", "group", "bound"),
    # Worst case with scales rounded up (no clipping): half a step of the group plus the slack
    # of the 6-bit (Q4_K) or 8-bit (Q6_K) scale, relative to the super-block's largest value.
    [("Q4_K", 144, 32, 0.07), ("Q6_K", 210, 16, 0.017)],
)
def test_k_quants_round_trip(kind: str, block_bytes: int, group: int, bound: float) -> None:
    w = _awkward_weights()
    q = quantize(w, kind)
    assert q.dtype == np.uint8
    assert q.shape == (6, 2 * block_bytes)
    back = dequantize(q, kind)
    assert back.shape == w.shape
    err = np.abs(back - w)
    superblock = np.abs(w).reshape(-1, 256).max(axis=-1)
    assert np.all(err.reshape(-1, 256).max(axis=-1) <= bound * superblock + 1e-12)
    # Per group: half a step of the group's own range, plus the super-block's scale slack.
    g = w.reshape(-1, group)
    spread = g.max(axis=-1) - np.minimum(g.min(axis=-1), 0) if kind == "Q4_K" else np.abs(g).max(-1)
    steps = 15 if kind == "Q4_K" else 31
    slack = np.repeat(superblock, 256 // group) * 0.01
    assert np.all(err.reshape(-1, group).max(axis=-1) <= spread / steps / 2 * 1.01 + slack)
    assert np.all(back[1, :256] == 0)


def test_quantize_refuses_rows_the_blocks_do_not_divide() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(np.zeros((2, 128), np.float32), "Q4_K")


# ---------------------------------------------------------------------------- models


@pytest.mark.parametrize("arch", ARCHES)
def test_f32_gguf_matches_the_hf_model(arch: str, built: Built) -> None:
    from transformers import AutoConfig

    hf, gguf_path = built(arch, "F32")
    want = AutoConfig.from_pretrained(hf).to_dict()
    got = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).to_dict()
    # unk_token_id comes from the tokenizer (the HF config has none); the rest must match.
    ignored = {"_name_or_path", "_model_name_or_path", "transformers_version", "unk_token_id"}
    ignored |= {"architectures", "dtype"}
    diff = {k: (want.get(k), got.get(k)) for k in want.keys() | got.keys() if k not in ignored}
    assert {k: v for k, v in diff.items() if v[0] != v[1]} == {}
    np.testing.assert_allclose(
        _logits(gguf_path.parent, gguf_path.name), _logits(hf), atol=1e-5, rtol=0
    )


def _expected_q4_k_m(name: str, n_dims: int) -> str:
    if n_dims == 1:
        return "F32"
    if name in ("token_embd.weight", "output.weight"):
        return "Q6_K"
    layer = int(name.split(".")[1])
    return "Q6_K" if name.split(".")[2] in ("attn_v", "ffn_down") and layer % 2 == 0 else "Q4_K"


@pytest.mark.parametrize("arch", ARCHES)
def test_q4_k_m_gguf_types_and_logits(arch: str, built: Built) -> None:
    import gguf

    hf, gguf_path = built(arch, "Q4_K_M")
    _, f32_path = built(arch, "F32")
    reader, dense = gguf.GGUFReader(gguf_path), gguf.GGUFReader(f32_path)
    exact = {t.name: np.asarray(t.data) for t in dense.tensors}
    kinds = {}
    for tensor in reader.tensors:
        kinds[tensor.name] = kind = tensor.tensor_type.name
        assert kind == _expected_q4_k_m(tensor.name, len(tensor.shape)), tensor.name
        w = exact[tensor.name]
        back = gguf.dequantize(tensor.data, tensor.tensor_type).reshape(w.shape)
        bound = {"F32": 0, "Q6_K": 0.017, "Q4_K": 0.07}[kind]
        assert np.abs(back - w).max() <= bound * np.abs(w).max(), tensor.name
    assert "Q6_K" in kinds.values() and "Q4_K" in kinds.values()
    assert ("output.weight" in kinds) == (arch in ("llama", "qwen3"))  # the others tie
    got, want = _logits(gguf_path.parent, gguf_path.name), _logits(hf)
    # 4-5 bits through 4-6 random layers: about 20% relative error (Q8_0 gives ~2%).
    rel = np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2))
    assert rel < 0.4


def test_llama3_rope_scaling_does_not_survive(tmp_path: Path) -> None:
    """llama.cpp keeps llama3 rope scaling as a rope_freqs tensor; transformers 5.5 drops it
    and reads plain rope back. The default tiny llama (hidden 64) also takes Q4_K_M's
    fallbacks for rows shorter than a K-quant super-block."""
    import gguf
    from transformers import AutoConfig

    make_model("llama", tmp_path / "hf", layers=2)
    out = write_gguf(tmp_path / "hf", tmp_path / "model.gguf", "Q4_K_M")
    reader = gguf.GGUFReader(out)
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["blk.0.attn_q.weight"] == "Q5_0" and kinds["blk.0.attn_v.weight"] == "Q8_0"
    freqs = np.asarray(next(t for t in reader.tensors if t.name == "rope_freqs.weight").data)
    assert freqs.shape == (8,) and freqs[0] == 1.0 and freqs[-1] == 8.0
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=out.name)
    assert config.rope_parameters["rope_type"] == "default"
    assert config.rope_parameters["rope_theta"] == 500000.0
    assert np.isfinite(_logits(tmp_path, out.name)).all()  # Q5_0 and Q8_0 blocks decode


def test_make_gguf_model_with_a_custom_mix(tmp_path: Path) -> None:
    import gguf

    types = {"": "Q8_0", "ffn_": "Q4_0", "ffn_down": "F16", "token_embd": "Q6_K"}
    path = make_gguf_model("qwen3", tmp_path, types=types, layers=2)
    assert [p.name for p in tmp_path.iterdir()] == [path.name] == ["tiny-qwen3-custom.gguf"]
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert kinds["token_embd.weight"] == "Q6_K" and kinds["output.weight"] == "Q8_0"
    assert kinds["blk.1.attn_q.weight"] == "Q8_0" and kinds["blk.1.attn_q_norm.weight"] == "F32"
    assert kinds["blk.1.ffn_up.weight"] == "Q4_0" and kinds["blk.1.ffn_down.weight"] == "F16"
    want = _logits(make_hf_model("qwen3", tmp_path / "hf", layers=2))
    got = _logits(tmp_path, path.name)
    assert np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)) < 0.4


# ---------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tokenizer_round_trip(arch: str, built: Built) -> None:
    from transformers import AutoTokenizer

    hf, gguf_path = built(arch, "F32")
    want = AutoTokenizer.from_pretrained(hf)
    got = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    for text in CORPUS:
        ids = want(text)["input_ids"]
        assert got(text, add_special_tokens=False)["input_ids"] == ids
        assert got.decode(ids) == text
        # transformers' llama GGUF tokenizer always prepends BOS (it ignores add_bos_token).
        assert got(text)["input_ids"] == ([1] if arch == "llama" else []) + ids
    assert got.chat_template == CHAT_TEMPLATE


def test_gguf_tokenizer_special_tokens_diverge(built: Built) -> None:
    """What transformers 5.5 gets wrong about the specials (the GGUF holds bos 1, eos 2,
    unk 0, pad 0 and marks <unk>, <s>, </s> as control tokens): its llama converter swaps
    eos for bos, and its qwen converter ignores the file's specials for Qwen's own, added
    past the model's rows, so "<s>" in a text is plain text there."""
    from transformers import AutoTokenizer

    text = "<s>user: hi</s>"
    for arch in ("llama", "qwen2"):
        hf, gguf_path = built(arch, "F32")
        want = AutoTokenizer.from_pretrained(hf)
        got = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        ids = got(text, add_special_tokens=False)["input_ids"]
        if arch == "llama":
            assert ids == want(text)["input_ids"]
            assert (got.bos_token_id, got.eos_token_id, got.unk_token_id) == (1, 1, 0)
        else:
            assert ids != want(text)["input_ids"]
            assert got.eos_token_id == got.unk_token_id == got.pad_token_id == 256
            assert got.bos_token_id is None


def test_gemma3_tokenizer_does_not_load(built: Built) -> None:
    """llama.cpp writes a ByteLevel BPE vocabulary for a gemma3 without tokenizer.model, but
    transformers 5.5 rebuilds every gemma3 GGUF tokenizer as a scored SentencePiece Unigram."""
    from transformers import AutoTokenizer

    _, gguf_path = built("gemma3", "F32")
    with pytest.raises(TypeError):
        AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
