"""The OpenAI-compatible requests (:class:`ChatCompletionRequest`, :class:`CompletionRequest`),
as docs/api.md describes them, and what the gateway reads from them:

* unknown extra fields are ignored, and named (``ignored_fields``: the gateway warns of them
  or refuses them); nearly every optional field accepts ``null``;
* numbers and booleans are strict (``"3"``, ``3.0`` or ``true`` are not a valid ``max_tokens``);
* out-of-range values are rejected; :func:`parse_request` turns any failure into an
  :class:`~server.api.errors.APIError` 400 ``invalid_request_error`` whose ``param`` is the path of
  the first failing field;
* so is a body nested deeper than ``MAX_JSON_DEPTH`` or holding a string that is not Unicode
  (a lone surrogate such as ``"\\ud800"``, which JSON can carry).

Union-typed fields (message ``content``, ``stop``, ``prompt``, ``logit_bias``) are checked by
``before`` validators so that an error names the field itself with one readable message, never
one error per union member; their JSON schema (the OpenAPI document) says what those accept.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)
from pydantic.json_schema import SkipJsonSchema

from protos.sampling import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, SamplingParams
from server.api.errors import APIError, param_path, short_json, validation_error_to_api_error

_Model = TypeVar("_Model", bound=BaseModel)

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
INT32_MAX = (1 << 31) - 1
MAX_STOP = 4
MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
LOGIT_BIAS_LIMIT = 100.0
MAX_JSON_DEPTH = 64  # nesting levels of a request body (a real request needs about 5)
MAX_TOOLS = 128  # as OpenAI

Role = Literal["system", "user", "assistant", "developer", "tool"]

# Strict scalars: JSON "3", 3.0 or true are not accepted where an integer is expected.
PositiveInt32 = Annotated[StrictInt, Field(ge=1, le=INT32_MAX)]
Penalty = Annotated[StrictFloat, Field(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[
    StrictFloat, Field(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
]
# What the ``before`` validators below enforce, also said in the JSON schema (OpenAPI).
StopSequence = Annotated[str, Field(min_length=1)]
LogitBias = Annotated[
    dict[str, float],
    WithJsonSchema(
        {
            "type": "object",
            "propertyNames": {"pattern": "^-?[0-9]+$"},
            "additionalProperties": {
                "type": "number",
                "minimum": -LOGIT_BIAS_LIMIT,
                "maximum": LOGIT_BIAS_LIMIT,
            },
        }
    ),
]
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        _TOKEN_IDS,
        {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "minItems": 1,
            "maxItems": 1,
        },
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": 1},
    ]
}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_JSON_SCALARS = frozenset({int, float, bool, type(None)})


def _check_json_value(data: Any) -> None:
    """Reject what JSON can carry but no later step should handle: nesting deeper than
    ``MAX_JSON_DEPTH`` (no real request nests that deep; validation and error messages recurse
    through it) and strings with a lone UTF-16 surrogate such as ``"\\ud800"`` (not Unicode:
    the tokenizer and the UTF-8 encoding of a response fail on it).

    Walks iteratively, so a deep body cannot exhaust the stack here either.
    """
    stack: list[tuple[Any, tuple[int | str, ...]]] = [(data, ())]
    while stack:
        value, loc = stack.pop()
        if len(loc) > MAX_JSON_DEPTH:
            raise _too_deep()
        if isinstance(value, str):
            _check_text(value, loc)
        elif isinstance(value, Mapping):
            for key, item in value.items():
                _check_text(str(key), loc)
                if isinstance(item, str | Mapping | list):
                    stack.append((item, (*loc, str(key))))
        elif isinstance(value, list) and not _JSON_SCALARS.issuperset(map(type, value)):
            # (the test above is the fast way past a long list of numbers: prompt token ids)
            stack.extend(
                (item, (*loc, i))
                for i, item in enumerate(value)
                if isinstance(item, str | Mapping | list)
            )


def _too_deep() -> APIError:
    return APIError(
        400, f"The JSON body of your request is nested too deeply (over {MAX_JSON_DEPTH} levels)."
    )


def _check_text(text: str, loc: tuple[int | str, ...]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        param = param_path(loc)
        name = f"'{param}'" if param else "the request body"
        bad = text[exc.start]
        raise APIError(
            400,
            f"Invalid value for {name}: the string holds a lone UTF-16 surrogate "
            f"(\\u{ord(bad):04x}), which is not valid Unicode.",
            param=param,
        ) from None


def parse_request(cls: type[_Model], body: bytes | str | Mapping[str, Any]) -> _Model:
    """Parse a request body (raw JSON or an already decoded object); raise :class:`APIError`.

    Malformed JSON, a body that is not a JSON object, JSON nested deeper than
    ``MAX_JSON_DEPTH``, strings that are not Unicode (lone surrogates), and every validation
    failure are 400 ``invalid_request_error`` (policy: 400, not 422).
    """
    data: Any = body
    if isinstance(body, bytes | str):
        try:
            data = json.loads(body, parse_constant=_reject_constant)
        except RecursionError:
            raise _too_deep() from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise APIError(
                400, f"We could not parse the JSON body of your request: {exc}."
            ) from None
    if not isinstance(data, Mapping):
        raise APIError(400, "The request body must be a JSON object.")
    _check_json_value(data)
    try:
        parsed = cls.model_validate(data)
    except ValidationError as exc:
        raise validation_error_to_api_error(exc) from None
    if isinstance(parsed, _Request):
        parsed._ignored = tuple(unknown_fields(parsed, data))
    return parsed


def unknown_fields(model: BaseModel, data: Any, loc: tuple[int | str, ...] = ()) -> list[str]:
    """The paths (``foo_bar``, ``messages[0].foo``) of the fields in ``data`` that ``model``,
    validated from it, does not know: the ones the gateway ignores."""
    if not isinstance(data, Mapping):
        return []
    known: dict[str, str] = {}
    for name, info in type(model).model_fields.items():
        known[name] = name
        if info.alias:
            known[info.alias] = name
    found: list[str] = []
    for key, raw in data.items():
        field = known.get(str(key))
        if field is None:
            found.append(param_path((*loc, str(key))) or str(key))
        else:
            found += _unknown_within(getattr(model, field, None), raw, (*loc, str(key)))
    return found


def _unknown_within(value: Any, raw: Any, loc: tuple[int | str, ...]) -> list[str]:
    if isinstance(value, BaseModel):
        return unknown_fields(value, raw, loc)
    if isinstance(value, list) and isinstance(raw, list) and len(value) == len(raw):
        return [p for i, (v, r) in enumerate(zip(value, raw, strict=True))
                for p in _unknown_within(v, r, (*loc, i))]  # fmt: skip
    return []


# --- requests ----------------------------------------------------------------------------------


class _Request(BaseModel):
    """A request or a part of one. Unknown fields are ignored (for compatibility: clients
    send other servers' extensions), and :func:`parse_request` names them
    (:attr:`ignored_fields`) so that the gateway can say so, or refuse them."""

    model_config = ConfigDict(extra="ignore")
    _ignored: tuple[str, ...] = PrivateAttr(default=())

    @property
    def ignored_fields(self) -> tuple[str, ...]:
        """The fields of the body it was parsed from that it does not know (top level only)."""
        return self._ignored


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


def _check_content_value(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(
            "content must be a string, a list of {'type': 'text', 'text': ...} parts, or null"
        )
    for i, part in enumerate(value):
        if not isinstance(part, Mapping):
            raise ValueError(f"content part {i} must be an object, got {short_json(part)}")
        kind = part.get("type")
        if kind != "text":
            raise ValueError(
                f"content part {i} has type {short_json(kind)}: only 'text' parts are supported"
            )
        if not isinstance(part.get("text"), str):
            raise ValueError(f"content part {i} must have a string 'text'")
    return value


# --- tools and structured output -------------------------------------------------------------

FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
FunctionName = Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
JsonSchemaObject = Annotated[dict[str, Any], WithJsonSchema({"type": "object"})]


def check_distinct(names: list[str], what: str) -> None:
    """A ValueError naming the first of ``names`` given twice (tools offered under one name)."""
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"{what} names must be distinct, {twice[0]!r} is given twice")


def _check_schema_object(value: Any, what: str) -> Any:
    if value is not None and not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a JSON Schema object, got {short_json(value)}")
    return value


class FunctionDefinition(_Request):
    name: FunctionName
    description: str | None = None
    parameters: JsonSchemaObject | None = None  # a JSON Schema; none: the function takes none
    strict: StrictBool | None = None

    @field_validator("parameters", mode="before")
    @classmethod
    def _schema(cls, value: Any) -> Any:
        return _check_schema_object(value, "parameters")


class ToolDefinition(_Request):
    """An offered tool: ``{"type": "function", "function": {...}}`` (the only kind)."""

    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Request):
    name: FunctionName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: ToolChoiceFunction


TOOL_CHOICE_MODES = ("none", "auto", "required")
ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def _check_tool_choice(value: Any) -> Any:
    """One readable error for a bad ``tool_choice`` (never one per union member)."""
    if value is None or (isinstance(value, str) and value in TOOL_CHOICE_MODES):
        return value
    if isinstance(value, str):
        raise ValueError(
            f"tool_choice must be 'none', 'auto', 'required' or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, got {short_json(value)}"
        )
    if not isinstance(value, Mapping):
        raise ValueError(
            "tool_choice must be a string ('none', 'auto', 'required') or "
            "{'type': 'function', 'function': {'name': ...}}"
        )
    if value.get("type") != "function":
        raise ValueError(
            f"tool_choice type must be 'function', got {short_json(value.get('type'))}"
        )
    function = value.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or not re.fullmatch(FUNCTION_NAME_PATTERN, name):
        raise ValueError(
            "tool_choice.function.name must name a function (1 to 64 of a-z, A-Z, 0-9, _ and -), "
            f"got {short_json(name)}"
        )
    return value


class JsonSchemaFormat(_Request):
    name: FunctionName
    description: str | None = None
    schema_: JsonSchemaObject = Field(alias="schema")
    strict: StrictBool | None = None

    @field_validator("schema_", mode="before")
    @classmethod
    def _schema(cls, value: Any) -> Any:
        return _check_schema_object(value, "schema")


class ResponseFormat(_Request):
    """``{"type": "text"}``, ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(default=None, validate_default=True)

    @field_validator("json_schema")
    @classmethod
    def _with_type(
        cls, value: JsonSchemaFormat | None, info: ValidationInfo
    ) -> JsonSchemaFormat | None:
        kind = info.data.get("type")
        if kind == "json_schema" and value is None:
            raise ValueError("json_schema is required when type is 'json_schema'")
        if kind is not None and kind != "json_schema" and value is not None:
            raise ValueError(f"json_schema is only valid with type 'json_schema', not {kind!r}")
        return value


# --- messages ----------------------------------------------------------------------------------


class MessageFunctionCall(_Request):
    name: Annotated[str, Field(min_length=1)]
    arguments: str  # the arguments as a JSON object, in a string (as the model wrote them)

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value, parse_constant=_reject_constant)
        except ValueError:
            raise ValueError(
                f"arguments must be a JSON object in a string, got {short_json(value)}"
            ) from None
        if not isinstance(parsed, dict):
            raise ValueError(f"arguments must be a JSON object, got {short_json(parsed)}")
        return value


