"""The Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

``MessagesRequest -> (to_chat) ChatCompletionRequest -> CompletionService.prepare`` (the chat
template, the tool format, the grammars of forced tool use) ``-> open_events -> OutputReader
pieces -> Message`` (JSON) or Anthropic's event stream (``message_start``,
``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``, ``message_stop``).
Errors leave in Anthropic's envelope (server/api/errors.py ``anthropic_error``). What the
gateway does not support is refused with a 400 naming it; docs/api.md lists both.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
)

from server.api.errors import APIError, anthropic_error, short_json
from server.api.output import Outcome, Piece, merged, named_event, read_pieces, stop_sequence_found
from server.api.reasoning import template_reads
from server.api.requests import (
    FUNCTION_NAME_PATTERN,
    INT32_MAX,
    ChatCompletionRequest,
    JsonSchemaObject,
    _Request,
    check_distinct,
    parse_request,
)
from server.api.serving import CompletionService, Prepared

log = logging.getLogger(__name__)
MAX_STOP_SEQUENCES = 16

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class _Model(_Request):
    """Unknown fields are ignored and named (``ignored_fields``), as on the chat endpoints."""


class CacheControl(_Model):
    """Accepted on blocks and tools: the stages' prefix cache keeps every prompt's prefix
    without being asked, so a breakpoint changes nothing."""

    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlock(_Model):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None  # citations are not supported: only null


class ToolUseBlock(_Model):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Model):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: list[TextBlock] | str | None = None
    is_error: StrictBool | None = None
    cache_control: CacheControl | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return _check_blocks(value, ("text",), "tool_result content")


class ThinkingBlock(_Model):
    """An earlier turn's thinking, sent back by the client: left out of the prompt, as the
    chat templates of thinking models leave out earlier turns' reasoning."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Model):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]
BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


def _check_blocks(value: Any, allowed: tuple[str, ...], what: str) -> Any:
    """One readable 400 for a block whose type is not supported (an image, a document, a
    server tool's block), before the union's own errors."""
    if value is None or isinstance(value, str) or not isinstance(value, list):
        return value
    for i, block in enumerate(value):
        if not isinstance(block, Mapping):
            raise ValueError(f"{what} block {i} must be an object, got {short_json(block)}")
        kind = block.get("type")
        if kind not in allowed:
            raise ValueError(
                f"{what} block {i} has type {short_json(kind)}, which is not supported "
                f"(supported: {', '.join(allowed)})"
            )
    return value


class InputMessage(_Model):
    role: Literal["user", "assistant"]
    content: list[ContentBlock] | str

    @field_validator("content", mode="before")
    @classmethod
    def _supported(cls, value: Any) -> Any:
        return _check_blocks(value, BLOCK_TYPES, "content")

    @field_validator("content")
    @classmethod
    def _by_role(cls, value: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if isinstance(value, list):
            kinds = {block.type for block in value}
            wrong = kinds & ({"tool_result"} if role == "assistant" else {"tool_use"})
            if role == "user" and kinds & {"thinking", "redacted_thinking"}:
                wrong |= kinds & {"thinking", "redacted_thinking"}
            if wrong:
                raise ValueError(f"{sorted(wrong)[0]} blocks are not valid in a {role} message")
        return value


class Tool(_Model):
    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    description: str | None = None
    input_schema: JsonSchemaObject
    cache_control: CacheControl | None = None
    type: Literal["custom"] | None = None  # server tools (web search, ...): refused, see below
    strict: StrictBool | None = None

    @field_validator("input_schema", mode="before")
    @classmethod
    def _schema(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            raise ValueError(f"input_schema must be a JSON Schema object, got {short_json(value)}")
        return value


def _check_tool(value: Any) -> Any:
    if isinstance(value, Mapping) and value.get("type") not in (None, "custom"):
        raise ValueError(
            f"tools of type {short_json(value.get('type'))} (Anthropic's server and client "
            "tools) are not supported: give custom tools with name and input_schema"
        )
    return value


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)] | None = Field(
        default=None, validate_default=True
    )
    disable_parallel_tool_use: StrictBool | None = None

    @field_validator("name")
    @classmethod
    def _named(cls, value: str | None, info: ValidationInfo) -> str | None:
        kind = info.data.get("type")
        if kind == "tool" and value is None:
            raise ValueError("tool_choice of type 'tool' needs the tool's name")
        if kind is not None and kind != "tool" and value is not None:
            raise ValueError(f"name is only valid with tool_choice type 'tool', not {kind!r}")
        return value


