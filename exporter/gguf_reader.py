"""A GGUF file's model config, tokenizer and chat template, read from its metadata alone.

transformers 5.5 reads both only for the architectures in its own GGUF table and refuses the
rest ("GGUF model with architecture ... is not supported yet"): glm4moe, gpt-oss, qwen35,
qwen35moe, qwen3next among them. This reader maps llama.cpp's metadata keys (what
convert_hf_to_gguf.py wrote from the Hugging Face config) back into the config.json of the
matching transformers config class, and builds a ``tokenizers`` BPE tokenizer from the
vocabulary and merges with the pre-tokenizer that ``tokenizer.ggml.pre`` names (the same split
rules as llama.cpp's ``llama-vocab.cpp``, in the original Hugging Face regex form).

- :func:`read_config`: a config.json-style dict (``transformers.AutoConfig.for_model(**d)``).
  For llama, qwen2, qwen3 and qwen3moe it gives the values transformers' own GGUF reader gives
  (tested), and reads what that reader misses where the file has it (qwen3's key_length, the
  MoE expert width).
- :func:`read_tokenizer`: a ``transformers.PreTrainedTokenizerFast`` with the file's special
  tokens (control tokens special, user-defined tokens added), bos/eos/unk/pad and its Jinja
  chat template.

Metadata comes from :func:`exporter.weights.read_gguf_header` (gguf-py's reader, with its
string arrays stepped over rather than decoded one numpy view at a time); the token and merge
arrays are decoded here from those bytes in one pass.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

from exporter.errors import ExportError
from exporter.families import FAMILIES, GGUF_MODEL_TYPES

# Part of the key under which exporter.source caches a config read from a GGUF: raised when
# this reader reads a file differently, so a cached config of an earlier reading is not reused
# (2: the MTP layers of Qwen3.5 files as mtp_num_hidden_layers)
READER_VERSION = 2

# The architectures whose config this reader maps: the families with a ``gguf_config`` reader
# (exporter/families/), and the model_type each reads back as
ARCHES = tuple(
    dict.fromkeys(f.gguf_arch for f in FAMILIES.values() if f.gguf_arch and f.gguf_config)
)
# The architectures transformers' own GGUF loader reads: their floats are given as it gives
# them (the f32 widened); for the others, as the Hugging Face config had them (the shortest
# decimal that is the same f32: 1e-05, not 9.999999747378752e-06).
_TRANSFORMERS_ARCHES = ("llama", "qwen2", "qwen3", "qwen3moe")
# Architectures whose layers alternate linear (Gated DeltaNet) and full attention.
_HYBRID = tuple(f.gguf_arch for f in FAMILIES.values() if f.hybrid and f.gguf_arch)

# tokenizer.ggml.pre -> the pre-tokenizer's split regex, as the model's tokenizer.json has it
# (llama.cpp's llama-vocab.cpp rewrites the case-insensitive groups for its own regex engine;
# the tokenizers library takes the originals). None: GPT-2's own, ByteLevel(use_regex=True).
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class _Pre:
    """How one ``tokenizer.ggml.pre`` family splits and normalizes text (llama-vocab.cpp)."""

    def __init__(
        self,
        regex: str | None,
        nfc: bool = False,
        ignore_merges: bool = False,
        add_bos: bool | None = None,
        bos: bool = True,
    ) -> None:
        self.regex = regex
        self.nfc = nfc  # the Qwen tokenizers normalize to NFC first (their tokenizer.json)
        self.ignore_merges = ignore_merges  # a word already in the vocabulary is one token
        self.add_bos = add_bos  # the family's default when the file has no add_bos_token
        self.bos = bos  # False: the family has no BOS token whatever the file says


_PRE: dict[str, _Pre] = {}
for _names, _pre in (
    (("gpt-2", "phi-2", "roberta-bpe"), _Pre(None)),
    (
        ("llama3", "llama-v3", "llama-bpe", "falcon3"),
        _Pre(_LLAMA3, ignore_merges=True, add_bos=True),
    ),
    (("dbrx", "smaug-bpe"), _Pre(_LLAMA3)),
    (("qwen2", "deepseek-r1-qwen", "megrez"), _Pre(_QWEN2, nfc=True)),
    (("qwen35",), _Pre(_QWEN35, nfc=True)),
    (("glm4", "chatglm-bpe"), _Pre(_LLAMA3, bos=False)),
    (("gpt-4o", "llama4"), _Pre(_GPT4O)),
):
    for _name in _names:
        _PRE[_name] = _pre


# ---------------------------------------------------------------------------- metadata


class _Meta:
    """The file's metadata fields by key, decoded on demand, and its tensor names."""

    def __init__(self, path: Path) -> None:
        from exporter.weights import read_gguf_header

        self.path = path
        reader = read_gguf_header(path)
        self.fields = reader.fields
        self.tensors = {t.name for t in reader.tensors}
        self.arch = str(self.get("general.architecture") or "")

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        if field is None:
            return default
        from gguf import GGUFValueType

        if field.types and field.types[0] == GGUFValueType.ARRAY:
            return _array(field)
        return field.contents()

    def model(self, name: str, default: Any = None) -> Any:
        """``{arch}.{name}``."""
        return self.get(f"{self.arch}.{name}", default)

    def real(self, value: Any) -> float:
        """A float field's value (stored as f32)."""
        if self.arch in _TRANSFORMERS_ARCHES:
            return float(value)
        return float(str(np.float32(value)))


