"""gpt-oss's harmony format served end to end: a tiny chat model whose template is harmony's
(testing_support/tiny_models.py HARMONY_TEMPLATE, its markup as special tokens), the real gateway
app over HTTP on the in-process ring, and the official SDKs. A forced call is written in the
``commentary`` channel to ``functions.NAME`` (after an analysis, if the model wants one) and
reaches each dialect as its tool call, valid for its schema; the analysis is reasoning, never
answer; a call's result fed back renders and is answered.

The tiny random model writes noise: the grammar makes it write calls; the tests assert shapes,
enforcement and that no harmony markup reaches an answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import pytest

from testing_support.tiny_models import HARMONY_TEMPLATE, HARMONY_TOKENS
from tests.fleets import KEY, Fleet, export_chat_model, local_gateway

pytestmark = pytest.mark.component

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
}
FUNCTION = {"name": "get_weather", "description": "the weather", "parameters": SCHEMA}
TOOLS: list[Any] = [{"type": "function", "function": FUNCTION}]
USER: list[Any] = [{"role": "user", "content": "the weather in Paris?"}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    _, export = export_chat_model(
        tmp_path_factory.mktemp("harmony"),
        name="harmony-model",
        chat_template=HARMONY_TEMPLATE,
        json=True,
        special_tokens=HARMONY_TOKENS,
    )
    with local_gateway(export, "harmony-model") as made:
        yield made


def _valid(arguments: str | dict[str, Any]) -> dict[str, Any]:
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(value, SCHEMA)
    assert set(value) <= set(SCHEMA["properties"])  # type: ignore[arg-type]  # closed
    return value


def test_a_required_call_is_a_chat_tool_call_whole_and_streamed(fleet: Fleet) -> None:
    """The guarantee as the README words it: every answer that does not stop at max_tokens
    ends in a call valid for its schema. Harmony lets the model write a free analysis before
    the call, so an answer may instead use up max_tokens (finish_reason "length", every token
    spent) before its call begins: that is the one other outcome, checked as such."""
    client = fleet.client()
    outcomes = []
    for seed in range(6):
        reply = client.chat.completions.create(
            model=fleet.model,
            messages=USER,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=100,
            seed=seed,
            temperature=1.0,
        )
        choice = reply.choices[0]
        assert "<|" not in (choice.message.content or "")
        reasoning = getattr(choice.message, "reasoning_content", None) or ""
        assert "<|" not in reasoning
        calls = choice.message.tool_calls or []
        outcomes.append(choice.finish_reason)
        if choice.finish_reason == "length":
            assert reply.usage is not None and reply.usage.completion_tokens == 100
            assert calls == []  # (no call had begun: no half call is ever reported)
            continue
        assert choice.finish_reason == "tool_calls", choice
        assert [c.function.name for c in calls] == ["get_weather"]  # type: ignore[union-attr]
        _valid(calls[0].function.arguments)  # type: ignore[union-attr]
    assert "tool_calls" in outcomes  # (not vacuous: these seeds are fixed; 5 of 6 call)
    stream = client.chat.completions.create(
        model=fleet.model,
        messages=USER,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=100,
        temperature=0,  # (greedy: its analysis ends in time every run, as the tests below)
        stream=True,
    )
    names, arguments, finish, content = [], "", None, ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.function and call.function.name:
                names.append(call.function.name)
            arguments += (call.function.arguments or "") if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    _valid(arguments)
    assert "<|" not in content


def test_a_call_s_result_fed_back_is_answered_without_markup(fleet: Fleet) -> None:
    client = fleet.client()
    history: list[Any] = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    reply = client.chat.completions.create(
        model=fleet.model,
        messages=history,
        tools=TOOLS,
        max_tokens=20,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
    )
    message = reply.choices[0].message
    assert "<|" not in (message.content or "")
    # the final channel held to the schema, unless the answer stopped at max_tokens
    assert reply.choices[0].finish_reason in ("stop", "length")
    if reply.choices[0].finish_reason == "stop":
        _valid(message.content or "")
    else:
        assert reply.usage is not None and reply.usage.completion_tokens == 20


def test_a_required_call_on_the_responses_api(fleet: Fleet) -> None:
    client = fleet.client()
    response = client.responses.create(
        model=fleet.model,
        input="the weather in Paris?",
        tools=[{"type": "function", **FUNCTION}],  # type: ignore[list-item]
        tool_choice="required",
        max_output_tokens=100,
        temperature=0,  # (greedy: the same output every run)
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"]
    _valid(calls[0].arguments)
    for item in response.output:
        if item.type == "message":
            assert all("<|" not in part.text for part in item.content)  # type: ignore[union-attr]


def test_forced_tool_use_on_the_messages_api(fleet: Fleet) -> None:
    client = anthropic.Anthropic(base_url=fleet.url, api_key=KEY, max_retries=0, timeout=120.0)
    tool = {"name": "get_weather", "input_schema": SCHEMA}
    message = client.messages.create(
        model=fleet.model,
        max_tokens=100,
        messages=USER,
        tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},  # (greedy: the same output every run)
    )
    assert message.stop_reason == "tool_use"
    uses = [block for block in message.content if block.type == "tool_use"]
    assert [u.name for u in uses] == ["get_weather"]
    _valid(uses[0].input)  # type: ignore[arg-type]
    texts = [block.text for block in message.content if block.type == "text"]
    assert all("<|" not in text for text in texts)