class Thinking(_Model):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[StrictInt, Field(ge=1024, le=INT32_MAX)] | None = Field(
        default=None, validate_default=True
    )

    @field_validator("budget_tokens")
    @classmethod
    def _with_enabled(cls, value: int | None, info: ValidationInfo) -> int | None:
        kind = info.data.get("type")
        if kind == "enabled" and value is None:
            raise ValueError("thinking of type 'enabled' needs budget_tokens")
        if kind is not None and kind != "enabled" and value is not None:
            raise ValueError(f"budget_tokens is only valid with type 'enabled', not {kind!r}")
        return value


class Metadata(_Model):
    user_id: str | None = None


class OutputFormat(_Model):
    """Structured output: the answer is JSON valid for ``schema`` (enforced by the grammar, as
    chat's strict ``json_schema``)."""

    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]


class OutputConfig(_Model):
    format: OutputFormat | None = None
    # the template's reasoning_effort (gpt-oss); a 400 where the template takes none
    effort: Literal["low", "medium", "high"] | None = None


# Fields of Anthropic's request the gateway cannot honour: a 400 naming them, never silence.
UNSUPPORTED = {
    "mcp_servers": "MCP servers (the gateway runs no tools)",
    "container": "code-execution containers",
    "context_management": "context management",
}


