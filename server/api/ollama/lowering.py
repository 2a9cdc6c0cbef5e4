"""Ollama requests lowered into the gateway's typed request, :class:`~server.api.serving.Prepared`
(the prompt's token ids, :class:`~protos.sampling.SamplingParams`, the constraint, the tool
format, the reasoning parser), the same thing chat completions prepare: no chat request is
built or parsed on the way.

``ChatRequest -> (messages as the chat template takes them, tools, think) rendered prompt ->
token ids``; ``format`` -> the grammar (after the reasoning on a thinking model); ``options``
-> sampling parameters with Ollama's defaults; ``num_ctx`` / ``num_predict`` -> the token limit.
``GenerateRequest``: the prompt as one user message (``system`` before it), or with ``raw`` the
prompt's own tokens.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any

from protos.sampling import SamplingParams
from server.api.constraint_lowering import json_spec, with_reasoning
from server.api.errors import APIError
from server.api.ollama.schema import ChatRequest, GenerateRequest, Message, Options, _Generation
from server.api.reasoning import opened_by_prompt, template_reads
from server.api.serving import CompletionService, Prepared, ToolParsing
from server.api.tools import template_tools
from server.engine.constraint_spec import ConstraintSpec
from server.engine.constraints import Constraint
from server.engine.loop import GenerationRequest

# Ollama's defaults (api/types.go DefaultOptions): what a request without options samples with
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.9
LATEST = ":latest"


def served_name(service: CompletionService, name: str) -> bool:
    """Whether ``name`` names the served model: its id or an alias, with or without Ollama's
    default tag ``:latest``."""
    bare = name.removesuffix(LATEST)
    return service.serves(name) or service.serves(bare)


def check_model(service: CompletionService, name: str) -> None:
    if not served_name(service, name):
        raise APIError(
            404,
            f"model '{name}' not found (this server serves '{service.model}')",
            param="model",
            type="not_found_error",
        )


def _template_kwargs(service: CompletionService, req: _Generation) -> dict[str, Any]:
    """The template variables ``think`` sets: ``enable_thinking`` (true / false) where the
    template reads it, ``reasoning_effort`` for a level; a 400 where it cannot be honoured."""
    think = req.think
    if think is None:
        return {}
    template = service.codec.chat_template
    if service.reasoning == "none" and think is not False:
        raise APIError(400, f'"{req.model}" does not support thinking', param="think")
    if isinstance(think, bool):
        if template_reads(template, "enable_thinking"):
            return {"enable_thinking": think}
        if not think and service.reasoning != "none":
            raise APIError(
                400,
                f'"{req.model}" cannot think less: its chat template has no switch for '
                "thinking (enable_thinking); send think true or leave it out",
                param="think",
            )
        return {}  # true on a model that always thinks; false on one that never does
    if template_reads(template, "reasoning_effort"):
        return {"reasoning_effort": "high" if think == "max" else think}
    raise APIError(
        400,
        f"think '{think}' needs a chat template that takes a reasoning effort (gpt-oss's); "
        f'"{req.model}" takes true or false',
        param="think",
    )


def template_messages(messages: Sequence[Message], rename: Any = None) -> list[dict[str, Any]]:
    """The messages as a chat template takes them: an assistant's calls as ``tool_calls``
    (``{"id", "type": "function", "function": {"name", "arguments": {...}}}``; a call without
    an id gets one), a tool result with the id of the call it answers (its ``tool_call_id``,
    else the first unanswered call of its ``tool_name``) and that function's ``name``. An
    earlier answer's ``thinking`` is left out, as thinking models' templates leave it out."""
    call_id = rename or (lambda ident: ident)
    unanswered: list[tuple[str, str]] = []  # (call id, function name), in order
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        item: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            calls = []
            for j, call in enumerate(message.tool_calls):
                made = call.id or f"call{i}x{j}"
                unanswered.append((made, call.function.name))
                function = {"name": call.function.name, "arguments": call.function.arguments}
                calls.append({"id": call_id(made), "type": "function", "function": function})
            item["tool_calls"] = calls
        if message.role == "tool":
            ident: str | None = message.tool_call_id
            name: str | None = message.tool_name
            match = next(
                (c for c in unanswered if (c[0] == ident if ident else name in (None, c[1]))),
                None,
            )
            if match is not None:
                unanswered.remove(match)
                ident, name = match[0], (name or match[1])
            if ident is not None:
                item["tool_call_id"] = call_id(ident)
            if name is not None:
                item["name"] = name
        out.append(item)
    return out


def _format_constraint(
    service: CompletionService,
    spec: ConstraintSpec | None,
    reasoning: str = "none",
    text: str = "",
) -> Constraint | None:
    """``format``'s grammar (:func:`~server.api.constraint_lowering.json_spec`), from the end
    of the model's reasoning as chat completions apply it, or a 400 naming ``format``."""
    opened = reasoning == "think" and opened_by_prompt(text)
    return service.build_constraint(with_reasoning(spec, reasoning, text, opened), "format")


