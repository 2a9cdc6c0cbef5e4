"""Bad HTTP input against the real gateway process on real stage processes.

* Property-based fuzzing of every operation in the gateway's own OpenAPI schema (schemathesis,
  valid and invalid requests): never a 5xx, only the documented statuses, content types and
  bodies; afterwards the gateway still answers and no stage holds a session.
* The edges, explicitly: a body over ``--max-body-bytes`` is 413 (also chunked, with no
  Content-Length), an absurd ``max_tokens`` or a prompt longer than the context is 400, all in
  the OpenAI error envelope; and the inputs the fuzzer found to crash the gateway.

Tools and structured output (``tools``, ``tool_choice``, ``parallel_tool_calls``,
``response_format``) are in the schema, so the fuzzing above sends them too; a focused
Hypothesis test also combines them as real clients do (valid function names, JSON schemas,
named choices among the tools), into the template and constrained decoding.

The model is the tests' tiny chat model (with a template that takes tools) exported with a
64-token context: the context bounds
every generation (a larger ``max_tokens`` is a 400), so fuzzing stays fast. Generation is
derandomized (the same requests every run); ``FUZZ_EXAMPLES=500`` fuzzes the completions
longer than the default 60 examples per operation and mode.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)
from schemathesis.core.result import Ok

from tests.fleets import Fleet, hermes_fleet
from tests.processes import settled

pytestmark = pytest.mark.integration

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 16384
CONTEXT = 64
MAX_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "60"))
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
    ignored_auth,
    unsupported_method,
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    # a template that takes tools (Qwen's calls), a tokenizer that can write JSON: the fuzzed
    # tools, tool_choice and response_format reach the template and constrained decoding
    flags = ["--api-key", KEY, "--max-body-bytes", str(MAX_BODY)]
    base = tmp_path_factory.mktemp("fuzz")
    with hermes_fleet(base, flags, name="chat-model", max_context=CONTEXT) as made:
        yield made


OPERATIONS = [
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /v1/responses",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "GET /v1/responses/{response_id}",
    "DELETE /v1/responses/{response_id}",
    "GET /v1/models",
    "GET /v1/models/{model_id}",
    "GET /health",
    "GET /ready",
    "GET /metrics",
]


@pytest.fixture(scope="module")
def api_schema(fleet: Fleet) -> schemathesis.BaseSchema:
    """The gateway's own schema, read from the running gateway over HTTP."""
    config = schemathesis.Config.from_dict(
        {
            "base-url": fleet.url,
            "headers": AUTH,
            "request-timeout": 60,
            # Invalid input is a 400, or a 413 when the generated body is over the limit.
            "checks": {"negative_data_rejection": {"expected-statuses": [400, 413]}},
        }
    )
    return schemathesis.openapi.from_url(f"{fleet.url}/openapi.json", config=config)


def test_schema_lists_every_operation(api_schema: schemathesis.BaseSchema) -> None:
    labels = []
    for result in api_schema.get_all_operations():
        assert isinstance(result, Ok), result  # an operation schemathesis cannot read
        labels.append(result.ok().label)
    assert sorted(labels) == sorted(OPERATIONS)


# schemathesis' own pytest loader from a fixture does not work with pytest 9.2, hence plain
# Hypothesis over its strategies, with its checks on every response.
@pytest.mark.parametrize(
    ("label", "mode"),
    [(label, GenerationMode.POSITIVE) for label in OPERATIONS]
    + [(label, GenerationMode.NEGATIVE) for label in OPERATIONS if label.startswith("POST")],
    # (the rest take no body)
)
def test_fuzz(
    fleet: Fleet, api_schema: schemathesis.BaseSchema, label: str, mode: GenerationMode
) -> None:
    operation = api_schema.find_operation_by_label(label)
    assert operation is not None
    examples = MAX_EXAMPLES if operation.method.upper() == "POST" else 10

    @given(
        case=operation.as_strategy(generation_mode=mode),
        # (Hypothesis draws the first more often)
        aim=st.sampled_from(["served model", "served model, streamed", "as generated"]),
    )
    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case: schemathesis.Case, aim: str) -> None:
        # A generated model name is almost never the served one, and a request for another
        # model stops at a 404: most valid requests name the served model, to generate, and
        # some of those stream (still valid requests).
        if mode is GenerationMode.POSITIVE and aim != "as generated":
            if isinstance(case.body, dict):
                case.body["model"] = fleet.model
                if aim == "served model, streamed":
                    case.body["stream"] = True
            if case.path_parameters and "model_id" in case.path_parameters:
                case.path_parameters["model_id"] = fleet.model
            if case.path_parameters and "response_id" in case.path_parameters:
                case.path_parameters["response_id"] = _stored_response(fleet)
        response = case.call_and_validate(headers=AUTH, checks=CHECKS)
        statuses.add(response.status_code)
        if response.status_code == 400 and len(refusals) < 20:  # (both envelopes have it)
            refusals.append(response.json()["error"]["message"])

    statuses: set[int] = set()
    refusals: list[str] = []  # (what stopped the requests, should none get through)
    fuzz()
    # The fuzzing got past authentication and validation into the work (for the completions,
    # into the generation).
    assert mode is GenerationMode.NEGATIVE or 200 in statuses, (statuses, refusals)


