"""Incremental detokenization: streamed pieces match the full decode, stop sequences."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from server.api.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

pytestmark = pytest.mark.unit

QWEN_TOKENIZER = Path(__file__).resolve().parents[1] / (
    "exports/qwen15-int4-s2/tokenizer/tokenizer.json"
)
CORPUS = [
    "Hello world! Streaming text with emoji 😀 🎉 👍 and more emoji 🚀 🚀 🙂.",
    "中文测试：你好，世界。我们正在测试增量解码，中文的字符需要三个字节。",
    "Café crème brûlée, naïve façade, jalapeño, Ångström, Zürich, São Paulo.",
    "def add(a, b):\n    return a + b  # sum ✓ → done",
    "日本語のテキストも少し。한국어도 조금 있습니다.",
    "The </end> marker and <|im_end|> tokens stop generation. Thanks! 👋",
]
SAMPLES = [
    *CORPUS,
    "Mixed: naïve 中文 😀 façade 🎉 世界 brûlée 👍🏽 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 end",
    "😀😀😀🎉🎉 你好你好 ééé ñ",
]
CHAT_OUTPUT = (
    "Sure! Here's a small Python function:\n\n"
    "```python\n"
    "def greet(name: str) -> str:\n"
    '    return f"你好, {name}! 👋"\n'
    "```\n\n"
    "这个函数会返回一句问候语。🎉 Café crème ☕ — naïve façade 🚀"
)


@pytest.fixture(scope="module")
def byte_bpe() -> Tokenizer:
    """A small byte-level BPE (GPT-2 / Qwen2 style) whose tokens split multi-byte characters."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def metaspace_bpe() -> Tokenizer:
    """A SentencePiece-style tokenizer: decoding drops the leading space of the first token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, show_progress=False)
    tok.train_from_iterator(["Hello world again", "hello there world", "peace again"] * 3, trainer)
    return tok


@pytest.fixture(scope="module")
def byte_fallback_sp() -> Tokenizer:
    """A Llama-style SentencePiece BPE: characters out of the vocab become <0xNN> byte tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for char in "▁abcdefghijklmnopqrstuvwxyzHW!":
        vocab[char] = len(vocab)
    merges = [("▁", "w"), ("o", "r"), ("▁w", "or"), ("l", "d"), ("H", "e"), ("l", "l")]
    merges += [("He", "ll")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    model = models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>")
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


def stream(det: IncrementalDetokenizer, ids: Sequence[int], finish: bool = True) -> list[str]:
    """Feed ids until a stop; the pieces returned (the last one from finish() if asked)."""
    pieces = []
    for token_id in ids:
        pieces.append(det.add(token_id))
        if det.stopped:
            break
    if finish:
        pieces.append(det.finish())
    return pieces


def encode(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)


def check_consistent(
    tok: Tokenizer, ids: Sequence[int], skip_special_tokens: bool = True, prompt: Sequence[int] = ()
) -> list[str]:
    """Every prefix of the stream is a prefix of the full decode; the whole stream equals it."""
    full = tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
    so_far = ""
    pieces = []
    for count, token_id in enumerate(ids, 1):
        piece = det.add(token_id)
        pieces.append(piece)
        so_far += piece
        assert full.startswith(so_far), (ids, pieces, full)
        assert det.num_tokens == count
    pieces.append(det.finish())
    assert "".join(pieces) == full, (ids, pieces, full)
    assert det.text == full
    assert not det.stopped
    return pieces


def test_tokenizer_splits_multibyte_characters(byte_bpe: Tokenizer) -> None:
    # The test tokenizer must exercise the incomplete-character path: single tokens that decode
    # to part of a character, and real text whose token prefixes end inside a character.
    partial = [i for i in range(byte_bpe.get_vocab_size()) if byte_bpe.decode([i]) == "\ufffd"]
    assert partial
    for text in ("😀 🎉", "中文测试：你好", "crème brûlée"):
        ids = encode(byte_bpe, text)
        assert byte_bpe.decode(ids) == text
        prefixes = [byte_bpe.decode(ids[:n]) for n in range(1, len(ids))]
        assert any(p.endswith(REPLACEMENT_CHAR) for p in prefixes), text


@pytest.mark.parametrize("text", SAMPLES)
def test_stream_matches_full_decode(byte_bpe: Tokenizer, text: str) -> None:
    ids = encode(byte_bpe, text)
    pieces = check_consistent(byte_bpe, ids)
    assert "".join(pieces) == text.replace("<|im_end|>", "")  # a special token, skipped
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)
    # Text was held back for split characters ("" returned) and released with a later token.
    if any(ord(c) > 0x7FF for c in text):
        assert "" in pieces[:-1]


