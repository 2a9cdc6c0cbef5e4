"""Constrained decoding: what a request's output must match (a JSON schema, any JSON object, a
call of an offered tool) as a grammar, and the per-sequence matcher that says which tokens the
last stage may sample.

The grammar engine is llguidance (numpy token bitmasks, no torch). The gateway keeps one
matcher per sequence, advanced by the tokens the sequence takes; each sampling step carries a
bitmask per sampled row (``pb.Step.token_masks``), which the last stage applies to the logits
before it samples (shard_runtime/sampling.py ``apply_masks``). With speculative decoding the
matcher walks the draft tokens to give each verified row its own mask and cuts the draft at
the first token the grammar refuses. Masks live in the gateway, so micro-batching, ``n > 1``,
preemption, re-prefill and a stage restart need nothing more: the matcher holds the state.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from server.engine.constraint_spec import ConstraintSpec, ToolCallSpec, ToolSchema, ToolSyntax


class ConstraintError(ValueError):
    """A grammar that cannot be built (an unsupported schema), or output it refuses."""


@dataclass(frozen=True)
class Constraint:
    """A grammar the output must match (llguidance's grammar form) and what it is for."""

    grammar: str
    kind: str  # "json_object", "json_schema", "tool_call" (required / a named function)


# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE_SCHEMA = ("additionalProperties", "items", "contains", "not", "if", "then", "else",
               "propertyNames", "unevaluatedItems", "additionalItems")  # fmt: skip
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema: Any) -> Any:
    """``schema`` with every object schema that names its ``properties`` and says nothing of
    extra keys (no ``additionalProperties``, ``unevaluatedProperties`` or
    ``patternProperties``) given ``"additionalProperties": false``: the keys it names are then
    the only ones an object may have, as with xgrammar's strict mode in vLLM. It goes down
    through properties, items, ``anyOf`` / ``oneOf`` branches, ``$defs`` and the other
    subschemas. Left open: an object that names no properties (a free-form object, such as
    ``{"type": "object"}``), and one composed with ``allOf`` or a sibling ``$ref`` (and the
    ``allOf`` members themselves), whose keys come from several schemas at once. A copy; the
    input is not changed."""
    return _close(schema, True)


def _close(node: Any, closable: bool) -> Any:
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = dict(node)
    for key in _ONE_SCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key], True)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_close(item, True) for item in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(sub, True) for name, sub in out[key].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_close(item, False) for item in out["allOf"]]
    composed = "allOf" in out or "$ref" in out
    open_ = any(k in out for k in ("additionalProperties", "unevaluatedProperties",
                                   "patternProperties"))  # fmt: skip
    if closable and not composed and not open_ and isinstance(out.get("properties"), dict):
        out["additionalProperties"] = False
    return out


def json_schema_constraint(
    schema: dict[str, Any], kind: str = "json_schema", closed: bool = False
) -> Constraint:
    """A grammar for JSON valid against ``schema``; ``closed``: objects that name their
    properties take no others (:func:`close_objects`)."""
    import llguidance

    if closed:
        schema = close_objects(schema)
    try:
        # compact JSON: a model may not wander off into whitespace (OpenAI writes it compact)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
    except (ValueError, TypeError) as exc:
        raise ConstraintError(f"the JSON schema cannot be enforced: {exc}") from None
    _check_grammar(grammar, "the JSON schema")
    return Constraint(grammar, kind)


