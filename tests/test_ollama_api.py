"""Ollama's API (``/api/*``) through the official ``ollama`` Python client against the real
gateway process on real stage processes: the tiny tool-calling fleet (a Hermes-style template, a
tokenizer that writes JSON). Chat and generate, whole and streamed (NDJSON), are the chat
completions' answer token for token (greedy); tags, show, ps and version describe the served
model; tools and their history reach the prompt; ``format`` with a JSON schema is enforced;
bad input is a 400 in Ollama's envelope that changes nothing.

The tiny random model never writes a tool call by itself, and Ollama's API has no way to force
one: calls in the output are tested on a scripted engine under the real service and renderer
(unit), read by the real client. ``think`` runs on the tiny model whose template opens a
``<think>`` block, in-process (component).
"""

# ruff: noqa: E501  (request bodies read best on one line)
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ollama
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from protos.sampling import SampledToken
from server.api.ollama import render
from server.api.ollama.lowering import lower_chat
from server.api.ollama.schema import ChatRequest
from server.api.requests import parse_request
from server.api.serving import CompletionService
from server.api.tokenization import TextCodec
from server.engine.loop import GenerationRequest, GenerationStats
from server.metrics import GatewayMetrics
from testing_support.tiny_models import CORPUS, JSON_CORPUS, THINK_TEMPLATE, make_tokenizer
from tests.fleets import (
    KEY,
    TINY_HERMES_TEMPLATE,
    Fleet,
    export_chat_model,
    hermes_fleet,
    local_gateway,
)

USER = [{"role": "user", "content": "the quick brown fox"}]
GREEDY = {"temperature": 0, "num_predict": 8}
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["city", "days"],
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with hermes_fleet(tmp_path_factory.mktemp("ollama"), ["--api-key", KEY]) as made:
        yield made


def _client(fleet: Fleet, key: str = KEY) -> ollama.Client:
    return ollama.Client(host=fleet.url, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def _post(fleet: Fleet, path: str, body: Any) -> httpx.Response:
    return httpx.post(
        f"{fleet.url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
    )


def _refused(response: httpx.Response, status: int, *words: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    for word in words:
        assert word in body["error"], body
    return str(body["error"])


def _chat_completion(fleet: Fleet, **fields: Any) -> Any:
    return fleet.client().chat.completions.create(model=fleet.model, temperature=0, **fields)


@pytest.mark.integration
def test_chat_whole_and_streamed_is_the_chat_completion(fleet: Fleet) -> None:
    expected = _chat_completion(fleet, messages=USER, max_tokens=8)
    client = _client(fleet)
    reply = client.chat(model=fleet.model, messages=USER, options=GREEDY, stream=False)
    assert reply.message.role == "assistant"
    assert reply.message.content == expected.choices[0].message.content
    assert reply.done is True and reply.done_reason == "length"  # 8 tokens: cut at num_predict
    assert reply.model == fleet.model and reply.created_at and reply.created_at.endswith("Z")
    assert reply.prompt_eval_count == expected.usage.prompt_tokens
    assert reply.eval_count == expected.usage.completion_tokens == 8
    assert reply.total_duration and reply.total_duration >= (reply.eval_duration or 0)
    assert reply.load_duration == 0
    parts = list(
        client.chat(model=f"{fleet.model}:latest", messages=USER, options=GREEDY, stream=True)
    )
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content or "" for p in parts) == reply.message.content
    last = parts[-1]
    assert last.message.content == "" and last.done_reason == "length" and last.eval_count == 8
    assert all(p.done_reason is None and p.eval_count is None for p in parts[:-1])
    assert last.model == f"{fleet.model}:latest"  # the name the request used


@pytest.mark.integration
def test_generate_whole_streamed_and_raw(fleet: Fleet) -> None:
    client = _client(fleet)
    expected = _chat_completion(
        fleet, messages=[{"role": "system", "content": "be brief"}, *USER], max_tokens=8
    )
    reply = client.generate(
        model=fleet.model,
        prompt=USER[0]["content"],
        system="be brief",
        options=GREEDY,
        stream=False,
    )
    assert reply.response == expected.choices[0].message.content
    assert reply.done and reply.done_reason == "length" and reply.eval_count == 8
    parts = list(
        client.generate(
            model=fleet.model,
            prompt=USER[0]["content"],
            system="be brief",
            options=GREEDY,
            stream=True,
        )
    )
    assert "".join(p.response or "" for p in parts) == reply.response
    assert (
        parts[-1].done
        and parts[-1].response == ""
        and parts[-1].prompt_eval_count == reply.prompt_eval_count
    )
    # JSON sent as a form (curl -d without a Content-Type, as Ollama's documentation does)
    form = httpx.post(
        f"{fleet.url}/api/generate",
        content=json.dumps(
            {
                "model": fleet.model,
                "prompt": USER[0]["content"],
                "system": "be brief",
                "options": GREEDY,
                "stream": False,
            }
        ),
        headers={
            "Authorization": f"Bearer {KEY}",
            "Content-Type": "application/x-www-form-urlencoded",
        },
    )
    assert form.status_code == 200 and form.json()["response"] == reply.response, form.text
    # raw: the prompt as it is, as a legacy completion reads it
    legacy = fleet.client().completions.create(
        model=fleet.model, prompt="once upon", max_tokens=6, temperature=0
    )
    raw = client.generate(
        model=fleet.model,
        prompt="once upon",
        raw=True,
        options={**GREEDY, "num_predict": 6},
        stream=False,
    )
    assert raw.response == legacy.choices[0].text
    # a stop sequence ends it (and is not returned)
    cut = raw.response[2:5]
    if cut.strip():
        stopped = client.generate(
            model=fleet.model,
            prompt="once upon",
            raw=True,
            options={**GREEDY, "num_predict": 6, "stop": [cut]},
            stream=False,
        )
        assert stopped.done_reason == "stop" and cut not in stopped.response


@pytest.mark.integration
def test_an_empty_request_answers_loaded(fleet: Fleet) -> None:
    reply = _client(fleet).chat(model=fleet.model, messages=[])
    assert reply.done and reply.done_reason == "load" and reply.message.content == ""
    loaded = _post(fleet, "/api/generate", {"model": fleet.model})
    assert loaded.status_code == 200 and loaded.json()["done_reason"] == "load"
    # without "stream": NDJSON, as Ollama streams by default
    streamed = _post(
        fleet, "/api/generate", {"model": fleet.model, "prompt": "hi", "options": GREEDY}
    )
    assert streamed.headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in streamed.text.splitlines()]
    assert [line["done"] for line in lines][-2:] == [False, True] and lines[-1]["eval_count"] == 8