def test_random_token_sequences(byte_bpe: Tokenizer) -> None:
    rng = random.Random(1234)
    vocab = byte_bpe.get_vocab_size()
    realistic = [i for text in SAMPLES for i in encode(byte_bpe, text)]
    for trial in range(300):
        if trial % 2:
            # Any ids at all, special tokens and invalid byte sequences included.
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        else:
            # Slices of real text, which may start and end inside a character.
            start = rng.randrange(len(realistic))
            ids = realistic[start : start + rng.randint(1, 40)]
        check_consistent(byte_bpe, ids, skip_special_tokens=bool(trial % 3))
        # With context: the pieces are the decode of prompt + generated beyond the prompt.
        prompt = realistic[: rng.randint(0, 12)]
        full = byte_bpe.decode(prompt + ids)
        prompt_text = byte_bpe.decode(prompt)
        if not prompt_text.endswith(REPLACEMENT_CHAR) and full.startswith(prompt_text):
            det = IncrementalDetokenizer(byte_bpe, prompt)
            assert prompt_text + "".join(stream(det, ids)) == full


def test_special_tokens(byte_bpe: Tokenizer) -> None:
    im_end = byte_bpe.token_to_id("<|im_end|>")
    ids = [*encode(byte_bpe, "done 🎉"), im_end]
    assert "".join(check_consistent(byte_bpe, ids)) == "done 🎉"
    kept = check_consistent(byte_bpe, ids, skip_special_tokens=False)
    assert "".join(kept) == "done 🎉<|im_end|>"


def test_finish_replaces_incomplete_trailing_character(byte_bpe: Tokenizer) -> None:
    ids = encode(byte_bpe, "ok 😀")
    cut = next(n for n in range(len(ids)) if byte_bpe.decode(ids[:n]).endswith(REPLACEMENT_CHAR))
    det = IncrementalDetokenizer(byte_bpe)
    pieces = stream(det, ids[:cut], finish=False)
    assert "ok".startswith("".join(pieces))
    pieces.append(det.finish())
    assert pieces[-1].endswith(REPLACEMENT_CHAR)
    assert "".join(pieces) == byte_bpe.decode(ids[:cut]) == "ok " + REPLACEMENT_CHAR
    assert det.finish() == ""
    with pytest.raises(RuntimeError):
        det.add(ids[cut])


def test_window_stays_small(byte_bpe: Tokenizer) -> None:
    """The cost per token does not grow with the length of the output."""
    lengths: list[int] = []

    class Counting:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            lengths.append(len(ids))
            return byte_bpe.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = [i for text in SAMPLES * 20 for i in encode(byte_bpe, text)]
    det = IncrementalDetokenizer(cast(Tokenizer, Counting()))
    assert "".join(stream(det, ids)) == byte_bpe.decode(ids)
    assert len(ids) > 2000
    assert max(lengths) <= 12
    assert len(lengths) <= 2 * len(ids) + 1


# --- stop sequences ---------------------------------------------------------------------------


