"""The OpenAI-compatible responses: chat and text completions, their streamed chunks, models.

They serialize (``model_dump_json()``) to exactly the JSON the ``openai`` Python client parses,
valid against OpenAI's OpenAPI document: a chat message always carries ``"refusal": null``,
chunk choices carry ``"logprobs"`` and ``"finish_reason"`` (``null`` until the last one), every
chat chunk carries ``"usage"`` (``null`` except on the usage chunk; a completions chunk leaves
it out, as the document types it an object), and a streamed ``delta`` holds only the keys that
are set (the last choice chunk has ``"delta": {}``). Non-finite logprobs are reported as
``-9999.0``, as OpenAI does, so the JSON stays valid. ``system_fingerprint`` is always a string:
the gateway's release, the backend configuration a seed's samples depend on.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from importlib import metadata
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

UNLIKELY_LOGPROB = -9999.0  # what OpenAI reports for a logprob that is -inf
OWNER = "pipeshard"
FinishReason = Literal["stop", "length", "tool_calls"]  # tool_calls: chat only


def _fingerprint() -> str:
    try:
        return f"fp_pipeshard_{metadata.version('pipeshard')}"
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "fp_pipeshard_dev"


SYSTEM_FINGERPRINT = _fingerprint()


def _is_none(value: Any) -> bool:
    return value is None


def _finite_logprob(value: float) -> float:
    return value if math.isfinite(value) else UNLIKELY_LOGPROB


Logprob = Annotated[float, AfterValidator(_finite_logprob)]


def new_id(prefix: str) -> str:
    """A fresh response id such as ``chatcmpl-<32 hex>`` or ``cmpl-<32 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


class PromptTokensDetails(BaseModel):
    # prompt tokens whose KV the stages took from their prefix cache instead of computing it
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    # completion tokens of the model's reasoning (its end tag included), not of its answer
    reasoning_tokens: int = 0


class Usage(BaseModel):
    """``completion_tokens_details`` only where the model reasons (a reasoning parser runs)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails | None = Field(
        default=None, exclude_if=_is_none
    )

    @classmethod
    def of(
        cls,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int = 0,
        reasoning_tokens: int | None = None,
    ) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
            completion_tokens_details=None
            if reasoning_tokens is None
            else CompletionTokensDetails(reasoning_tokens=reasoning_tokens),
        )


class TopLogprob(BaseModel):
    token: str
    logprob: Logprob
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: Logprob
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


def chat_token_logprob(
    raw: bytes, logprob: float, top: Sequence[tuple[bytes, float]] = ()
) -> ChatTokenLogprob:
    """A chat logprob entry from raw token bytes (possibly half a UTF-8 character).

    ``token`` is their lossy UTF-8 decoding, ``bytes`` the exact bytes; ``top`` is
    ``(raw bytes, logprob)`` pairs, most probable first.
    """
    return ChatTokenLogprob(
        token=raw.decode("utf-8", errors="replace"),
        logprob=logprob,
        bytes=list(raw),
        top_logprobs=[
            TopLogprob(token=t.decode("utf-8", errors="replace"), logprob=lp, bytes=list(t))
            for t, lp in top
        ],
    )


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCall(BaseModel):
    """A call the model made: ``{"id": "call_<24 hex>", "type": "function", "function"}``."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(BaseModel):
    """The answer; ``tool_calls`` is there only when the model called tools (then ``content``
    is the text outside the calls, or null); ``reasoning_content`` only where the model
    reasons (its thinking, never in ``content``; null when it wrote none)."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = Field(default=None, exclude_if=_is_none)
    refusal: None = None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=_is_none)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[ChatCompletionChoice]
    usage: Usage


class DeltaFunctionCall(BaseModel):
    name: str | None = Field(default=None, exclude_if=_is_none)
    arguments: str | None = Field(default=None, exclude_if=_is_none)  # a fragment of the JSON


class DeltaToolCall(BaseModel):
    """A streamed piece of tool call ``index``: first its ``id``, ``type`` and name (with
    ``"arguments": ""``), then fragments of its arguments."""

    index: int
    id: str | None = Field(default=None, exclude_if=_is_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=_is_none)
    function: DeltaFunctionCall | None = Field(default=None, exclude_if=_is_none)


class ChatDelta(BaseModel):
    """A streamed delta; serializes only the keys that are set (``{}`` on the last chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        return {key: value for key, value in data.items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    """Legacy logprobs: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Logprob] = Field(default_factory=list)
    top_logprobs: list[dict[str, Logprob]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[CompletionChunkChoice]
    # left out until the usage chunk: OpenAPI types it as an object, never null
    usage: Usage | None = Field(default=None, exclude_if=_is_none)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = OWNER


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
