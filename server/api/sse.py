"""Server-Sent Events framing and the streamed chunks of chat and legacy completions.

Pure functions, no server: every event is exactly ``data: <one-line JSON>\\n\\n`` and a stream
ends with ``data: [DONE]\\n\\n``. JSON is compact and UTF-8 (not ASCII-escaped); line breaks
inside strings are escaped by JSON, so an event never spans lines.

A chat stream for one choice is::

    first_chat_chunk -> (chat_reasoning_chunk | chat_content_chunk | chat_tool_call_chunks)*
    -> chat_final_chunk -> [chat_usage_chunk] -> [DONE]

(the usage chunk only with ``stream_options.include_usage``); a legacy completion stream is
``completion_text_chunk* -> completion_final_chunk -> [completion_usage_chunk] -> [DONE]``.
Every chunk of one response shares ``id`` and ``created``; every chunk but the usage chunk has
``"usage": null``. An error after the 200 has been sent is :func:`sse_error` then
:func:`sse_done`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from server.api.errors import APIError
from server.api.responses import (
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChatTokenLogprob,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    DeltaFunctionCall,
    DeltaToolCall,
    FinishReason,
    Usage,
)

__all__ = [
    "SSE_HEADERS",
    "SSE_MEDIA_TYPE",
    "chat_content_chunk",
    "chat_final_chunk",
    "chat_reasoning_chunk",
    "chat_tool_call_chunks",
    "chat_usage_chunk",
    "completion_final_chunk",
    "completion_text_chunk",
    "completion_usage_chunk",
    "first_chat_chunk",
    "sse_done",
    "sse_error",
    "sse_event",
]

SSE_MEDIA_TYPE = "text/event-stream"
# Headers worth sending with a stream: no caching, and no buffering by reverse proxies (nginx).
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

_DONE = b"data: [DONE]\n\n"


def sse_event(payload: BaseModel | Mapping[str, Any]) -> bytes:
    """``b"data: <compact one-line JSON>\\n\\n"`` for a response model or a plain mapping.

    Models keep their ``null`` fields (``"usage": null``, ``"finish_reason": null``); fields that
    must be absent (unset keys of a streamed ``delta``) are dropped by the models themselves.
    Mappings must be JSON-serializable without NaN or infinity (ValueError otherwise).
    """
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json()
    else:
        text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return b"data: " + text.encode("utf-8") + b"\n\n"


def sse_done() -> bytes:
    """The end of a stream: ``b"data: [DONE]\\n\\n"``."""
    return _DONE


def sse_keepalive() -> bytes:
    """An SSE comment: clients ignore it, and it tells their read timeout the server is alive."""
    return b": keep-alive\n\n"


def sse_error(error: APIError) -> bytes:
    """An error event ``data: {"error": {...}}`` for a failure after the stream started."""
    return sse_event(error.response())


# --- chat ----------------------------------------------------------------------------------


def _chat_chunk(
    id: str, created: int, model: str, choices: list[ChatChunkChoice], usage: Usage | None = None
) -> ChatCompletionChunk:
    return ChatCompletionChunk(id=id, created=created, model=model, choices=choices, usage=usage)


def first_chat_chunk(
    id: str, created: int, model: str, index: int = 0, content: str | None = ""
) -> ChatCompletionChunk:
    """The first chunk of a choice: ``delta = {"role": "assistant", "content": ""}`` (only the
    role with ``content=None``: an answer that may be only tool calls has no content yet)."""
    delta = ChatDelta(role="assistant", content=content)
    return _chat_chunk(id, created, model, [ChatChunkChoice(index=index, delta=delta)])


def chat_content_chunk(
    id: str,
    created: int,
    model: str,
    content: str,
    index: int = 0,
    logprobs: list[ChatTokenLogprob] | None = None,
) -> ChatCompletionChunk:
    """Text in ``delta.content``, with the logprobs of the tokens it came from if asked for."""
    choice = ChatChunkChoice(
        index=index,
        delta=ChatDelta(content=content),
        logprobs=None if logprobs is None else ChatChoiceLogprobs(content=logprobs),
    )
    return _chat_chunk(id, created, model, [choice])


def chat_reasoning_chunk(
    id: str,
    created: int,
    model: str,
    reasoning: str,
    index: int = 0,
    logprobs: list[ChatTokenLogprob] | None = None,
) -> ChatCompletionChunk:
    """The model's reasoning in ``delta.reasoning_content`` (never in ``content``), with the
    logprobs of the tokens it came from if asked for."""
    choice = ChatChunkChoice(
        index=index,
        delta=ChatDelta(reasoning_content=reasoning),
        logprobs=None if logprobs is None else ChatChoiceLogprobs(content=logprobs),
    )
    return _chat_chunk(id, created, model, [choice])


def chat_tool_call_chunks(
    id: str,
    created: int,
    model: str,
    call_index: int,
    call_id: str,
    name: str,
    arguments: str,
    index: int = 0,
) -> list[ChatCompletionChunk]:
    """A complete tool call as OpenAI streams one: a chunk with its ``id``, ``type`` and
    ``function.name`` (``"arguments": ""``), then one with the ``arguments`` (all of them, as
    one fragment). ``call_index`` counts the choice's calls from 0."""
    opening = DeltaToolCall(
        index=call_index,
        id=call_id,
        type="function",
        function=DeltaFunctionCall(name=name, arguments=""),
    )
    rest = DeltaToolCall(index=call_index, function=DeltaFunctionCall(arguments=arguments))
    return [
        _chat_chunk(
            id, created, model, [ChatChunkChoice(index=index, delta=ChatDelta(tool_calls=[d]))]
        )
        for d in (opening, rest)
    ]


