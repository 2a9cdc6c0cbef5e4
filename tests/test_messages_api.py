"""The Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) through the
official ``anthropic`` SDK against the real gateway app, served over HTTP on the in-process ring
of a tiny chat model whose template takes tools (Hermes calls).

The tiny random model writes noise: the tests assert the shapes and event order of Anthropic's
API, the same answer token for token as chat completions (greedy), forced tool use made valid
by the grammar, and Anthropic's error envelope for what is refused.
"""

# ruff: noqa: E501  (request bodies read best on one line)
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from tests.fleets import KEY, TINY_HERMES_TEMPLATE, Fleet, export_chat_model, local_gateway

pytestmark = pytest.mark.component

ALIAS = "claude-sonnet-test"
# (the SDK no longer takes the sampling fields as arguments; the API still does)
GREEDY = {"temperature": 0}
USER = [{"role": "user", "content": "the weather in Paris?"}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"name": "get_weather", "description": "the weather in a city", "input_schema": SCHEMA},
    {
        "name": "lookup",
        "input_schema": {
            "type": "object",
            "properties": {"query": {"enum": ["fox"]}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    base: Path = tmp_path_factory.mktemp("messages")
    _, export = export_chat_model(
        base, name="tool-model", chat_template=TINY_HERMES_TEMPLATE, json=True
    )
    with local_gateway(export, "tool-model", model_aliases=[ALIAS]) as made:
        yield made


def _client(fleet: Fleet, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=fleet.url, api_key=key, max_retries=0, timeout=120.0)


def _post(fleet: Fleet, body: Any, path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(f"{fleet.url}{path}", json=body, headers={"x-api-key": KEY}, timeout=120)


def _refused(response: httpx.Response, status: int, kind: str = "invalid_request_error") -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    return str(body["error"]["message"])


def test_a_text_answer_is_the_chat_answer_token_for_token(fleet: Fleet) -> None:
    client = _client(fleet)
    message = client.messages.create(
        model=fleet.model,
        max_tokens=12,
        system="be brief",
        messages=USER,
        extra_body=GREEDY,  # type: ignore[arg-type]
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == fleet.model
    assert all(block.type == "text" for block in message.content)
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.stop_sequence is None
    assert 1 <= message.usage.output_tokens <= 12
    if message.stop_reason == "max_tokens":
        assert message.usage.output_tokens == 12
    chat = fleet.client().chat.completions.create(
        model=fleet.model,
        max_tokens=12,
        temperature=0,
        messages=[{"role": "system", "content": "be brief"}, *USER],  # type: ignore[list-item]
    )
    text = "".join(block.text for block in message.content if block.type == "text")
    assert text == chat.choices[0].message.content
    assert chat.usage is not None
    assert message.usage.output_tokens == chat.usage.completion_tokens
    prompt = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    assert prompt == chat.usage.prompt_tokens
    counted = client.messages.count_tokens(model=fleet.model, system="be brief", messages=USER)  # type: ignore[arg-type]
    assert counted.input_tokens == prompt
    # the JSON itself validates as the SDK's Message type (the client does not validate)
    raw = _post(fleet, {"model": fleet.model, "max_tokens": 4, "messages": USER})
    anthropic.types.Message.model_validate(raw.json())


def test_the_stream_has_anthropics_event_sequence_and_the_same_answer(fleet: Fleet) -> None:
    client = _client(fleet)
    kwargs: dict[str, Any] = dict(
        model=fleet.model, max_tokens=12, messages=USER, extra_body=GREEDY
    )
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    blocks = [k for k in kinds if k.startswith("content_block")]
    if whole.content:
        assert blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"
        assert set(blocks[1:-1]) == {"content_block_delta"}
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # the raw stream: named events, a ping after message_start
    raw = httpx.post(
        f"{fleet.url}/v1/messages",
        json={"model": fleet.model, "max_tokens": 12, "messages": USER, **GREEDY, "stream": True},
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
        timeout=120,
    )
    events = [
        line.removeprefix("event: ") for line in raw.text.splitlines() if line.startswith("event: ")
    ]
    assert events[:2] == ["message_start", "ping"]
    datas = [json.loads(line[6:]) for line in raw.text.splitlines() if line.startswith("data: ")]
    assert [d["type"] for d in datas] == events


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_use_is_valid_against_the_input_schema(fleet: Fleet, stream: bool) -> None:
    client = _client(fleet)
    for choice, names in [
        ({"type": "any", "disable_parallel_tool_use": True}, {"get_weather", "lookup"}),
        ({"type": "tool", "name": "get_weather"}, {"get_weather"}),
    ]:
        kwargs: dict[str, Any] = dict(
            model=fleet.model, max_tokens=60, messages=USER, tools=TOOLS, tool_choice=choice,
            extra_body=GREEDY,
        )  # fmt: skip
        if stream:
            with client.messages.stream(**kwargs) as events:
                message = events.get_final_message()
        else:
            message = client.messages.create(**kwargs)
        calls = [block for block in message.content if block.type == "tool_use"]
        assert len(calls) == 1, message
        assert calls[0].name in names and calls[0].id.startswith("toolu_")
        schema = next(t["input_schema"] for t in TOOLS if t["name"] == calls[0].name)
        jsonschema.validate(calls[0].input, schema)
        assert message.stop_reason == "tool_use"


def test_a_tool_result_is_fed_back_through_the_template(fleet: Fleet) -> None:
    """The conversation with a tool_use and its tool_result is the prompt chat completions
    make of the same conversation (assistant tool_calls, a tool message)."""
    history: list[Any] = [
        *USER,
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "let me look"},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"},
                {"type": "text", "text": "and tomorrow?"},
            ],
        },
    ]
    client = _client(fleet)
    counted = client.messages.count_tokens(model=fleet.model, messages=history, tools=TOOLS)
    message = client.messages.create(
        model=fleet.model, max_tokens=8, messages=history, tools=TOOLS, extra_body=GREEDY
    )
    chat_tools = [
        {"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"],
                                          **({"description": t["description"]} if "description" in t else {})}}
        for t in TOOLS
    ]  # fmt: skip
    chat = fleet.client().chat.completions.create(
        model=fleet.model,
        max_tokens=8,
        temperature=0,
        tools=chat_tools,  # type: ignore[arg-type]
        messages=[
            *USER,
            {
                "role": "assistant",
                "content": "let me look",
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"},
            {"role": "user", "content": "and tomorrow?"},
        ],  # type: ignore[list-item]
    )
    assert chat.usage is not None
    assert counted.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    # the result changes the prompt (it is rendered, not dropped)
    other = json.loads(json.dumps(history))
    other[2]["content"][0]["content"] = "rain all day long, 9 C, wind from the west"
    assert client.messages.count_tokens(model=fleet.model, messages=other, tools=TOOLS).input_tokens > counted.input_tokens  # fmt: skip


def test_a_stop_sequence_ends_the_answer_and_is_named(fleet: Fleet) -> None:
    client = _client(fleet)
    free = client.messages.create(
        model=fleet.model, max_tokens=16, messages=USER, extra_body=GREEDY
    )  # type: ignore[arg-type]
    text = "".join(b.text for b in free.content if b.type == "text")
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if len(stop) < 2 or not stop.strip():
        pytest.skip(f"the greedy answer {text!r} has no stop sequence to cut at")
    cut = client.messages.create(
        model=fleet.model, max_tokens=16, messages=USER, extra_body=GREEDY,  # type: ignore[arg-type]
        stop_sequences=["never written §", stop],
    )  # fmt: skip
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert "".join(b.text for b in cut.content if b.type == "text") == text[: text.index(stop)]


def test_keys_aliases_and_versions(fleet: Fleet) -> None:
    # x-api-key (the SDK's way), or a Bearer token; a wrong key in Anthropic's envelope
    message = _client(fleet).messages.create(model=ALIAS, max_tokens=2, messages=USER)  # type: ignore[arg-type]
    assert message.model == ALIAS
    bearer = anthropic.Anthropic(base_url=fleet.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(model=fleet.model, max_tokens=2, messages=USER).usage  # type: ignore[arg-type]
    with pytest.raises(anthropic.AuthenticationError) as info:
        _client(fleet, key="wrong").messages.create(model=fleet.model, max_tokens=2, messages=USER)  # type: ignore[arg-type]
    assert info.value.status_code == 401
    assert info.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    # the alias is accepted everywhere, /v1/models lists the model id
    chat = fleet.client().chat.completions.create(model=ALIAS, max_tokens=2, messages=USER)  # type: ignore[arg-type]
    assert chat.choices
    assert [m.id for m in fleet.client().models.list()] == [fleet.model]
    # thinking is accepted (this model does not reason: no thinking blocks; its 256-token
    # context has no room for a budget of 1024, which count_tokens does not need)
    counted = _client(fleet).messages.count_tokens(
        model=fleet.model,
        messages=USER,
        thinking={"type": "enabled", "budget_tokens": 1024},  # type: ignore[arg-type]
    )
    assert counted.input_tokens > 0
    plain = _client(fleet).messages.create(
        model=fleet.model,
        max_tokens=4,
        messages=USER,
        thinking={"type": "disabled"},  # type: ignore[arg-type]
    )
    assert all(block.type == "text" for block in plain.content)
    metrics = httpx.get(f"{fleet.url}/metrics").text
    assert 'pipeshard_gateway_requests_total{endpoint="/v1/messages",status="200"}' in metrics


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_is_json_valid_for_the_schema(fleet: Fleet, stream: bool) -> None:
    """``output_config.format`` (and its older name ``output_format``) holds the answer to the
    schema, as chat's strict ``json_schema``: every object closed."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6}, "n": {"enum": [1, 2]}},
        "required": ["city", "n"],
    }
    # (the SDK takes output_config; the older output_format goes as an extra field)
    fields = (
        {"output_config": {"format": {"type": "json_schema", "schema": schema}}},
        {"extra_body": {"output_format": {"type": "json_schema", "schema": schema}}},
    )
    for field in fields:
        body = {"model": fleet.model, "max_tokens": 40, "messages": USER, **field}
        if stream:
            with _client(fleet).messages.stream(**body) as events:  # type: ignore[arg-type]
                message = events.get_final_message()
        else:
            message = _client(fleet).messages.create(**body)  # type: ignore[arg-type]
        assert message.stop_reason == "end_turn", message
        text = "".join(block.text for block in message.content if block.type == "text")
        value = json.loads(text)
        jsonschema.validate(value, schema)
        assert set(value) <= {"city", "n"}


@pytest.mark.parametrize(
    ("body", "status", "kind", "names"),
    [
        ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            400, "invalid_request_error", "image",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            400, "invalid_request_error", "document",
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error", "web_search_20250305"),
        ({"mcp_servers": [{"type": "url", "url": "http://x"}]}, 400, "invalid_request_error", "mcp_servers"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error", "nope"),
        ({"tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tool_choice"),
        ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
        ({"thinking": {"type": "enabled", "budget_tokens": 4096}}, 400, "invalid_request_error", "budget_tokens"),
        ({"model": "no-such-model"}, 404, "not_found_error", "no-such-model"),
        ({"max_tokens": 10**6}, 400, "invalid_request_error", "max_tokens"),
        ({"messages": [*USER, {"role": "assistant", "content": "The weather is"}]}, 400, "invalid_request_error", "prefill"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": [{"type": "char_location"}]}]}]}, 400, "invalid_request_error", "citations"),
        ({"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}, "output_format": {"type": "json_schema", "schema": SCHEMA}}, 400, "invalid_request_error", "output_format"),
        ({"output_config": {"format": {"type": "text"}}}, 400, "invalid_request_error", "output_config"),
        ({"output_config": {"effort": "high"}}, 400, "invalid_request_error", "reasoning_effort"),
    ],
)  # fmt: skip
def test_refusals_name_the_field_in_anthropics_envelope(
    fleet: Fleet, body: dict[str, Any], status: int, kind: str, names: str
) -> None:
    full = {"model": fleet.model, "max_tokens": 16, "messages": USER, **body}
    full = {key: value for key, value in full.items() if value is not None}
    message = _refused(_post(fleet, full), status, kind)
    assert names in message, message


def test_the_sdk_raises_anthropics_errors(fleet: Fleet) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        _client(fleet).messages.create(
            model=fleet.model, max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/i.png"}}]}],
        )  # fmt: skip
    assert info.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    # bad JSON and a route's 404 also leave in Anthropic's envelope
    response = httpx.post(
        f"{fleet.url}/v1/messages", content=b"{", headers={"x-api-key": KEY}, timeout=30
    )
    _refused(response, 400)
