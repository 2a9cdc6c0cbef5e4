"""The event streams of the Messages and Responses APIs built from fabricated output pieces
(reasoning, text, tool calls), read back by the official SDKs' own types and accumulators:
the reasoning a model writes becomes ``thinking`` blocks and ``reasoning`` items, in the
documented order, around the text and the calls. (The real gateway's streams are in
tests/test_messages_api.py and tests/test_responses_api.py; a tiny random model does not
reason, so the reasoning here is fabricated.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from server.api import anthropic, responses_api
from server.api.output import Outcome, Piece
from server.api.requests import parse_request
from server.api.tools import ParsedToolCall

pytestmark = pytest.mark.unit

PIECES = [
    [Piece("reasoning", "Let me think. ")],
    [Piece("reasoning", "Paris, surely.")],
    [Piece("text", "Checking")],
    [Piece("text", " the weather.")],
    [Piece("call", call=ParsedToolCall("get_weather", '{"city": "Paris"}'))],
]


async def _batches() -> AsyncIterator[list[Piece]]:
    for batch in PIECES:
        yield batch


def _outcome() -> Outcome:
    return Outcome(
        prompt_tokens=20, finish="tool_calls", output_tokens=12, reasoning_tokens=5, calls=1
    )


def _events(stream: AsyncIterator[bytes]) -> list[tuple[str, dict[str, Any]]]:
    async def read() -> list[bytes]:
        return [chunk async for chunk in stream]

    out = []
    for chunk in asyncio.run(read()):
        head, data = chunk.decode().strip().split("\n")
        out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_anthropic_stream_has_a_thinking_block_then_text_then_tool_use() -> None:
    prep: Any = SimpleNamespace(request_id="r", stop=[])
    stream = anthropic._stream(None, prep, "m", _outcome(), _batches())  # type: ignore[arg-type]
    events = _events(stream)
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    assert names == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    deltas = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert deltas == ["thinking_delta"] * 2 + ["text_delta"] * 2 + ["input_json_delta"]
    snapshot = None
    for name, data in events:
        if name != "ping":
            snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs={})  # type: ignore[arg-type]
    assert snapshot is not None
    blocks = [block.to_dict() for block in snapshot.content]
    assert (
        blocks[0]["type"] == "thinking" and blocks[0]["thinking"] == "Let me think. Paris, surely."
    )
    assert blocks[1] == {"type": "text", "text": "Checking the weather."} or (
        blocks[1]["type"] == "text" and blocks[1]["text"] == "Checking the weather."
    )
    assert blocks[2]["type"] == "tool_use" and blocks[2]["input"] == {"city": "Paris"}
    assert snapshot.stop_reason == "tool_use"
    assert snapshot.usage.output_tokens == 12 and snapshot.usage.input_tokens == 20


def test_responses_stream_has_a_reasoning_item_then_a_message_then_a_call() -> None:
    req = parse_request(responses_api.ResponsesRequest, {"model": "m", "input": "weather?"})
    store = responses_api.ResponseStore(4)
    shaper = responses_api.Shaper(req, "resp_1")
    outcome = _outcome()
    events = _events(responses_api._Stream(shaper, store, outcome, []).run(_batches()))
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_python(data) for _, data in events]  # the SDK's own types
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    names = [name for name, _ in events]
    assert names == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    final = Response.model_validate(events[-1][1]["response"])
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "Let me think. Paris, surely."  # type: ignore[union-attr,index]
    assert final.output_text == "Checking the weather."
    assert final.output[2].arguments == '{"city": "Paris"}'  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens == 5
    # stored, and the call is what a chained request replays
    stored = store.get("resp_1")
    assert stored is not None and stored[1][0]["tool_calls"][0]["function"]["name"] == "get_weather"
