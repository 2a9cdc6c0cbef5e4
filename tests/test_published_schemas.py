"""Replies to the letter: every response object, stream event and error of chat completions,
completions, Responses and Messages validates against the published schema of its API
(``tests/schemas``: OpenAI's OpenAPI document, the Open Responses specification, Anthropic's
OpenAPI document), sent as raw HTTP to the real gateway app on the in-process ring of a tiny
chat model whose template takes tools (Hermes calls), so no SDK smooths a reply over.

The tiny random model writes noise; tool calls and structured output are made valid by the
grammar, so the shapes under test appear whatever it writes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fleets import KEY, TINY_HERMES_TEMPLATE, Fleet, export_chat_model, local_gateway
from tests.schemas import document, errors

pytestmark = pytest.mark.component

ALIAS = "claude-sonnet-test"
QUESTION = "the weather in Paris?"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris"]}},
    "required": ["city"],
    "additionalProperties": False,
}
FUNCTION = {"name": "get_weather", "description": "the weather", "parameters": SCHEMA}
CHAT_TOOLS = [{"type": "function", "function": FUNCTION}]
RESPONSES_TOOLS = [{"type": "function", **FUNCTION}]
MESSAGES_TOOLS = [{"name": "get_weather", "description": "the weather", "input_schema": SCHEMA}]
CHAT = {"messages": [{"role": "user", "content": QUESTION}], "temperature": 0}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    base: Path = tmp_path_factory.mktemp("schemas")
    _, export = export_chat_model(
        base, name="tool-model", chat_template=TINY_HERMES_TEMPLATE, json=True
    )
    with local_gateway(export, "tool-model", model_aliases=[ALIAS]) as made:
        yield made


def _post(fleet: Fleet, path: str, body: Any, key: str = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", "x-api-key": key}
    return httpx.post(f"{fleet.url}{path}", json=body, headers=headers, timeout=120)


def _events(response: httpx.Response) -> list[Any]:
    """The JSON of every ``data:`` line of an SSE reply, ``[DONE]`` left out."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return [
        json.loads(line.removeprefix("data: "))
        for line in response.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def _valid(api: str, schema: str | dict[str, Any], instance: Any) -> None:
    found = errors(api, schema, instance)
    assert not found, (
        f"{schema} does not validate:\n" + "\n".join(found) + f"\n{json.dumps(instance)[:2000]}"
    )


def _by_type(api: str, names: list[str]) -> dict[str, str]:
    """The schema among ``names`` of each stream event, by the event's ``type``."""
    schemas = document(api)["components"]["schemas"]
    found = {}
    for name in names:
        kind = schemas[name]["properties"]["type"]
        for value in kind.get("enum", [kind.get("const")]):
            found[value] = name
    return found


def _responses_event_schemas() -> tuple[dict[str, str], dict[str, str]]:
    """Each Responses stream event's schema by its ``type``: Open Responses', OpenAI's."""
    schemas = document("openresponses")["components"]["schemas"]
    union = document("openai")["components"]["schemas"]["ResponseStreamEvent"]["anyOf"]
    return (
        _by_type("openresponses", [n for n in schemas if n.endswith("StreamingEvent")]),
        _by_type("openai", [ref["$ref"].rsplit("/", 1)[1] for ref in union]),
    )


# --- chat completions -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {"max_tokens": 6, "logprobs": True, "top_logprobs": 2, "seed": 3},
        {"max_tokens": 60, "tools": CHAT_TOOLS, "tool_choice": "required"},
        {
            "max_tokens": 60,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
            },
        },
    ],
    ids=["logprobs", "tools", "json_schema"],
)
def test_chat_completions_whole_and_every_chunk_validate(
    fleet: Fleet, extra: dict[str, Any]
) -> None:
    body = {"model": fleet.model, **CHAT, **extra}
    whole = _post(fleet, "/v1/chat/completions", body)
    assert whole.status_code == 200, whole.text
    _valid("openai", "CreateChatCompletionResponse", whole.json())
    chunks = _events(
        _post(
            fleet,
            "/v1/chat/completions",
            {**body, "stream": True, "stream_options": {"include_usage": True}},
        )
    )
    assert chunks and chunks[-1]["choices"] == [] and chunks[-1]["usage"]
    for chunk in chunks:
        _valid("openai", "CreateChatCompletionStreamResponse", chunk)
    if "tools" in extra:
        assert whole.json()["choices"][0]["message"]["tool_calls"]
        assert any(c["choices"] and c["choices"][0]["delta"].get("tool_calls") for c in chunks)
    if "logprobs" in extra:
        assert whole.json()["choices"][0]["logprobs"]["content"]


def test_completions_whole_and_every_chunk_validate(fleet: Fleet) -> None:
    body = {
        "model": fleet.model,
        "prompt": QUESTION,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 2,
        "echo": False,
    }
    whole = _post(fleet, "/v1/completions", body)
    assert whole.status_code == 200, whole.text
    _valid("openai", "CreateCompletionResponse", whole.json())
    chunks = _events(
        _post(
            fleet,
            "/v1/completions",
            {**body, "stream": True, "stream_options": {"include_usage": True}},
        )
    )
    assert chunks
    for chunk in chunks[:-2]:
        assert chunk["choices"][0]["finish_reason"] is None
    for chunk in chunks:
        _valid("openai", "CreateCompletionStreamResponse", chunk)
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    _valid("openai", "CreateCompletionResponse", chunks[-2])  # the last choice chunk: to the letter
    _valid("openai", "CreateCompletionResponse", chunks[-1])  # the usage chunk


