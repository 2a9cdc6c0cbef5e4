"""The OpenAI wire protocol: request validation, helpers, SSE framing, and client round trips."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from openai._models import construct_type
from openai.types import Completion as OpenAICompletion
from openai.types import Model as OpenAIModel
from openai.types.chat import ChatCompletion as OpenAIChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChatCompletionChunk
from pydantic import BaseModel, ValidationError

from protos.sampling import SamplingParams
from server.api.errors import (
    APIError,
    errors_to_api_error,
    model_not_found,
    validation_error_to_api_error,
)
from server.api.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    effective_max_tokens,
    include_usage,
    message_text,
    parse_request,
    stop_list,
    template_messages,
    to_sampling_params,
)
from server.api.responses import (
    SYSTEM_FINGERPRINT,
    ChatChoiceLogprobs,
    ChatCompletion,
    ChatCompletionChoice,
    ChatResponseMessage,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    ModelCard,
    ModelList,
    TopLogprob,
    Usage,
    chat_token_logprob,
    new_id,
)
from server.api.sse import (
    chat_content_chunk,
    chat_final_chunk,
    chat_usage_chunk,
    completion_final_chunk,
    completion_text_chunk,
    completion_usage_chunk,
    first_chat_chunk,
    sse_done,
    sse_error,
    sse_event,
)
from tests.schemas import errors

pytestmark = pytest.mark.unit

try:  # the HTTP library the installed openai client is built on
    import httpx2 as httpx
except ImportError:  # older openai releases
    import httpx  # type: ignore[no-redef]

BASE: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
ID, CREATED, MODEL = "chatcmpl-abc", 1_700_000_000, "tiny"


_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def _chat(**fields: Any) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {**BASE, **fields})


def _completion(**fields: Any) -> CompletionRequest:
    return parse_request(CompletionRequest, {"model": "tiny", "prompt": "Once", **fields})


def _json(model: BaseModel) -> dict[str, Any]:
    """What goes on the wire, decoded again."""
    data: dict[str, Any] = json.loads(model.model_dump_json())
    return data


# --- request validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"messages": []}, "messages", "at least 1"),
        ({"messages": None}, "messages", "list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "robot"),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "Missing"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
            "only 'text' parts",
        ),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
        ({"temperature": 3}, "temperature", "less than or equal to 2"),
        ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
        ({"temperature": "1"}, "temperature", "number"),
        ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"top_k": -1}, "top_k", "greater than or equal to 0"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"n": 17}, "n", "less than or equal to 16"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"stop": ["a", ""]}, "stop", "empty"),
        ({"stop": ""}, "stop", "empty"),
        ({"stop": [1]}, "stop", "strings"),
        ({"seed": 1 << 63}, "seed", "less than or equal to"),
        ({"seed": 1.5}, "seed", "integer"),
        ({"top_logprobs": 5}, "top_logprobs", "requires logprobs"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs", "requires logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"1.5": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"50256": 200}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {"7": "x"}}, "logit_bias", "number"),
        ({"logit_bias": [1]}, "logit_bias", "object"),
        ({"presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
        ({"frequency_penalty": -2.5}, "frequency_penalty", "greater than or equal to -2"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"max_tokens": -5}, "max_tokens", "greater than or equal to 1"),
        ({"max_tokens": "10"}, "max_tokens", "integer"),
        ({"max_tokens": True}, "max_tokens", "integer"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
        ({"stream": "yes"}, "stream", "boolean"),
        ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage", "boolean"),
        ({"model": None}, "model", "string"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "needs content"),
        ({"messages": [{"role": "system", "content": None}]}, "messages[0].content", "needs"),
        ({"messages": [{"role": "assistant"}]}, "messages[0].content", "content or tool_calls"),
        ({"messages": [{"role": "tool", "content": "4"}]}, "messages[0].tool_call_id", "needs"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
            "messages[0].tool_call_id",
            "only valid in tool messages",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [_CALL]}]},
            "messages[0].tool_calls",
            "only valid in assistant messages",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{**_CALL, "function": {"name": "f", "arguments": "{oops"}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
            "JSON object",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "'function'"),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools[0].function.name",
            "pattern",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": "sometimes"}, "tool_choice", "'none', 'auto', 'required'"),
        ({"parallel_tool_calls": 1}, "parallel_tool_calls", "boolean"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "Missing",
        ),
        ({"functions": [{"name": "f"}]}, "functions", "use tools"),
    ],
)
def test_invalid_chat_request_is_a_400_naming_the_field(
    fields: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(APIError) as info:
        _chat(**fields)
    error = info.value
    assert error.status == 400
    assert error.type == "invalid_request_error"
    assert error.param == param
    assert words in error.message
    assert f"'{param}'" in error.message
    body = error.response()
    assert set(body) == {"error"}
    assert body["error"] == {
        "message": error.message,
        "type": "invalid_request_error",
        "param": param,
        "code": None,
    }


def test_missing_fields_are_named() -> None:
    with pytest.raises(APIError) as info:
        parse_request(ChatCompletionRequest, {"messages": BASE["messages"]})
    assert info.value.param == "model"
    assert info.value.message.startswith("Missing required parameter: 'model'.")
    with pytest.raises(APIError) as info:
        parse_request(ChatCompletionRequest, {"model": "tiny"})
    assert info.value.param == "messages"


def test_validation_error_conversion_directly() -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({**BASE, "temperature": 3, "top_p": 2})
    error = validation_error_to_api_error(info.value)
    assert (error.status, error.param) == (400, "temperature")
    assert "1 more error" in error.message


def test_fastapi_style_errors_and_malformed_json() -> None:
    error = errors_to_api_error(
        [{"type": "missing", "loc": ("body", "messages"), "msg": "Field required"}],
        strip_body=True,
    )
    assert (error.status, error.param) == (400, "messages")
    error = errors_to_api_error(
        [{"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error"}],
        strip_body=True,
    )
    assert (error.status, error.param) == (400, None)
    assert "JSON" in error.message
    for body in (b"{", b"", b"\xff", '{"model": "tiny", "messages": [], "temperature": NaN}'):
        with pytest.raises(APIError) as info:
            parse_request(ChatCompletionRequest, body)
        assert info.value.status == 400
        assert "JSON" in info.value.message
    with pytest.raises(APIError, match="JSON object"):
        parse_request(ChatCompletionRequest, b"[1, 2]")


def test_nulls_are_accepted_for_optional_fields() -> None:
    optional = [
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "n",
        "stop",
        "seed",
        "stream",
        "stream_options",
        "presence_penalty",
        "frequency_penalty",
        "logprobs",
        "top_logprobs",
        "logit_bias",
        "user",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "functions",
        "function_call",
    ]
    messages = [
        {"role": "system", "content": "", "name": None, "tool_calls": None, "tool_call_id": None},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [_CALL]},
    ]
    req = parse_request(
        ChatCompletionRequest,
        json.dumps({"model": "tiny", "messages": messages, **dict.fromkeys(optional)}),
    )
    assert effective_max_tokens(req) is None
    assert stop_list(req) == []
    assert include_usage(req) is False
    assert message_text(req.messages[0]) == message_text(req.messages[2]) == ""
    assert req.tool_mode() is None
    params = to_sampling_params(req)
    assert params == SamplingParams(temperature=1.0, top_p=1.0)
    req = _chat(stream=True, stream_options={"include_usage": None})
    assert include_usage(req) is False


def test_unknown_fields_are_ignored() -> None:
    req = _chat(
        messages=[{"role": "user", "content": "hi", "whatever": 1}],
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        stream=True,
        brand_new_field={"nested": [1, 2]},
    )
    assert include_usage(req) is True
    assert "brand_new_field" not in req.model_dump()


def test_content_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world", "extra": 1}]
    req = _chat(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": parts, "name": "ann"},
            {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        ]
    )
    assert message_text(req.messages[1]) == "Hello\nworld"
    assert message_text(req.messages[0]) == "Be brief."
    assert template_messages(req.messages) == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hello\nworld", "name": "ann"},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert effective_max_tokens(_chat(max_tokens=10)) == 10
    assert effective_max_tokens(_chat(max_completion_tokens=7)) == 7
    assert effective_max_tokens(_chat(max_tokens=10, max_completion_tokens=7)) == 7
    assert effective_max_tokens(_chat(max_tokens=10, max_completion_tokens=None)) == 10


def test_stop_list() -> None:
    assert stop_list(_chat(stop="\n")) == ["\n"]
    assert stop_list(_chat(stop=["a", "bb", "c", "d"])) == ["a", "bb", "c", "d"]
    assert stop_list(_chat(stop=[])) == []


def test_to_sampling_params_maps_every_field() -> None:
    req = _chat(
        temperature=0,
        top_p=0.9,
        top_k=40,
        seed=-3,
        logprobs=True,
        top_logprobs=3,
        logit_bias={"5": -100, "17": 2.5},
        presence_penalty=0.5,
        frequency_penalty=-1,
    )
    assert to_sampling_params(req, vocab_size=100) == SamplingParams(
        temperature=0.0,
        top_p=0.9,
        top_k=40,
        seed=-3,
        top_logprobs=3,
        logprobs=True,
        logit_bias={5: -100.0, 17: 2.5},
        presence_penalty=0.5,
        frequency_penalty=-1.0,
    )
    # top_p 0 keeps only the most probable token; top_logprobs 0 with logprobs is allowed.
    params = to_sampling_params(_chat(top_p=0, logprobs=True, top_logprobs=0))
    assert (params.top_p, params.top_k, params.logprobs, params.top_logprobs) == (1.0, 1, True, 0)
    assert to_sampling_params(_chat(top_logprobs=0)).logprobs is False


def test_to_sampling_params_checks_the_vocabulary() -> None:
    req = _chat(logit_bias={"500": 1})
    assert to_sampling_params(req).logit_bias == {500: 1.0}
    with pytest.raises(APIError) as info:
        to_sampling_params(req, vocab_size=100)
    assert (info.value.status, info.value.param) == (400, "logit_bias")
    assert "500" in info.value.message
    with pytest.raises(APIError) as info:
        to_sampling_params(_chat(logit_bias={"-1": 1}), vocab_size=100)
    assert info.value.param == "logit_bias"
    # A request built around validation still gets a clear error for a non-integer key.
    bad = _chat().model_copy(update={"logit_bias": {"x": 1.0}})
    with pytest.raises(APIError) as info:
        to_sampling_params(bad)
    assert (info.value.status, info.value.param) == (400, "logit_bias")


def test_completion_request() -> None:
    req = _completion()
    assert req.prompt == "Once"
    assert effective_max_tokens(req) == 16  # the OpenAI default for legacy completions
    assert effective_max_tokens(_completion(max_tokens=None)) is None
    assert _completion(prompt=["Once"]).prompt == "Once"
    assert _completion(prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert _completion(prompt=[[4, 5]]).prompt == [4, 5]
    assert _completion(echo=False, suffix=None, best_of=1).prompt == "Once"
    assert _completion(n=2, best_of=2).n == 2
    assert stop_list(_completion(stop="END")) == ["END"]
    assert to_sampling_params(_completion()).logprobs is False
    params = to_sampling_params(_completion(logprobs=0))
    assert (params.logprobs, params.top_logprobs) == (True, 0)
    params = to_sampling_params(_completion(logprobs=5, temperature=0.5))
    assert (params.logprobs, params.top_logprobs, params.temperature) == (True, 5, 0.5)


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"prompt": ["a", "b"]}, "prompt", "single prompt"),
        ({"prompt": [[1], [2]]}, "prompt", "single prompt"),
        ({"prompt": []}, "prompt", "prompt must be"),
        ({"prompt": [1, -2]}, "prompt", "non-negative"),
        ({"prompt": [1, True]}, "prompt", "non-negative"),
        ({"prompt": None}, "prompt", "prompt must be"),
        ({"echo": True}, "echo", "echo=true is not supported"),
        ({"logprobs": 6}, "logprobs", "less than or equal to 5"),
        ({"logprobs": True}, "logprobs", "integer"),
        ({"suffix": "tail"}, "suffix", "not supported"),
        ({"best_of": 3}, "best_of", "not supported"),
        ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ],
)
def test_invalid_completion_request(fields: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(APIError) as info:
        _completion(**fields)
    assert (info.value.status, info.value.param) == (400, param)
    assert words in info.value.message


def test_missing_prompt() -> None:
    with pytest.raises(APIError) as info:
        parse_request(CompletionRequest, {"model": "tiny"})
    assert (info.value.status, info.value.param) == (400, "prompt")


# --- errors ------------------------------------------------------------------------------------


def test_api_error_bodies() -> None:
    error = APIError(503, "stage 1 is unavailable", type="service_unavailable")
    assert error.response() == {
        "error": {
            "message": "stage 1 is unavailable",
            "type": "service_unavailable",
            "param": None,
            "code": None,
        }
    }
    missing = model_not_found("gpt-9")
    assert missing.status == 404
    assert missing.response()["error"]["code"] == "model_not_found"
    assert "gpt-9" in missing.message
    assert str(missing) == missing.message


# --- SSE framing -------------------------------------------------------------------------------


def test_sse_framing_is_exact() -> None:
    assert sse_done() == b"data: [DONE]\n\n"
    assert sse_event({"a": 1, "b": [1, 2], "c": None}) == b'data: {"a":1,"b":[1,2],"c":null}\n\n'
    assert sse_event({"t": "line\nbreak\r\n é"}) == (
        b'data: {"t":"line\\nbreak\\r\\n \xc3\xa9"}\n\n'
    )
    assert sse_error(APIError(500, "stage failed", type="server_error")) == (
        b'data: {"error":{"message":"stage failed","type":"server_error",'
        b'"param":null,"code":null}}\n\n'
    )
    with pytest.raises(ValueError):
        sse_event({"x": float("nan")})


def test_chat_chunks_on_the_wire() -> None:
    assert sse_event(first_chat_chunk(ID, CREATED, MODEL)) == (
        b'data: {"id":"chatcmpl-abc","object":"chat.completion.chunk","created":1700000000,'
        b'"model":"tiny","system_fingerprint":"'
        + SYSTEM_FINGERPRINT.encode()
        + b'","choices":[{"index":0,'
        b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
        b'"usage":null}\n\n'
    )
    content = _json(chat_content_chunk(ID, CREATED, MODEL, "Hi\n", index=1))
    assert content["choices"] == [
        {"index": 1, "delta": {"content": "Hi\n"}, "logprobs": None, "finish_reason": None}
    ]
    assert content["usage"] is None
    final = _json(chat_final_chunk(ID, CREATED, MODEL, "length"))
    assert final["choices"] == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    ]
    assert final["usage"] is None
    usage = _json(chat_usage_chunk(ID, CREATED, MODEL, Usage.of(5, 3)))
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    for event in (content, final, usage):
        assert (event["id"], event["created"], event["object"]) == (
            ID,
            CREATED,
            "chat.completion.chunk",
        )
        assert b"\n" not in json.dumps(event).encode()


def test_completion_chunks_on_the_wire() -> None:
    text = _json(completion_text_chunk("cmpl-1", CREATED, MODEL, "abc"))
    assert text["object"] == "text_completion"
    assert text["choices"] == [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": None}]
    assert "usage" not in text  # (chat's chunks carry "usage": null; OpenAPI types it so)
    final = _json(completion_final_chunk("cmpl-1", CREATED, MODEL, "stop"))
    assert final["choices"][0]["finish_reason"] == "stop"
    assert final["choices"][0]["text"] == ""
    usage = _json(completion_usage_chunk("cmpl-1", CREATED, MODEL, Usage.of(2, 1)))
    assert (usage["choices"], usage["usage"]["total_tokens"]) == ([], 3)


# --- round trips through the openai client types ---------------------------------------------


def _chat_logprobs() -> ChatChoiceLogprobs:
    return ChatChoiceLogprobs(
        content=[
            chat_token_logprob(b"Hi", -0.25, [(b"Hi", -0.25), (b"\xe4\xbd", -1.5)]),
            chat_token_logprob(b"!", float("-inf"), []),
        ]
    )


def _chat_completion() -> ChatCompletion:
    return ChatCompletion(
        id=new_id("chatcmpl"),
        created=CREATED,
        model=MODEL,
        choices=[
            ChatCompletionChoice(
                index=0,
                message=ChatResponseMessage(content="Hi!"),
                logprobs=_chat_logprobs(),
                finish_reason="stop",
            ),
            ChatCompletionChoice(
                index=1, message=ChatResponseMessage(content="Hello"), finish_reason="length"
            ),
        ],
        usage=Usage.of(9, 2),
    )


def test_chat_completion_round_trip() -> None:
    wire = _json(_chat_completion())
    assert wire["object"] == "chat.completion"
    assert wire["id"].startswith("chatcmpl-")
    assert wire["choices"][0]["message"] == {"role": "assistant", "content": "Hi!", "refusal": None}
    assert wire["choices"][1]["logprobs"] is None
    logprobs = wire["choices"][0]["logprobs"]
    assert logprobs["refusal"] is None
    assert logprobs["content"][0] == {
        "token": "Hi",
        "logprob": -0.25,
        "bytes": [72, 105],
        "top_logprobs": [
            {"token": "Hi", "logprob": -0.25, "bytes": [72, 105]},
            {"token": "\ufffd", "logprob": -1.5, "bytes": [0xE4, 0xBD]},
        ],
    }
    assert logprobs["content"][1]["logprob"] == -9999.0  # -inf is not valid JSON
    parsed = OpenAIChatCompletion.model_validate(wire)
    assert parsed.choices[0].message.content == "Hi!"
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[1].finish_reason == "length"
    assert parsed.usage is not None and parsed.usage.total_tokens == 11
    assert parsed.choices[0].logprobs is not None
    assert parsed.choices[0].logprobs.content is not None
    assert parsed.choices[0].logprobs.content[0].top_logprobs[1].bytes == [0xE4, 0xBD]
    assert parsed.model_dump(exclude_unset=True) == wire


def test_chat_chunk_round_trip() -> None:
    chunks = [
        first_chat_chunk(ID, CREATED, MODEL),
        chat_content_chunk(ID, CREATED, MODEL, "Hi", logprobs=_chat_logprobs().content),
        chat_final_chunk(ID, CREATED, MODEL, "stop"),
        chat_usage_chunk(ID, CREATED, MODEL, Usage.of(4, 1)),
    ]
    parsed = [OpenAIChatCompletionChunk.model_validate(_json(chunk)) for chunk in chunks]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert parsed[0].choices[0].delta.content == ""
    assert parsed[1].choices[0].delta.content == "Hi"
    assert parsed[1].choices[0].logprobs is not None
    assert parsed[2].choices[0].finish_reason == "stop"
    assert parsed[2].choices[0].delta.content is None
    assert parsed[3].choices == []
    assert parsed[3].usage is not None and parsed[3].usage.completion_tokens == 1
    assert all(chunk.usage is None for chunk in parsed[:3])
    for chunk, original in zip(parsed, chunks, strict=True):
        assert chunk.model_dump(exclude_unset=True) == _json(original)


def test_completion_round_trip() -> None:
    logprobs = CompletionLogprobs(
        tokens=["Once", " upon"],
        token_logprobs=[-0.5, float("nan")],
        top_logprobs=[{"Once": -0.5, "Twice": -2.0}, {" upon": -0.1}],
        text_offset=[0, 4],
    )
    completion = Completion(
        id=new_id("cmpl"),
        created=CREATED,
        model=MODEL,
        choices=[
            CompletionChoice(index=0, text="Once upon", logprobs=logprobs, finish_reason="length")
        ],
        usage=Usage.of(3, 2),
    )
    wire = _json(completion)
    assert wire["choices"][0]["logprobs"] == {
        "tokens": ["Once", " upon"],
        "token_logprobs": [-0.5, -9999.0],
        "top_logprobs": [{"Once": -0.5, "Twice": -2.0}, {" upon": -0.1}],
        "text_offset": [0, 4],
    }
    parsed = OpenAICompletion.model_validate(wire)
    assert parsed.object == "text_completion"
    assert parsed.choices[0].text == "Once upon"
    assert parsed.choices[0].logprobs is not None
    assert parsed.choices[0].logprobs.text_offset == [0, 4]
    assert parsed.model_dump(exclude_unset=True) == wire


def test_completion_chunk_round_trip() -> None:
    # The client parses stream chunks as Completion without validation (construct_type), so
    # the intermediate "finish_reason": null is fine there; the final chunk validates strictly.
    middle = construct_type(
        type_=OpenAICompletion, value=_json(completion_text_chunk("cmpl-1", CREATED, MODEL, "a"))
    )
    assert isinstance(middle, OpenAICompletion)
    assert middle.choices[0].text == "a"
    assert middle.choices[0].finish_reason is None
    final = OpenAICompletion.model_validate(
        _json(completion_final_chunk("cmpl-1", CREATED, MODEL, "stop", text="b"))
    )
    assert (final.choices[0].text, final.choices[0].finish_reason) == ("b", "stop")
    usage = OpenAICompletion.model_validate(
        _json(completion_usage_chunk("cmpl-1", CREATED, MODEL, Usage.of(2, 2)))
    )
    assert usage.choices == [] and usage.usage is not None and usage.usage.total_tokens == 4


def test_models_round_trip() -> None:
    listing = ModelList(data=[ModelCard(id="tiny", created=CREATED)])
    wire = _json(listing)
    assert wire == {
        "object": "list",
        "data": [{"id": "tiny", "object": "model", "created": CREATED, "owned_by": "pipeshard"}],
    }
    model = OpenAIModel.model_validate(wire["data"][0])
    assert (model.id, model.owned_by) == ("tiny", "pipeshard")


def test_top_logprob_defaults() -> None:
    assert _json(TopLogprob(token="a", logprob=-1.0)) == {
        "token": "a",
        "logprob": -1.0,
        "bytes": None,
    }


# --- the real openai client against these bytes (no server, no network) ----------------------


def _client(handler: Any) -> openai.OpenAI:
    transport = httpx.MockTransport(handler)
    return openai.OpenAI(
        api_key="k",
        base_url="http://test/v1",
        http_client=httpx.Client(transport=transport),
        max_retries=0,
    )


def _stream_response(events: list[bytes]) -> httpx.Response:
    return httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=b"".join(events)
    )


def test_openai_client_reads_a_chat_stream() -> None:
    events = [
        sse_event(first_chat_chunk(ID, CREATED, MODEL)),
        sse_event(chat_content_chunk(ID, CREATED, MODEL, "Hel")),
        sse_event(chat_content_chunk(ID, CREATED, MODEL, "lo ✓")),
        sse_event(chat_final_chunk(ID, CREATED, MODEL, "stop")),
        sse_event(chat_usage_chunk(ID, CREATED, MODEL, Usage.of(3, 2))),
        sse_done(),
    ]
    client = _client(lambda request: _stream_response(events))
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert len(chunks) == 5
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello ✓"
    assert chunks[3].choices[0].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 5


def test_openai_client_reads_a_completion_and_errors() -> None:
    completion = _chat_completion()
    client = _client(lambda request: httpx.Response(200, json=_json(completion)))
    result = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]
    )
    assert result.choices[0].message.content == "Hi!"

    error = APIError(400, "Invalid value for 'temperature'.", param="temperature")
    client = _client(lambda request: httpx.Response(400, json=error.response()))
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert info.value.param == "temperature"

    events = [
        sse_event(completion_text_chunk("cmpl-1", CREATED, MODEL, "Once")),
        sse_error(APIError(503, "stage 1 went away", type="service_unavailable")),
        sse_done(),
    ]
    client = _client(lambda request: _stream_response(events))
    stream = client.completions.create(model=MODEL, prompt="x", stream=True)
    with pytest.raises(openai.APIError, match="stage 1 went away"):
        for _ in stream:
            pass


# --- the published schemas the replies are held to (tests/test_published_schemas.py) ----------


def test_openapi_3_0_nullable_becomes_a_null_alternative() -> None:
    """OpenAI's document is OpenAPI 3.0: ``logprobs`` is ``nullable``, ``finish_reason`` not."""
    choice = {"index": 0, "text": "a", "logprobs": None, "finish_reason": "stop"}
    reply = {"id": "c", "object": "text_completion", "created": 1, "model": "m"}
    reply["choices"] = [choice]
    assert errors("openai", "CreateCompletionResponse", reply) == []
    bad = {**reply, "choices": [{**choice, "finish_reason": None}]}
    assert errors("openai", "CreateCompletionResponse", bad) == [
        "choices/0/finish_reason: None is not one of ['stop', 'length', 'content_filter']",
        "choices/0/finish_reason: None is not of type 'string'",
    ]
    assert errors("openai", "CreateCompletionStreamResponse", bad) == []