class MessageToolCall(_Request):
    """A call an assistant message made: ``{"id", "type": "function", "function"}``."""

    id: Annotated[str, Field(min_length=1)]
    type: Literal["function"]
    function: MessageFunctionCall


# apply_chat_template's own arguments (and what the gateway renders with): not template variables
RENDER_ARGUMENTS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "chat_template",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
    }
)

ROLES_WITH_CONTENT = ("system", "user", "developer", "tool")


def _message_schema(schema: dict[str, Any]) -> None:
    """The JSON schema of a message by role (as the OpenAI spec has it), which is what the
    validators below enforce: content required (not null) but in an assistant message with
    tool_calls, tool_call_id only (and always) in a tool message, tool_calls only in an
    assistant message (a field a role does not take may only be null)."""
    props = schema.pop("properties")
    required_content = {"anyOf": [s for s in props["content"]["anyOf"] if s.get("type") != "null"]}
    calls = next(s for s in props["tool_calls"]["anyOf"] if s.get("type") == "array")
    call_id = next(s for s in props["tool_call_id"]["anyOf"] if s.get("type") == "string")
    null = {"type": "null"}

    def variant(roles: list[str], required: list[str], **fields: Any) -> dict[str, Any]:
        properties = {"role": {"type": "string", "enum": roles}, "name": props["name"], **fields}
        return {"type": "object", "properties": properties, "required": ["role", *required]}

    spoken = ["system", "user", "developer"]
    schema.pop("required", None)
    schema.pop("type", None)
    schema["anyOf"] = [
        variant(spoken, ["content"], content=required_content, tool_calls=null, tool_call_id=null),
        variant(
            ["assistant"], ["content"], content=required_content, tool_calls=props["tool_calls"],
            tool_call_id=null,
        ),
        variant(
            ["assistant"], ["tool_calls"], content=props["content"], tool_calls=calls,
            tool_call_id=null,
        ),
        variant(["tool"], ["content", "tool_call_id"], content=required_content,
                tool_call_id=call_id, tool_calls=null),
    ]  # fmt: skip