def _array(field: Any) -> list[Any]:
    """An array field's values. The header reader leaves arrays undecoded (its last parts:
    the length, then the raw bytes); gguf-py's full reader decodes them (``field.data`` set)."""
    from gguf import GGUFValueType

    if field.data:
        return list(field.contents())
    itype = GGUFValueType(int(field.types[-1]))
    count = int(field.parts[-2][0])
    body = field.parts[-1]
    if itype == GGUFValueType.STRING:
        raw = body.tobytes()
        out: list[Any] = []
        offs = 0
        for _ in range(count):
            (size,) = struct.unpack_from("<Q", raw, offs)
            offs += 8
            out.append(raw[offs : offs + size].decode("utf-8", errors="replace"))
            offs += size
        return out
    from gguf import GGUFReader

    dtype = np.dtype(GGUFReader.gguf_scalar_to_np[itype])
    return np.frombuffer(body.tobytes(), dtype=dtype, count=count).tolist()


def _scalar(value: Any) -> Any:
    """A per-layer array (some files store head counts per layer) as its one value."""
    if isinstance(value, list):
        distinct = {v for v in value if v}
        return max(distinct) if distinct else (value[0] if value else None)
    return value


# ---------------------------------------------------------------------------- config


def read_config(path: Path | str) -> dict[str, Any]:
    """The Hugging Face config.json (transformers 5 form: ``rope_parameters``) of the GGUF at
    ``path``, from its ``{arch}.*``, ``tokenizer.ggml.*`` keys and its tensor names.

    Raises ExportError for an architecture this reader does not map (naming it)."""
    meta = _Meta(Path(path))
    arch = meta.arch
    if arch not in ARCHES:
        raise ExportError(
            f"{Path(path).name}: GGUF architecture {arch!r} has no config mapping here "
            f"(known: {', '.join(ARCHES)})"
        )
    m = meta.model
    config: dict[str, Any] = {"model_type": GGUF_MODEL_TYPES[arch]}

    nextn = int(m("nextn_predict_layers") or 0)
    layers = int(m("block_count")) - nextn  # MTP/NextN blocks follow the trunk's layers
    heads = int(_scalar(m("attention.head_count")))
    hidden = int(m("embedding_length"))
    config.update(
        max_position_embeddings=int(m("context_length")),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(_scalar(m("attention.head_count_kv", heads))),
        rms_norm_eps=meta.real(m("attention.layer_norm_rms_epsilon")),
    )
    if (ff := m("feed_forward_length")) is not None:
        config["intermediate_size"] = int(_scalar(ff))
    vocab = m("vocab_size")
    if vocab is None:
        field = meta.fields.get("tokenizer.ggml.tokens")
        if field is not None:
            vocab = len(field.data) if field.data else int(field.parts[-2][0])
    if vocab is not None:
        config["vocab_size"] = int(vocab)
    # llama.cpp writes no output tensor when the head reuses the embeddings
    config["tie_word_embeddings"] = "output.weight" not in meta.tensors

    head_dim = m("attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = m("rope.dimension_count")  # as transformers reads llama
    if head_dim is not None:
        config["head_dim"] = int(head_dim)
    head_dim = int(head_dim) if head_dim is not None else hidden // heads

    config["rope_parameters"] = _rope(meta, head_dim)
    config.update(_token_ids(meta))

    fam = FAMILIES[GGUF_MODEL_TYPES[arch]]
    assert fam.gguf_config is not None  # ARCHES holds only such families
    config.update(fam.gguf_config(meta, layers, nextn))  # the family's own fields
    return config


def _rope(meta: _Meta, head_dim: int) -> dict[str, Any]:
    m = meta.model
    rope: dict[str, Any] = {"rope_type": "default"}
    if (base := m("rope.freq_base")) is not None:
        rope["rope_theta"] = meta.real(base)
    kind = m("rope.scaling.type")
    factor = m("rope.scaling.factor")
    if kind == "linear" and factor:
        rope.update(rope_type="linear", factor=meta.real(factor))
    elif kind == "yarn" and factor:
        rope.update(rope_type="yarn", factor=meta.real(factor))
        for key, name in (
            ("original_context_length", "original_max_position_embeddings"),
            ("yarn_beta_fast", "beta_fast"),
            ("yarn_beta_slow", "beta_slow"),
            ("yarn_ext_factor", "extrapolation_factor"),
            ("yarn_attn_factor", "attention_factor"),
        ):
            if (value := m(f"rope.scaling.{key}")) is not None:
                rope[name] = int(value) if name.startswith("original") else meta.real(value)
        if meta.arch == "gpt-oss":
            # not in the file: gpt-oss's config.json says False (transformers' default is True)
            rope["truncate"] = False
    elif kind not in (None, "none"):
        raise ExportError(f"{meta.path.name}: RoPE scaling {kind!r} is not mapped here")
    dims = m("rope.dimension_count")
    if dims is not None and meta.arch not in ("llama", "gpt-oss") and int(dims) != head_dim:
        rope["partial_rotary_factor"] = int(dims) / head_dim
    elif meta.arch in ("glm4moe", *_HYBRID):
        # these config classes default to a partial factor: state the file's (all channels)
        rope["partial_rotary_factor"] = (int(dims) if dims else head_dim) / head_dim
    if meta.arch in ("qwen35", "qwen35moe") and (sections := m("rope.dimension_sections")):
        # M-RoPE (text positions only here, where it equals plain RoPE): Qwen3.5's sections
        # interleave (llama.cpp writes 4, the last one 0)
        rope.update(mrope_section=[int(s) for s in sections[:3]], mrope_interleaved=True)
    return rope


def _token_ids(meta: _Meta) -> dict[str, Any]:
    """bos/eos/unk/pad ids, as transformers copies them into the config; for the families it
    cannot read, eos lists every end-of-generation id the file names (eos, eot, eom), as their
    Hugging Face configs do (GLM-4.5: 3 ids)."""
    out: dict[str, Any] = {}
    for key, name in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("unknown_token_id", "unk_token_id"),
        ("padding_token_id", "pad_token_id"),
    ):
        if (value := meta.get(f"tokenizer.ggml.{key}")) is not None:
            out[name] = int(value)
    if meta.arch not in _TRANSFORMERS_ARCHES and "eos_token_id" in out:
        ids = [out["eos_token_id"]]
        for key in ("eot_token_id", "eom_token_id"):
            value = meta.get(f"tokenizer.ggml.{key}")
            if value is not None and int(value) not in ids:
                ids.append(int(value))
        if len(ids) > 1:
            out["eos_token_id"] = ids
    return out


