"""Streams whose first token is slow (a long prompt's prefill) start anyway and keep the client's
read timeout alive: chat completions with SSE comments, the Messages API with ``ping`` events,
the Responses API with SSE comments; the output is the same as without the wait, and a failure
during the wait ends the stream with the dialect's error event (the in-process ring, made slow
or failing on its prefill steps)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

import httpx
import pytest

from protos.step import StepRequest
from server.ring import StageUnavailable, StepOutput
from server.ring.local import LocalRing
from tests.conftest import EXACT
from tests.fleets import KEY, export_chat_model, local_gateway

pytestmark = pytest.mark.component

KEEPALIVE_S = 0.2
PREFILL_S = 1.2  # the prefill's wait: several keep-alive periods


class SlowPrefillRing(LocalRing):
    """The in-process ring, waiting before each prefill step (and failing it if told to)."""

    def __init__(self, export: Path) -> None:
        super().__init__(export, EXACT)
        self.slow = False
        self.fail = False

    async def steps(
        self, step: StepRequest, timeout: float | None = None
    ) -> AsyncGenerator[StepOutput, None]:
        if self.slow and step.start_position == 0:
            await asyncio.sleep(PREFILL_S)
            if self.fail:
                raise StageUnavailable("stage 0 went away while reading the prompt")
        async for out in super().steps(step, timeout):
            yield out


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[httpx.Client, SlowPrefillRing, str]]:
    _, export = export_chat_model(tmp_path_factory.mktemp("keepalive"))
    ring = SlowPrefillRing(export)
    with local_gateway(
        export,
        "chat-model",
        ring=ring,
        stream_keepalive_s=KEEPALIVE_S,
        prefix_cache=False,
        resume_grace=0,  # a stage that goes away ends the request (no waiting for it)
    ) as fleet:
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=fleet.url, headers=headers, timeout=60) as client:
            yield client, ring, fleet.model


def _stream(client: httpx.Client, path: str, body: dict[str, object]) -> list[str]:
    with client.stream("POST", path, json={**body, "stream": True}) as reply:
        assert reply.status_code == 200, reply.read()
        return [line for line in reply.iter_lines() if line]


def _both(
    served: tuple[httpx.Client, SlowPrefillRing, str], path: str, body: dict[str, object]
) -> tuple[list[str], list[str]]:
    """The stream's lines with a fast prefill, then with a slow one."""
    client, ring, _ = served
    ring.slow = False
    fast = _stream(client, path, body)
    ring.slow = True
    try:
        slow = _stream(client, path, body)
    finally:
        ring.slow = False
    return fast, slow


def _data(lines: list[str]) -> list[dict[str, object]]:
    return [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]


def _chat_text(lines: list[str]) -> str:
    return "".join(
        c["choices"][0]["delta"].get("content") or ""  # type: ignore[index]
        for c in _data(lines)
        if c.get("choices")
    )


def test_a_chat_stream_sends_keepalive_comments_while_the_prompt_is_read(
    served: tuple[httpx.Client, SlowPrefillRing, str],
) -> None:
    _, _, model = served
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    body["temperature"] = 0
    fast, slow = _both(served, "/v1/chat/completions", body)
    assert slow.count(": keep-alive") >= 2
    first_content = next(i for i, x in enumerate(slow) if '"content":"' in x and x != slow[0])
    assert slow.index(": keep-alive") < first_content
    assert _chat_text(slow) == _chat_text(fast) and _chat_text(fast)
    assert slow[-1] == "data: [DONE]"


def test_a_messages_stream_sends_pings_while_the_prompt_is_read(
    served: tuple[httpx.Client, SlowPrefillRing, str],
) -> None:
    _, _, model = served
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    body["temperature"] = 0
    fast, slow = _both(served, "/v1/messages", body)
    events = [x[7:] for x in slow if x.startswith("event: ")]
    assert events[:2] == ["message_start", "ping"]
    first_block = events.index("content_block_start")
    assert events[:first_block].count("ping") >= 3  # the opening one, then keep-alives
    assert events[-1] == "message_stop"

    def text(lines: list[str]) -> str:
        return "".join(
            d["delta"].get("text", "")  # type: ignore[union-attr]
            for d in _data(lines)
            if d["type"] == "content_block_delta"
        )

    assert text(slow) == text(fast) and text(fast)


def test_a_responses_stream_is_created_and_kept_alive_while_the_prompt_is_read(
    served: tuple[httpx.Client, SlowPrefillRing, str],
) -> None:
    _, _, model = served
    body = {"model": model, "input": "hi", "max_output_tokens": 5, "temperature": 0}
    fast, slow = _both(served, "/v1/responses", body)
    kinds = [d["type"] for d in _data(slow)]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert slow.index(": keep-alive") < slow.index("event: response.output_item.added")
    assert kinds[-1] == _data(fast)[-1]["type"] == "response.incomplete"  # max_output_tokens

    def text(lines: list[str]) -> str:
        return "".join(
            str(d["delta"]) for d in _data(lines) if d["type"] == "response.output_text.delta"
        )

    assert text(slow) == text(fast) and text(fast)


def test_a_failure_while_the_prompt_is_read_ends_each_stream_with_its_error_event(
    served: tuple[httpx.Client, SlowPrefillRing, str],
) -> None:
    client, ring, model = served
    ring.slow = ring.fail = True
    try:
        chat = _stream(
            client,
            "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        messages = _stream(
            client,
            "/v1/messages",
            {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        responses = _stream(client, "/v1/responses", {"model": model, "input": "hi"})
    finally:
        ring.slow = ring.fail = False
    assert ": keep-alive" in chat
    assert "error" in _data(chat)[-1] and chat[-1] == "data: [DONE]"
    assert "went away" in json.dumps(_data(chat)[-1])
    assert [x for x in messages if x.startswith("event: ")][-1] == "event: error"
    assert _data(messages)[-1]["type"] == "error"
    assert _data(responses)[-1]["type"] == "response.failed"
    # and the fleet serves on
    reply = client.post(
        "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    )
    assert reply.status_code == 200, reply.text
