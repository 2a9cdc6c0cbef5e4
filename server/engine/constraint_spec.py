"""What a request's output must match, said without any HTTP dialect: each dialect's lowering
(server/api: chat completions, and through them Responses and Messages; Ollama's ``format``)
fills a :class:`ConstraintSpec`, and :func:`server.engine.constraints.build_constraint` turns it
into a grammar. The engine never sees the request it came from.

``dialect request -> ConstraintSpec -> Constraint (llguidance grammar) -> per-sequence Matcher``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class ToolSchema:
    """A function the model may call: its name and the JSON schema of its arguments (None:
    any object)."""

    name: str
    parameters: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class ToolSyntax:
    """How the model writes its calls, as far as the grammar needs it: ``calls_start``, each
    call as ``call_start`` body ``call_end`` with ``call_separator`` between calls, then
    ``calls_end``; the body is ``{"name": ..., <arguments_key>: {...}}`` (``style`` "json"),
    GLM's ``<arg_key>``/``<arg_value>`` pairs after the name ("xml"), or a harmony message in
    the commentary channel ("harmony"). ``tags``: markers the tokenizer may hold as single
    tokens."""

    style: Literal["json", "xml", "harmony"]
    calls_start: str
    call_start: str
    call_end: str
    call_separator: str
    calls_end: str
    arguments_key: str
    tags: tuple[str, ...] = ()


@dataclass(frozen=True)
class ToolCallSpec:
    """The output is a call of one of ``tools`` (or, with ``parallel``, one or more calls),
    written in ``syntax``; ``closed``: argument objects take no keys their schema does not
    name."""

    tools: tuple[ToolSchema, ...]
    syntax: ToolSyntax
    parallel: bool = False
    closed: bool = True


@dataclass(frozen=True)
class JsonSpec:
    """The output is JSON valid against ``schema`` (None: any JSON object); ``closed``: objects
    that name their properties take no others."""

    schema: Mapping[str, Any] | None = None
    closed: bool = False


@dataclass(frozen=True)
class ReasoningSpec:
    """The answer's grammar applies only after the model's reasoning: ``think`` (``<think>``
    ... ``</think>``; ``opened``: the prompt opened it already) or ``analysis`` (a harmony
    model's analysis channel, then ``final``)."""

    kind: Literal["think", "analysis"]
    opened: bool = False


@dataclass(frozen=True)
class ConstraintSpec:
    """What the output must match: a tool call or JSON (exactly one), after the reasoning
    where ``reasoning`` is set."""

    answer: ToolCallSpec | JsonSpec
    reasoning: ReasoningSpec | None = None

    @property
    def kind(self) -> str:
        """``tool_call``, ``json_schema`` or ``json_object`` (the built constraint's kind)."""
        if isinstance(self.answer, ToolCallSpec):
            return "tool_call"
        return "json_object" if self.answer.schema is None else "json_schema"
