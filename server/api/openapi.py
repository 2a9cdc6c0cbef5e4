"""The gateway's OpenAPI document, made to tell the truth: the request bodies the routes parse
themselves (for OpenAI-style 400s) are documented as components, every operation lists its
error statuses with the OpenAI error envelope and no 422, streaming operations their server-sent
events, and with API keys the ``/v1`` operations need Bearer authentication."""

from __future__ import annotations

import functools
import json
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from server.api.errors import ErrorResponse
from server.api.requests import ChatCompletionRequest, CompletionRequest

# What each error status of the API means; the OpenAPI schema lists them per operation.
_ERRORS = {
    400: "Invalid request: bad JSON, a bad field, or more tokens than the model's context",
    401: "Missing or wrong API key (Authorization: Bearer KEY)",
    404: "No such model",
    413: "Request body over the gateway's limit (--max-body-bytes)",
    415: "A body declared as anything but JSON (Content-Type other than application/json)",
    429: "Too many requests queued: retry after Retry-After seconds",
    503: "The gateway is starting, a stage is down, or the request waited too long in the queue",
    504: "A pipeline step took longer than the step timeout",
}
_BEARER = "bearerAuth"
_REF_TEMPLATE = "#/components/schemas/{model}"

_REQUEST_MODELS: list[type[BaseModel]] = [ChatCompletionRequest, CompletionRequest]


@functools.cache
def _request_schemas() -> tuple[dict[type[BaseModel], dict[str, Any]], dict[str, Any]]:
    """References to the request models and their component schemas (with nested models)."""
    refs, schema = models_json_schema(
        [(model, "validation") for model in _REQUEST_MODELS], ref_template=_REF_TEMPLATE
    )
    return {model: refs[(model, "validation")] for model in _REQUEST_MODELS}, schema["$defs"]


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """Document the JSON body in the OpenAPI schema (the route parses it itself, for 400s)."""
    refs, _ = _request_schemas()
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": refs[model]}},
        }
    }


def operation_responses(
    ok: type[BaseModel] | None, errors: tuple[int, ...], stream: bool = False
) -> dict[int | str, dict[str, Any]]:
    """OpenAPI responses: the 200 (a model, and with ``stream`` also an SSE stream) and the
    error statuses, each with the OpenAI error envelope."""
    out: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorResponse, "description": _ERRORS[status]} for status in errors
    }
    if ok is not None:
        out[200] = {"model": ok, "description": "Successful Response"}
    if stream:
        out[200]["description"] = "The completion; with stream=true, server-sent events"
        out[200]["content"] = {"text/event-stream": {"schema": _SSE_EVENT}}
    return out


# One server-sent event of a streamed completion (OpenAPI before 3.2: `schema` is per event).
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {
            "type": "string",
            "description": "a JSON chunk (chat.completion.chunk or text_completion), an "
            '{"error": {...}} envelope if generation fails after the 200, and last [DONE]',
        },
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}


def document(app: FastAPI, secured: bool) -> None:
    """Make the generated OpenAPI schema tell the truth about the API.

    * the request bodies' models are components (their nested ``$ref`` resolve);
    * no 422 (validation errors are 400 in the OpenAI envelope, listed per operation);
    * with API keys, the ``/v1`` operations need Bearer authentication.
    """
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        _, defs = _request_schemas()
        for name, definition in defs.items():
            if schemas.setdefault(name, definition) != definition:
                raise RuntimeError(f"two different OpenAPI schemas are named {name}")
        for path, item in schema["paths"].items():
            for operation in item.values():
                operation["responses"].pop("422", None)
                if secured and path.startswith("/v1/"):
                    operation["security"] = [{_BEARER: []}]
        if "/HTTPValidationError" not in json.dumps(schema["paths"]):
            schemas.pop("HTTPValidationError", None)
            schemas.pop("ValidationError", None)
        if secured:
            components["securitySchemes"] = {_BEARER: {"type": "http", "scheme": "bearer"}}
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
