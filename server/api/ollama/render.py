"""Ollama's replies from the neutral output (server/api/output.py): one choice's pieces
(reasoning, text, complete tool calls) become ``/api/chat`` messages or ``/api/generate``
responses, whole or as NDJSON (one JSON object a line, ``"done": false`` until the last, which
has ``done_reason`` and the statistics).

``read_pieces -> Piece* + Outcome -> ChatResponse / GenerateResponse`` (JSON) or their lines.
A failure after the stream started ends it with one ``{"error": "..."}`` line, as Ollama's.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from server.api.errors import APIError
from server.api.ollama.schema import (
    ChatResponse,
    GenerateResponse,
    Metrics,
    OutMessage,
    OutToolCall,
    OutToolCallFunction,
)
from server.api.output import Outcome, Piece, merged, read_pieces
from server.api.serving import CompletionService, Prepared
from server.api.tools import new_call_id

log = logging.getLogger(__name__)

Kind = Literal["chat", "generate"]
NDJSON_MEDIA_TYPE = "application/x-ndjson"


def timestamp(at: float | None = None) -> str:
    """An RFC 3339 time in UTC with microseconds, as Ollama writes ``created_at``."""
    moment = datetime.fromtimestamp(time.time() if at is None else at, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class Clock:
    """When the request came, when its first token did, when its output ended."""

    started: float = field(default_factory=time.perf_counter)
    first: float | None = None
    ended: float | None = None

    def saw(self, outcome: Outcome) -> None:
        if self.first is None and outcome.output_tokens:
            self.first = time.perf_counter()

    def metrics(self, outcome: Outcome) -> Metrics:
        """Ollama's statistics, in nanoseconds: the prompt's evaluation is the time to the
        first token (the queue included), the output's the rest; the model is always loaded."""
        ended = self.ended or time.perf_counter()
        first = self.first or ended
        ns = 1_000_000_000
        return Metrics(
            total_duration=round((ended - self.started) * ns),
            load_duration=0,
            prompt_eval_count=outcome.prompt_tokens,
            prompt_eval_duration=round((first - self.started) * ns),
            eval_count=outcome.output_tokens,
            eval_duration=round((ended - first) * ns),
        )


def done_reason(outcome: Outcome) -> str:
    """``length`` when the output was cut at the token limit, else ``stop`` (after tool calls
    too, as Ollama says)."""
    return "length" if outcome.finish == "length" else "stop"


def _call(piece: Piece, index: int) -> OutToolCall:
    assert piece.call is not None
    return OutToolCall(
        id=new_call_id(),
        function=OutToolCallFunction(
            index=index, name=piece.call.name, arguments=json.loads(piece.call.arguments)
        ),
    )


def _line(body: dict[str, Any]) -> bytes:
    return (json.dumps(body, ensure_ascii=False) + "\n").encode()


def _body(reply: ChatResponse | GenerateResponse, metrics: Metrics | None = None) -> dict[str, Any]:
    out = reply.model_dump(exclude_none=True)
    if isinstance(reply, ChatResponse):
        out["message"] = reply.message.model_dump(exclude_none=True)
    if metrics is not None:
        out.update(metrics.model_dump())
    return out


def _reply(
    kind: Kind,
    model: str,
    text: str = "",
    thinking: str | None = None,
    calls: list[OutToolCall] | None = None,
    reason: str | None = None,
) -> ChatResponse | GenerateResponse:
    done = reason is not None
    if kind == "chat":
        message = OutMessage(content=text, thinking=thinking, tool_calls=calls)
        return ChatResponse(
            model=model, created_at=timestamp(), message=message, done=done, done_reason=reason
        )
    return GenerateResponse(
        model=model,
        created_at=timestamp(),
        response=text,
        thinking=thinking,
        done=done,
        done_reason=reason,
    )


def loaded(kind: Kind, model: str) -> dict[str, Any]:
    """The answer to a request without messages (or prompt): the model is loaded (it always
    is while the stages run)."""
    return _body(_reply(kind, model, reason="load"))


async def whole(
    service: CompletionService, prep: Prepared, kind: Kind, model: str, clock: Clock
) -> dict[str, Any]:
    """The whole reply (``"stream": false``)."""
    reader, batches = await read_pieces(service, prep)
    pieces: list[Piece] = []
    async for batch in batches:
        clock.saw(reader.outcome)
        pieces.extend(batch)
    clock.ended = time.perf_counter()
    outcome = reader.outcome
    text = "".join(p.text for p in merged(pieces) if p.kind == "text")
    thinking = "".join(p.text for p in pieces if p.kind == "reasoning") or None
    calls = [_call(p, i) for i, p in enumerate(p for p in pieces if p.kind == "call")]
    if calls:  # the text around the calls, as chat completions give it
        text = text.strip()
    reply = _reply(kind, model, text, thinking, calls or None, done_reason(outcome))
    return _body(reply, clock.metrics(outcome))


async def open_stream(
    service: CompletionService, prep: Prepared, kind: Kind, model: str, clock: Clock
) -> AsyncIterator[bytes]:
    """Start the generation (errors before any output are raised here, as plain HTTP errors;
    a first token slower than the stream keep-alive lets the stream start without it) and
    return the NDJSON lines."""
    reader, batches = await read_pieces(service, prep, stream=True)
    return _lines(prep, kind, model, clock, reader.outcome, batches)


async def _lines(
    prep: Prepared,
    kind: Kind,
    model: str,
    clock: Clock,
    outcome: Outcome,
    batches: AsyncIterator[list[Piece]],
) -> AsyncIterator[bytes]:
    calls = 0
    try:
        async for batch in batches:  # (an empty batch while the prompt is read: no line)
            clock.saw(outcome)
            for piece in batch:
                if piece.kind == "call":
                    reply = _reply(kind, model, calls=[_call(piece, calls)])
                    calls += 1
                elif piece.kind == "reasoning":
                    reply = _reply(kind, model, thinking=piece.text)
                else:
                    reply = _reply(kind, model, piece.text)
                yield _line(_body(reply))
    except APIError as exc:
        log.warning("request %s failed while streaming: %s", prep.request_id, exc.message)
        yield _line({"error": exc.message})
        return
    except Exception as exc:
        log.exception("request %s failed while streaming", prep.request_id)
        yield _line({"error": f"generation failed: {exc}"})
        return
    clock.ended = time.perf_counter()
    yield _line(_body(_reply(kind, model, reason=done_reason(outcome)), clock.metrics(outcome)))