@pytest.mark.integration
def test_tags_show_ps_and_version(fleet: Fleet) -> None:
    client = _client(fleet)
    listed = client.list().models
    assert [m.model for m in listed] == [f"{fleet.model}:latest"]
    assert listed[0].details is not None and listed[0].details.family == "qwen2"
    assert listed[0].details.format == "openvino" and listed[0].modified_at is not None
    shown = client.show(fleet.model)
    assert shown.capabilities == ["completion", "tools"]
    assert shown.modelinfo is not None and shown.modelinfo["general.architecture"] == "qwen2"
    context = shown.modelinfo["qwen2.context_length"]
    assert isinstance(context, int) and context > 0
    assert shown.template == TINY_HERMES_TEMPLATE
    running = client.ps().models
    assert [m.model for m in running] == [f"{fleet.model}:latest"] and running[
        0
    ].context_length == context
    assert httpx.head(fleet.url).status_code == 200  # Ollama's heartbeat, open
    version = httpx.get(
        f"{fleet.url}/api/version", headers={"Authorization": f"Bearer {KEY}"}
    ).json()
    assert set(version) == {"version"} and version["version"].count(".") == 2
    with pytest.raises(ollama.ResponseError) as missing:
        client.show("no-such-model")
    assert missing.value.status_code == 404 and "no-such-model" in missing.value.error


@pytest.mark.integration
def test_format_json_schema_and_json_are_enforced(fleet: Fleet) -> None:
    client = _client(fleet)
    for seed in range(3):
        reply = client.chat(
            model=fleet.model,
            messages=USER,
            format=SCHEMA,
            options={"temperature": 1, "seed": seed, "num_predict": 40},
            stream=False,
        )
        assert reply.done_reason == "stop", reply
        jsonschema.validate(json.loads(reply.message.content or ""), SCHEMA)
    parts = list(
        client.generate(
            model=fleet.model,
            prompt="the fox",
            stream=True,
            format="json",
            options={"seed": 1, "num_predict": 40},
        )
    )
    assert parts[-1].done_reason == "stop"
    assert isinstance(json.loads("".join(p.response or "" for p in parts)), dict)