def test_stop_spanning_tokens(byte_bpe: Tokenizer) -> None:
    text = "Answer: 42 </end> and this is never shown"
    ids = encode(byte_bpe, text)
    pieces_text = [byte_bpe.decode([i]) for i in ids]
    assert "</end>" not in pieces_text and " <" in pieces_text  # the stop spans tokens
    det = IncrementalDetokenizer(byte_bpe, stop=["</end>"])
    pieces = stream(det, ids)
    assert "".join(pieces) == det.text == "Answer: 42 "
    assert det.stopped
    # The token that completed "</end>" was the last one consumed.
    done = next(n for n in range(len(ids)) if "</end>" in byte_bpe.decode(ids[: n + 1]))
    assert det.num_tokens == done + 1
    assert det.add(ids[0]) == "" and det.num_tokens == done + 1  # ignored after the stop
    assert pieces[-1] == ""  # finish() after a stop


def test_stop_prefix_held_back_while_ambiguous(byte_bpe: Tokenizer) -> None:
    head, parts = "Answer: 42 ", ["<", "/", "e"]
    det = IncrementalDetokenizer(byte_bpe, stop=["</end>"])
    assert "".join(det.add(i) for i in encode(byte_bpe, head)) == head
    for part in parts:  # "<", "</", "</e": each could start "</end>"
        assert all(det.add(i) == "" for i in encode(byte_bpe, part))
        assert det.text == head
    # "</ex" cannot: the held text is released with the new character.
    assert "".join(det.add(i) for i in encode(byte_bpe, "x")) == "</ex"
    assert not det.stopped and det.text == head + "</ex"
    # Held text that is still ambiguous at the end is flushed by finish().
    assert "".join(det.add(i) for i in encode(byte_bpe, " </en")) == " "
    assert det.finish() == "</en"
    assert det.text == head + "</ex </en"
    assert not det.stopped


def test_min_tokens_holds_back_the_stop_sequences(byte_bpe: Tokenizer) -> None:
    text = "a </end> b </end> c"
    ids = encode(byte_bpe, text)
    first = next(n for n in range(len(ids)) if "</end>" in byte_bpe.decode(ids[: n + 1])) + 1
    second = (
        next(
            n for n in range(first, len(ids)) if byte_bpe.decode(ids[: n + 1]).count("</end>") == 2
        )
        + 1
    )
    # before min_tokens tokens are out, a stop sequence is text; from then on it stops
    det = IncrementalDetokenizer(byte_bpe, stop=["</end>"], min_tokens=first + 1)
    assert "".join(stream(det, ids)) == det.text == "a </end> b "
    assert det.stopped and det.num_tokens == second
    # the stop completed by the min_tokens-th token itself counts
    det = IncrementalDetokenizer(byte_bpe, stop=["</end>"], min_tokens=first)
    assert "".join(stream(det, ids)) == "a " and det.num_tokens == first


def test_text_after_stop_in_same_token_is_dropped(byte_bpe: Tokenizer) -> None:
    ids = encode(byte_bpe, "The marker and tokens")
    tokens = [byte_bpe.decode([i]) for i in ids]
    assert " and" in tokens
    det = IncrementalDetokenizer(byte_bpe, stop=[" a"])
    pieces = stream(det, ids)
    assert "".join(pieces) == det.text == "The marker"
    assert det.stopped and det.num_tokens == tokens.index(" and") + 1


def test_stop_before_incomplete_character_in_same_token(byte_bpe: Tokenizer) -> None:
    # A token like "cr" + the first byte of "è": the stop "cr" is complete with that token even
    # though the token's text is held back for the unfinished character.
    ids = encode(byte_bpe, "Café crème")
    tokens = [byte_bpe.decode([i]) for i in ids]
    assert "cr\ufffd" in tokens
    det = IncrementalDetokenizer(byte_bpe, stop=["cr"])
    assert "".join(stream(det, ids)) == "Café "
    assert det.stopped and det.num_tokens == tokens.index("cr\ufffd") + 1