def _stored_response(fleet: Fleet) -> str:
    """The id of a new stored response (/v1/responses), for the operations that read or
    delete one."""
    body = {"model": fleet.model, "input": "the quick brown fox", "max_output_tokens": 1}
    response = httpx.post(f"{fleet.url}/v1/responses", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


def _post(
    fleet: Fleet, content: bytes | Iterator[bytes], path: str = "/v1/chat/completions"
) -> httpx.Response:
    headers = {**AUTH, "content-type": "application/json"}
    return httpx.post(f"{fleet.url}{path}", content=content, headers=headers, timeout=60)


def _assert_error(
    response: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> dict[str, object]:
    """``response`` is ``status`` with the OpenAI envelope; returns the error object."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["param"] == param and error["code"] == code, error
    return dict(error)


def _chunks(data: bytes, size: int = 4096) -> Iterator[bytes]:
    """``data`` as an iterator: httpx sends it chunked, with no Content-Length."""
    for start in range(0, len(data), size):
        yield data[start : start + size]


def test_oversized_body_is_413_also_when_chunked(fleet: Fleet) -> None:
    # (the plain oversized body with a Content-Length: tests/test_gateway.py)
    good = {"model": fleet.model, "messages": MESSAGES, "max_tokens": 2}
    padded = json.dumps({**good, "user": "x" * MAX_BODY}).encode()
    assert len(padded) > MAX_BODY
    for path in ("/v1/chat/completions", "/v1/completions"):
        response = _post(fleet, _chunks(padded), path)
        assert "content-length" not in response.request.headers
        assert response.request.headers["transfer-encoding"] == "chunked"
        error = _assert_error(response, 413)
        assert str(MAX_BODY) in str(error["message"])
    # A chunked body within the limit is read whole and served.
    response = _post(fleet, _chunks(json.dumps({**good, "user": "x" * 9000}).encode(), 1000))
    assert response.status_code == 200, response.text


def test_absurd_max_tokens_and_too_long_prompts_are_400(fleet: Fleet) -> None:
    # (the chat endpoint's own cases are in tests/test_gateway.py)
    cases: list[tuple[str, dict[str, object], str]] = [
        (
            "/v1/completions",
            {"model": fleet.model, "prompt": "once upon a time", "max_tokens": 10**9},
            "max_tokens",
        ),
        ("/v1/completions", {"model": fleet.model, "prompt": [5] * (CONTEXT + 1)}, "prompt"),
        (
            "/v1/chat/completions",
            {"model": fleet.model, "messages": MESSAGES, "max_completion_tokens": 10**9},
            "max_tokens",
        ),
    ]
    for path, body, param in cases:
        for stream in (False, True):
            response = _post(fleet, json.dumps({**body, "stream": stream}).encode(), path)
            error = _assert_error(response, 400, param, "context_length_exceeded")
            assert f"maximum context length is {CONTEXT} tokens" in str(error["message"])


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        # A lone UTF-16 surrogate is valid JSON but not Unicode: it crashed the tokenizer (500)
        # and the UTF-8 encoding of a 404 naming the model (500).
        (
            rb'{"model": "chat-model", "messages": [{"role": "user", "content": "a\ud800"}]}',
            "messages[0].content",
        ),
        (rb'{"model": "\udc00", "messages": [{"role": "user", "content": "hi"}]}', "model"),
        # Deep nesting overflowed the JSON decoder's recursion (500); a body nested deeper than
        # any real request (64 levels) is refused before anything else recurses through it.
        (b'{"model": "chat-model", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),
        (b'{"model": "chat-model", "user": ' + b"[" * 100 + b"]" * 100 + b"}", None),
    ],
)
def test_inputs_that_crashed_the_gateway_are_400(
    fleet: Fleet, raw: bytes, param: str | None
) -> None:
    _assert_error(_post(fleet, raw), 400, param)


def test_negative_seed_is_served_reproducibly(fleet: Fleet) -> None:
    # OpenAI's seed is a signed 64-bit integer; a negative one failed the uint64 wire field (500).
    def text(seed: int) -> str:
        body = {"model": fleet.model, "messages": MESSAGES, "max_tokens": 6, "seed": seed}
        response = _post(fleet, json.dumps({**body, "logit_bias": {"2": -100}}).encode())
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["message"]["content"])

    assert text(-5) == text(-5)
    assert text(-(2**63)) == text(-(2**63))


def test_wrong_method_is_405_with_allow(fleet: Fleet) -> None:
    response = httpx.delete(f"{fleet.url}/health")
    _assert_error(response, 405)
    assert response.headers["allow"] == "GET"
    response = httpx.get(f"{fleet.url}/v1/chat/completions", headers=AUTH)
    _assert_error(response, 405)
    assert response.headers["allow"] == "POST"


_NAMES = st.from_regex(r"\A[a-zA-Z0-9_-]{1,12}\Z")
_SCALAR_SCHEMAS = st.sampled_from(
    [
        {"type": "string"},
        {"type": "integer"},
        {"type": "number", "minimum": 0},
        {"type": "boolean"},
        {"enum": ["a", "b", 3]},
        {"const": "x"},
        {"type": "string", "maxLength": 3},
        {},
    ]
)
_SCHEMAS = st.recursive(
    _SCALAR_SCHEMAS,
    lambda inner: st.one_of(
        st.builds(
            lambda props, required, extra: {
                "type": "object",
                "properties": props,
                "required": sorted(set(required) & set(props)),
                "additionalProperties": extra,
            },
            st.dictionaries(_NAMES, inner, max_size=3),
            st.lists(_NAMES, max_size=2),
            st.booleans(),
        ),
        st.builds(lambda items: {"type": "array", "items": items, "maxItems": 2}, inner),
    ),
    max_leaves=6,
)
_OBJECT_SCHEMAS = st.one_of(
    st.builds(lambda s: {"type": "object", "properties": {"v": s}}, _SCHEMAS),
    st.just({"type": "object"}),
    st.just({}),
)


@st.composite
def _tool_requests(draw: st.DrawFn) -> dict[str, object]:
    names = draw(st.lists(_NAMES, min_size=1, max_size=3, unique=True))
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                **draw(st.fixed_dictionaries({}, optional={"parameters": _OBJECT_SCHEMAS})),
                **draw(st.fixed_dictionaries({}, optional={"description": st.text(max_size=8)})),
            },
        }
        for name in names
    ]
    choice = draw(st.sampled_from(["none", "auto", "required", None, "named", "unknown name"]))
    body: dict[str, object] = {"messages": MESSAGES, "max_tokens": draw(st.integers(1, 8))}
    if draw(st.booleans()):
        body["tools"] = tools
    if choice in ("named", "unknown name"):
        name = draw(st.sampled_from(names)) if choice == "named" else "not-" + names[0]
        body["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif choice is not None:
        body["tool_choice"] = choice
    if draw(st.booleans()):
        body["parallel_tool_calls"] = draw(st.booleans())
    fmt = draw(st.sampled_from([None, "text", "json_object", "json_schema"]))
    if fmt == "json_schema":
        schema = draw(_SCHEMAS)
        body["response_format"] = {
            "type": fmt,
            "json_schema": {"name": draw(_NAMES), "schema": schema, "strict": draw(st.booleans())},
        }
    elif fmt is not None:
        body["response_format"] = {"type": fmt}
    if draw(st.booleans()):
        body["stream"] = True
    if draw(st.booleans()):  # a call and its answer in the history
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": names[0], "arguments": "{}"},
        }
        body["messages"] = [
            *MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
        ]
    return body


def test_fuzz_tools_and_response_formats(fleet: Fleet) -> None:
    """Tools, tool_choice and response_format as clients combine them: a 200 (a stream ends
    with [DONE]; calls carry JSON arguments) or a 400 in the envelope, never a 5xx."""
    statuses: set[int] = set()

    @given(fields=_tool_requests())
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(fields: dict[str, object]) -> None:
        body = {"model": fleet.model, **fields}
        response = _post(fleet, json.dumps(body).encode())
        statuses.add(response.status_code)
        if response.status_code != 200:
            error = response.json()["error"]
            _assert_error(response, 400, error["param"], error["code"])
            return
        if body.get("stream"):
            assert response.text.endswith("data: [DONE]\n\n"), response.text
            assert '"error"' not in response.text, response.text
            return
        for choice in response.json()["choices"]:
            for call in choice["message"].get("tool_calls") or []:
                assert isinstance(json.loads(call["function"]["arguments"]), dict)

    fuzz()
    assert {200, 400} <= statuses, statuses


def test_gateway_survives_fuzzing(fleet: Fleet) -> None:
    """Runs after the fuzzing (file order): the process is up, answers, and holds nothing."""
    assert fleet.gateway.popen is not None and fleet.gateway.popen.poll() is None
    assert httpx.get(f"{fleet.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{fleet.url}/ready").status_code == 200
    # (a session is released just after its answer has gone out)
    assert settled(fleet.stage_sessions, lambda held: not any(held)) == [0, 0]
    log = Path(fleet.gateway.log).read_text(errors="replace")
    assert "unexpected error" not in log and "Traceback" not in log
