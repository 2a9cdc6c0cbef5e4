"""A tool-calling agent loop against a running server, with the `openai` client.

Two tools (a weather lookup and a unit converter, answered here), a user task that needs both,
and up to ``--turns`` model turns: each turn sends the conversation with ``tools``; a reply with
``tool_calls`` gets each call answered as a ``role: "tool"`` message and the loop goes on; a
reply with text ends it. The first turn uses ``--tool-choice`` (``auto``, or ``required``,
which constrained decoding turns into a schema-valid call every time), the turns after it
``auto``, and the last one ``none`` (the tool budget spent, the agent asks for the answer).
Prints every turn (calls, arguments, text, seconds) and one JSON summary line; exits 1 unless
the loop completed (a final text answer after at least one valid call of each tool within the
turns).

  pipeshard bench agent [--url http://127.0.0.1:8000] [--turns 3] [--stream]
      [--tool-choice required|auto] [--api-key KEY]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current temperature in a city, in degrees Celsius.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "the city's name"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "celsius_to_fahrenheit",
            "description": "Convert a temperature from degrees Celsius to Fahrenheit.",
            "parameters": {
                "type": "object",
                "properties": {"celsius": {"type": "number"}},
                "required": ["celsius"],
                "additionalProperties": False,
            },
        },
    },
]
TASK = (
    "What is the temperature in Paris right now, in Fahrenheit? Use get_weather first, then "
    "celsius_to_fahrenheit on its result, then answer in one sentence."
)


def answer(name: str, arguments: dict[str, Any]) -> str:
    """What the tools return (fixed, so runs compare)."""
    if name == "get_weather":
        return json.dumps({"city": arguments.get("city", ""), "celsius": 18.5})
    if name == "celsius_to_fahrenheit":
        return json.dumps({"fahrenheit": round(float(arguments["celsius"]) * 9 / 5 + 32, 1)})
    return json.dumps({"error": f"no tool {name}"})


def turn(
    client: Any,
    model: str,
    messages: list[Any],
    choice: Any,
    stream: bool,
    tools: list[dict[str, Any]] = TOOLS,
    **extra: Any,
) -> dict[str, Any]:
    """One model turn: the assistant message (content, calls) and the finish reason, as a
    dict; ``extra``: more request fields."""
    common: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "tools": tools,
        "tool_choice": choice,
        "max_tokens": 256,
        "temperature": 0,
    }
    common.update(extra)
    if not stream:
        choice = client.chat.completions.create(**common).choices[0]
        message = choice.message
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls or []
        ]
        return {"content": message.content, "calls": calls, "finish": choice.finish_reason}
    content = ""
    parts: dict[int, dict[str, str]] = {}  # tool calls by index, as their deltas come
    finish = None
    for chunk in client.chat.completions.create(stream=True, **common):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = parts.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = piece.id or call["id"]
            if piece.function is not None:
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
    calls = [parts[i] for i in sorted(parts)]
    return {"content": content or None, "calls": calls, "finish": finish}


def run(url: str, turns: int, first_choice: str, stream: bool, api_key: str) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    messages: list[Any] = [{"role": "user", "content": TASK}]
    called: set[str] = set()
    log: list[dict[str, Any]] = []
    final = None
    for number in range(1, turns + 1):
        began = time.perf_counter()
        # the last turn answers: an agent's tool budget spent, it asks for the text
        choice = first_choice if number == 1 else "none" if number == turns else "auto"
        # one call a turn: the task is a chain (each call needs the last one's result)
        reply = turn(client, model, messages, choice, stream, parallel_tool_calls=False)
        seconds = time.perf_counter() - began
        log.append({"turn": number, "seconds": round(seconds, 2), **reply})
        print(json.dumps(log[-1]))
        if not reply["calls"]:
            final = reply["content"]
            break
        messages.append(
            {
                "role": "assistant",
                "content": reply["content"],
                "tool_calls": [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["name"], "arguments": c["arguments"]},
                    }
                    for c in reply["calls"]
                ],
            }
        )
        for call in reply["calls"]:
            arguments = json.loads(call["arguments"])  # a valid call's arguments parse
            called.add(call["name"])
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "content": answer(call["name"], arguments),
                }
            )
    completed = final is not None and called == {"get_weather", "celsius_to_fahrenheit"}
    return {
        "model": model,
        "completed": completed,
        "turns": len(log),
        "tools_called": sorted(called),
        "answer": final,
        "seconds": round(sum(t["seconds"] for t in log), 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pipeshard bench agent", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tool-choice", choices=["required", "auto"], default="auto")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--api-key", default="none")
    opts = parser.parse_args(argv)
    summary = run(opts.url, opts.turns, opts.tool_choice, opts.stream, opts.api_key)
    print(json.dumps(summary))
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
