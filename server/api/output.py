"""One choice's output as the pieces the Responses and Messages APIs build their answers from:
reasoning, text of the answer, and complete tool calls.

``CompletionService.open_events -> ChoiceEvent* -> (OutputReader: reasoning, ToolCallParser
on the text) Piece* + Outcome``; server/api/responses_api.py and server/api/anthropic.py turn
the pieces into their own output items / content blocks (streamed or whole), as the chat API
does with the same tool-call parser.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from server.api.responses import FinishReason
from server.api.serving import (
    ChoiceEvent,
    ChoiceTally,
    CompletionService,
    Prepared,
    finish_with_calls,
)
from server.api.tools import ParsedToolCall, ToolCallParser

PieceKind = Literal["reasoning", "text", "call"]


@dataclass(frozen=True)
class Piece:
    """A piece of the output: reasoning or answer text (``text``), or a complete ``call``."""

    kind: PieceKind
    text: str = ""
    call: ParsedToolCall | None = None


@dataclass
class Outcome:
    """How the output ended and what it cost."""

    prompt_tokens: int
    finish: FinishReason = "length"
    output_tokens: int = 0
    reasoning_tokens: int = 0  # tokens of the reasoning (its tags included)
    cached_tokens: int = 0  # prompt tokens taken from the stages' prefix cache
    eos: bool = False  # the model ended its answer (not a stop sequence, not the limit)
    calls: int = 0
    text: str = ""  # the answer's whole raw text (tool calls included)
    token_ids: list[int] = field(default_factory=list)


@dataclass
class OutputReader:
    """Reads one choice's events into :class:`Piece` s: reasoning as it comes, the answer's
    text with its tool calls parsed out (when tools are offered), each call once complete."""

    service: CompletionService
    prep: Prepared
    tally: ChoiceTally = field(default_factory=ChoiceTally)  # counted by the service
    outcome: Outcome = field(init=False)
    _parser: ToolCallParser | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.outcome = Outcome(prompt_tokens=len(self.prep.generation.prompt_ids))
        if self.prep.tools is not None:
            self._parser = self.prep.tools.parser()

    def read(self, event: ChoiceEvent) -> list[Piece]:
        out = self.outcome
        pieces: list[Piece] = []
        if event.token is not None:
            out.output_tokens += 1
            out.token_ids.append(event.token.token_id)
            if event.token.token_id in self.service.engine.eos_ids:
                out.eos = True
        out.reasoning_tokens = self.tally.reasoning_tokens
        if event.reasoning:
            pieces.append(Piece("reasoning", event.reasoning))
        out.text += event.text
        if self._parser is None:
            if event.text:
                pieces.append(Piece("text", event.text))
        else:
            found = self._parser.feed(event.text)
            if event.finish_reason:
                found += self._parser.finish()
            for item in found:
                if isinstance(item, ParsedToolCall):
                    out.calls += 1
                    pieces.append(Piece("call", call=item))
                elif item:
                    pieces.append(Piece("text", item))
        if event.finish_reason:
            out.finish = finish_with_calls(event.finish_reason, out.calls)
            out.cached_tokens = event.cached_tokens
        return pieces


async def read_pieces(
    service: CompletionService, prep: Prepared, *, stream: bool = False
) -> tuple[OutputReader, AsyncIterator[list[Piece]]]:
    """Start the generation (errors before any output raise here, as :class:`APIError`) and
    return the reader and the pieces of each event; the reader's ``outcome`` is complete once
    the iteration ends. Leaving the iteration early ends the generation.

    With ``stream``, a first token slower than the service's ``keepalive_s`` (a long prefill)
    is not waited for here: the iteration then yields an empty batch every ``keepalive_s``
    until the output comes (the caller sends its keep-alive event), and a failure before it
    is raised by the iteration instead."""
    reader = OutputReader(service, prep)
    patience = service.keepalive_s if stream else 0.0
    if patience <= 0:
        events = await service.open_events(prep, reader.tally)
        return reader, _pieces(reader, events)
    opening = asyncio.ensure_future(service.open_events(prep, reader.tally))
    try:
        await asyncio.wait({opening}, timeout=patience)
    except BaseException:
        opening.cancel()
        raise
    if opening.done():
        return reader, _pieces(reader, opening.result())
    return reader, _waiting(reader, opening, patience)


async def _waiting(
    reader: OutputReader,
    opening: asyncio.Future[AsyncGenerator[ChoiceEvent, None]],
    interval: float,
) -> AsyncIterator[list[Piece]]:
    events: AsyncGenerator[ChoiceEvent, None] | None = None
    try:
        while not opening.done():
            done, _ = await asyncio.wait({opening}, timeout=interval)
            if not done:
                yield []
        events = opening.result()
    finally:
        if events is None:  # the client left while the prompt was read
            opening.cancel()
            with contextlib.suppress(BaseException):
                started = await opening
                await started.aclose()  # it had opened the generation all the same
    async for pieces in _pieces(reader, events):
        yield pieces


async def _pieces(
    reader: OutputReader, events: AsyncGenerator[ChoiceEvent, None]
) -> AsyncIterator[list[Piece]]:
    async with contextlib.aclosing(events):
        async for event in events:
            yield reader.read(event)


def merged(pieces: Sequence[Piece]) -> list[Piece]:
    """Whole output: runs of reasoning or text joined into one piece each."""
    out: list[Piece] = []
    for piece in pieces:
        if out and piece.kind != "call" and out[-1].kind == piece.kind:
            out[-1] = Piece(piece.kind, out[-1].text + piece.text)
        else:
            out.append(piece)
    return out


def stop_sequence_found(service: CompletionService, prep: Prepared, outcome: Outcome) -> str | None:
    """The stop sequence that ended the output (finish ``stop`` without the end of the
    answer), or None: the one that comes first in the decoded output (the detokenizer cut the
    text at the first one)."""
    if outcome.finish != "stop" or outcome.eos or not prep.stop:
        return None
    if len(prep.stop) == 1:
        return prep.stop[0]
    text = service.codec.tokenizer.decode(outcome.token_ids, skip_special_tokens=False)
    found = [(text.find(s), -len(s), s) for s in prep.stop if s in text]
    return min(found)[2] if found else prep.stop[0]


def named_event(kind: str, data: Mapping[str, Any]) -> bytes:
    """One server-sent event with its name: ``event: KIND`` and ``data: <JSON>`` (the streams of
    the Messages and Responses APIs)."""
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