def _tool_body_schema(
    tools: Sequence[ToolSchema], arguments_key: str, closed: bool = True
) -> dict[str, Any]:
    """A JSON object calling one of ``tools``: its name and arguments valid for its schema
    (``closed``: argument objects take no keys their schema does not name)."""
    options = []
    for i, tool in enumerate(tools):
        parameters = dict(tool.parameters or {"type": "object", "properties": {}})
        if closed:
            parameters = close_objects(parameters)
        # the schema's own references ("#/$defs/x", "#") point into it, not the body's root
        where = f"/properties/{arguments_key}"
        parameters = _rebase_refs(parameters, where if len(tools) == 1 else f"/anyOf/{i}{where}")
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, arguments_key: parameters},
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def _rebase_refs(node: Any, base: str) -> Any:
    """``node`` (a schema placed at JSON pointer ``base`` of another) with its local
    references (``#``, ``#/...``) pointing to the same places from the new root."""
    if isinstance(node, list):
        return [_rebase_refs(item, base) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _rebase_refs(value, base) for key, value in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = "#" + base + ref[1:]
    return out


def _check_grammar(grammar: str, what: str) -> None:
    """Refuse a grammar llguidance cannot use now (a 400), not when a sequence starts."""
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ConstraintError(f"{what} cannot be enforced: {messages[0].splitlines()[0]}")


def tool_call_constraint(
    tools: Sequence[ToolSchema],
    syntax: ToolSyntax,
    parallel: bool,
    vocab: dict[str, int] | None = None,
    closed: bool = True,
) -> Constraint:
    """A grammar for one call (or, with ``parallel``, one or more) of ``tools`` written as
    ``syntax`` says: its text before each call, the JSON body, its text after.
    ``closed``: argument objects take no keys their schema does not name
    (:func:`close_objects`)."""
    import llguidance

    if syntax.style == "xml":
        return _xml_tool_call_constraint(tools, parallel, vocab)
    if syntax.style == "harmony":
        return _harmony_tool_call_constraint(tools, vocab, closed)
    body = _tool_body_schema(tools, syntax.arguments_key, closed)

    def literal(text: str) -> str:
        if not text:
            return ""
        token = (vocab or {}).get(text)
        quoted = json.dumps(text)
        # a tag the model writes as one token of its vocabulary may come either way
        return f"(<[{token}]> | {quoted})" if token is not None else quoted

    def tagged(text: str) -> str:
        """``text`` with each of the format's tags in it (``<tool_call>``, ``[TOOL_CALLS]``)
        as a literal of its own, so that one may come as its single token."""
        parts = [text]
        for tag in syntax.tags:
            parts = [
                piece
                for part in parts
                for i, split in enumerate(part.split(tag))
                for piece in ((tag, split) if i else (split,))
            ]
        return " ".join(literal(p) for p in parts if p)

    call = " ".join(x for x in (tagged(syntax.call_start), "body", tagged(syntax.call_end)) if x)
    separator = literal(syntax.call_separator)
    more = f"({separator} call)*" if parallel else ""
    lines = [
        f"start: {tagged(syntax.calls_start)} call {more} {tagged(syntax.calls_end)}",
        f"call: {call}",
        f"body: %json {json.dumps({**body, 'x-guidance': {'whitespace_flexible': False}})}",
    ]
    lark = "\n".join(" ".join(line.split()) for line in lines) + "\n"
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError) as exc:
        raise ConstraintError(f"the tools' schemas cannot be enforced: {exc}") from None
    _check_grammar(grammar, "the tools' schemas")
    return Constraint(grammar, "tool_call")


def _harmony_tool_call_constraint(
    tools: Sequence[ToolSchema], vocab: dict[str, int] | None, closed: bool
) -> Constraint:
    """gpt-oss's call: first, if the model wants, an ``analysis`` message (free text), then
    ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`` and arguments
    valid for NAME's schema; the model's end of turn (``<|call|>``, one of its end tokens)
    follows. One call per turn, as harmony has it. The markup is the model's special tokens,
    by name; without ``<|constrain|>`` in the vocabulary the header says ``json`` in text."""
    import llguidance

    constrain = '" " <|constrain|> "json"' if "<|constrain|>" in (vocab or {}) else '" json"'
    lines = [
        "%llguidance {}",
        "start: analysis? call",
        'analysis: <|channel|> "analysis" <|message|> TEXT <|end|> <|start|> "assistant"',
        'call: <|channel|> "commentary to=functions." ('
        + " | ".join(f"call{i}" for i in range(len(tools)))
        + ")",
    ]
    grammars: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        parameters = dict(tool.parameters or {"type": "object", "properties": {}})
        if closed:
            parameters = close_objects(parameters)
        schema = {**parameters, "x-guidance": {"whitespace_flexible": False}}
        lines.append(f"call{i}: {json.dumps(tool.name)} {constrain} <|message|> args{i}")
        lines.append(f"args{i}: %json {json.dumps(schema)}")
    lines.append(r"TEXT: /(.|\n)*/")
    grammars.append({"name": "call", "lark_grammar": "\n".join(lines) + "\n"})
    grammar = json.dumps({"grammars": grammars})
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ConstraintError(f"the tools' schemas cannot be enforced: {error}")
    return Constraint(grammar, "tool_call")


def after_reasoning(
    answer: Constraint, opened: bool, think_tokens: int | None = None
) -> Constraint:
    """``answer``, applied once the model's reasoning has ended: ``<think>`` (unless the
    template opened it already: then the output starts inside it), free text (no special
    token) up to the first ``</think>``, up to 4 white-space characters, then the answer's
    grammar. Without an opened think the model may also answer at once.

    ``think_tokens``: the reasoning is exactly that many tokens, then ``</think>`` is forced
    (for a test that needs the reasoning to end at a chosen point).
    """
    if think_tokens is None:
        think = 'think[lazy]: THINK_TEXT "</think>"'  # the shortest text up to the end tag
    else:
        think = (
            f'think: think_text "</think>"\nthink_text[max_tokens={int(think_tokens)}]: THINK_TEXT'
        )
    head = "think" if opened else '("<think>" think)?'
    lark = "\n".join(
        [
            "%llguidance {}",
            f"start: {head} SEP? @answer",
            think,
            r"THINK_TEXT: /(.|\n)*/",
            r"SEP: /[ \t\r\n]{1,4}/",
        ]
    )
    return _before_answer(lark, answer)


