"""Reasoning through the HTTP API and the engine, on a tiny model whose chat template opens a
``<think>`` block (testing_support/tiny_models.py THINK_TEMPLATE) and the in-process ring: the
reasoning separated from the answer (``message.reasoning_content``, streamed as
``delta.reasoning_content``, ``usage.completion_tokens_details.reasoning_tokens``), switched
off by ``chat_template_kwargs``, 400s for what the template cannot take, and constraints that
apply only after the reasoning, token for token against the unconstrained reasoning.

The official ``openai`` client talks to the real FastAPI app (over an in-process transport).
A random model never ends its reasoning by itself: the tests compare with the raw output of the
same prompt (a legacy completion of the rendered prompt), and the engine test forces the end
tag at a chosen point with the grammar's ``think_tokens``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from protos.sampling import SamplingParams
from server.api.app import create_app
from server.api.reasoning import ThinkParser
from server.api.requests import ChatCompletionRequest, parse_request
from server.api.responses import ChatCompletion
from server.api.serving import CompletionService
from server.engine.constraint_spec import ToolSchema
from server.engine.constraints import (
    Grammars,
    after_reasoning,
    json_schema_constraint,
    tool_call_constraint,
)
from server.engine.loop import Engine, GenerationRequest
from server.metrics import GatewayMetrics
from server.ring.local import LocalRing
from server.settings import GatewaySettings
from testing_support.tiny_models import THINK_TEMPLATE
from tests.conftest import EXACT
from tests.fleets import export_chat_model

pytestmark = pytest.mark.component

MESSAGES: list[Any] = [{"role": "user", "content": "the quick brown fox"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}


@dataclass
class Served:
    client: openai.OpenAI
    http: TestClient
    service: CompletionService
    model: str
    export: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    base = tmp_path_factory.mktemp("think")
    _, export = export_chat_model(base, name="think-model", chat_template=THINK_TEMPLATE, json=True)
    settings = GatewaySettings(stages=["127.0.0.1:9"], speculation="off")
    app = create_app(settings, LocalRing(export, EXACT))
    with TestClient(app) as http:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0
        )
        service = app.state.gateway.service
        yield Served(client, http, service, client.models.list().data[0].id, export)


def _raw(served: Served, max_tokens: int, **template: Any) -> tuple[str, int, str]:
    """The model's raw greedy output for MESSAGES (a legacy completion of the rendered
    prompt): its text, completion tokens and finish reason."""
    prompt = served.service.codec.chat_prompt(MESSAGES, template_kwargs=template)
    reply = served.client.completions.create(
        model=served.model, prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    assert reply.usage is not None
    return reply.choices[0].text, reply.usage.completion_tokens, reply.choices[0].finish_reason


def _split(raw: str) -> tuple[str, str]:
    """What the think parser must make of a template-opened output."""
    if "</think>" not in raw:
        return raw, ""
    reasoning, content = raw.split("</think>", 1)
    return reasoning, content.lstrip()


def test_the_parser_is_read_from_the_template(served: Served) -> None:
    assert served.service.reasoning == "think"


def test_reasoning_is_separated_from_the_answer(served: Served) -> None:
    raw, tokens, finish = _raw(served, 16)
    reply = served.client.chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=16, temperature=0
    )
    message = reply.choices[0].message
    reasoning, content = _split(raw)
    assert raw and message.reasoning_content == (reasoning or None)  # type: ignore[attr-defined]
    assert message.content == content
    assert "<think>" not in (message.content or "") and "</think>" not in (message.content or "")
    assert reply.choices[0].finish_reason == finish
    usage = reply.usage
    assert usage is not None and usage.completion_tokens == tokens
    assert usage.completion_tokens_details is not None
    if "</think>" not in raw:  # every token reasoning, but an end-of-sequence token
        eos = 1 if finish == "stop" else 0
        assert usage.completion_tokens_details.reasoning_tokens == tokens - eos


def test_reasoning_streams_before_the_answer(served: Served) -> None:
    whole = served.client.chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=16, temperature=0
    )
    stream = served.client.chat.completions.create(
        model=served.model,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    kinds: list[str] = []
    reasoning = content = ""
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = getattr(choice.delta, "reasoning_content", None)
            if piece:
                kinds.append("reasoning")
                reasoning += piece
            if choice.delta.content:
                kinds.append("content")
                content += choice.delta.content
    assert kinds and kinds[0] == "reasoning"
    assert kinds == sorted(kinds, key=lambda kind: kind != "reasoning")  # never back to reasoning
    message = whole.choices[0].message
    assert reasoning == message.reasoning_content  # type: ignore[attr-defined]
    assert content == (message.content or "")
    assert usage is not None and whole.usage is not None
    assert usage.completion_tokens_details == whole.usage.completion_tokens_details


def test_enable_thinking_false_switches_reasoning_off(served: Served) -> None:
    raw, tokens, _ = _raw(served, 12, enable_thinking=False)
    reply = served.client.chat.completions.create(
        model=served.model,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    message = reply.choices[0].message
    assert reply.usage is not None and reply.usage.completion_tokens == tokens
    if not raw.lstrip().startswith("<think>"):  # the model did not open a block itself
        assert getattr(message, "reasoning_content", None) is None
        assert message.content == raw.lstrip()
        assert reply.usage.completion_tokens_details is not None
        assert reply.usage.completion_tokens_details.reasoning_tokens == 0
    # the prompt differs: the template closed an empty block
    on = served.service.codec.chat_prompt(MESSAGES)
    off = served.service.codec.chat_prompt(MESSAGES, template_kwargs={"enable_thinking": False})
    assert on != off


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"no_such_variable": 1}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),  # the template takes none
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ],
)
def test_template_fields_the_model_cannot_take_are_a_400(
    served: Served, extra: dict[str, Any], param: str
) -> None:
    body = {"model": served.model, "messages": MESSAGES, "max_tokens": 2, **extra}
    reply = served.http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_response_format_leaves_the_reasoning_free(served: Served) -> None:
    """The schema applies only after </think>: inside the reasoning the greedy tokens are the
    unconstrained ones (a grammar applied from the start would have forced a '{')."""
    free = served.client.chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=12, temperature=0
    )
    held = served.client.chat.completions.create(
        model=served.model,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        response_format=FORMAT,
    )
    assert held.choices[0].message.reasoning_content  # type: ignore[attr-defined]
    free_reasoning = free.choices[0].message.reasoning_content  # type: ignore[attr-defined]
    if free.choices[0].message.content == "":  # the free run never ended its reasoning
        assert held.choices[0].message.reasoning_content == free_reasoning  # type: ignore[attr-defined]
        assert held.usage == free.usage
    assert not (free_reasoning or "").startswith("{")


def test_a_schema_applies_from_the_end_of_the_reasoning_token_for_token(served: Served) -> None:
    """The engine on the in-process ring: a constrained greedy run whose reasoning the grammar
    ends after K tokens writes the unconstrained run's first K tokens, then </think>, then
    JSON valid for the schema; the think parser splits it there."""
    codec = served.service.codec
    prompt = codec.chat_prompt(MESSAGES)
    ring = LocalRing(served.export, EXACT)
    grammars = Grammars(codec.chat, codec.vocab_size, sorted(codec.eos_ids))
    k = 6
    constraint = after_reasoning(json_schema_constraint(SCHEMA), opened=True, think_tokens=k)

    async def run() -> tuple[list[int], list[int]]:
        engine = Engine(ring, codec.eos_ids, 256, grammars=grammars)
        try:
            free = GenerationRequest("free", prompt, k, SamplingParams(temperature=0.0))
            held = GenerationRequest(
                "held", prompt, 80, SamplingParams(temperature=0.0), constraint=constraint
            )
            return (
                [t.token_id async for t in engine.generate(free)],
                [t.token_id async for t in engine.generate(held)],
            )
        finally:
            await engine.close()
            await ring.close()

    free, held = asyncio.run(run())
    assert len(free) == k and not set(free) & codec.eos_ids
    assert held[:k] == free
    assert held[-1] in codec.eos_ids  # the answer was complete
    text = codec.tokenizer.decode(held[:-1])
    assert text.startswith(codec.tokenizer.decode(free) + "</think>")
    parser = ThinkParser(opened=True)
    pieces = [parser.feed(codec.token_text(t)) for t in held[:-1]]
    pieces.append(parser.finish())
    reasoning = "".join(r for r, _ in pieces)
    answer = "".join(c for _, c in pieces)
    assert reasoning == codec.tokenizer.decode(free)
    jsonschema.validate(json.loads(answer), SCHEMA)
    assert parser.tokens >= k + 1  # the reasoning and its end tag


TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"q": {"type": "string", "maxLength": 6}},
            "required": ["q"],
        },
    },
}


@pytest.mark.parametrize("kind", ["tool", "schema"])
def test_the_answer_after_the_reasoning_is_a_call_or_json(served: Served, kind: str) -> None:
    """A chat request prepared by the service, whose grammar (the product's, with the
    reasoning ended after K tokens to steer the random model) makes the model think, end its
    reasoning and answer: the reasoning is ``reasoning_content``, the answer after it becomes
    ``tool_calls`` (or the JSON ``content``), streamed and not, with the reasoning tokens
    counted."""
    codec = served.service.codec
    k = 5
    body: dict[str, Any] = {
        "model": served.model,
        "messages": MESSAGES,
        "max_tokens": 120,
        "temperature": 0,
    }
    if kind == "tool":
        body |= {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}
    else:
        body |= {"response_format": FORMAT}
    request = parse_request(ChatCompletionRequest, body)
    streamed = parse_request(
        ChatCompletionRequest, {**body, "stream": True, "stream_options": {"include_usage": True}}
    )

    async def run() -> tuple[ChatCompletion, list[dict[str, Any]]]:
        ring = LocalRing(served.export, EXACT)
        grammars = Grammars(codec.chat, codec.vocab_size, sorted(codec.eos_ids))
        engine = Engine(ring, codec.eos_ids, 256, grammars=grammars)
        service = CompletionService(engine, codec, served.model, 256, GatewayMetrics())
        if kind == "tool":
            assert service.tool_format is not None
            vocab = dict(codec.chat.get_vocab())
            offered = request.tools or []
            tools = [ToolSchema(t.function.name, t.function.parameters) for t in offered]
            answer = tool_call_constraint(tools, service.tool_format.syntax, False, vocab)
        else:
            answer = json_schema_constraint(SCHEMA)
        steered = after_reasoning(answer, opened=True, think_tokens=k)
        try:
            prep = service.prepare(request, "chatcmpl-whole")
            assert prep.generation.constraint is not None
            assert prep.generation.constraint.grammar.startswith('{"grammars"')  # after reasoning
            prep.generation = replace(prep.generation, constraint=steered)
            whole = await service.complete(prep)
            assert isinstance(whole, ChatCompletion)
            prep = service.prepare(streamed, "chatcmpl-stream")
            prep.generation = replace(prep.generation, constraint=steered)
            raw = b"".join([chunk async for chunk in await service.open_stream(prep)])
            events = [
                json.loads(line.removeprefix(b"data: "))
                for line in raw.split(b"\n\n")
                if line.startswith(b"data: {")
            ]
            return whole, events
        finally:
            await engine.close()
            await ring.close()

    whole, events = asyncio.run(run())
    message = whole.choices[0].message
    assert message.reasoning_content and "think>" not in message.reasoning_content
    usage = whole.usage
    assert usage.completion_tokens_details is not None
    assert k < usage.completion_tokens_details.reasoning_tokens < usage.completion_tokens
    if kind == "tool":
        assert message.content is None and message.tool_calls and len(message.tool_calls) == 1
        call = message.tool_calls[0].function
        assert call.name == "lookup"
        jsonschema.validate(json.loads(call.arguments), TOOL["function"]["parameters"])
        assert whole.choices[0].finish_reason == "tool_calls"
    else:
        assert message.content is not None
        jsonschema.validate(json.loads(message.content), SCHEMA)
    # streamed: the reasoning first, then the answer, the same as the whole
    kinds, reasoning, content, calls = [], "", "", []
    for event in events:
        for choice in event["choices"]:
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                kinds.append("reasoning")
                reasoning += delta["reasoning_content"]
            if delta.get("content"):
                kinds.append("answer")
                content += delta["content"]
            if delta.get("tool_calls"):
                kinds.append("answer")
                calls += delta["tool_calls"]
    assert kinds[0] == "reasoning" and "answer" in kinds
    assert kinds == sorted(kinds, key=lambda kind: kind != "reasoning")
    assert reasoning == message.reasoning_content
    if kind == "tool":
        assert message.tool_calls is not None
        assert calls[0]["function"]["name"] == "lookup"
        assert calls[1]["function"]["arguments"] == message.tool_calls[0].function.arguments
    else:
        assert content == message.content
    assert events[-1]["usage"]["completion_tokens_details"] == {
        "reasoning_tokens": usage.completion_tokens_details.reasoning_tokens
    }


def test_reasoning_parser_none_leaves_the_output_whole(served: Served) -> None:
    """``--reasoning-parser none`` overrides the template's: the raw output is the content,
    and neither message nor usage has reasoning fields."""
    raw, tokens, _ = _raw(served, 8)
    settings = GatewaySettings(stages=["127.0.0.1:9"], speculation="off", reasoning_parser="none")
    app = create_app(settings, LocalRing(served.export, EXACT))
    with TestClient(app) as http:
        body = {"model": served.model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
        reply = http.post("/v1/chat/completions", json=body)
        assert app.state.gateway.service.reasoning == "none"
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["choices"][0]["message"]["content"] == raw
    assert "reasoning_content" not in answer["choices"][0]["message"]
    assert "completion_tokens_details" not in answer["usage"]
    assert answer["usage"]["completion_tokens"] == tokens
