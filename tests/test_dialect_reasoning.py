"""Reasoning through the Messages and Responses APIs: a tiny model whose template opens a
``<think>`` block (testing_support/tiny_models.py THINK_TEMPLATE) behind the real gateway over HTTP.
The reasoning is chat's ``reasoning_content`` token for token, as ``thinking`` blocks and
``reasoning`` items (streamed as ``thinking_delta`` / ``response.reasoning_text.delta``);
``thinking: disabled`` switches the template's ``enable_thinking`` off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from testing_support.tiny_models import THINK_TEMPLATE
from tests.fleets import KEY, Fleet, export_chat_model, local_gateway

pytestmark = pytest.mark.component

USER: list[Any] = [{"role": "user", "content": "the quick brown fox"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    base: Path = tmp_path_factory.mktemp("think")
    _, export = export_chat_model(base, name="think-model", chat_template=THINK_TEMPLATE, json=True)
    with local_gateway(export, "think-model") as made:
        yield made


def _chat(fleet: Fleet, **extra: Any) -> dict[str, Any]:
    body = {"model": fleet.model, "messages": USER, "max_tokens": 16, **GREEDY, **extra}
    reply = httpx.post(
        f"{fleet.url}/v1/chat/completions", json=body, headers={"x-api-key": KEY}, timeout=120
    )
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def test_thinking_blocks_are_chats_reasoning(fleet: Fleet) -> None:
    chat = _chat(fleet)
    reasoning = chat["choices"][0]["message"].get("reasoning_content") or ""
    assert reasoning  # the template opened the block: the output starts as reasoning
    client = anthropic.Anthropic(base_url=fleet.url, api_key=KEY, max_retries=0)
    # ("adaptive": the tiny context has no room for an "enabled" budget of 1024 or more)
    kwargs: dict[str, Any] = dict(
        model=fleet.model, max_tokens=16, messages=USER, extra_body=GREEDY,
        thinking={"type": "adaptive"},
    )  # fmt: skip
    message = client.messages.create(**kwargs)
    assert message.content[0].type == "thinking"
    assert message.content[0].thinking == reasoning
    text = "".join(b.text for b in message.content if b.type == "text")
    assert text == (chat["choices"][0]["message"]["content"] or "")
    with client.messages.stream(**kwargs) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" in deltas
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]
    # thinking disabled: the template writes an empty block, closed; the answer is all text
    off = client.messages.create(
        model=fleet.model, max_tokens=16, messages=USER, extra_body=GREEDY,
        thinking={"type": "disabled"},
    )  # fmt: skip
    assert all(block.type == "text" for block in off.content)
    plain = _chat(fleet, chat_template_kwargs={"enable_thinking": False})
    assert "".join(b.text for b in off.content if b.type == "text") == (
        plain["choices"][0]["message"]["content"] or ""
    )


def test_reasoning_items_are_chats_reasoning(fleet: Fleet) -> None:
    chat = _chat(fleet)
    reasoning = chat["choices"][0]["message"].get("reasoning_content") or ""
    client = fleet.client()
    response = client.responses.create(
        model=fleet.model, input=USER[0]["content"], max_output_tokens=16, temperature=0
    )
    assert response.output[0].type == "reasoning"
    assert response.output[0].content is not None
    assert response.output[0].content[0].text == reasoning
    assert response.usage is not None
    details = chat["usage"]["completion_tokens_details"]
    assert response.usage.output_tokens_details.reasoning_tokens == details["reasoning_tokens"]
    events = list(
        client.responses.create(
            model=fleet.model, input=USER[0]["content"], max_output_tokens=16, temperature=0,
            stream=True,
        )
    )  # fmt: skip
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")  # type: ignore[union-attr]
    assert text == reasoning
