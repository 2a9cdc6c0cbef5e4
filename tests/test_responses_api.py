"""The OpenAI Responses API (``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``)
through the official ``openai`` SDK against the real gateway app, served over HTTP on the
in-process ring of a tiny chat model whose template takes tools (Hermes calls).

The tiny random model writes noise: the tests assert the shapes and the documented event
sequence, the same answer token for token as chat completions (greedy), function calls and
JSON made valid by the grammar, the store and chaining, and the 400s for what is refused.
"""

# ruff: noqa: E501  (request bodies read best on one line)
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response

from tests.fleets import KEY, TINY_HERMES_TEMPLATE, Fleet, export_chat_model, local_gateway

pytestmark = pytest.mark.component

QUESTION = "the weather in Paris?"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "the weather", "parameters": SCHEMA},
    {
        "type": "function",
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"query": {"enum": ["fox"]}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
]
CHAT_TOOLS = [
    {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS
]


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base: Path = tmp_path_factory.mktemp("responses")
    _, made = export_chat_model(
        base, name="tool-model", chat_template=TINY_HERMES_TEMPLATE, json=True
    )
    return made


@pytest.fixture(scope="module")
def fleet(export: Path) -> Iterator[Fleet]:
    with local_gateway(export, "tool-model") as made:
        yield made


def _post(fleet: Fleet, body: Any) -> httpx.Response:
    return httpx.post(
        f"{fleet.url}/v1/responses",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
    )


def _chat_usage(fleet: Fleet, messages: list[Any], **kwargs: Any) -> Any:
    chat = fleet.client().chat.completions.create(
        model=fleet.model, messages=messages, temperature=0, **kwargs
    )
    return chat


def test_a_text_answer_is_the_chat_answer_token_for_token(fleet: Fleet) -> None:
    client = fleet.client()
    response = client.responses.create(
        model=fleet.model,
        input=QUESTION,
        instructions="be brief",
        max_output_tokens=12,
        temperature=0,
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    assert all(item.type == "message" for item in response.output)
    chat = _chat_usage(
        fleet,
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": QUESTION}],
        max_tokens=12,
    )
    assert response.output_text == (chat.choices[0].message.content or "")
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert response.usage.total_tokens == chat.usage.total_tokens
    if response.status == "incomplete":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
        assert response.usage.output_tokens == 12
    assert response.instructions == "be brief" and response.max_output_tokens == 12
    # the JSON itself validates as the SDK's Response type (the client does not validate)
    raw = _post(fleet, {"model": fleet.model, "input": QUESTION, "max_output_tokens": 4})
    Response.model_validate(raw.json())


def test_the_stream_has_the_documented_event_sequence(fleet: Fleet) -> None:
    client = fleet.client()
    kwargs: dict[str, Any] = dict(
        model=fleet.model, input=QUESTION, max_output_tokens=12, temperature=0
    )
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == (
        "response.completed" if whole.status == "completed" else "response.incomplete"
    )
    final = events[-1].response  # type: ignore[union-attr]
    assert final.id == events[0].response.id  # type: ignore[union-attr]
    if whole.output:
        assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
        assert kinds[-4:-1] == [
            "response.output_text.done", "response.content_part.done", "response.output_item.done",
        ]  # fmt: skip
        assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert text == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_function_calls_are_valid_against_their_schema(
    fleet: Fleet, stream: bool
) -> None:
    client = fleet.client()
    for choice, names in [
        ("required", {"get_weather", "lookup"}),
        ({"type": "function", "name": "get_weather"}, {"get_weather"}),
    ]:
        kwargs: dict[str, Any] = dict(
            model=fleet.model, input=QUESTION, tools=TOOLS, tool_choice=choice, max_output_tokens=60,
            temperature=0, parallel_tool_calls=False,
        )  # fmt: skip
        if stream:
            with client.responses.stream(**kwargs) as events:
                kinds = [event.type for event in events]
                response = events.get_final_response()
            assert "response.function_call_arguments.delta" in kinds
            assert "response.function_call_arguments.done" in kinds
        else:
            response = client.responses.create(**kwargs)
        calls = [item for item in response.output if item.type == "function_call"]
        assert len(calls) == 1, response.output
        assert calls[0].name in names and calls[0].call_id.startswith("call_")
        schema = next(t["parameters"] for t in TOOLS if t["name"] == calls[0].name)
        jsonschema.validate(json.loads(calls[0].arguments), schema)
        assert response.status == "completed"


def test_a_function_call_output_is_fed_back_through_the_template(fleet: Fleet) -> None:
    items: list[Any] = [
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
    ]
    response = fleet.client().responses.create(
        model=fleet.model, input=items, tools=TOOLS, max_output_tokens=8, temperature=0
    )
    chat = _chat_usage(
        fleet,
        [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        ],
        tools=CHAT_TOOLS, max_tokens=8,
    )  # fmt: skip
    assert response.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens


def test_text_format_json_schema_is_enforced(fleet: Fleet) -> None:
    client = fleet.client()
    for seed_text in ("one", "two", "three"):
        response = client.responses.create(
            model=fleet.model, input=f"{QUESTION} {seed_text}", max_output_tokens=64,
            text={"format": {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}},
        )  # fmt: skip
        jsonschema.validate(json.loads(response.output_text), SCHEMA)
        assert response.text.format.type == "json_schema"  # type: ignore[union-attr]
    obj = client.responses.create(
        model=fleet.model, input=QUESTION, max_output_tokens=64, temperature=0,
        text={"format": {"type": "json_object"}},
    )  # fmt: skip
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


def test_stored_responses_chain_and_can_be_read_and_deleted(fleet: Fleet) -> None:
    client = fleet.client()
    first = client.responses.create(
        model=fleet.model, input="the quick brown fox", max_output_tokens=6, temperature=0
    )
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(
        model=fleet.model,
        input="and then?",
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    replayed = _chat_usage(
        fleet,
        [
            {"role": "user", "content": "the quick brown fox"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "and then?"},
        ],
        max_tokens=6,
    )
    assert second.usage is not None
    assert second.usage.input_tokens == replayed.usage.prompt_tokens
    assert second.output_text == (replayed.choices[0].message.content or "")
    deleted = httpx.delete(
        f"{fleet.url}/v1/responses/{first.id}", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert deleted.status_code == 200 and deleted.json() == {
        "id": first.id,
        "object": "response",
        "deleted": True,
    }
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(
            model=fleet.model, input="x", previous_response_id=first.id, max_output_tokens=2
        )
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]
    unstored = client.responses.create(
        model=fleet.model, input="x", store=False, max_output_tokens=2
    )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    metrics = httpx.get(f"{fleet.url}/metrics").text
    assert 'pipeshard_gateway_requests_total{endpoint="/v1/responses",status="200"}' in metrics


def test_without_a_store_previous_response_id_is_a_clear_400(export: Path) -> None:
    with local_gateway(export, "tool-model", responses_store_size=0) as bare:
        client = bare.client()
        first = client.responses.create(model=bare.model, input="x", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(
                model=bare.model, input="y", previous_response_id=first.id, max_output_tokens=2
            )
        assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]
        assert "stores no responses" in info.value.body["message"]  # type: ignore[index]


@pytest.mark.parametrize(
    ("body", "status", "param", "names"),
    [
        ({"tools": [{"type": "web_search"}]}, 400, "tools", "web_search"),
        ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, 400, "tools", "file_search"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/i.png"}]}]}, 400, "input", "input_image"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, 400, "input", "input_file"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input", "item_reference"),
        ({"background": True}, 400, "background", "background"),
        ({"tool_choice": {"type": "web_search_preview"}}, 400, "tool_choice", "built-in"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format", "schema"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice", "nope"),
        ({"max_output_tokens": 10**6}, 400, "max_output_tokens", "context"),
        ({"temperature": 3.0}, 400, "temperature", "temperature"),
        ({"model": "no-such-model"}, 404, "model", "no-such-model"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(
    fleet: Fleet, body: dict[str, Any], status: int, param: str, names: str
) -> None:
    response = _post(
        fleet, {"model": fleet.model, "input": QUESTION, "max_output_tokens": 8, **body}
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert names in error["message"], error
