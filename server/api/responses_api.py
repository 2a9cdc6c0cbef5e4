"""The OpenAI Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

``ResponsesRequest -> (to_chat, with the items of previous_response_id replayed)
ChatCompletionRequest -> CompletionService.prepare`` (the chat template, the tool format, the
grammars of required / named calls and of ``text.format``) ``-> open_events -> OutputReader
pieces -> output items`` (reasoning, message, function_call), whole or as the documented event
stream (``response.created``, ``response.in_progress``, ``response.output_item.added``, ...,
``response.completed``; every event with its ``sequence_number``). Stored responses live in a
bounded in-memory store (:class:`ResponseStore`, least recently used out first); chaining one
replays its conversation, which the stages' prefix cache makes cheap. What the gateway does
not support is refused with a 400 naming it; docs/api.md lists both.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from server.api.errors import APIError, short_json
from server.api.output import Outcome, Piece, merged, named_event, read_pieces
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
from server.api.sse import sse_keepalive
from server.api.tools import new_call_id

log = logging.getLogger(__name__)

FunctionName = Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]


class _Model(_Request):
    """Unknown fields are ignored and named (``ignored_fields``), as on the chat endpoints."""


# --- the request ---------------------------------------------------------------------------------


class TextPart(_Model):
    """``input_text`` (user, system, developer) or ``output_text`` (an assistant's earlier
    answer)."""

    type: Literal["input_text", "output_text"]
    text: str


def _check_parts(value: Any, what: str) -> Any:
    if value is None or isinstance(value, str) or not isinstance(value, list):
        return value
    for i, part in enumerate(value):
        if not isinstance(part, Mapping):
            raise ValueError(f"{what} part {i} must be an object, got {short_json(part)}")
        kind = part.get("type")
        if kind not in ("input_text", "output_text"):
            raise ValueError(
                f"{what} part {i} has type {short_json(kind)}, which is not supported "
                "(supported: input_text, output_text)"
            )
    return value


class MessageItem(_Model):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[TextPart] | str
    id: str | None = None
    status: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value: Any) -> Any:
        return _check_parts(value, "content")


class FunctionCallItem(_Model):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: FunctionName
    arguments: str
    id: str | None = None
    status: str | None = None

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            raise ValueError(
                f"arguments must be a JSON object in a string, got {short_json(value)}"
            ) from None
        if not isinstance(parsed, dict):
            raise ValueError(f"arguments must be a JSON object, got {short_json(parsed)}")
        return value


class FunctionCallOutputItem(_Model):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: list[TextPart] | str
    id: str | None = None
    status: str | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _parts(cls, value: Any) -> Any:
        return _check_parts(value, "output")


class ReasoningItem(_Model):
    """An earlier turn's reasoning, sent back by the client: left out of the prompt, as the
    chat templates of thinking models leave out earlier turns' reasoning."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
    Field(discriminator="type"),
]
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _check_items(value: Any) -> Any:
    """Items without ``type`` but with a ``role`` are messages (the SDK's short form); any
    other kind of item (a built-in tool's call, an item reference) is refused by name."""
    if not isinstance(value, list):
        return value
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise ValueError(f"input item {i} must be an object, got {short_json(item)}")
        if "type" not in item and "role" in item:
            item = {**item, "type": "message"}
        kind = item.get("type")
        if kind not in ITEM_TYPES:
            raise ValueError(
                f"input item {i} has type {short_json(kind)}, which is not supported "
                f"(supported: {', '.join(ITEM_TYPES)})"
            )
        if kind == "message":
            _check_parts(item.get("content"), f"input item {i}: content")
        elif kind == "function_call_output":
            _check_parts(item.get("output"), f"input item {i}: output")
        out.append(item)
    return out


class FunctionTool(_Model):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: JsonSchemaObject | None = None
    strict: StrictBool | None = None

    @field_validator("parameters", mode="before")
    @classmethod
    def _schema(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, Mapping):
            raise ValueError(f"parameters must be a JSON Schema object, got {short_json(value)}")
        return value


def _check_tools(value: Any) -> Any:
    if isinstance(value, list):
        for i, tool in enumerate(value):
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            if kind != "function":
                raise ValueError(
                    f"tool {i} has type {short_json(kind)}: only function tools are supported "
                    "(no built-in tools such as web_search or file_search)"
                )
    return value


class FunctionChoice(_Model):
    type: Literal["function"]
    name: FunctionName