@pytest.mark.integration
def test_tools_and_their_history_reach_the_prompt(fleet: Fleet) -> None:
    client = _client(fleet)
    plain = client.chat(model=fleet.model, messages=USER, options=GREEDY, stream=False)
    offered = client.chat(
        model=fleet.model, messages=USER, tools=TOOLS, options=GREEDY, stream=False
    )
    assert offered.prompt_eval_count > plain.prompt_eval_count  # the template renders the tools
    history = [
        *USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ]
    answered = client.chat(
        model=fleet.model, messages=history, tools=TOOLS, options=GREEDY, stream=False
    )
    # the same conversation as chat completions render it: the same prompt, the same answer
    expected = _chat_completion(
        fleet,
        max_tokens=8,
        tools=TOOLS,
        messages=[
            *USER,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        ],
    )
    assert answered.prompt_eval_count == expected.usage.prompt_tokens
    assert answered.message.content == (expected.choices[0].message.content or "")


@pytest.mark.integration
def test_bad_input_is_a_400_in_ollamas_envelope(fleet: Fleet) -> None:
    good = {"model": fleet.model, "messages": USER, "stream": False, "options": {"num_predict": 2}}
    context = _client(fleet).show(fleet.model).modelinfo["qwen2.context_length"]  # type: ignore[index]
    cases: list[tuple[dict[str, Any], tuple[str, ...]]] = [
        ({"options": {"temperature": "hot"}}, ("options.temperature",)),
        ({"options": {"num_ctx": context + 1}}, ("options.num_ctx", str(context))),
        ({"options": {"num_predict": context * 2}}, ("options.num_predict",)),
        ({"options": {"num_gpu": 1}}, ("options.num_gpu",)),
        ({"options": {"mirostat": 2}}, ("options.mirostat",)),
        ({"options": {"repeat_penalty": 1.2, "repeat_last_n": 64}}, ("repeat_last_n",)),
        ({"format": "yaml"}, ("format",)),
        (
            {
                "format": {
                    "type": "object",
                    "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}},
                }
            },
            ("format",),
        ),
        ({"think": True}, ("does not support thinking",)),
        ({"think": "extreme"}, ("think",)),
        ({"keep_alive": 0}, ("keep_alive",)),
        ({"keep_alive": "soon"}, ("keep_alive",)),
        ({"truncate": True}, ("truncate",)),
        ({"logprobs": True}, ("logprobs",)),
        ({"messages": [{"role": "robot", "content": "hi"}]}, ("messages[0].role",)),
        ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, ("image",)),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            ("tools[0].function.name",),
        ),
        ({"stream": "yes"}, ("stream",)),
    ]
    for fields, words in cases:
        _refused(_post(fleet, "/api/chat", {**good, **fields}), 400, *words)
    _refused(_post(fleet, "/api/chat", {**good, "model": "other"}), 404, "other")
    for fields, words in [
        ({"suffix": "end"}, ("suffix",)),
        ({"template": "{{ .Prompt }}"}, ("template",)),
        ({"context": [1, 2]}, ("context",)),
        ({"raw": True, "think": False}, ("think",)),
    ]:
        _refused(
            _post(
                fleet,
                "/api/generate",
                {"model": fleet.model, "prompt": "hi", "stream": False, **fields},
            ),
            400,
            *words,
        )
    _refused(
        httpx.post(
            f"{fleet.url}/api/chat",
            content=b"{not json",
            headers={"Authorization": f"Bearer {KEY}"},
        ),
        400,
    )
    _refused(httpx.get(f"{fleet.url}/api/tags"), 401)  # no key
    _refused(httpx.get(f"{fleet.url}/api/tags", headers={"Authorization": "Bearer wrong"}), 401)
    _refused(
        httpx.get(f"{fleet.url}/api/pull", headers={"Authorization": f"Bearer {KEY}"}),
        404,
        "/api/pull",
        "/api/chat",
    )  # not served
    _refused(httpx.get(f"{fleet.url}/api/chat", headers={"Authorization": f"Bearer {KEY}"}), 405)
    with pytest.raises(ollama.ResponseError) as refused:
        _client(fleet).chat(model=fleet.model, messages=USER, options={"top_p": 2})
    assert refused.value.status_code == 400 and "top_p" in refused.value.error
    # a null content is empty, as Ollama reads it
    empty = _post(fleet, "/api/chat", {**good, "messages": [{"role": "user", "content": None}]})
    assert empty.status_code == 200 and empty.json()["done"] is True, empty.text
    # nothing changed: the same greedy answer as before the refusals, no session left
    again = _client(fleet).chat(model=fleet.model, messages=USER, options=GREEDY, stream=False)
    assert (
        again.message.content
        == _chat_completion(fleet, messages=USER, max_tokens=8).choices[0].message.content
    )
    assert fleet.stage_sessions() == [0, 0]