def chat_final_chunk(
    id: str, created: int, model: str, finish_reason: FinishReason, index: int = 0
) -> ChatCompletionChunk:
    """The last chunk of a choice: an empty delta and the ``finish_reason``."""
    choice = ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=finish_reason)
    return _chat_chunk(id, created, model, [choice])


def chat_usage_chunk(id: str, created: int, model: str, usage: Usage) -> ChatCompletionChunk:
    """The usage chunk right before ``[DONE]``: ``choices: []`` and ``usage``."""
    return _chat_chunk(id, created, model, [], usage)


# --- legacy completions ----------------------------------------------------------------------


def _completion_chunk(
    id: str,
    created: int,
    model: str,
    choices: list[CompletionChunkChoice],
    usage: Usage | None = None,
) -> CompletionChunk:
    return CompletionChunk(id=id, created=created, model=model, choices=choices, usage=usage)


def completion_text_chunk(
    id: str,
    created: int,
    model: str,
    text: str,
    index: int = 0,
    logprobs: CompletionLogprobs | None = None,
) -> CompletionChunk:
    """Generated text (``finish_reason: null``), with its tokens' logprobs if asked for."""
    choice = CompletionChunkChoice(index=index, text=text, logprobs=logprobs)
    return _completion_chunk(id, created, model, [choice])


def completion_final_chunk(
    id: str,
    created: int,
    model: str,
    finish_reason: FinishReason,
    index: int = 0,
    text: str = "",
    logprobs: CompletionLogprobs | None = None,
) -> CompletionChunk:
    """The last chunk of a choice: its ``finish_reason`` (and any text still held back)."""
    choice = CompletionChunkChoice(
        index=index, text=text, logprobs=logprobs, finish_reason=finish_reason
    )
    return _completion_chunk(id, created, model, [choice])


def completion_usage_chunk(id: str, created: int, model: str, usage: Usage) -> CompletionChunk:
    """The usage chunk right before ``[DONE]``: ``choices: []`` and ``usage``."""
    return _completion_chunk(id, created, model, [], usage)
