"""Tool arguments and ``strict`` JSON schemas are closed by default: an object schema that names
its properties and says nothing of ``additionalProperties`` takes no other keys (the gateway's
``json_schema_additional_properties``, "closed"; "open" enforces schemas as written). Through
the real app on the in-process ring, with a random tiny model writing under the grammar."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from server.api.app import create_app
from server.engine.constraints import close_objects
from server.ring.local import LocalRing
from server.settings import GatewaySettings
from tests.conftest import EXACT
from tests.fleets import TINY_HERMES_TEMPLATE, export_chat_model

pytestmark = pytest.mark.component

# No additionalProperties anywhere: a nested object, an array of objects and a $defs entry.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 3},
        "at": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0}}},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 2},
    },
    "required": ["city"],
    "$defs": {"tag": {"type": "object", "properties": {"t": {"type": "boolean"}}}},
}
NAMED = {(): {"city", "at", "tags"}, ("at",): {"x"}, ("tags",): {"t"}}
TOOLS = [{"type": "function", "function": {"name": "find", "parameters": SCHEMA}}]


def extra_keys(value: Any, path: tuple[str, ...] = ()) -> list[str]:
    """Keys of ``value`` (arguments valid for SCHEMA) that SCHEMA does not name."""
    if not isinstance(value, dict):
        return []
    found = [k for k in value if k not in NAMED[path]]
    if isinstance(value.get("at"), dict) and not path:
        found += extra_keys(value["at"], ("at",))
    for tag in value.get("tags", []) if not path else []:
        found += extra_keys(tag, ("tags",))
    return found


def test_close_objects_closes_every_object_that_names_its_properties() -> None:
    closed = close_objects(SCHEMA)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["at"]["additionalProperties"] is False
    assert closed["$defs"]["tag"]["additionalProperties"] is False
    assert "additionalProperties" not in SCHEMA  # a copy
    branches = close_objects({"anyOf": [{"properties": {"a": {}}}, {"type": "string"}]})
    assert branches["anyOf"][0]["additionalProperties"] is False
    items = close_objects({"type": "array", "items": {"type": "object", "properties": {}}})
    assert items["items"]["additionalProperties"] is False
    # what the schema says stays: explicit extra keys, free-form objects, composed objects
    explicit = {"type": "object", "properties": {"a": {}}, "additionalProperties": True}
    assert close_objects(explicit) == explicit
    assert close_objects({"type": "object"}) == {"type": "object"}
    composed = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert close_objects(composed) == composed


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("strict")
    return export_chat_model(
        base, name="tool-model", chat_template=TINY_HERMES_TEMPLATE, json=True
    )[1]


@pytest.fixture(scope="module")
def clients(export: Path) -> Iterator[dict[str, TestClient]]:
    """The app over the in-process ring, closed (the default) and open."""
    with (
        TestClient(create_app(GatewaySettings(stages=["127.0.0.1:9"], speculation="off"),
                              LocalRing(export, EXACT))) as closed,
        TestClient(create_app(
            GatewaySettings(stages=["127.0.0.1:9"], speculation="off",
                            json_schema_additional_properties="open"),
            LocalRing(export, EXACT))) as open_,
    ):  # fmt: skip
        yield {"closed": closed, "open": open_}


def sample_arguments(client: TestClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The arguments of every choice of 16 that does not stop at max_tokens, over two seeds
    (sampled at temperature 2: the random model wanders wherever the grammar lets it); every
    other choice stops at max_tokens, the one outcome besides a valid answer."""
    found = []
    model = client.get("/v1/models").json()["data"][0]["id"]
    for seed in (1, 2):
        reply = client.post(
            "/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "the fox"}],
                  "temperature": 2.0, "seed": seed, "n": 16, "max_tokens": 96, **body},
        )  # fmt: skip
        assert reply.status_code == 200, reply.text
        for choice in reply.json()["choices"]:
            done = "tool_calls" if body.get("tools") else "stop"
            assert choice["finish_reason"] in (done, "length"), choice
            if choice["finish_reason"] == "length":
                continue
            if body.get("tools"):
                (call,) = choice["message"]["tool_calls"]
                found.append(json.loads(call["function"]["arguments"]))
            else:
                found.append(json.loads(choice["message"]["content"]))
    return found


TOOL_CALL = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "find"}}}


def strict_format(strict: bool) -> dict[str, Any]:
    fmt = {"name": "find", "schema": SCHEMA, "strict": strict}
    return {"response_format": {"type": "json_schema", "json_schema": fmt}}


@pytest.mark.parametrize("body", [TOOL_CALL, strict_format(True)], ids=["tool", "strict"])
def test_closed_objects_never_grow_keys_and_open_ones_do(
    clients: dict[str, TestClient], body: dict[str, Any]
) -> None:
    closed = sample_arguments(clients["closed"], body)
    assert len(closed) >= 8, "too few complete outputs to judge"
    assert all(not extra_keys(args) for args in closed), closed
    # the opt-out: the same requests, enforced as written, invent keys
    opened = sample_arguments(clients["open"], body)
    assert any(extra_keys(args) for args in opened), opened


def test_a_schema_that_is_not_strict_is_enforced_as_written(
    clients: dict[str, TestClient],
) -> None:
    loose = sample_arguments(clients["closed"], strict_format(False))
    assert any(extra_keys(args) for args in loose), loose


def test_a_schema_the_grammar_cannot_use_is_a_400_before_generation(
    clients: dict[str, TestClient],
) -> None:
    client = clients["closed"]
    model = client.get("/v1/models").json()["data"][0]["id"]
    broken = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    messages = [{"role": "user", "content": "the fox"}]
    tools = [{"type": "function", "function": {"name": "find", "parameters": broken}}]
    reply = client.post(
        "/v1/chat/completions",
        json={"model": model, "messages": messages, "tools": tools, "tool_choice": "required"},
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools", reply.text
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": broken}}
    reply = client.post(
        "/v1/chat/completions", json={"model": model, "messages": messages, "response_format": fmt}
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "response_format"