def _check_tool_choice(value: Any) -> Any:
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, Mapping) and value.get("type") == "function":
        return value
    raise ValueError(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}, "
        f"got {short_json(value)} (built-in tools are not supported)"
    )


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName | None = None
    schema_: JsonSchemaObject | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _with_type(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise ValueError("a json_schema format needs name and schema")
        if self.type != "json_schema" and self.schema_ is not None:
            raise ValueError(f"schema is only valid with type 'json_schema', not {self.type!r}")
        return self


class TextConfig(_Model):
    format: TextFormat | None = None
    # how long the answer should be: the model's own length only ("medium", the default)
    verbosity: Literal["medium"] | None = None


class ReasoningConfig(_Model):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # none are written
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


# Fields the gateway cannot honour: a 400 naming them, never silence.
UNSUPPORTED = {
    "background": "background responses",
    "conversation": "conversations (use previous_response_id)",
    "prompt": "prompt templates",
    "max_tool_calls": "max_tool_calls",
    "top_logprobs": "logprobs",
}
INCLUDABLE = ("reasoning.encrypted_content",)  # never encrypted here: the text is in content


class ResponsesRequest(_Model):
    """``POST /v1/responses``."""

    model: str
    input: Annotated[list[InputItem], Field(min_length=1)] | str
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None
    temperature: Annotated[StrictFloat, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[StrictFloat, Field(ge=0.0, le=1.0)] | None = None
    reasoning: ReasoningConfig | None = None
    stream: StrictBool | None = False
    store: StrictBool | None = True
    previous_response_id: Annotated[str, Field(min_length=1)] | None = None
    metadata: dict[str, str] | None = None
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    truncation: Literal["disabled"] | None = None
    service_tier: Literal["auto", "default"] | None = None  # one tier here
    user: str | None = None  # identifiers for the client's own use: no effect
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache serves every prompt without a key
    stream_options: dict[str, Any] | None = None
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        return _check_items(value)

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        return _check_tools(value)

    @field_validator("tools")
    @classmethod
    def _distinct(cls, value: list[FunctionTool] | None) -> list[FunctionTool] | None:
        check_distinct([tool.name for tool in value or ()], "function")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice(cls, value: Any) -> Any:
        return _check_tool_choice(value)

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        unknown = sorted(set(value or {}) - {"include_obfuscation"})
        if unknown:
            raise ValueError(f"stream_options.{unknown[0]} is not supported")
        return value

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and value is not False:
            raise ValueError(f"{UNSUPPORTED[str(info.field_name)]} are not supported")
        return value


# --- the store -----------------------------------------------------------------------------------


class ResponseStore:
    """Stored responses, at most ``size`` (the least recently used goes first); each with its
    conversation as chat messages, for ``previous_response_id``."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if self.size <= 0:
            return
        self._items[response["id"]] = (response, conversation)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        found = self._items.get(response_id)
        if found is not None:
            self._items.move_to_end(response_id)
        return found

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None


def not_found(response_id: str) -> APIError:
    return APIError(
        404,
        f"No response with id '{response_id}' is stored (it was not stored, was deleted, or "
        "was dropped as the least recently used).",
        type="invalid_request_error",
        param="response_id",
    )


# --- the translation -----------------------------------------------------------------------------


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def conversation(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as chat-completions messages (without the instructions):
    function calls join the assistant message before them, their outputs are tool
    messages, reasoning items are left out."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict[str, Any]] = []
    for item in req.input:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                if not last["content"]:
                    last["content"] = None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}
            )
    return out


def output_conversation(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the assistant message they make (for chaining)."""
    text = "".join(
        part["text"]
        for item in output
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return [message]


# reasoning.effort as a template's reasoning_effort (gpt-oss's: low, medium, high)
_EFFORTS = {
    "none": "low",
    "minimal": "low",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
}

# chat-completions parameters and the Responses API's names for them
_PARAMS = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}


def _renamed(exc: APIError) -> APIError:
    if exc.param is None:
        return exc
    head, sep, rest = exc.param.partition("[")
    head, dot, tail = head.partition(".")
    name = _PARAMS.get(head)
    if name is None:
        return exc
    exc.param = name + dot + tail + sep + rest
    return exc


def prepare(
    service: CompletionService, store: ResponseStore, req: ResponsesRequest, request_id: str
) -> tuple[Prepared, list[dict[str, Any]]]:
    """The prepared chat request and the conversation it continues (for the store)."""
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        if store.size <= 0:
            raise APIError(
                400,
                "previous_response_id cannot be used: this gateway stores no responses "
                "(responses_store_size is 0); send the whole conversation as input instead.",
                param="previous_response_id",
            )
        found = store.get(req.previous_response_id)
        if found is None:
            raise APIError(
                400,
                f"Previous response with id '{req.previous_response_id}' not found (not "
                "stored, deleted, or dropped as the least recently used).",
                param="previous_response_id",
            )
        history = found[1]
    turn = history + conversation(req)
    messages = list(turn)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": tool.model_dump(
                    include={"name", "description", "parameters", "strict"}, exclude_none=True
                ),
            }
            for tool in req.tools
        ]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = (
            {"type": "function", "function": {"name": choice.name}}
            if isinstance(choice, FunctionChoice)
            else choice
        )
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        response_format: dict[str, Any] = {"type": fmt.type}
        if fmt.type == "json_schema":
            response_format["json_schema"] = {
                "name": fmt.name,
                "schema": fmt.schema_,
                **({"strict": fmt.strict} if fmt.strict is not None else {}),
                **({"description": fmt.description} if fmt.description else {}),
            }
        body["response_format"] = response_format
    effort = req.reasoning.effort if req.reasoning is not None else None
    template = service.codec.chat_template
    if effort is not None and template_reads(template, "reasoning_effort"):
        body["reasoning_effort"] = _EFFORTS[effort]
    elif effort == "none" and template_reads(template, "enable_thinking"):
        body["chat_template_kwargs"] = {"enable_thinking": False}
    try:
        chat = parse_request(ChatCompletionRequest, body)
        return service.prepare(chat, request_id), turn
    except APIError as exc:
        raise _renamed(exc) from None