def after_analysis(answer: Constraint) -> Constraint:
    """``answer``, applied in the ``final`` channel of a harmony model (gpt-oss): first, if the
    model wants, an ``analysis`` message (free text, no special token, up to ``<|end|>``),
    then ``<|channel|>final<|message|>`` and the answer's grammar. The markup is the model's
    special tokens, by name."""
    lark = "\n".join(
        [
            "%llguidance {}",
            'start: analysis? <|channel|> "final" <|message|> @answer',
            'analysis: <|channel|> "analysis" <|message|> TEXT <|end|> <|start|> "assistant"',
            r"TEXT: /(.|\n)*/",
        ]
    )
    return _before_answer(lark, answer)


def _before_answer(lark: str, answer: Constraint) -> Constraint:
    """A grammar set: ``lark`` (which refers to ``@answer``), and ``answer``'s grammar."""
    import llguidance

    if answer.grammar.lstrip().startswith("{"):  # a grammar set (JSON schemas)
        parts = json.loads(answer.grammar)["grammars"]
    else:  # a Lark grammar
        parts = [{"lark_grammar": answer.grammar}]
    parts = [{**parts[0], "name": "answer"}, *parts[1:]]
    grammar = json.dumps({"grammars": [{"name": "reasoned", "lark_grammar": lark}, *parts]})
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ConstraintError(f"the grammar cannot follow the reasoning: {error}")
    return Constraint(grammar, answer.kind)


def _xml_string(function: str, key: str, schema: dict[str, Any]) -> str:
    """A string argument as GLM writes it (the text itself, up to the next tag): its ``enum``
    or ``const``, else text without ``<`` of ``minLength`` to ``maxLength`` characters.
    ``pattern`` and ``format`` cannot be enforced on it: refused."""
    for word in ("pattern", "format"):
        if word in schema:
            raise ConstraintError(
                f"the tools' schemas cannot be enforced: {function}'s string argument {key!r} "
                f"has {word!r}, which this model's tool-call format (plain text values) "
                "cannot be held to"
            )
    if "const" in schema:
        return json.dumps(str(schema["const"]))
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return "(" + " | ".join(json.dumps(str(v)) for v in enum) + ")"
    low = int(schema.get("minLength", 0) or 0)
    high = schema.get("maxLength")
    span = f"{max(low, 1)},{int(high)}" if high is not None else f"{max(low, 1)},"
    if high is not None and int(high) < 1:
        return '""'
    text = f"/[^<]{{{span}}}/"
    return text if low > 0 else f"({text})?"


def _xml_tool_call_constraint(
    tools: Sequence[ToolSchema], parallel: bool, vocab: dict[str, int] | None
) -> Constraint:
    """GLM's calls: ``<tool_call>NAME`` then one ``<arg_key>K</arg_key><arg_value>V
    </arg_value>`` pair per argument (each of the schema's properties at most once, in its
    order, the required ones always), then ``</tool_call>``, with the newlines GLM-4.5 writes
    between them optional (GLM-4.7 writes none). A value is free text without ``<`` where the
    schema says ``"type": "string"`` (one of its ``enum`` where it has one), else compact JSON
    valid for the argument's schema."""
    import llguidance

    def literal(text: str) -> str:
        token = (vocab or {}).get(text)
        quoted = json.dumps(text)
        return f"(<[{token}]> | {quoted})" if token is not None else quoted

    newline = '"\\n"?'
    lines = []
    calls = []
    for t, tool in enumerate(tools):
        parameters = tool.parameters or {"type": "object"}
        properties = parameters.get("properties") or {}
        required = set(parameters.get("required") or ())
        pairs = []
        for a, (key, schema) in enumerate(properties.items()):
            schema = schema if isinstance(schema, dict) else {}
            rule = f"arg_{t}_{a}"
            if schema.get("type") == "string":
                value = _xml_string(tool.name, key, schema)
            else:
                flat = {**schema, "x-guidance": {"whitespace_flexible": False}}
                value = f"%json {json.dumps(flat)}"
            lines.append(
                f"{rule}: {literal('<arg_key>')} {json.dumps(str(key))} {literal('</arg_key>')} "
                f"{newline} {literal('<arg_value>')} value_{t}_{a} {literal('</arg_value>')} "
                f"{newline}"
            )
            lines.append(f"value_{t}_{a}: {value}")
            pairs.append(rule if key in required else f"{rule}?")
        calls.append(
            f"{literal('<tool_call>')} {json.dumps(tool.name)} {newline} "
            f"{' '.join(pairs)} {literal('</tool_call>')}"
        )
    more = f"({newline} call)*" if parallel else ""
    lark = "\n".join(
        [f"start: call {more}", "call: " + " | ".join(f"({c})" for c in calls), *lines]
    )
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark + "\n")
    except (ValueError, TypeError) as exc:
        raise ConstraintError(f"the tools' schemas cannot be enforced: {exc}") from None
    return Constraint(grammar, "tool_call")