@pytest.mark.integration
def test_unknown_fields_are_named_and_options_honoured(fleet: Fleet) -> None:
    body = {
        "model": fleet.model,
        "messages": USER,
        "stream": False,
        "keep_alive": "5m",
        "options": {**GREEDY, "foo": 1},
        "bar": 2,
    }
    reply = _post(fleet, "/api/chat", body)
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-pipeshard-ignored-fields"] == "options.foo,bar"
    # sampled with a seed: reproducible; another seed (most likely) another answer
    sampled = {
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "repeat_penalty": 1.1,
        "seed": 7,
        "num_predict": 12,
    }
    client = _client(fleet)
    first = client.chat(
        model=fleet.model, messages=USER, options=sampled, stream=False
    ).message.content
    assert (
        client.chat(model=fleet.model, messages=USER, options=sampled, stream=False).message.content
        == first
    )
    expected = fleet.client().chat.completions.create(
        model=fleet.model,
        messages=USER,
        max_tokens=12,
        seed=7,
        temperature=1.0,
        extra_body={"repetition_penalty": 1.1},
    )
    assert first == expected.choices[0].message.content


# --- tool calls in the output: the real service and renderer on a scripted engine -------------------


@dataclass
class _Engine:
    """Stands in for the engine: the choice "generates" the given token ids, then EOS."""

    output: list[int]
    eos_ids: frozenset[int] = frozenset({2})

    async def generate(
        self, request: GenerationRequest, choice: int = 0, stats: GenerationStats | None = None
    ) -> AsyncIterator[SampledToken]:
        for token in [*self.output, 2]:
            if stats is not None:
                stats.tokens += 1
            yield SampledToken(token, None, [])


CALL = (
    'Looking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def _scripted(tmp_path: Path, output: str) -> CompletionService:
    from transformers import PreTrainedTokenizerFast

    make_tokenizer(tmp_path, chat_template=TINY_HERMES_TEMPLATE, corpus=CORPUS + JSON_CORPUS)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    codec = TextCodec(
        tokenizer=tokenizer,
        chat=PreTrainedTokenizerFast.from_pretrained(str(tmp_path)),
        eos_ids=frozenset({2}),
        has_chat_template=True,
        vocab_size=256,
    )
    ids = tokenizer.encode(output, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == output  # the tiny vocabulary can write it
    engine: Any = _Engine(ids)
    return CompletionService(engine, codec, "m", 4096, GatewayMetrics())


def _served(service: CompletionService, body: dict[str, Any]) -> ollama.Client:
    """An ``ollama`` client whose every request is answered with what the gateway's Ollama
    routes send for ``body`` (lowered, generated by the service, rendered)."""
    req = parse_request(ChatRequest, {"model": "m", **body})

    async def run() -> bytes:
        prep = lower_chat(service, req, "ollama-1")
        clock = render.Clock()
        if not prep.stream:
            return json.dumps(await render.whole(service, prep, "chat", "m", clock)).encode()
        return b"".join(
            [line async for line in await render.open_stream(service, prep, "chat", "m", clock)]
        )

    content = asyncio.run(run())
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=content))
    return ollama.Client(host="http://test", transport=transport)


@pytest.mark.unit
@pytest.mark.parametrize("stream", [False, True])
def test_calls_become_ollama_tool_calls(tmp_path: Path, stream: bool) -> None:
    service = _scripted(tmp_path, CALL)
    client = _served(service, {"messages": USER, "tools": TOOLS, "stream": stream})
    if stream:
        parts = list(client.chat(model="m", messages=USER, tools=TOOLS, stream=True))
        calls = [c for p in parts for c in p.message.tool_calls or ()]
        content = "".join(p.message.content or "" for p in parts)
        assert parts[-1].done and parts[-1].done_reason == "stop"
        assert content.strip() == "Looking."
    else:
        reply = client.chat(model="m", messages=USER, tools=TOOLS, stream=False)
        calls = list(reply.message.tool_calls or ())
        assert reply.message.content == "Looking." and reply.done_reason == "stop"
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    # without tools the same output is text
    plain = _served(service, {"messages": USER, "stream": False}).chat(
        model="m", messages=USER, stream=False
    )
    assert plain.message.content == CALL and not plain.message.tool_calls