# ---------------------------------------------------------------------------- tokenizer


def read_tokenizer(path: Path | str) -> Any:
    """The GGUF's tokenizer as a ``transformers.PreTrainedTokenizerFast``: a byte-level BPE
    (``tokenizer.ggml.model`` "gpt2") with the vocabulary, merges and the split rules of
    ``tokenizer.ggml.pre``; control tokens become special tokens, user-defined ones added
    tokens; bos/eos/unk/pad and the chat template come from the file."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers import processors as tk_processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    meta = _Meta(Path(path))
    name = meta.path.name
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ExportError(
            f"{name}: tokenizer model {model!r} is not read here (only byte-level BPE, 'gpt2')"
        )
    pre_name = meta.get("tokenizer.ggml.pre") or "default"
    pre = _PRE.get(pre_name)
    if pre is None:
        raise ExportError(
            f"{name}: pre-tokenizer {pre_name!r} is not mapped here (known: {', '.join(_PRE)})"
        )
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    vocab: dict[str, int] = {}
    for i, text in enumerate(tokens):
        vocab.setdefault(text, i)

    tok = Tokenizer(
        BPE(vocab, merges, ignore_merges=pre.ignore_merges, fuse_unk=False, byte_fallback=False)
    )
    if pre.nfc:
        tok.normalizer = normalizers.NFC()
    if pre.regex is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pre.regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()

    # Control tokens are matched whole and are special; user-defined ones are matched whole
    # (llama.cpp splits the text on both before BPE) but are ordinary text.
    added = [
        AddedToken(tokens[i], special=int(kind) == 3, normalized=False)
        for i, kind in enumerate(types)
        if int(kind) in (3, 4)
    ]
    tok.add_tokens(added)

    def named(key: str) -> str | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(value)] if value is not None and 0 <= int(value) < len(tokens) else None

    bos = named("bos_token_id") if pre.bos else None
    eos = named("eos_token_id")
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    add_bos = bool(pre.add_bos if add_bos is None else add_bos)
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    first = [bos] if add_bos and bos is not None else []
    last = [eos] if add_eos and eos is not None else []
    if first or last:
        tok.post_processor = tk_processors.Sequence(
            [
                tk_processors.ByteLevel(trim_offsets=False),
                tk_processors.TemplateProcessing(
                    single=[*first, "$A", *last],
                    pair=[*first, "$A", *last, *first, "$B:1", *last],
                    special_tokens=[(t, vocab[t]) for t in {*first, *last}],
                ),
            ]
        )
    else:
        tok.post_processor = tk_processors.ByteLevel(trim_offsets=False)

    kwargs: dict[str, Any] = {
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": named("unknown_token_id"),
        "pad_token": named("padding_token_id"),
        "clean_up_tokenization_spaces": False,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        kwargs["chat_template"] = template
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, **{k: v for k, v in kwargs.items() if v is not None}
    )