@pytest.mark.parametrize("stop", ["😀", "界", "ç", "ade 😀"])
def test_stop_on_multibyte_character(byte_bpe: Tokenizer, stop: str) -> None:
    text = "Hi! 你好，世界 façade 😀 after"
    ids = encode(byte_bpe, text)
    det = IncrementalDetokenizer(byte_bpe, stop=[stop])
    pieces = stream(det, ids)
    assert "".join(pieces) == text[: text.index(stop)]
    assert det.stopped
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


def test_multiple_stops_earliest_match_wins(byte_bpe: Tokenizer) -> None:
    text = "foo END bar STOP baz"
    ids = encode(byte_bpe, text)
    for stops in (["STOP", "END"], ["END", "STOP"], ["STOP", "END", "zzz", "bar!"]):
        det = IncrementalDetokenizer(byte_bpe, stop=stops)
        assert "".join(stream(det, ids)) == "foo "
        assert det.stopped


def test_overlapping_stops_do_not_depend_on_token_split(byte_bpe: Tokenizer) -> None:
    # "wor" completes first in the character stream, whatever the tokens: the result is the
    # same whether "world" arrives as one token or in single bytes.
    text = "hello world! more"
    stops = ["world!", "wor", "lo w"]
    whole = encode(byte_bpe, text)
    single_bytes = [i for char in text for i in encode(byte_bpe, char)]
    assert len(single_bytes) > len(whole)
    results = set()
    for ids in (whole, single_bytes):
        det = IncrementalDetokenizer(byte_bpe, stop=stops)
        results.add("".join(stream(det, ids)))
        assert det.stopped
    assert results == {"hel"}  # "lo w" ends before "wor" and "world!"
    # A stop that is a prefix of another: the shorter one completes first.
    det = IncrementalDetokenizer(byte_bpe, stop=["world!", "world"])
    assert "".join(stream(det, whole)) == "hello "


def test_stop_text_never_emitted_random(byte_bpe: Tokenizer) -> None:
    """Compare with a reference on random outputs: truncate the full text at the first stop."""
    rng = random.Random(7)
    realistic = [i for text in SAMPLES for i in encode(byte_bpe, text)]
    alphabet = "abe </>中文😀"
    for _ in range(200):
        start = rng.randrange(len(realistic))
        ids = realistic[start : start + rng.randint(1, 40)]
        full = byte_bpe.decode(ids)
        if not full:
            continue
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))]
        if rng.random() < 0.7:  # a stop taken from the text itself
            start = rng.randrange(len(full))
            stops.append(full[start : start + rng.randint(1, 4)])
        det = IncrementalDetokenizer(byte_bpe, stop=stops)
        streamed = "".join(stream(det, ids))
        ends = {s: full.find(s) + len(s) for s in stops if s in full}
        if ends:
            first_end = min(ends.values())
            expect = min(end - len(s) for s, end in ends.items() if end == first_end)
            assert det.stopped and streamed == full[:expect], (ids, stops, streamed)
        else:
            assert not det.stopped and streamed == full, (ids, stops, streamed)
        assert not any(s in streamed for s in stops)


def test_empty_stop_strings_are_ignored(byte_bpe: Tokenizer) -> None:
    ids = encode(byte_bpe, "plain text")
    det = IncrementalDetokenizer(byte_bpe, stop=["", "zzz"])
    assert "".join(stream(det, ids)) == "plain text"
    assert not det.stopped


# --- prompt context ---------------------------------------------------------------------------


def test_prompt_ids_give_leading_space(metaspace_bpe: Tokenizer) -> None:
    ids = encode(metaspace_bpe, "Hello world again")
    prompt, generated = ids[:1], ids[1:]
    assert metaspace_bpe.decode(prompt) == "Hello"
    assert metaspace_bpe.decode(generated[:1]) == "world"  # a lone token loses its space
    bare = stream(IncrementalDetokenizer(metaspace_bpe), generated)
    assert "".join(bare) == metaspace_bpe.decode(generated) == "world again"
    det = IncrementalDetokenizer(metaspace_bpe, prompt_ids=prompt)
    pieces = stream(det, generated)
    assert pieces[0] == " world"
    assert "Hello" + "".join(pieces) == metaspace_bpe.decode(ids) == "Hello world again"


