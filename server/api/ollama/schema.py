"""Ollama's API as pydantic models: the requests of ``/api/chat``, ``/api/generate`` and
``/api/show`` (with their ``options``), and the replies of every ``/api/*`` route, in the shapes
of Ollama's API documentation (docs/api.md of github.com/ollama/ollama, v0.32) and its Go types
(api/types.go).

Requests follow the gateway's rules (server/api/requests.py): unknown fields are ignored and
named (``ignored_fields``; an unknown key of ``options`` as ``options.KEY``), strict scalars,
and a field the gateway knows but cannot honour is a 400 naming it, never silence.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from protos.sampling import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from server.api.errors import short_json
from server.api.requests import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    ToolDefinition,
    _Request,
    check_distinct,
)

MAX_STOP = 16
Number = StrictFloat | StrictInt

# --- options ----------------------------------------------------------------------------------

# Options Ollama knows that change how its own runner loads or runs a model, or sampling
# methods the stages do not have: refused with a 400 unless the value is the one that changes
# nothing (``NO_OP``); "the gateway cannot honour this" is never silence.
_RUNNER = "set when the stages start (pipeshard stage / up), not per request"
UNSUPPORTED_OPTIONS: dict[str, str] = {
    "num_gpu": _RUNNER,
    "main_gpu": _RUNNER,
    "num_thread": _RUNNER,
    "num_batch": _RUNNER,
    "numa": _RUNNER,
    "low_vram": _RUNNER,
    "f16_kv": _RUNNER,
    "use_mmap": _RUNNER,
    "use_mlock": _RUNNER,
    "vocab_only": _RUNNER,
    "logits_all": _RUNNER,
    "embedding_only": _RUNNER,
    "draft_num_predict": "the speculation settings are the gateway's (--spec-k), not per request",
    "num_keep": "the context is never shifted here: a prompt that does not fit is a 400",
    "typical_p": "typical sampling is not supported (only 1.0, off)",
    "tfs_z": "tail-free sampling is not supported (only 1.0, off)",
    "mirostat": "mirostat sampling is not supported (only 0, off)",
    "mirostat_tau": "mirostat sampling is not supported",
    "mirostat_eta": "mirostat sampling is not supported",
}
# the values of those options that ask for nothing this server does not do anyway
NO_OP: dict[str, tuple[Any, ...]] = {"typical_p": (1, 1.0), "tfs_z": (1, 1.0), "mirostat": (0,)}


class Options(_Request):
    """``options``: the model parameters of a request, as Ollama's Modelfile names them."""

    num_predict: StrictInt | None = None  # <= 0 (-1, -2): up to the end of the context
    temperature: Annotated[Number, Field(ge=0.0, le=2.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0, le=INT32_MAX)] | None = None
    top_p: Annotated[Number, Field(ge=0.0, le=1.0)] | None = None
    min_p: Annotated[Number, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None  # -1: random
    stop: list[Annotated[str, Field(min_length=1)]] | None = None
    repeat_penalty: (
        Annotated[Number, Field(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)] | None
    ) = None
    repeat_last_n: StrictInt | None = None
    penalize_newline: StrictBool | None = None
    presence_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] | None = None
    num_ctx: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None
    # the ones refused (UNSUPPORTED_OPTIONS): typed Any so that the refusal names them
    num_gpu: Any = None
    main_gpu: Any = None
    num_thread: Any = None
    num_batch: Any = None
    numa: Any = None
    low_vram: Any = None
    f16_kv: Any = None
    use_mmap: Any = None
    use_mlock: Any = None
    vocab_only: Any = None
    logits_all: Any = None
    embedding_only: Any = None
    draft_num_predict: Any = None
    num_keep: Any = None
    typical_p: Any = None
    tfs_z: Any = None
    mirostat: Any = None
    mirostat_tau: Any = None
    mirostat_eta: Any = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        if isinstance(value, str):  # (Ollama's Modelfile gives one stop per line)
            value = [value]
        if isinstance(value, list) and len(value) > MAX_STOP:
            raise ValueError(f"stop may hold at most {MAX_STOP} sequences, got {len(value)}")
        return value

    @field_validator(*UNSUPPORTED_OPTIONS)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        name = str(info.field_name)
        if value is None or value in NO_OP.get(name, ()):
            return value
        raise ValueError(f"{name} cannot be honoured: {UNSUPPORTED_OPTIONS[name]}")

    @model_validator(mode="after")
    def _penalty_window(self) -> Options:
        """The repetition penalty covers the whole prompt and output (``repeat_last_n: -1``)
        and every token, newlines too: another window, or newlines spared, only while no
        penalty applies."""
        active = self.repeat_penalty is not None and self.repeat_penalty != 1.0
        if active and self.repeat_last_n not in (None, -1):
            raise ValueError(
                "repeat_last_n cannot be honoured with a repeat_penalty: the penalty covers the "
                "whole prompt and output here (only -1)"
            )
        if active and self.penalize_newline is False:
            raise ValueError(
                "penalize_newline false cannot be honoured with a repeat_penalty: the penalty "
                "covers every token here"
            )
        return self