# --- the answer ----------------------------------------------------------------------------------


class ResponseObject(BaseModel):
    """A response (documented loosely: the items are as docs/api.md describes them)."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class Deleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(outcome: Outcome) -> dict[str, Any]:
    return {
        "input_tokens": outcome.prompt_tokens,
        # (no prompt is written to a cache on request here: the prefix cache keeps them all)
        "input_tokens_details": {"cached_tokens": outcome.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": outcome.output_tokens,
        "output_tokens_details": {"reasoning_tokens": outcome.reasoning_tokens},
        "total_tokens": outcome.prompt_tokens + outcome.output_tokens,
    }


def _item(piece: Piece, status: str = "completed") -> dict[str, Any]:
    if piece.kind == "reasoning":
        return {
            "id": _id("rs"),
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": piece.text}],
            "status": status,
        }
    if piece.kind == "text":
        return {
            "id": _id("msg"),
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [
                {"type": "output_text", "text": piece.text, "annotations": [], "logprobs": []}
            ],
        }
    assert piece.call is not None
    return {
        "id": _id("fc"),
        "type": "function_call",
        "call_id": new_call_id(),
        "name": piece.call.name,
        "arguments": piece.call.arguments,
        "status": status,
    }


class Shaper:
    """What every response object of one request shares: its id, creation time and the
    request's settings echoed back."""

    def __init__(self, req: ResponsesRequest, response_id: str) -> None:
        self.req = req
        self.id = response_id
        self.created = int(time.time())

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        outcome: Outcome | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        req = self.req
        incomplete = status == "incomplete"
        fmt = req.text.format if req.text is not None and req.text.format else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": req.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {
                "effort": req.reasoning.effort if req.reasoning else None,
                "summary": None,
            },
            "store": req.store is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": _format(fmt)},
            "tool_choice": (
                req.tool_choice.model_dump()
                if isinstance(req.tool_choice, FunctionChoice)
                else req.tool_choice or "auto"
            ),
            # the function tool's shape: every key, null where the request left it out
            "tools": [tool.model_dump() for tool in req.tools or ()],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            # what was applied: no penalties, logprobs or tool-call cap here (the last two are
            # refused), never in the background, the one service tier
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "top_logprobs": 0,
            "max_tool_calls": None,
            "background": False,
            "service_tier": "default",
            "truncation": "disabled",
            "metadata": req.metadata or {},
            "safety_identifier": req.safety_identifier,
            "prompt_cache_key": req.prompt_cache_key,
            "usage": _usage(outcome) if outcome is not None else None,
            # (OpenAI types user a string: left out when the request had none)
            **({"user": req.user} if req.user is not None else {}),
        }


def _format(fmt: TextFormat | None) -> dict[str, Any]:
    """The echoed ``text.format``: a json_schema format with every key (``strict`` false
    unless asked for, as it was applied)."""
    if fmt is None or fmt.type != "json_schema":
        return {"type": fmt.type if fmt else "text"}
    return {
        "type": "json_schema",
        "name": fmt.name,
        "description": fmt.description,
        "schema": fmt.schema_,
        "strict": fmt.strict is True,
    }


def _status(outcome: Outcome) -> str:
    return "incomplete" if outcome.finish == "length" else "completed"