def sampling_params(options: Options, vocab_size: int) -> SamplingParams:
    """``options`` as sampling parameters, Ollama's defaults where absent (temperature 0.8,
    top_k 40, top_p 0.9); ``seed`` -1 (or none): a random seed."""

    def given(value: Any, default: Any) -> Any:
        return default if value is None else value

    top_p = float(given(options.top_p, DEFAULT_TOP_P))
    top_k = given(options.top_k, DEFAULT_TOP_K)
    if top_p == 0.0:  # only the most probable token (as chat completions map it)
        top_p, top_k = 1.0, 1
    seed = options.seed if options.seed not in (None, -1) else secrets.randbits(63)
    penalty = given(options.repeat_penalty, 1.0)
    if options.repeat_last_n == 0:  # Ollama: 0 turns the penalty off
        penalty = 1.0
    params = SamplingParams(
        temperature=float(given(options.temperature, DEFAULT_TEMPERATURE)),
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        presence_penalty=float(given(options.presence_penalty, 0.0)),
        frequency_penalty=float(given(options.frequency_penalty, 0.0)),
        min_p=float(given(options.min_p, 0.0)),
        repetition_penalty=float(penalty),
    )
    try:
        params.validate(vocab_size)
    except ValueError as exc:
        raise APIError(400, f"Invalid value for 'options': {exc}", param="options") from None
    return params


def _prepared(
    service: CompletionService,
    req: _Generation,
    request_id: str,
    prompt: list[int],
    *,
    text: str = "",
    tools: ToolParsing | None = None,
    reasoning: str = "none",
    constraint: Constraint | None = None,
) -> Prepared:
    """The typed request: the token limit from ``num_ctx`` and ``num_predict``, the sampling
    parameters from ``options``."""
    options = req.options or Options()
    context = service.max_context
    if options.num_ctx is not None and options.num_ctx > context:
        raise APIError(
            400,
            f"Invalid value for 'options.num_ctx': {options.num_ctx} is more than the "
            f"{context} tokens of context this server serves for '{service.model}'.",
            param="options.num_ctx",
        )
    context = options.num_ctx or context
    if not prompt:
        raise APIError(400, "The prompt is empty.", param="prompt")
    room = context - len(prompt)
    wanted = options.num_predict if options.num_predict and options.num_predict > 0 else None
    if room < 1 or (wanted is not None and wanted > room):
        raise APIError(
            400,
            f"The context is {context} tokens; the prompt is {len(prompt)} tokens"
            + (f" and num_predict asks for {wanted} more" if wanted else "")
            + " (nothing is truncated or shifted here).",
            param="options.num_predict" if room >= 1 else "options.num_ctx",
            code="context_length_exceeded",
        )
    thinking_open = reasoning == "think" and opened_by_prompt(text)
    generation = GenerationRequest(
        request_id=request_id,
        prompt_ids=prompt,
        max_tokens=wanted or room,
        sampling=sampling_params(options, service.codec.vocab_size),
        constraint=constraint,
    )
    return Prepared(
        request_id=request_id,
        created=int(time.time()),
        model=service.model,
        generation=generation,
        stop=list(options.stop or ()),
        logprobs=False,
        stream=req.stream is not False,
        include_usage=False,
        chat=True,
        tools=tools,
        reasoning=reasoning,
        thinking_open=thinking_open,
    )


def _render(
    service: CompletionService,
    messages: list[dict[str, Any]],
    offered: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
) -> tuple[str, list[int]]:
    try:
        text = service.codec.chat_text(messages, tools=offered, template_kwargs=kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    return text, service.codec.encode_rendered(text)


def lower_chat(service: CompletionService, req: ChatRequest, request_id: str) -> Prepared:
    """``/api/chat`` (with at least one message) as the typed request."""
    check_model(service, req.model)
    tools: ToolParsing | None = None
    offered = None
    fmt = service.tool_format
    if req.tools:
        if fmt is None:
            raise APIError(
                400,
                f'"{req.model}" does not support tools: its chat template has none',
                param="tools",
            )
        tools = ToolParsing(fmt, True, {t.function.name: t.function.parameters for t in req.tools})
        offered = template_tools(req.tools)
    messages = template_messages(req.messages, fmt.call_id if fmt else None)
    text, prompt = _render(service, messages, offered, _template_kwargs(service, req))
    return _prepared(
        service,
        req,
        request_id,
        prompt,
        text=text,
        tools=tools,
        reasoning=service.reasoning,
        constraint=_format_constraint(
            service, json_spec(req.format, service.close_schemas), service.reasoning, text
        ),
    )


def lower_generate(service: CompletionService, req: GenerateRequest, request_id: str) -> Prepared:
    """``/api/generate`` (with a prompt) as the typed request: the prompt as the user's message
    through the chat template (``system`` before it), or with ``raw`` as it is."""
    check_model(service, req.model)
    spec = json_spec(req.format, service.close_schemas)
    if req.raw:
        constraint = _format_constraint(service, spec)
        if req.think is not None:
            raise APIError(
                400, "think cannot be used with raw: raw output is not parsed", param="think"
            )
        return _prepared(
            service, req, request_id, service.codec.encode(req.prompt), constraint=constraint
        )
    messages: list[dict[str, Any]] = []
    if req.system is not None:
        messages.append({"role": "system", "content": req.system})
    messages.append({"role": "user", "content": req.prompt})
    text, prompt = _render(service, messages, None, _template_kwargs(service, req))
    return _prepared(
        service,
        req,
        request_id,
        prompt,
        text=text,
        reasoning=service.reasoning,
        constraint=_format_constraint(service, spec, service.reasoning, text),
    )
