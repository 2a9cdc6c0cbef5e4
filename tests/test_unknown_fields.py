"""Request fields the gateway does not know are accepted (clients send other servers'
extensions) but never silently: a warning in the log and the ``x-pipeshard-ignored-fields``
header name them on every generation endpoint, and ``unknown_fields = "reject"`` makes them a
400 naming the field. Through the real app on the in-process ring."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from server.api.app import create_app
from server.ring.local import LocalRing
from server.settings import GatewaySettings
from tests.conftest import EXACT
from tests.fleets import export_chat_model

pytestmark = pytest.mark.component

HEADER = "x-pipeshard-ignored-fields"
PATHS = ["/v1/chat/completions", "/v1/completions"]


@dataclass
class App:
    client: TestClient
    model: str


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 with a chat template, on 2 stages."""
    return export_chat_model(tmp_path_factory.mktemp("unknown"))[1]


def serve(export: Path, **settings: Any) -> Iterator[App]:
    ring = LocalRing(export, EXACT)
    config = GatewaySettings(stages=["127.0.0.1:9"], speculation="off", **settings)
    with TestClient(create_app(config, ring)) as client:
        yield App(client, client.get("/v1/models").json()["data"][0]["id"])


@pytest.fixture(scope="module")
def warn(export: Path) -> Iterator[App]:
    yield from serve(export)


@pytest.fixture(scope="module")
def reject(export: Path) -> Iterator[App]:
    yield from serve(export, unknown_fields="reject")


def body(app: App, path: str, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": app.model, "max_tokens": 3, "temperature": 0}
    if path == "/v1/chat/completions":
        base["messages"] = [{"role": "user", "content": "the fox"}]
    else:
        base["prompt"] = "the fox"
    return {**base, **extra}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stream", [False, True])
def test_unknown_fields_are_named_in_a_header_and_the_log(
    warn: App, path: str, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="server.api.app"):
        reply = warn.client.post(
            path, json=body(warn, path, foo_bar=1, baz={"x": 1}, stream=stream, ignore_eos=True)
        )
    assert reply.status_code == 200, reply.text
    assert reply.headers[HEADER] == "foo_bar,baz"  # never a field it knows (ignore_eos)
    if stream:
        assert reply.text.rstrip().endswith("data: [DONE]")
    assert any("foo_bar, baz" in r.getMessage() or "foo_bar,baz" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    clean = warn.client.post(path, json=body(warn, path))
    assert clean.status_code == 200 and HEADER not in clean.headers


def test_nested_unknown_fields_are_named_by_their_path(warn: App) -> None:
    path = "/v1/chat/completions"
    message = {"role": "user", "content": [{"type": "text", "text": "hi", "cache": 1}], "x": 2}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
            "properties": {"unknown_to_the_schema_is_fine": {}}}}, "extra": True}  # fmt: skip
    reply = warn.client.post(
        path,
        json=body(warn, path, messages=[message], tools=[tool], tool_choice="none",
                  response_format={"type": "text", "strict": True}),
    )  # fmt: skip
    assert reply.status_code == 200, reply.text
    assert reply.headers[HEADER].split(",") == [
        "messages[0].content[0].cache",
        "messages[0].x",
        "tools[0].extra",
        "response_format.strict",
    ]


def test_names_that_are_no_header_text_are_encoded(warn: App) -> None:
    path = "/v1/completions"
    odd = {"caf\u00e9": 1, "line\r\nx-evil: 1": 2, "a,b": 3}
    reply = warn.client.post(path, json=body(warn, path, **odd))
    assert reply.status_code == 200, reply.text
    assert reply.headers[HEADER] == "caf%C3%A9,line%0D%0Ax-evil%3A%201,a%2Cb"
    assert "x-evil" not in reply.headers
    many = {f"f{i}": i for i in range(20)}
    named = warn.client.post(path, json=body(warn, path, **many)).headers[HEADER].split(",")
    assert len(named) == 17 and named[-1] == "...4-more"


@pytest.mark.parametrize("path", PATHS)
def test_reject_turns_an_unknown_field_into_a_400_naming_it(reject: App, path: str) -> None:
    reply = reject.client.post(path, json=body(reject, path, foo_bar=1))
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "foo_bar" and "foo_bar" in error["message"]
    nested = [{"role": "user", "content": "hi", "x": 1}]
    if path == "/v1/chat/completions":
        reply = reject.client.post(path, json=body(reject, path, messages=nested))
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages[0].x"
    # the extensions are known fields, not unknown ones
    known = reject.client.post(path, json=body(reject, path, min_p=0.5, repetition_penalty=1.1))
    assert known.status_code == 200, known.text


@pytest.mark.parametrize("mode", ["warn", "reject"])
def test_known_but_unsupported_fields_stay_a_400(warn: App, reject: App, mode: str) -> None:
    app = warn if mode == "warn" else reject
    reply = app.client.post("/v1/completions", json=body(app, "/v1/completions", echo=True))
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "echo"
    path = "/v1/chat/completions"
    reply = app.client.post(path, json=body(app, path, functions=[{"name": "f"}]))
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "functions"


DIALECTS = {
    "/v1/messages": lambda app: {
        "model": app.model,
        "max_tokens": 3,
        "messages": [{"role": "user", "content": "the fox"}],
    },
    "/v1/responses": lambda app: {
        "model": app.model,
        "max_output_tokens": 3,
        "input": "the fox",
        "store": False,
    },
    "/api/chat": lambda app: {  # Ollama's
        "model": app.model,
        "options": {"num_predict": 3},
        "messages": [{"role": "user", "content": "the fox"}],
    },
}


@pytest.mark.parametrize("path", sorted(DIALECTS))
@pytest.mark.parametrize("stream", [False, True])
def test_the_other_dialects_name_unknown_fields_too(warn: App, path: str, stream: bool) -> None:
    reply = warn.client.post(path, json={**DIALECTS[path](warn), "foo_bar": 1, "stream": stream})
    assert reply.status_code == 200, reply.text
    assert reply.headers[HEADER] == "foo_bar"
    clean = warn.client.post(path, json=DIALECTS[path](warn))
    assert clean.status_code == 200 and HEADER not in clean.headers


@pytest.mark.parametrize("path", sorted(DIALECTS))
def test_the_other_dialects_reject_unknown_fields_when_told(reject: App, path: str) -> None:
    reply = reject.client.post(path, json={**DIALECTS[path](reject), "foo_bar": 1})
    assert reply.status_code == 400
    text = reply.text
    assert "foo_bar" in text
    if path == "/v1/messages":  # Anthropic's envelope
        assert reply.json()["type"] == "error"
    elif path == "/api/chat":  # Ollama's, and its options' unknown keys too
        assert set(reply.json()) == {"error"}
        body = DIALECTS[path](reject)
        body["options"]["foo"] = 1
        nested = reject.client.post(path, json=body)
        assert nested.status_code == 400 and "options.foo" in nested.json()["error"]
    else:
        assert reply.json()["error"]["param"] == "foo_bar"