class ChatMessage(_Request):
    """A message. ``system``, ``user``, ``developer`` and ``tool`` messages need ``content``;
    an ``assistant`` message needs ``content`` or ``tool_calls``; ``tool_call_id`` (required)
    is only for ``tool`` messages and ``tool_calls`` only for ``assistant`` ones."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_message_schema)

    role: Role
    name: str | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(min_length=1)] | None = None
    tool_call_id: Annotated[str, Field(min_length=1)] | None = Field(
        default=None, validate_default=True
    )
    content: str | list[TextContentPart] | None = Field(default=None, validate_default=True)

    @field_validator("tool_calls")
    @classmethod
    def _only_assistant(cls, value: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if value is not None and role is not None and role != "assistant":
            raise ValueError(f"tool_calls are only valid in assistant messages, not {role!r}")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, value: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if role == "tool" and value is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if value is not None and role is not None and role != "tool":
            raise ValueError(f"tool_call_id is only valid in tool messages, not {role!r}")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any, info: ValidationInfo) -> Any:
        value = _check_content_value(value)
        role = info.data.get("role")
        if value is None and role in ROLES_WITH_CONTENT:
            raise ValueError(f"a {role} message needs content")
        if value is None and role == "assistant" and not info.data.get("tool_calls"):
            raise ValueError("an assistant message needs content or tool_calls")
        return value


class StreamOptions(_Request):
    include_usage: StrictBool | None = None


def _check_stop(value: Any) -> Any:
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise ValueError("stop must be a string, a list of strings, or null")
    if len(items) > MAX_STOP:
        raise ValueError(f"stop may hold at most {MAX_STOP} sequences, got {len(items)}")
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"stop sequences must be strings, got {short_json(item)}")
        if not item:
            raise ValueError("stop sequences must not be empty")
    return value


def _check_logit_bias(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError("logit_bias must be an object mapping token ids to biases")
    checked: dict[str, float] = {}
    for key, bias in value.items():
        token = _token_key(key)
        if token is None:
            raise ValueError(
                f"logit_bias keys must be token ids (integers as strings), got {short_json(key)}"
            )
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise ValueError(f"logit_bias value for token {token} must be a number")
        if not (math.isfinite(bias) and -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT):
            raise ValueError(
                f"logit_bias value for token {token} must be in [-100, 100], got {bias!r}"
            )
        checked[str(token)] = float(bias)
    return checked


def _token_key(key: Any) -> int | None:
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and re.fullmatch(r"-?[0-9]+", key):
        return int(key)
    return None


class _SamplingRequest(_Request):
    """Fields shared by chat and legacy completions."""

    model: str
    max_tokens: PositiveInt32 | None = None
    temperature: Annotated[StrictFloat, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[StrictFloat, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0, le=INT32_MAX)] | None = None  # extension; 0 = off
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = 1
    stop: StopSequence | Annotated[list[StopSequence], Field(max_length=MAX_STOP)] | None = None
    seed: Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None
    # Extensions clients of vLLM and llama.cpp send (vLLM's semantics; docs/api.md)
    ignore_eos: StrictBool | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0, le=INT32_MAX)] | None = None
    min_p: Annotated[StrictFloat, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: RepetitionPenalty | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _validate_stop(cls, value: Any) -> Any:
        return _check_stop(value)

    @field_validator("stream_options")
    @classmethod
    def _only_streaming(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _validate_logit_bias(cls, value: Any) -> Any:
        return _check_logit_bias(value)


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt32 | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None
    # Variables for the chat template (e.g. {"enable_thinking": false}); each must be one the
    # template reads (checked by the service, which has the template).
    chat_template_kwargs: JsonSchemaObject | None = None
    # The template's reasoning_effort variable (gpt-oss); a 400 where the template has none.
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # The deprecated forms of tools: refused with a pointer to tools (not in the schema).
    functions: SkipJsonSchema[Any] = None
    function_call: SkipJsonSchema[Any] = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, value: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        check_distinct([tool.function.name for tool in value or ()], "function")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _validate_tool_choice(cls, value: Any) -> Any:
        return _check_tool_choice(value)

    @field_validator("tool_choice")
    @classmethod
    def _offered(cls, value: Any, info: ValidationInfo) -> Any:
        if "tools" not in info.data:
            return value  # the tools were invalid: that is the error
        names = [tool.function.name for tool in info.data.get("tools") or ()]
        if value == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if isinstance(value, NamedToolChoice):
            if not names:
                raise ValueError(
                    f"tool_choice names {value.function.name!r} but no tools are given"
                )
            if value.function.name not in names:
                raise ValueError(
                    f"tool_choice names {value.function.name!r}, which is not among the tools"
                )
        return value

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _template_kwargs(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise ValueError(
                f"chat_template_kwargs must be a JSON object of template variables, "
                f"got {short_json(value)}"
            )
        taken = sorted(set(value) & RENDER_ARGUMENTS)
        if taken:
            raise ValueError(
                f"chat_template_kwargs may not set {taken[0]!r}: the request sets it "
                "(messages, tools and the generation prompt come from the request)"
            )
        return value

    @field_validator("functions", "function_call")
    @classmethod
    def _deprecated(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            instead = "tools" if info.field_name == "functions" else "tool_choice"
            raise ValueError(f"{info.field_name} is deprecated and not supported: use {instead}")
        return value

    def tool_mode(self) -> str | None:
        """How tools are used: ``"auto"``, ``"required"``, ``"named"``, or None (no tools offered,
        or ``tool_choice: "none"``: the model must not call any)."""
        if not self.tools or self.tool_choice == "none":
            return None
        if self.tool_choice is None or self.tool_choice == "auto":
            return "auto"
        return "required" if self.tool_choice == "required" else "named"


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions`` (legacy). One prompt per request.

    ``prompt`` is a string or a list of token ids after validation: a list of one string (or of
    one token-id list) is unwrapped; a batch of several prompts is rejected. ``max_tokens``
    defaults to 16 as in the OpenAI spec (an explicit ``null`` means no limit but the context).
    ``logprobs`` is the number (0..5) of top alternatives per token to report.
    """

    prompt: Annotated[str | list[int], Field(json_schema_extra=_PROMPT_SCHEMA)]
    max_tokens: PositiveInt32 | None = 16
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: StrictBool | None = False
    suffix: str | None = None
    best_of: Annotated[StrictInt, Field(ge=1)] | None = None
    # Chat-only fields, refused here rather than ignored (not in the schema).
    tools: SkipJsonSchema[Any] = None
    tool_choice: SkipJsonSchema[Any] = None
    parallel_tool_calls: SkipJsonSchema[Any] = None
    response_format: SkipJsonSchema[Any] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise ValueError("prompt must be a string, a list of one string, or token ids")
        if all(isinstance(item, str | list) for item in value):
            if len(value) > 1:
                raise ValueError(f"only a single prompt per request is supported, got {len(value)}")
            value = value[0]
            if isinstance(value, str):
                return value
            if not value:
                raise ValueError("prompt token ids must not be empty")
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int) or item < 0:
                raise ValueError(
                    f"prompt token ids must be non-negative integers, got {short_json(item)}"
                )
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("echo=true is not supported; send echo=false or leave it out")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    @field_validator("tools", "tool_choice", "parallel_tool_calls", "response_format")
    @classmethod
    def _chat_only(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(
                f"{info.field_name} is only supported by /v1/chat/completions, "
                "not by the legacy /v1/completions"
            )
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if value is not None and value != n:
            raise ValueError(f"best_of other than n ({n}) is not supported")
        return value


AnyRequest = ChatCompletionRequest | CompletionRequest


def message_text(message: ChatMessage) -> str:
    """The message's text: the string, text parts joined with newlines, or ``""`` for null."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


def template_messages(
    messages: Sequence[ChatMessage], call_id: Callable[[str], str] | None = None
) -> list[dict[str, Any]]:
    """``[{"role", "content"}]`` dicts (plus ``name`` when given) for a chat template.

    An assistant message's ``tool_calls`` go in as ``{"id", "type", "function": {"name",
    "arguments"}}`` with the arguments parsed into a dict (as the templates of Qwen, Llama and
    Mistral expect); a tool message keeps its ``tool_call_id`` and, unless it has its own, the
    ``name`` of the function whose call it answers. ``call_id`` rewrites call ids (a Mistral
    template accepts only ids of 9 letters and digits).
    """
    rename = call_id or (lambda ident: ident)
    called: dict[str, str] = {}  # call id -> function name
    out: list[dict[str, Any]] = []
    for message in messages:
        item: dict[str, Any] = {"role": message.role, "content": message_text(message)}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls:
            calls = []
            for call in message.tool_calls:
                called[call.id] = call.function.name
                function = {
                    "name": call.function.name,
                    "arguments": json.loads(call.function.arguments),
                }
                calls.append({"id": rename(call.id), "type": "function", "function": function})
            item["tool_calls"] = calls
        if message.tool_call_id is not None:
            item["tool_call_id"] = rename(message.tool_call_id)
            if message.name is None and message.tool_call_id in called:
                item["name"] = called[message.tool_call_id]
        out.append(item)
    return out


def effective_max_tokens(req: AnyRequest) -> int | None:
    """The token limit asked for: ``max_completion_tokens`` wins over ``max_tokens``."""
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


def stop_list(req: AnyRequest) -> list[str]:
    """The stop sequences as a list (``[]`` for none)."""
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


def include_usage(req: AnyRequest) -> bool:
    """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