async def create(
    service: CompletionService,
    store: ResponseStore,
    prep: Prepared,
    req: ResponsesRequest,
    turn: list[dict[str, Any]],
) -> dict[str, Any]:
    """The whole response (stored when ``store`` is not false)."""
    reader, batches = await read_pieces(service, prep)
    pieces: list[Piece] = []
    async for batch in batches:
        pieces.extend(batch)
    outcome = reader.outcome
    status = _status(outcome)
    output = [_item(piece, status) for piece in merged(pieces)]
    response = Shaper(req, _id("resp")).response(status, output, outcome)
    if req.store is not False:
        store.put(response, turn + output_conversation(output))
    return response


async def open_stream(
    service: CompletionService,
    store: ResponseStore,
    prep: Prepared,
    req: ResponsesRequest,
    turn: list[dict[str, Any]],
) -> AsyncIterator[bytes]:
    """Start the generation (errors before any output are raised here, as plain HTTP errors)
    and return the event stream."""
    reader, batches = await read_pieces(service, prep, stream=True)
    return _Stream(Shaper(req, _id("resp")), store, reader.outcome, turn).run(batches)


class _Stream:
    def __init__(
        self, shaper: Shaper, store: ResponseStore, outcome: Outcome, turn: list[dict[str, Any]]
    ) -> None:
        self.shaper = shaper
        self.store = store
        self.outcome = outcome
        self.turn = turn
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # items done
        self.open: dict[str, Any] | None = None  # the item being written
        self.written = ""  # its text so far

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return named_event(kind, data)

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    def begin(self, piece: Piece) -> list[bytes]:
        out = self.close()
        item = _item(Piece(piece.kind, "", piece.call), "in_progress")
        if piece.kind in ("text", "reasoning"):
            item["content"] = []
        else:
            item["arguments"] = ""
        self.open = item
        self.written = ""
        out.append(
            self.event("response.output_item.added", output_index=len(self.output), item=item)
        )
        if piece.kind == "text":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(
                self.event(
                    "response.content_part.added", **self._where(), content_index=0, part=part
                )
            )
        elif piece.kind == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
            out.append(
                self.event(
                    "response.content_part.added", **self._where(), content_index=0, part=part
                )
            )
        return out

    def close(self, status: str = "completed") -> list[bytes]:
        item = self.open
        if item is None:
            return []
        out: list[bytes] = []
        where = self._where()
        text = self.written
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(
                self.event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                )
            )
            out.append(
                self.event("response.content_part.done", **where, content_index=0, part=part)
            )
            item["content"] = [part]
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            out.append(
                self.event("response.reasoning_text.done", **where, content_index=0, text=text)
            )
            out.append(
                self.event("response.content_part.done", **where, content_index=0, part=part)
            )
            item["content"] = [part]
        else:
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        item["status"] = status
        out.append(
            self.event("response.output_item.done", output_index=where["output_index"], item=item)
        )
        self.output.append(item)
        self.open = None
        return out

    def piece(self, piece: Piece) -> list[bytes]:
        out: list[bytes] = []
        if piece.kind == "call":
            assert piece.call is not None
            out += self.begin(piece)
            assert self.open is not None
            self.open["arguments"] = piece.call.arguments
            out.append(
                self.event(
                    "response.function_call_arguments.delta",
                    **self._where(),
                    delta=piece.call.arguments,
                )
            )
            out += self.close()
            return out
        kind = "message" if piece.kind == "text" else "reasoning"
        if self.open is None or self.open["type"] != kind:
            out += self.begin(piece)
        self.written += piece.text
        name = (
            "response.output_text.delta"
            if piece.kind == "text"
            else "response.reasoning_text.delta"
        )
        extra: dict[str, Any] = {"logprobs": []} if piece.kind == "text" else {}
        out.append(self.event(name, **self._where(), content_index=0, delta=piece.text, **extra))
        return out

    async def run(self, batches: AsyncIterator[list[Piece]]) -> AsyncIterator[bytes]:
        shaper = self.shaper
        yield self.event("response.created", response=shaper.response("in_progress", []))
        yield self.event("response.in_progress", response=shaper.response("in_progress", []))
        try:
            async for batch in batches:
                if not batch:  # still reading the prompt
                    yield sse_keepalive()
                for piece in batch:
                    for chunk in self.piece(piece):
                        yield chunk
        except Exception as exc:
            error = exc if isinstance(exc, APIError) else APIError(500, f"generation failed: {exc}")
            log.warning("response %s failed while streaming: %s", shaper.id, error.message)
            body = {"code": error.code or error.type, "message": error.message}
            yield self.event(
                "response.failed", response=shaper.response("failed", self.output, error=body)
            )
            return
        status = _status(self.outcome)
        for chunk in self.close(status):
            yield chunk
        response = shaper.response(status, self.output, self.outcome)
        if shaper.req.store is not False:
            self.store.put(response, self.turn + output_conversation(self.output))
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield self.event(kind, response=response)
