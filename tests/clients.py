"""What the tests send: request bodies, streamed text, a JSON schema, greedy steps over a ring."""

from __future__ import annotations

from typing import Any

from server.ring.grpc_client import PipelineClient
from tests.fleets import Fleet

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["city", "days", "ok"],
    "additionalProperties": False,
}


def request(i: int) -> dict[str, Any]:
    """Eight different requests: greedy and seeded sampling, short and chunked prompts."""
    words = " ".join(["fox", "dog", "cat", "owl"][j % 4] for j in range(3 + 5 * i))
    body: dict[str, Any] = {
        "model": "chat-model",
        "messages": [{"role": "user", "content": f"{i} {words}"}],
        "max_tokens": 24,
        "temperature": 0.0,
    }
    if i % 2:
        body.update(temperature=0.9, top_p=0.9, seed=1000 + i)
    return body


def stream_text(fleet: Fleet, body: dict[str, Any], url: str = "") -> str:
    pieces = []
    for chunk in fleet.client(url).chat.completions.create(stream=True, **body):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    return "".join(pieces)


async def ring_greedy(
    client: PipelineClient, session: str, prompt: list[int], steps: int
) -> list[int]:
    out = await client.step(session, prompt, 0)
    tokens = [out.tokens[0].token_id]
    position = len(prompt)
    while len(tokens) < steps:
        out = await client.step(session, tokens[-1:], position)
        position += 1
        tokens.append(out.tokens[0].token_id)
    return tokens