_PARAM_NAMES = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "top_logprobs",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "min_p",
    "repetition_penalty",
)


def to_sampling_params(req: AnyRequest, vocab_size: int | None = None) -> SamplingParams:
    """The request's :class:`SamplingParams` (OpenAI defaults: temperature 1, top_p 1).

    ``top_p == 0`` keeps only the most probable token (mapped to ``top_k=1``). With
    ``vocab_size`` the result is also validated against the vocabulary (logit_bias token ids);
    every failure is an :class:`APIError` 400 naming the parameter.
    """
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        token = _token_key(key)
        if token is None:
            raise APIError(
                400,
                f"Invalid value for 'logit_bias': keys must be token ids (integers), got {key!r}",
                param="logit_bias",
            )
        bias[token] = value
    top_p = 1.0 if req.top_p is None else req.top_p
    top_k = req.top_k or 0
    if top_p == 0.0:
        top_p, top_k = 1.0, 1
    if isinstance(req, ChatCompletionRequest):
        logprobs = bool(req.logprobs)
        top_logprobs = (req.top_logprobs or 0) if logprobs else 0
    else:
        logprobs = req.logprobs is not None
        top_logprobs = req.logprobs or 0
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=top_p,
        top_k=top_k,
        seed=req.seed,
        top_logprobs=top_logprobs,
        logprobs=logprobs,
        logit_bias=bias,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        min_p=req.min_p or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
    )
    if vocab_size is not None:
        try:
            params.validate(vocab_size)
        except ValueError as exc:
            text = str(exc)
            param = next((p for p in _PARAM_NAMES if text.startswith(p)), None)
            raise APIError(400, f"Invalid value for '{param}': {text}", param=param) from None
    return params