# --- think: the tiny model whose template opens a <think> block, in-process ------------------------


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    _, export = export_chat_model(
        tmp_path_factory.mktemp("think"),
        name="think-model",
        chat_template=THINK_TEMPLATE,
        json=True,
    )
    with local_gateway(export, "think-model") as made:
        yield made


@pytest.mark.component
def test_think_splits_and_switches_reasoning(thinker: Fleet) -> None:
    client = _client(thinker)
    expected = (
        thinker.client()
        .chat.completions.create(model=thinker.model, messages=USER, max_tokens=16, temperature=0)
        .choices[0]
        .message
    )
    reasoning = expected.reasoning_content  # type: ignore[attr-defined]
    assert reasoning  # (a random model never ends its reasoning by itself)
    reply = client.chat(
        model=thinker.model,
        messages=USER,
        think=True,
        options={"temperature": 0, "num_predict": 16},
        stream=False,
    )
    assert reply.message.thinking == reasoning and reply.message.content == expected.content
    assert "thinking" in client.show(thinker.model).capabilities  # type: ignore[operator]
    parts = list(
        client.chat(
            model=thinker.model,
            messages=USER,
            options={"temperature": 0, "num_predict": 16},
            stream=True,
        )
    )
    assert "".join(p.message.thinking or "" for p in parts) == reasoning
    off = client.chat(
        model=thinker.model,
        messages=USER,
        think=False,
        options={"temperature": 0, "num_predict": 16},
        stream=False,
    )
    assert not off.message.thinking and off.message.content  # the template closed the block
    schema = client.chat(
        model=thinker.model,
        messages=USER,
        think=False,
        format=SCHEMA,
        options={"temperature": 0, "num_predict": 40},
        stream=False,
    )
    jsonschema.validate(json.loads(schema.message.content or ""), SCHEMA)
    levels = _post(
        thinker, "/api/chat", {"model": thinker.model, "messages": USER, "think": "high"}
    )
    _refused(levels, 400, "reasoning effort")


# --- fuzzed fields: a 200 or a 4xx in Ollama's envelope, never a 5xx --------------------------------

_ANY: Any = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 70), 1 << 70)
    | st.floats()
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
_FIELDS = {
    "/api/chat": [
        "messages",
        "tools",
        "format",
        "think",
        "keep_alive",
        "stream",
        "truncate",
        "shift",
    ],
    "/api/generate": [
        "prompt",
        "system",
        "raw",
        "suffix",
        "format",
        "think",
        "keep_alive",
        "images",
    ],
}
_OPTIONS = [
    "num_predict",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "stop",
    "repeat_penalty",
    "repeat_last_n",
    "num_ctx",
    "mirostat",
]


@pytest.mark.integration
def test_fuzzed_fields_are_answered_or_refused(fleet: Fleet) -> None:
    statuses: set[int] = set()

    @given(
        path=st.sampled_from(sorted(_FIELDS)),
        fields=st.dictionaries(
            st.sampled_from(sorted({f for fs in _FIELDS.values() for f in fs})), _ANY, max_size=3
        ),
        options=st.dictionaries(st.sampled_from(_OPTIONS), _ANY, max_size=2),
    )
    @settings(
        max_examples=30,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(path: str, fields: dict[str, Any], options: dict[str, Any]) -> None:
        body = {
            "model": fleet.model,
            "messages": USER,
            "prompt": "the fox",
            **fields,
            "options": {**options, "num_predict": 2},
        }
        response = httpx.post(
            f"{fleet.url}{path}",
            content=json.dumps(body, allow_nan=True),
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=120,
        )
        statuses.add(response.status_code)
        assert response.status_code in (200, 400), response.text
        if response.status_code == 400:
            _refused(response, 400)
        elif response.headers["content-type"] == "application/x-ndjson":
            lines = [json.loads(line) for line in response.text.splitlines()]
            assert lines[-1]["done"] is True and "error" not in lines[-1], lines[-1]
        else:
            assert response.json()["done"] is True

    fuzz()
    assert statuses == {200, 400}, statuses
    assert fleet.stage_sessions() == [0, 0]
