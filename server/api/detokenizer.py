"""Incremental detokenization for streaming completions, with OpenAI-style stop sequences.

``token id -> (prefix-offset decode) new stable text -> (stop-sequence filter) text to emit``

Decoding uses the prefix-offset scheme of vLLM / text-generation-inference: the detokenizer keeps
a small window of recent token ids and two marks in it, ``read_offset`` (the end of what was
already turned into text) and the window start (the prefix).  Each step decodes
``window[:read_offset]`` (the prefix text) and the whole window, and emits what the whole window
decodes to beyond the prefix text.  Decoding the prefix along with the new tokens keeps the text
right for decoders whose output depends on the neighbours (SentencePiece / Metaspace drops the
leading space of the first token it decodes); while the window ends in U+FFFD, a byte-level BPE
token that split a multi-byte UTF-8 character, nothing is emitted and the window grows until the
character completes.  After each emission the window drops everything before the old read
offset, so it holds the last one or two emitted chunks and a step costs O(1), not O(n).

Stop sequences follow the OpenAI semantics: generation stops at the first point where the
generated text contains one of them, and the text returned ends right before it.  Text that could
still become the start of a stop sequence is held back until it is clear it is not.  With several
stop sequences, the occurrence that completes first in the character stream wins (ties: the
longer one, which starts earlier), so the result does not depend on how the text was split into
tokens, and the returned text never contains any of the stop sequences.
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens used as the initial prefix window (vLLM uses the same number).
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns generated token ids, one at a time, into text that is safe to stream.

    ``add`` returns the new text for each token ("" while text is held back: an incomplete UTF-8
    character or a possible start of a stop sequence); ``finish`` flushes what is still held when
    generation ends without a stop sequence (length or EOS).  Without stop sequences, everything
    returned concatenates to ``tokenizer.decode(generated_ids, skip_special_tokens=...)``.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        prompt_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        # stop sequences are looked for from the min_tokens-th token's text on (as vLLM does)
        self._min_tokens = min_tokens
        self._skip_special_tokens = skip_special_tokens
        # Empty stop strings would match everywhere; OpenAI ignores them too.
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        self._max_held = max((len(s) for s in self._stops), default=1) - 1
        # The window: ids[:read_offset] is the prefix (already decoded), the rest is not yet.
        self._ids: list[int] = self._prompt_context(prompt_ids)
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._pending = ""  # decoded but held back: it may be the start of a stop sequence
        self._emitted: list[str] = []
        self._num_tokens = 0
        self._stopped = False
        self._finished = False

    @property
    def stopped(self) -> bool:
        """Whether a stop sequence was matched (later tokens are ignored)."""
        return self._stopped

    @property
    def text(self) -> str:
        """All text emitted so far (never the stop sequence or anything after it)."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    @property
    def num_tokens(self) -> int:
        """Tokens added, including the one that completed a stop sequence."""
        return self._num_tokens

    def add(self, token_id: int) -> str:
        """Add one generated token; return the new text that is safe to emit now (maybe "").

        After a stop sequence matched, further tokens are ignored and "" is returned; after
        ``finish`` (without a stop), adding is an error.
        """
        if self._stopped:
            return ""
        if self._finished:
            raise RuntimeError("add() after finish()")
        self._num_tokens += 1
        self._ids.append(int(token_id))
        new_text = self._decode(self._ids)
        prefix_len = len(self._prefix_text)
        if len(new_text) > prefix_len and not new_text.endswith(REPLACEMENT_CHAR):
            # The window ends on a complete character: emit and move the window on.
            del self._ids[: self._read_offset]
            self._read_offset = len(self._ids)
            self._prefix_text = self._decode(self._ids)
            return self._filter(new_text[prefix_len:])
        if not self._stops:
            return ""
        # Held back (an incomplete character, or no new text yet). The characters before the
        # incomplete one are final already: look at them for a stop sequence without waiting.
        return self._filter("", lookahead=new_text[prefix_len:].rstrip(REPLACEMENT_CHAR))

    def finish(self) -> str:
        """Flush what is still held back, when generation ends without a stop sequence.

        An incomplete trailing UTF-8 sequence becomes U+FFFD, as ``tokenizer.decode`` writes it.
        Calling it again, or after a stop, returns "".
        """
        if self._finished or self._stopped:
            self._finished = True
            return ""
        self._finished = True
        new_text = self._decode(self._ids)
        rest = new_text[len(self._prefix_text) :]
        self._ids = []
        self._read_offset = 0
        self._prefix_text = ""
        return self._filter(rest, final=True)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _prompt_context(self, prompt_ids: Sequence[int]) -> list[int]:
        """The last prompt tokens as the initial prefix window (for the first token's spacing)."""
        prompt = [int(i) for i in prompt_ids[-(PROMPT_CONTEXT_TOKENS + 3) :]]
        size = min(PROMPT_CONTEXT_TOKENS, len(prompt))
        text = self._decode(prompt[len(prompt) - size :])
        # Start the window on a character boundary: a window that starts inside a character
        # decodes to U+FFFD there (a byte-fallback decoder turns the whole byte run into U+FFFD).
        # A character takes at most 4 bytes, so at most 3 more tokens are needed.
        extra = 0
        while text.startswith(REPLACEMENT_CHAR) and extra < 3 and size < len(prompt):
            size += 1
            extra += 1
            text = self._decode(prompt[len(prompt) - size :])
        # A prompt that ends inside a character would make the first generated bytes complete it
        # inside the prefix text; that text belongs to neither side, so do without context.
        if text.endswith(REPLACEMENT_CHAR):
            return []
        return prompt[len(prompt) - size :]

    def _filter(self, new_text: str, lookahead: str = "", final: bool = False) -> str:
        """Apply the stop sequences to newly decoded text; return what may be emitted now.

        ``lookahead`` is final text that follows ``new_text`` but is not emitted yet (the
        complete characters before an incomplete one): it is only searched for a stop sequence.
        """
        if not self._stops:
            out = new_text
        elif self._num_tokens < self._min_tokens and not final:
            # too early to stop: a stop sequence completed now is text; the end of the text
            # that may still become one is held back as usual
            self._pending += new_text
            ends = [self._pending.rfind(s) + len(s) for s in self._stops if s in self._pending]
            keep = max(ends, default=0)
            rest = self._pending[keep:]
            keep += len(rest) - self._held_length(rest)
            out, self._pending = self._pending[:keep], self._pending[keep:]
        else:
            self._pending += new_text
            candidate = self._pending + lookahead
            cut = self._find_stop(candidate)
            if cut is not None:
                out = candidate[:cut]
                self._stopped = True
                self._pending = ""
            elif final:
                out, self._pending = self._pending, ""
            else:
                keep = len(self._pending) - self._held_length(self._pending)
                out, self._pending = self._pending[:keep], self._pending[keep:]
        if out:
            self._emitted.append(out)
        return out

    def _find_stop(self, text: str) -> int | None:
        """Where the text must end for the stop occurrence that completes first, if any."""
        best: tuple[int, int] | None = None  # (end, start)
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best):
                best = (start + len(stop), start)
        return None if best is None else best[1]

    def _held_length(self, text: str) -> int:
        """Length of the longest end of ``text`` that is the start of some stop sequence."""
        for size in range(min(self._max_held, len(text)), 0, -1):
            tail = text[-size:]
            if any(stop.startswith(tail) for stop in self._stops):
                return size
        return 0
