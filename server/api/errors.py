"""The error envelopes (OpenAI's; Anthropic's on /v1/messages): :class:`APIError` (status,
type, ``param``, code) and the turn of a pydantic validation failure into one 400
``invalid_request_error`` naming the path of the first failing field (``"temperature"``,
``"messages[0].role"``) with one readable message."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    ValidationError,
)


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class AnthropicErrorBody(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error envelope (the Messages API's routes)."""

    type: Literal["error"] = "error"
    error: AnthropicErrorBody
    request_id: str | None = None  # the x-request-id header's


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


def param_path(loc: Sequence[int | str]) -> str | None:
    path = ""
    for item in loc:
        if isinstance(item, int):
            path += f"[{item}]"
        elif item == "[key]" or _UNION_TAG.match(item):
            continue
        else:
            path += f".{item}" if path else item
    return path or None


def short_json(value: Any, limit: int = 80) -> str:
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
    got = short_json(error.get("input"))
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
    param = param_path(loc)
    message = _describe(first, param)
    if len(errors) > 1:
        more = len(errors) - 1
        message += f" ({more} more error{'s' if more > 1 else ''} in the request.)"
    return APIError(400, message, param=param)


def validation_error_to_api_error(exc: ValidationError) -> APIError:
    """A 400 ``invalid_request_error`` naming the first failing field (``param`` = its path)."""
    return errors_to_api_error(exc.errors(include_url=False))


def error_response(exc: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    """``exc`` as the HTTP response: its status, the OpenAI envelope, its headers and
    ``headers``."""
    return JSONResponse(
        exc.response(), status_code=exc.status, headers={**exc.headers, **(headers or {})}
    )


# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
ANTHROPIC_PATHS = "/v1/messages"  # the routes that answer in Anthropic's envelope


def anthropic_error(exc: APIError, request_id: str | None = None) -> dict[str, Any]:
    """``exc`` in Anthropic's envelope: ``{"type": "error", "error": {"type", "message"},
    "request_id"}`` (the failing field, OpenAI's ``param``, is named in the message; the
    request id is the ``x-request-id`` header's)."""
    kind = _ANTHROPIC_TYPES.get(exc.status, "api_error" if exc.status >= 500 else None)
    if kind is None:  # another 4xx (405, 415, 499): the request's fault
        kind = "invalid_request_error"
    message = exc.message
    if exc.param and f"'{exc.param}'" not in message:
        message = f"{message} (parameter: {exc.param})"
    return {"type": "error", "error": {"type": kind, "message": message}, "request_id": request_id}


OLLAMA_PATHS = "/api"  # the routes that answer in Ollama's envelope


def ollama_error(exc: APIError) -> dict[str, Any]:
    """``exc`` in Ollama's envelope: ``{"error": "message"}`` (the failing field, OpenAI's
    ``param``, is named in the message)."""
    message = exc.message
    if exc.param and f"'{exc.param}'" not in message:
        message = f"{message} (parameter: {exc.param})"
    return {"error": message}


def error_response_for(
    path: str,
    exc: APIError,
    headers: dict[str, str] | None = None,
    request_id: str | None = None,
) -> JSONResponse:
    """``exc`` as the response of a request to ``path``: Anthropic's envelope on the Messages
    API's routes, Ollama's on ``/api/*``, OpenAI's everywhere else."""
    if path == OLLAMA_PATHS or path.startswith(f"{OLLAMA_PATHS}/"):
        return JSONResponse(
            ollama_error(exc), status_code=exc.status, headers={**exc.headers, **(headers or {})}
        )
    if path == ANTHROPIC_PATHS or path.startswith(f"{ANTHROPIC_PATHS}/"):
        return JSONResponse(
            anthropic_error(exc, request_id),
            status_code=exc.status,
            headers={**exc.headers, **(headers or {})},
        )
    return error_response(exc, headers)
