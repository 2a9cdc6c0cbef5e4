"""The HTTP side of constrained decoding: a dialect's request fields lowered into the engine's
neutral :class:`~server.engine.constraint_spec.ConstraintSpec` (the engine builds the grammar
from that alone, server/engine/constraints.py).

``ChatCompletionRequest (tools, tool_choice, parallel_tool_calls, response_format) ->
ConstraintSpec``; Responses and Messages reach it through their chat request; Ollama's
``format`` through :func:`json_spec`. :func:`with_reasoning` adds where the grammar starts on a
reasoning model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from server.api.reasoning import closed_by_prompt
from server.api.requests import ChatCompletionRequest
from server.api.tools import ToolFormat
from server.engine.constraint_spec import (
    ConstraintSpec,
    JsonSpec,
    ReasoningSpec,
    ToolCallSpec,
    ToolSchema,
)


def chat_spec(
    req: ChatCompletionRequest, mode: str | None, tool_format: ToolFormat | None, closed: bool
) -> ConstraintSpec | None:
    """What a chat request's output must match, or None: a call of an offered tool with
    ``tool_choice`` ``"required"`` (one or more calls, unless ``parallel_tool_calls`` is
    false) or a named function (one call), else ``response_format`` ``json_object`` /
    ``json_schema``. ``mode``: the request's :meth:`~ChatCompletionRequest.tool_mode`.

    ``closed`` (the gateway's ``json_schema_additional_properties`` "closed", the default):
    tool arguments and ``strict`` JSON schemas treat a missing ``additionalProperties`` as
    false; a non-strict schema is enforced as written."""
    tools = req.tools or []
    choice = req.tool_choice
    if mode in ("required", "named") and tool_format is not None and choice is not None:
        if choice == "required":
            offered = tools
        else:  # a named function
            name = choice.function.name  # type: ignore[union-attr]
            offered = [t for t in tools if t.function.name == name]
        if offered:
            parallel = req.parallel_tool_calls is not False and choice == "required"
            schemas = tuple(ToolSchema(t.function.name, t.function.parameters) for t in offered)
            return ConstraintSpec(ToolCallSpec(schemas, tool_format.syntax, parallel, closed))
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ConstraintSpec(JsonSpec())
    schema = fmt.json_schema
    if schema is None:
        return None
    return ConstraintSpec(JsonSpec(schema.schema_, closed and schema.strict is True))


def json_spec(fmt: Any, closed: bool) -> ConstraintSpec | None:
    """Ollama's ``format``: ``"json"`` (any JSON object) or a JSON schema (its objects closed
    with ``closed``, as chat's strict schemas), else None."""
    if not fmt:
        return None
    if fmt == "json":
        return ConstraintSpec(JsonSpec())
    schema: Mapping[str, Any] = fmt
    return ConstraintSpec(JsonSpec(schema, closed))


def with_reasoning(
    spec: ConstraintSpec | None,
    reasoning: str,
    prompt_text: str,
    opened: bool,
    harmony_calls: bool = False,
) -> ConstraintSpec | None:
    """``spec`` applied from the end of the model's reasoning (free inside it): after a harmony
    model's analysis (not for a call written in harmony's own format, whose grammar has the
    analysis already), after ``</think>`` unless the prompt closed the thinking already
    (``opened``: the prompt opened it)."""
    if spec is None or reasoning == "none":
        return spec
    if reasoning == "harmony":
        if spec.kind == "tool_call" and harmony_calls:
            return spec
        return ConstraintSpec(spec.answer, ReasoningSpec("analysis"))
    if closed_by_prompt(prompt_text):
        return spec
    return ConstraintSpec(spec.answer, ReasoningSpec("think", opened))
