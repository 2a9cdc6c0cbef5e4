"""The OpenAI-compatible wire protocol: request and response models, errors, and helpers.

Requests (:class:`ChatCompletionRequest`, :class:`CompletionRequest`) follow the OpenAI spec as
described in ``/work/shared/notes/openai-api.md``:

* unknown extra fields are ignored, nearly every optional field accepts ``null``;
* numbers and booleans are strict (``"3"``, ``3.0`` or ``true`` are not a valid ``max_tokens``);
* out-of-range values are rejected; :func:`parse_request` / :func:`validation_error_to_api_error`
  turn any failure into an :class:`APIError` 400 ``invalid_request_error`` whose ``param`` is the
  path of the first failing field (``"temperature"``, ``"messages[0].role"``);
* so is a body nested deeper than ``MAX_JSON_DEPTH`` or holding a string that is not Unicode
  (a lone surrogate such as ``"\\ud800"``, which JSON can carry).

Union-typed fields (message ``content``, ``stop``, ``prompt``, ``logit_bias``) are checked by
``before`` validators so that an error names the field itself with one readable message, never
one error per union member; their JSON schema (the OpenAPI document) says what those accept.

Responses serialize (``model_dump_json()``) to exactly the JSON the ``openai`` Python client
parses: a chat message always carries ``"refusal": null``, chunk choices carry ``"logprobs"``
and ``"finish_reason"`` (``null`` until the last one), every chunk carries ``"usage"`` (``null``
except on the usage chunk), and a streamed ``delta`` holds only the keys that are set (the last
choice chunk has ``"delta": {}``). Non-finite logprobs are reported as ``-9999.0``, as OpenAI
does, so the JSON stays valid.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_serializer,
)

from stage_node.sampling import SamplingParams

__all__ = [
    "APIError",
    "ChatChoiceLogprobs",
    "ChatChunkChoice",
    "ChatCompletion",
    "ChatCompletionChoice",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatDelta",
    "ChatMessage",
    "ChatResponseMessage",
    "ChatTokenLogprob",
    "Completion",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionChunkChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "ErrorBody",
    "ErrorResponse",
    "FinishReason",
    "ModelCard",
    "ModelList",
    "StreamOptions",
    "TextContentPart",
    "TopLogprob",
    "Usage",
    "chat_token_logprob",
    "effective_max_tokens",
    "errors_to_api_error",
    "include_usage",
    "message_text",
    "model_not_found",
    "new_id",
    "parse_request",
    "stop_list",
    "template_messages",
    "to_sampling_params",
    "validation_error_to_api_error",
]

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
INT32_MAX = (1 << 31) - 1
MAX_STOP = 4
MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
LOGIT_BIAS_LIMIT = 100.0
MAX_JSON_DEPTH = 64  # nesting levels of a request body (a real request needs about 5)
UNLIKELY_LOGPROB = -9999.0  # what OpenAI reports for a logprob that is -inf
OWNER = "pipeshard"

Role = Literal["system", "user", "assistant", "developer", "tool"]
FinishReason = Literal["stop", "length"]

# Strict scalars: JSON "3", 3.0 or true are not accepted where an integer is expected.
PositiveInt32 = Annotated[StrictInt, Field(ge=1, le=INT32_MAX)]
Penalty = Annotated[StrictFloat, Field(ge=-2.0, le=2.0)]
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


def _finite_logprob(value: float) -> float:
    return value if math.isfinite(value) else UNLIKELY_LOGPROB


Logprob = Annotated[float, AfterValidator(_finite_logprob)]


def new_id(prefix: str) -> str:
    """A fresh response id such as ``chatcmpl-<32 hex>`` or ``cmpl-<32 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