def build_constraint(spec: ConstraintSpec, vocab: dict[str, int] | None = None) -> Constraint:
    """The grammar ``spec`` asks for (a call of its tools, or JSON), after the model's
    reasoning where it says so. ``vocab``: the tokenizer's token strings (a tool format's tags
    that are one token may come as that token). A :class:`ConstraintError` for a schema or
    grammar that cannot be enforced."""
    answer = spec.answer
    if isinstance(answer, ToolCallSpec):
        constraint = tool_call_constraint(
            answer.tools, answer.syntax, answer.parallel, vocab, answer.closed
        )
    elif answer.schema is None:
        constraint = json_schema_constraint({"type": "object"}, "json_object")
    else:
        constraint = json_schema_constraint(dict(answer.schema), "json_schema", answer.closed)
    reasoning = spec.reasoning
    if reasoning is None:
        return constraint
    if reasoning.kind == "analysis":
        return after_analysis(constraint)
    return after_reasoning(constraint, reasoning.opened)


class Grammars:
    """The model's tokenizer as llguidance sees it (built once, ~1 s, on first use) and the
    matchers of constrained sequences."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_ids)
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._tokenizer

    def vocab(self) -> dict[str, int]:
        """Token strings to ids (tags that are one token are allowed as that token)."""
        return dict(self._hf.get_vocab())

    def matcher(self, constraint: Constraint) -> Matcher:
        return Matcher(self.tokenizer(), constraint, self.vocab_size, self._eos)


class Matcher:
    """One sequence's place in its grammar: the masks of its next rows, advanced by the tokens
    it takes."""

    def __init__(
        self,
        tokenizer: Any,
        constraint: Constraint,
        vocab_size: int,
        eos_ids: Sequence[int] = (),
    ) -> None:
        import llguidance

        self.constraint = constraint
        self.vocab_size = vocab_size
        self._eos = frozenset(eos_ids)
        self._m = llguidance.LLMatcher(tokenizer, constraint.grammar, log_level=0)
        if self._m.is_error():
            raise ConstraintError(f"the grammar cannot be used: {self._m.get_error()}")

    def masks(self, draft: Sequence[int] = ()) -> tuple[list[bytes], int]:
        """The bitmask of the next row, and of each row after a draft token the grammar
        allows (draft tokens are walked, then forgotten); how many draft tokens it allows."""
        import llguidance.numpy as lnp

        buffer = lnp.allocate_token_bitmask(len(draft) + 1, self.vocab_size)
        lnp.fill_next_token_bitmask(self._m, buffer, 0)
        used = 0
        for i, token in enumerate(draft):
            if not _allows(buffer[i], token):
                break
            if token in self._eos:
                # the end: not walked (llguidance does not roll back out of its stop), nothing
                # after it is used, and the row after it is never sampled from
                used += 1
                buffer[used] = buffer[used - 1]
                break
            if not self._m.consume_token(token):
                break
            used += 1
            lnp.fill_next_token_bitmask(self._m, buffer, used)
        walked = used - (1 if used and draft[used - 1] in self._eos else 0)
        if walked:
            self._m.rollback(walked)
        self._check()
        return [buffer[i].tobytes() for i in range(used + 1)], used

    def advance(self, tokens: Sequence[int]) -> None:
        """The sequence took ``tokens`` (sampled under this matcher's masks)."""
        for token in tokens:
            if self._m.is_stopped():
                break  # the end-of-sequence token after a complete match
            if not self._m.consume_token(token):
                raise ConstraintError(f"token {token} does not match the grammar")
        self._check()

    def _check(self) -> None:
        if self._m.is_error():
            raise ConstraintError(f"constrained decoding failed: {self._m.get_error()}")


def _allows(row: np.ndarray, token: int) -> bool:
    word = token // 32
    return word < len(row) and bool((int(row[word]) >> (token % 32)) & 1)