# --- messages and tools ----------------------------------------------------------------------


class ToolCallFunction(_Request):
    name: Annotated[str, Field(min_length=1)]
    arguments: dict[str, Any] = Field(default_factory=dict)  # an object, not a string
    index: StrictInt | None = None


class ToolCall(_Request):
    id: str | None = None
    function: ToolCallFunction


def _no_images(value: Any) -> Any:
    if value:
        raise ValueError("image input is not supported: no vision model is served")
    return value


class Message(_Request):
    """A message of ``/api/chat``: ``role``, ``content`` (a string), an assistant's
    ``tool_calls`` and ``thinking``, a tool result's ``tool_name`` / ``tool_call_id``."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""  # (null: empty, as Ollama reads it)
    thinking: str | None = None  # an earlier answer's thinking: left out of the prompt
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value  # (as Ollama reads it)

    @field_validator("content", mode="before")
    @classmethod
    def _null_is_empty(cls, value: Any) -> Any:
        return "" if value is None else value

    @field_validator("images")
    @classmethod
    def _images(cls, value: Any) -> Any:
        return _no_images(value)

    @field_validator("tool_calls", "thinking")
    @classmethod
    def _assistant_only(cls, value: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if value is not None and role is not None and role != "assistant":
            raise ValueError(f"{info.field_name} is only valid in assistant messages, not {role!r}")
        return value

    @field_validator("tool_name", "tool_call_id")
    @classmethod
    def _tool_only(cls, value: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if value is not None and role is not None and role != "tool":
            raise ValueError(f"{info.field_name} is only valid in tool messages, not {role!r}")
        return value


# --- the requests ------------------------------------------------------------------------------

_GO_DURATION = re.compile(r"^-?(?:\d+(?:\.\d*)?(?:ns|us|µs|ms|s|m|h))+$")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def duration_seconds(value: str | float) -> float:
    """A ``keep_alive`` in seconds: a number of seconds, a string of one, or a Go duration
    (``"5m"``, ``"1h30m"``, ``"-1m"``); a ValueError for anything else."""
    if isinstance(value, int | float):
        return float(value)
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    if not _GO_DURATION.match(text):
        raise ValueError(
            f"keep_alive must be a duration ('5m', '1h', '-1') or a number of seconds, "
            f"got {short_json(value)}"
        )
    sign = -1.0 if text.startswith("-") else 1.0
    parts = re.findall(r"(\d+(?:\.\d*)?)(ns|us|µs|ms|s|m|h)", text)
    return sign * sum(float(n) * _UNITS[unit] for n, unit in parts)


class _Generation(_Request):
    """What ``/api/chat`` and ``/api/generate`` share."""

    model: Annotated[str, Field(min_length=1)]
    stream: StrictBool | None = None  # default true: NDJSON
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: str | Number | None = None
    think: StrictBool | Literal["low", "medium", "high", "max"] | None = None
    truncate: StrictBool | None = None
    shift: StrictBool | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None

    @field_validator("format", mode="before")
    @classmethod
    def _format(cls, value: Any) -> Any:
        if value is None or value in ("", "json") or isinstance(value, Mapping):
            return value
        raise ValueError(f"format must be 'json' or a JSON schema object, got {short_json(value)}")

    @field_validator("think", mode="before")
    @classmethod
    def _think(cls, value: Any) -> Any:
        if value is None or isinstance(value, bool) or value in ("low", "medium", "high", "max"):
            return value
        raise ValueError(
            f"think must be true, false, 'low', 'medium', 'high' or 'max', got {short_json(value)}"
        )

    @field_validator("keep_alive")
    @classmethod
    def _keep_alive(cls, value: Any) -> Any:
        if value is None:
            return value
        if duration_seconds(value) == 0:
            raise ValueError(
                "keep_alive 0 (unload the model now) cannot be honoured: the stages hold the "
                "model until they stop"
            )
        return value

    @field_validator("truncate", "shift")
    @classmethod
    def _never(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value:
            what = "truncated" if info.field_name == "truncate" else "shifted"
            raise ValueError(
                f"{info.field_name} true cannot be honoured: the context is never {what} here "
                "(a prompt and output over the context are a 400; send false or leave it out)"
            )
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError(
                "logprobs are not supported on the Ollama API (use /v1/chat/completions)"
            )
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise ValueError("top_logprobs are not supported on the Ollama API")
        return value


class ChatRequest(_Generation):
    """``POST /api/chat``. No messages: the model is loaded (it always is here)."""

    messages: list[Message] = Field(default_factory=list)
    tools: list[ToolDefinition] | None = None

    @field_validator("tools")
    @classmethod
    def _distinct(cls, value: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        check_distinct([tool.function.name for tool in value or ()], "function")
        return value


class GenerateRequest(_Generation):
    """``POST /api/generate``. No prompt: the model is loaded (it always is here)."""

    prompt: str = ""
    system: str | None = None
    raw: StrictBool | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None

    @field_validator("images")
    @classmethod
    def _images(cls, value: Any) -> Any:
        return _no_images(value)

    @field_validator("suffix", "template", "context")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if not value:
            return value
        reasons = {
            "suffix": "fill-in-the-middle is not supported",
            "template": "the export's chat template is the template (Go templates are not run)",
            "context": "the deprecated context is not supported: send the conversation to "
            "/api/chat",
        }
        raise ValueError(f"{info.field_name} cannot be honoured: {reasons[str(info.field_name)]}")

    @field_validator("system")
    @classmethod
    def _not_raw(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("raw"):
            raise ValueError("raw mode does not support a system prompt")
        return value


class ShowRequest(_Request):
    """``POST /api/show``: ``model`` (or its older name ``name``)."""

    model: str | None = None
    name: str | None = None
    verbose: StrictBool | None = None  # (no field here is left out without it)

    @model_validator(mode="after")
    def _named(self) -> ShowRequest:
        if not (self.model or self.name):
            raise ValueError("model is required")
        return self

    @property
    def wanted(self) -> str:
        return self.model or self.name or ""


# --- the replies ---------------------------------------------------------------------------------


class Metrics(BaseModel):
    """The final reply's statistics; durations in nanoseconds."""

    total_duration: int
    load_duration: int
    prompt_eval_count: int
    prompt_eval_duration: int
    eval_count: int
    eval_duration: int


class OutToolCallFunction(BaseModel):
    index: int
    name: str
    arguments: dict[str, Any]


class OutToolCall(BaseModel):
    id: str
    function: OutToolCallFunction


class OutMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    thinking: str | None = None
    tool_calls: list[OutToolCall] | None = None


class ChatResponse(BaseModel):
    model: str
    created_at: str
    message: OutMessage
    done: bool
    done_reason: str | None = None


class GenerateResponse(BaseModel):
    model: str
    created_at: str
    response: str
    thinking: str | None = None
    done: bool
    done_reason: str | None = None


class ModelDetails(BaseModel):
    parent_model: str = ""
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class ListedModel(BaseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails


class ListResponse(BaseModel):
    models: list[ListedModel]


class RunningModel(BaseModel):
    name: str
    model: str
    size: int
    digest: str
    details: ModelDetails
    expires_at: str
    size_vram: int
    context_length: int


class ProcessResponse(BaseModel):
    models: list[RunningModel]


class ShowResponse(BaseModel):
    license: str
    modelfile: str
    parameters: str
    template: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class VersionResponse(BaseModel):
    version: str


class ErrorResponse(BaseModel):
    """Ollama's error envelope: ``{"error": "message"}``."""

    error: str