def test_prompt_context_with_byte_level(byte_bpe: Tokenizer) -> None:
    prompt = encode(byte_bpe, "The prompt: 你好")
    generated = encode(byte_bpe, " world 😀 and more")
    det = IncrementalDetokenizer(byte_bpe, prompt_ids=prompt)
    assert "".join(stream(det, generated)) == " world 😀 and more"
    # A prompt that ends inside a character is not used as context.
    cut = encode(byte_bpe, "한국어도 조금")
    partial = next(n for n in range(1, len(cut)) if byte_bpe.decode(cut[:n]).endswith("\ufffd"))
    det = IncrementalDetokenizer(byte_bpe, prompt_ids=cut[:partial])
    assert "".join(stream(det, cut[partial:])) == byte_bpe.decode(cut[partial:])


@pytest.mark.parametrize("text", ["Hello wörld 😀 中文 ok", "中文😀 world", "ok 中"])
def test_byte_fallback_prompt_splits(byte_fallback_sp: Tokenizer, text: str) -> None:
    """Split the text into prompt + generated at every token: the stream is the rest."""
    tok = byte_fallback_sp
    ids = encode(tok, text)
    assert tok.decode(ids) == text
    assert "<0xE4>" in [tok.id_to_token(i) for i in ids]  # "中" as byte tokens
    check_consistent(tok, ids)
    for split in range(len(ids)):
        prompt_text = tok.decode(ids[:split])
        det = IncrementalDetokenizer(tok, prompt_ids=ids[:split])
        pieces = stream(det, ids[split:])
        if prompt_text.endswith(REPLACEMENT_CHAR):  # the prompt ends inside a character
            assert "".join(pieces) == tok.decode(ids[split:])
        else:
            assert prompt_text + "".join(pieces) == text, (split, pieces)
            assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


# --- a real tokenizer, when the export is there -----------------------------------------------


def test_chat_output_real_tokenizer(byte_bpe: Tokenizer) -> None:
    """Qwen2's tokenizer when the export is present (the trained one otherwise)."""
    tok = Tokenizer.from_file(str(QWEN_TOKENIZER)) if QWEN_TOKENIZER.is_file() else byte_bpe
    prompt = encode(tok, "<|im_start|>user\nWrite a greeting<|im_end|>\n<|im_start|>assistant\n")
    ids = encode(tok, CHAT_OUTPUT)
    assert tok.decode(ids) == CHAT_OUTPUT
    assert any(tok.decode(ids[:n]).endswith(REPLACEMENT_CHAR) for n in range(1, len(ids)))
    eos = tok.token_to_id("<|im_end|>")
    assert eos is not None
    for context in ((), prompt):
        det = IncrementalDetokenizer(tok, prompt_ids=context)
        pieces = stream(det, [*ids, eos])
        assert "".join(pieces) == det.text == CHAT_OUTPUT
        assert not any(REPLACEMENT_CHAR in piece for piece in pieces)
        assert det.num_tokens == len(ids) + 1
    check_consistent(tok, [*ids, eos], skip_special_tokens=False)
    # Stop at the end of the code block; the fence and the rest are not returned.
    det = IncrementalDetokenizer(tok, prompt_ids=prompt, stop=["```\n\n", "STOP"])
    pieces = stream(det, ids)
    assert "".join(pieces) == CHAT_OUTPUT[: CHAT_OUTPUT.index("```\n\n")]
    assert det.stopped and det.num_tokens < len(ids)
    det = IncrementalDetokenizer(tok, stop=["问候", "🎉"])
    assert "".join(stream(det, ids)) == CHAT_OUTPUT[: CHAT_OUTPUT.index("问候")]