class MessagesRequest(_Model):
    """``POST /v1/messages``."""

    model: str
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)]
    system: list[TextBlock] | str | None = None
    stop_sequences: (
        Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_SEQUENCES)]
        | None
    ) = None
    stream: StrictBool | None = False
    temperature: Annotated[StrictFloat, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[StrictFloat, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0, le=INT32_MAX)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    metadata: Metadata | None = None  # an end-user id for the client's own use: no effect
    cache_control: CacheControl | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here
    mcp_servers: Any = None
    container: Any = None
    context_management: Any = None
    output_format: OutputFormat | None = None  # the older name of output_config.format
    output_config: OutputConfig | None = None

    @field_validator("messages")
    @classmethod
    def _ends_with_user(cls, value: list[InputMessage]) -> list[InputMessage]:
        if value and value[-1].role == "assistant":
            raise ValueError(
                "the last message must be the user's: continuing a final assistant message "
                "(prefill) is not supported"
            )
        return value

    @field_validator("system", mode="before")
    @classmethod
    def _system_text(cls, value: Any) -> Any:
        return _check_blocks(value, ("text",), "system")

    @field_validator("tools", mode="before")
    @classmethod
    def _custom_tools(cls, value: Any) -> Any:
        if isinstance(value, list):
            for item in value:
                _check_tool(item)
        return value

    @field_validator("tools")
    @classmethod
    def _distinct(cls, value: list[Tool] | None) -> list[Tool] | None:
        check_distinct([tool.name for tool in value or ()], "tool")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _offered(cls, value: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        if value is None or "tools" not in info.data:
            return value
        names = [tool.name for tool in info.data.get("tools") or ()]
        if value.type in ("any", "tool") and not names:
            raise ValueError(f"tool_choice of type {value.type!r} needs tools")
        if value.type == "tool" and value.name not in names:
            raise ValueError(f"tool_choice names {value.name!r}, which is not among the tools")
        return value

    @field_validator("thinking")
    @classmethod
    def _budget(cls, value: Thinking | None, info: ValidationInfo) -> Thinking | None:
        limit = info.data.get("max_tokens")
        budget = value.budget_tokens if value is not None else None
        if budget is not None and limit is not None and budget >= limit:
            raise ValueError(f"budget_tokens ({budget}) must be less than max_tokens ({limit})")
        return value

    @field_validator("output_config")
    @classmethod
    def _one_format(cls, value: OutputConfig | None, info: ValidationInfo) -> OutputConfig | None:
        if value is not None and value.format is not None and info.data.get("output_format"):
            raise ValueError(
                "give output_config.format only (output_format is its older name), not both"
            )
        return value

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(f"{UNSUPPORTED[str(info.field_name)]} are not supported")
        return value


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: a messages request without ``max_tokens``."""

    max_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None  # type: ignore[assignment]


# --- the answer ---------------------------------------------------------------------------------


class CacheCreation(BaseModel):
    # nothing is written to a cache on request (cache_control): the prefix cache keeps all
    ephemeral_5m_input_tokens: int = 0
    ephemeral_1h_input_tokens: int = 0


class OutputTokensDetails(BaseModel):
    thinking_tokens: int = 0


class Usage(BaseModel):
    """Every key of Anthropic's usage; those about its hosted features (server tools, where
    and in which tier it ran) say none."""

    input_tokens: int  # prompt tokens computed (those not read from the prefix cache)
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0  # prompt tokens whose KV the prefix cache held
    cache_creation: CacheCreation = Field(default_factory=CacheCreation)
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    server_tool_use: None = None
    service_tier: Literal["standard"] = "standard"
    inference_geo: None = None

    def delta(self) -> dict[str, Any]:
        """The keys a ``message_delta`` event's usage has."""
        return self.model_dump(
            include={
                "input_tokens", "output_tokens", "cache_creation_input_tokens",
                "cache_read_input_tokens", "output_tokens_details", "server_tool_use",
            }
        )  # fmt: skip


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    stop_details: None = None  # set for refusals only, which are not told apart here
    container: None = None  # no code execution containers
    usage: Usage


DIRECT_CALLER = {"type": "direct"}  # a tool_use block's caller: the model itself


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


# --- the translation ------------------------------------------------------------------------------


def _text(content: str | list[TextBlock] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(block.text for block in content)


def chat_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    """The conversation as chat-completions messages: the system prompt, user text, tool
    results as ``tool`` messages, assistant text with its ``tool_use`` as ``tool_calls``."""
    out: list[dict[str, Any]] = []
    if req.system is not None:
        out.append({"role": "system", "content": _text(req.system)})
    for message in req.messages:
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        if message.role == "assistant":
            text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
            calls = [
                {
                    "id": b.id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": json.dumps(b.input)},
                }
                for b in message.content
                if isinstance(b, ToolUseBlock)
            ]
            item: dict[str, Any] = {"role": "assistant", "content": text or None}
            if calls:
                item["tool_calls"] = calls
            elif not text:
                item["content"] = ""
            out.append(item)
            continue
        texts: list[str] = []  # user text runs between tool results
        for block in message.content:
            if isinstance(block, ToolResultBlock):
                if texts:
                    out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                result = _text(block.content)
                if block.is_error:
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": result})
            elif isinstance(block, TextBlock):
                texts.append(block.text)
        if texts or not message.content:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def to_chat(req: MessagesRequest, template: Any = None) -> ChatCompletionRequest:
    """The chat request the service prepares (stop sequences are set on the prepared request:
    Anthropic takes more than chat's four). ``thinking`` switches the ``template``'s
    ``enable_thinking`` where it has one (Qwen3's)."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req)}
    if req.max_tokens is not None:
        body["max_tokens"] = req.max_tokens
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "parameters": tool.input_schema,
                    **({"description": tool.description} if tool.description else {}),
                    **({"strict": tool.strict} if tool.strict is not None else {}),
                },
            }
            for tool in req.tools
        ]
        choice = req.tool_choice
        if choice is not None:
            if choice.type == "tool":
                body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[
                    choice.type
                ]
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
    config = req.output_config or OutputConfig()
    output = config.format or req.output_format
    if output is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": output.schema_, "strict": True},
        }
    if config.effort is not None:
        body["reasoning_effort"] = config.effort
    if req.thinking is not None and template_reads(template, "enable_thinking"):
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    return parse_request(ChatCompletionRequest, body)


def prepare(service: CompletionService, req: MessagesRequest, request_id: str) -> Prepared:
    prep = service.prepare(to_chat(req, service.codec.chat_template), request_id)
    prep.stop = list(req.stop_sequences or ())
    return prep


class TokenCount(BaseModel):
    input_tokens: int


def count_tokens(service: CompletionService, req: CountTokensRequest) -> dict[str, int]:
    """``{"input_tokens": N}``: the prompt's tokens, tools included, as generation counts them."""
    prep = service.prepare(to_chat(req, service.codec.chat_template), "count")
    return TokenCount(input_tokens=len(prep.generation.prompt_ids)).model_dump()


def _stop_reason(outcome: Outcome, stop_sequence: str | None) -> StopReason:
    if outcome.calls and outcome.finish == "tool_calls":
        return "tool_use"
    if outcome.finish == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def _usage(outcome: Outcome) -> Usage:
    return Usage(
        input_tokens=outcome.prompt_tokens - outcome.cached_tokens,
        output_tokens=outcome.output_tokens,
        cache_read_input_tokens=outcome.cached_tokens,
        output_tokens_details=OutputTokensDetails(thinking_tokens=outcome.reasoning_tokens),
    )


def _block(piece: Piece) -> dict[str, Any]:
    if piece.kind == "reasoning":
        return {"type": "thinking", "thinking": piece.text, "signature": ""}
    if piece.kind == "text":
        return {"type": "text", "text": piece.text, "citations": None}
    assert piece.call is not None
    return {
        "type": "tool_use",
        "id": new_tool_use_id(),
        "name": piece.call.name,
        "input": json.loads(piece.call.arguments),
        "caller": DIRECT_CALLER,
    }


async def create(service: CompletionService, prep: Prepared, model: str) -> Message:
    """The whole answer."""
    reader, batches = await read_pieces(service, prep)
    pieces: list[Piece] = []
    async for batch in batches:
        pieces.extend(batch)
    outcome = reader.outcome
    stop = stop_sequence_found(service, prep, outcome)
    return Message(
        id=new_message_id(),
        model=model,
        content=[_block(piece) for piece in merged(pieces)],
        stop_reason=_stop_reason(outcome, stop),
        stop_sequence=stop,
        usage=_usage(outcome),
    )


async def open_stream(
    service: CompletionService, prep: Prepared, model: str
) -> AsyncIterator[bytes]:
    """Start the generation (errors before any output are raised here, as plain HTTP errors)
    and return Anthropic's event stream."""
    reader, batches = await read_pieces(service, prep, stream=True)
    return _stream(service, prep, model, reader.outcome, batches)


async def _stream(
    service: CompletionService,
    prep: Prepared,
    model: str,
    outcome: Outcome,
    batches: AsyncIterator[list[Piece]],
) -> AsyncIterator[bytes]:
    start = Message(
        id=new_message_id(),
        model=model,
        content=[],
        stop_reason=None,
        usage=Usage(input_tokens=outcome.prompt_tokens, output_tokens=0),
    )
    yield named_event("message_start", {"type": "message_start", "message": start.model_dump()})
    yield named_event("ping", {"type": "ping"})
    request_id = prep.request_id.removeprefix("msg-")  # the x-request-id header's
    index = -1
    open_kind: str | None = None  # the kind of the block open at index, if any

    def close() -> list[bytes]:
        nonlocal open_kind
        if open_kind is None:
            return []
        open_kind = None
        return [named_event("content_block_stop", {"type": "content_block_stop", "index": index})]

    def begin(block: dict[str, Any], kind: str | None) -> list[bytes]:
        nonlocal index, open_kind
        out = close()
        index += 1
        open_kind = kind
        out.append(
            named_event(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": block},
            )
        )
        return out

    def delta(body: dict[str, Any]) -> bytes:
        return named_event(
            "content_block_delta", {"type": "content_block_delta", "index": index, "delta": body}
        )

    try:
        async for batch in batches:
            if not batch:  # still reading the prompt
                yield named_event("ping", {"type": "ping"})
            for piece in batch:
                if piece.kind == "call":
                    assert piece.call is not None
                    block = {
                        "type": "tool_use",
                        "id": new_tool_use_id(),
                        "name": piece.call.name,
                        "input": {},
                        "caller": DIRECT_CALLER,
                    }
                    for chunk in begin(block, "tool_use"):
                        yield chunk
                    yield delta({"type": "input_json_delta", "partial_json": piece.call.arguments})
                    for chunk in close():
                        yield chunk
                    continue
                if open_kind != piece.kind:
                    empty = (
                        {"type": "thinking", "thinking": "", "signature": ""}
                        if piece.kind == "reasoning"
                        else {"type": "text", "text": "", "citations": None}
                    )
                    for chunk in begin(empty, piece.kind):
                        yield chunk
                if piece.kind == "reasoning":
                    yield delta({"type": "thinking_delta", "thinking": piece.text})
                else:
                    yield delta({"type": "text_delta", "text": piece.text})
    except APIError as exc:
        log.warning("request %s failed while streaming: %s", prep.request_id, exc.message)
        yield named_event("error", anthropic_error(exc, request_id))
        return
    except Exception as exc:
        log.exception("request %s failed while streaming", prep.request_id)
        failed = APIError(500, f"generation failed: {exc}")
        yield named_event("error", anthropic_error(failed, request_id))
        return
    for chunk in close():
        yield chunk
    stop = stop_sequence_found(service, prep, outcome)
    yield named_event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {
                "stop_reason": _stop_reason(outcome, stop),
                "stop_sequence": stop,
                "stop_details": None,
                "container": None,
            },
            "usage": _usage(outcome).delta(),
        },
    )
    yield named_event("message_stop", {"type": "message_stop"})