@pytest.mark.parametrize(
    "path, body, key, status",
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "temperature": 9},
            KEY,
            400,
        ),
        (
            "/v1/chat/completions",
            {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
            KEY,
            404,
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}]},
            "wrong-key",
            401,
        ),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, KEY, 400),
        ("/v1/responses", {"input": "hi", "temperature": 9}, KEY, 400),
        ("/v1/responses/compact", {"input": "hi"}, KEY, 404),
        ("/v1/responses/resp_1/cancel", {}, KEY, 404),
        ("/v1/no-such-route", {}, KEY, 404),
        ("/v1/chat/completions/nothing", {}, KEY, 404),
    ],
)
def test_openai_errors_validate(
    fleet: Fleet, path: str, body: dict[str, Any], key: str, status: int
) -> None:
    reply = _post(fleet, path, {"model": fleet.model, **body}, key=key)
    assert reply.status_code == status, reply.text
    _valid("openai", "ErrorResponse", reply.json())
    if path.startswith("/v1/responses"):
        _valid(
            "openresponses",
            {
                "type": "object",
                "required": ["error"],
                "properties": {"error": {"$ref": "#/components/schemas/ErrorPayload"}},
            },
            reply.json(),
        )


# --- Responses ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {"instructions": "be brief", "max_output_tokens": 6},
        {
            "tools": RESPONSES_TOOLS,
            "tool_choice": "required",
            "max_output_tokens": 60,
            "parallel_tool_calls": False,
        },
        {
            "text": {
                "format": {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}
            },
            "max_output_tokens": 60,
        },
    ],
    ids=["text", "tools", "json_schema"],
)
def test_responses_whole_and_every_event_validate(fleet: Fleet, extra: dict[str, Any]) -> None:
    body = {"model": fleet.model, "input": QUESTION, "temperature": 0, **extra}
    whole = _post(fleet, "/v1/responses", body)
    assert whole.status_code == 200, whole.text
    _valid("openresponses", "ResponseResource", whole.json())
    _valid("openai", "Response", whole.json())
    retrieved = httpx.get(
        f"{fleet.url}/v1/responses/{whole.json()['id']}", headers={"Authorization": f"Bearer {KEY}"}
    )
    _valid("openresponses", "ResponseResource", retrieved.json())
    open_responses, openai = _responses_event_schemas()
    events = _events(_post(fleet, "/v1/responses", {**body, "stream": True}))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        assert event["type"] in open_responses and event["type"] in openai, event
        _valid("openresponses", open_responses[event["type"]], event)
        _valid("openai", openai[event["type"]], event)
    if "tools" in extra:
        assert any(item["type"] == "function_call" for item in whole.json()["output"])
        assert "response.function_call_arguments.done" in [e["type"] for e in events]


# --- Messages -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {"max_tokens": 6, "system": "be brief"},
        {"max_tokens": 60, "tools": MESSAGES_TOOLS, "tool_choice": {"type": "any"}},
    ],
    ids=["text", "tool_use"],
)
def test_messages_whole_and_every_event_validate(fleet: Fleet, extra: dict[str, Any]) -> None:
    body = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        **extra,
    }
    whole = _post(fleet, "/v1/messages", body)
    assert whole.status_code == 200, whole.text
    _valid("anthropic", "Message", whole.json())
    events = _events(_post(fleet, "/v1/messages", {**body, "stream": True}))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    for event in events:
        if event["type"] == "ping":  # documented, and absent from the schema's union
            assert event == {"type": "ping"}
            continue
        _valid("anthropic", "MessageStreamEvent", event)
    if "tools" in extra:
        assert [b["type"] for b in whole.json()["content"]][-1] == "tool_use"
    counted = _post(
        fleet,
        "/v1/messages/count_tokens",
        {k: v for k, v in body.items() if k not in ("max_tokens", "temperature")},
    )
    assert counted.status_code == 200, counted.text
    _valid("anthropic", "CountMessageTokensResponse", counted.json())


@pytest.mark.parametrize(
    "path, body, key, status",
    [
        (
            "/v1/messages",
            {
                "model": ALIAS,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "temperature": 9,
            },
            KEY,
            400,
        ),
        (
            "/v1/messages",
            {
                "model": "claude-none",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
            },
            KEY,
            404,
        ),
        (
            "/v1/messages",
            {"model": ALIAS, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
            "wrong-key",
            401,
        ),
        ("/v1/messages/count_tokens", {"model": ALIAS}, KEY, 400),
        ("/v1/messages/batches", {}, KEY, 404),
    ],
)
def test_messages_errors_validate(
    fleet: Fleet, path: str, body: dict[str, Any], key: str, status: int
) -> None:
    reply = _post(fleet, path, body, key=key)
    assert reply.status_code == status, reply.text
    _valid("anthropic", "ErrorResponse", reply.json())