# --- errors ------------------------------------------------------------------------------------


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class APIError(Exception):
    """An error to send as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers or {}
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code)
        )

    def response(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return self.body().model_dump()

    def __repr__(self) -> str:
        return (
            f"APIError(status={self.status}, message={self.message!r}, type={self.type!r}, "
            f"param={self.param!r}, code={self.code!r})"
        )


def model_not_found(model: str) -> APIError:
    """404 for an unknown ``model`` (policy: 404 ``model_not_found``, as OpenAI answers)."""
    return APIError(
        404,
        f"The model `{model}` does not exist.",
        type="invalid_request_error",
        param="model",
        code="model_not_found",
    )


# Location items pydantic adds for union members and dict keys; they are not part of the path.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[\w-]+\[.*\])$")
_INSTANCE_OF = re.compile(r" or instance of \w+")


def _param_path(loc: Sequence[int | str]) -> str | None:
    path = ""
    for item in loc:
        if isinstance(item, int):
            path += f"[{item}]"
        elif item == "[key]" or _UNION_TAG.match(item):
            continue
        else:
            path += f".{item}" if path else item
    return path or None


def _short_json(value: Any, limit: int = 80) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False, default=repr)
    except ValueError:  # NaN / circular
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(error: Mapping[str, Any], param: str | None) -> str:
    kind = str(error.get("type", ""))
    ctx = error.get("ctx") or {}
    name = f"'{param}'" if param else "the request body"
    if kind == "missing":
        return f"Missing required parameter: {name}."
    if kind == "json_invalid":
        return "We could not parse the JSON body of your request: it is not valid JSON."
    if kind == "value_error" and "error" in ctx:
        text = str(ctx["error"]).rstrip()
        return f"Invalid value for {name}: {text}{'' if text.endswith('.') else '.'}"
    got = _short_json(error.get("input"))
    if kind == "too_short":
        return (
            f"Invalid value for {name}: expected at least {ctx.get('min_length')} item(s), "
            f"got {ctx.get('actual_length')}."
        )
    if kind == "too_long":
        return (
            f"Invalid value for {name}: expected at most {ctx.get('max_length')} item(s), "
            f"got {ctx.get('actual_length')}."
        )
    msg = _INSTANCE_OF.sub("", str(error.get("msg", "invalid value")))
    msg = msg[:1].lower() + msg[1:]
    return f"Invalid value for {name}: {msg}, got {got}."


def errors_to_api_error(errors: Sequence[Mapping[str, Any]], strip_body: bool = False) -> APIError:
    """A 400 for pydantic-style error dicts (``exc.errors()``), naming the first one.

    ``strip_body`` drops a leading ``"body"`` location item, as in FastAPI's
    ``RequestValidationError.errors()``.
    """
    if not errors:
        return APIError(400, "Invalid request.")
    first = errors[0]
    loc = list(first.get("loc", ()))
    if strip_body and loc and loc[0] == "body":
        loc = loc[1:]
    if first.get("type") == "json_invalid":
        loc = []
    param = _param_path(loc)
    message = _describe(first, param)
    if len(errors) > 1:
        more = len(errors) - 1
        message += f" ({more} more error{'s' if more > 1 else ''} in the request.)"
    return APIError(400, message, param=param)


def validation_error_to_api_error(exc: ValidationError) -> APIError:
    """A 400 ``invalid_request_error`` naming the first failing field (``param`` = its path)."""
    return errors_to_api_error(exc.errors(include_url=False))


_Model = TypeVar("_Model", bound=BaseModel)


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
        param = _param_path(loc)
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
        return cls.model_validate(data)
    except ValidationError as exc:
        raise validation_error_to_api_error(exc) from None


# --- requests ----------------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Role
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(
                "content must be a string, a list of {'type': 'text', 'text': ...} parts, or null"
            )
        for i, part in enumerate(value):
            if not isinstance(part, Mapping):
                raise ValueError(f"content part {i} must be an object, got {_short_json(part)}")
            kind = part.get("type")
            if kind != "text":
                raise ValueError(
                    f"content part {i} has type {_short_json(kind)}: only 'text' parts are "
                    "supported"
                )
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i} must have a string 'text'")
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
            raise ValueError(f"stop sequences must be strings, got {_short_json(item)}")
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
                f"logit_bias keys must be token ids (integers as strings), got {_short_json(key)}"
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

    @field_validator("stop", mode="before")
    @classmethod
    def _validate_stop(cls, value: Any) -> Any:
        return _check_stop(value)

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

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value


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
                    f"prompt token ids must be non-negative integers, got {_short_json(item)}"
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


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """``[{"role", "content"}]`` dicts (plus ``name`` when given) for a chat template."""
    out: list[dict[str, str]] = []
    for message in messages:
        item = {"role": message.role, "content": message_text(message)}
        if message.name is not None:
            item["name"] = message.name
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
    )
    if vocab_size is not None:
        try:
            params.validate(vocab_size)
        except ValueError as exc:
            text = str(exc)
            param = next((p for p in _PARAM_NAMES if text.startswith(p)), None)
            raise APIError(400, f"Invalid value for '{param}': {text}", param=param) from None
    return params


# --- responses ---------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
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


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: None = None


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
    system_fingerprint: str | None = None
    choices: list[ChatCompletionChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """A streamed delta; serializes only the keys that are set (``{}`` on the last chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

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
    system_fingerprint: str | None = None
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
    system_fingerprint: str | None = None
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
    system_fingerprint: str | None = None
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = OWNER


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
