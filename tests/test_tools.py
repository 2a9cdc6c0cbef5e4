"""Tools and structured output on the API side: the model's tool-call format from its chat
template, tools and tool history through the template, generated calls into OpenAI
``tool_calls`` (whole and streamed, read by the ``openai`` client), and the validation of
``tools`` / ``tool_choice`` / ``response_format`` over HTTP against the real gateway.

The tiny random models never write a valid call by themselves: the end-to-end calls from a
real fleet (``tool_choice`` ``"required"`` or a named function) rely on constrained decoding
(``server/engine/constraints.py``) and are marked so below; everything else uses fabricated outputs.
"""

# ruff: noqa: E501  (the chat templates are quoted as they are)
from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from benchmarks.agent_loop import turn
from protos.sampling import SampledToken
from server.api.errors import APIError
from server.api.requests import ChatCompletionRequest, parse_request, template_messages
from server.api.responses import ChatCompletion
from server.api.serving import CompletionService
from server.api.tokenization import TextCodec
from server.api.tools import (
    FORMATS,
    ParsedToolCall,
    ToolCallParser,
    ToolFormat,
    detect_tool_format,
    parse_tool_calls,
    template_tools,
)
from server.engine.loop import GenerationRequest, GenerationStats
from server.metrics import GatewayMetrics
from testing_support.tiny_models import CHAT_TEMPLATE, CORPUS, JSON_CORPUS, make_tokenizer
from tests.clients import SCHEMA
from tests.fleets import TINY_HERMES_TEMPLATE, Fleet, export_chat_model, hermes_fleet
from tests.processes import start_gateway, start_stages

# --- chat templates, representative of the real ones ------------------------------------------

# Qwen2.5-Instruct's template (Qwen3's writes tool calls the same way): "hermes".
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama 3.1-Instruct's template, its JSON tool calling (trimmed of the built-in tools).
LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\n' }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {{- message.content }}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Mistral-7B-Instruct-v0.3's template (v3 tokenizer): tools, [TOOL_CALLS] and 9-character ids.
MISTRAL_TEMPLATE = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == loop_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {{- tool | tojson }}
                {%- if not loop.last %}{{- ", " }}{%- endif %}
            {%- endfor %}
            {{- "][/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {{- "[INST] " + message["content"] + "[/INST]" }}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool" %}
        {{- '[TOOL_RESULTS] {"content": ' + message.content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported!") }}
    {%- endif %}
{%- endfor %}
"""


# GLM-4.5's template, shortened to its tool parts (the system turn that offers the tools, the
# assistant's calls as <arg_key>/<arg_value> pairs, the observation turn): "glm".
GLM45_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
...
</tool_call>{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}<|user|>
{{ m.content }}
{%- elif m.role == 'assistant' -%}<|assistant|>
{%- if m.content %}
{{ m.content }}
{%- endif %}
{%- for tc in m.tool_calls or [] %}
{%- set tc = tc.function if tc.function else tc %}
{{ '\n<tool_call>' + tc.name }}
{% for k, v in tc.arguments.items() -%}
<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson if v is not string else v }}</arg_value>
{% endfor -%}
</tool_call>
{%- endfor %}
{%- elif m.role == 'tool' -%}<|observation|>
<tool_response>
{{ m.content }}
</tool_response>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"""


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
    },
}
TOOLS = [WEATHER, LOOKUP]
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")
HISTORY = [
    {"role": "user", "content": "the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0123456789abcdef01234567",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "sunny"},
]


# --- the format, from the template ---------------------------------------------------------------


@pytest.mark.unit
def test_formats_are_detected_from_the_templates() -> None:
    assert detect_tool_format(QWEN25_TEMPLATE) is FORMATS["hermes"]
    assert detect_tool_format(TINY_HERMES_TEMPLATE) is FORMATS["hermes"]
    assert detect_tool_format(LLAMA31_TEMPLATE) is FORMATS["llama3_json"]
    assert detect_tool_format(MISTRAL_TEMPLATE) is FORMATS["mistral"]
    # GLM writes <tool_call> too, around key/value tags instead of JSON: not hermes
    assert detect_tool_format(GLM45_TEMPLATE) is FORMATS["glm"]
    assert detect_tool_format(CHAT_TEMPLATE) is None
    assert detect_tool_format(None) is None
    assert detect_tool_format("") is None
    # named templates (older tokenizers: a "tool_use" template besides the default one)
    named = {"default": CHAT_TEMPLATE, "tool_use": QWEN25_TEMPLATE}
    assert detect_tool_format(named) is FORMATS["hermes"]
    assert (
        detect_tool_format([{"name": "tool_use", "template": MISTRAL_TEMPLATE}])
        is (FORMATS["mistral"])
    )


@pytest.mark.unit
def test_the_formats_say_what_the_grammar_needs() -> None:
    hermes, llama, mistral = FORMATS["hermes"], FORMATS["llama3_json"], FORMATS["mistral"]
    assert (hermes.call_start, hermes.call_end, hermes.arguments_key) == (
        "<tool_call>\n",
        "\n</tool_call>",
        "arguments",
    )
    assert llama.arguments_key == "parameters" and llama.whole_answer
    assert (mistral.calls_start, mistral.calls_end) == ("[TOOL_CALLS][", "]")
    assert mistral.keep_special_tokens and "[TOOL_CALLS]" in mistral.tags


def _written(fmt: ToolFormat, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """Calls written exactly as the format (and so the grammar built from it) says."""
    bodies = [fmt.write_call(n, a) for n, a in calls]
    return fmt.calls_start + fmt.call_separator.join(bodies) + fmt.calls_end


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_calls_written_in_the_format_parse_back(name: str) -> None:
    fmt = FORMATS[name]
    calls = [("get_weather", {"city": "Paris", "days": 3}), ("lookup", {"query": "fox ✓"})]
    for some in (calls[:1], calls):
        content, parsed = parse_tool_calls(_written(fmt, some), fmt)
        assert content == ""
        assert [(c.name, json.loads(c.arguments)) for c in parsed] == some
    # parallel_tool_calls: false keeps the first
    _, parsed = parse_tool_calls(_written(fmt, calls), fmt, parallel=False)
    assert [c.name for c in parsed] == ["get_weather"]


# --- parsing outputs ---------------------------------------------------------------------------

H, L, M, G = FORMATS["hermes"], FORMATS["llama3_json"], FORMATS["mistral"], FORMATS["glm"]
CALL = ParsedToolCall("get_weather", '{"city": "Paris"}')


@pytest.mark.parametrize(
    ("fmt", "text", "content", "calls"),
    [
        (H, "just text, no <b>call</b>\n", "just text, no <b>call</b>", []),
        (
            H,
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            "\n</tool_call>",
            "Let me check.",
            [CALL],
        ),
        # several calls, text between and after them
        (
            H,
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_call>\nDone.',
            "Done.",
            [CALL, ParsedToolCall("lookup", "{}")],
        ),
        # a call whose JSON does not parse stays text; so does one without a name
        (
            H,
            '<tool_call>\n{"name": "get_weather", "arguments": {city}}\n</tool_call>',
            '<tool_call>\n{"name": "get_weather", "arguments": {city}}\n</tool_call>',
            [],
        ),
        (
            H,
            '<tool_call>\n{"arguments": {}}\n</tool_call>',
            '<tool_call>\n{"arguments": {}}\n</tool_call>',
            [],
        ),
        # a block the model did not close, and arguments written as a JSON string
        (
            H,
            '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',
            "",
            [CALL],
        ),
        (L, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [CALL]),
        (
            L,
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "lookup", "parameters": {}}',
            "",
            [CALL, ParsedToolCall("lookup", "{}")],
        ),
        (L, 'It is {"name": "x"}', 'It is {"name": "x"}', []),
        (
            L,
            '{"name": "get_weather", "parameters": {"city": ',
            '{"name": "get_weather", "parameters": {"city":',
            [],
        ),
        (L, "{} is an empty object", "{} is an empty object", []),
        (
            M,
            'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
            "Sure.",
            [CALL],
        ),
        (M, "[TOOL_CALLS][{oops}]", "[TOOL_CALLS][{oops}]", []),
        # GLM-4.5 (newlines between the tags), after text
        (
            G,
            "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
            "<arg_value>Paris</arg_value>\n</tool_call>",
            "Let me check.",
            [CALL],
        ),
        # GLM-4.7 (none), two calls, a JSON value, a call without arguments, text after
        (
            G,
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
            "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
            "<tool_call>lookup</tool_call>\nDone.",
            "Done.",
            [
                ParsedToolCall("get_weather", '{"city": "Paris", "days": 3}'),
                ParsedToolCall("lookup", "{}"),
            ],
        ),
        # JSON values of every kind; a value that is not JSON stays the string written
        (
            G,
            '<tool_call>f<arg_key>a</arg_key><arg_value>[1, "x"]</arg_value>'
            '<arg_key>b</arg_key><arg_value>{"k": null}</arg_value>'
            "<arg_key>c</arg_key><arg_value>two words</arg_value></tool_call>",
            "",
            [ParsedToolCall("f", '{"a": [1, "x"], "b": {"k": null}, "c": "two words"}')],
        ),
        # not a GLM call: stays text (a key without its value, hermes' JSON, no name)
        (
            G,
            "<tool_call>get_weather\n<arg_key>city</arg_key>Paris</tool_call>",
            "<tool_call>get_weather\n<arg_key>city</arg_key>Paris</tool_call>",
            [],
        ),
        (
            G,
            '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
            '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
            [],
        ),
        (
            G,
            "<tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
            "<tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
            [],
        ),
        # a block the model did not close
        (
            G,
            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n",
            "",
            [CALL],
        ),
    ],
)
@pytest.mark.unit
def test_outputs_parse_whole_and_streamed_alike(
    fmt: ToolFormat, text: str, content: str, calls: list[ParsedToolCall]
) -> None:
    assert parse_tool_calls(text, fmt) == (content, calls)
    for seed in range(25):  # fed in random pieces, as a stream arrives
        rng = random.Random(seed)
        parser = ToolCallParser(fmt)
        events: list[Any] = []
        at = 0
        while at < len(text):
            size = rng.randint(1, 6)
            events += parser.feed(text[at : at + size])
            at += size
        events += parser.finish()
        assert "".join(e for e in events if isinstance(e, str)) == content
        assert [e for e in events if isinstance(e, ParsedToolCall)] == calls


@pytest.mark.unit
def test_glm_string_arguments_are_read_as_their_schema_says() -> None:
    """GLM writes a string argument as the text itself: where the offered tool declares it a
    string, text that looks like JSON (``123``, ``true``) stays a string; elsewhere it is
    JSON."""
    text = (
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    )
    schemas = {"get_weather": WEATHER["function"]["parameters"]}  # type: ignore[index]
    _, calls = parse_tool_calls(text, G, schemas=schemas)
    assert json.loads(calls[0].arguments) == {"city": "123", "days": 3}
    _, calls = parse_tool_calls(text, G)  # no schema: JSON where it parses
    assert json.loads(calls[0].arguments) == {"city": 123, "days": 3}


@pytest.mark.unit
def test_text_before_a_call_streams_before_the_call_completes() -> None:
    parser = ToolCallParser(H)
    assert parser.feed("Checking the weather") == ["Checking the weather"]
    assert parser.feed(" now <tool") == [" now"]  # "<tool" may start a call: held
    assert parser.feed('_call>\n{"name": "get_weather", ') == []
    assert parser.feed('"arguments": {"city": "Paris"}}\n</tool_call>') == [CALL]
    assert parser.finish() == []


# --- through the chat templates ----------------------------------------------------------------


def _codec(folder: Path, template: str) -> TextCodec:
    from transformers import PreTrainedTokenizerFast

    make_tokenizer(folder, chat_template=template, corpus=CORPUS + JSON_CORPUS)
    return TextCodec(
        tokenizer=Tokenizer.from_file(str(folder / "tokenizer.json")),
        chat=PreTrainedTokenizerFast.from_pretrained(str(folder)),
        eos_ids=frozenset({2}),
        has_chat_template=True,
        vocab_size=256,
    )


def _rendered(codec: TextCodec, messages: list[dict[str, Any]], tools: list[Any] | None) -> str:
    req = parse_request(ChatCompletionRequest, {"model": "m", "messages": messages, "tools": tools})
    fmt = detect_tool_format(codec.chat_template)
    rendered = template_messages(req.messages, fmt.call_id if fmt else None)
    offered = template_tools(req.tools) if req.tools else None
    codec.chat_prompt(rendered, tools=offered)  # the prompt the gateway would send
    text: str = codec.chat.apply_chat_template(
        rendered, tools=offered, add_generation_prompt=True, tokenize=False
    )
    return text


@pytest.mark.unit
def test_the_templates_render_tools_and_the_call_history(tmp_path: Path) -> None:
    qwen = _codec(tmp_path / "qwen", QWEN25_TEMPLATE)
    text = _rendered(qwen, HISTORY, TOOLS)
    assert '"name": "get_weather"' in text.split("\n</tools>")[0]  # the tools offered
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in (
        text
    )
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert "<tools>" not in _rendered(qwen, HISTORY, None)  # the history alone, no tools

    llama = _codec(tmp_path / "llama", LLAMA31_TEMPLATE)
    text = _rendered(llama, HISTORY, TOOLS)
    assert "Environment: ipython" in text
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in text
    # a template that refuses the messages: a ValueError (the gateway's 400), not a 500
    two_calls = json.loads(json.dumps(HISTORY))
    two_calls[1]["tool_calls"].append({**two_calls[1]["tool_calls"][0], "id": "call_2"})
    with pytest.raises(ValueError, match="single tool-calls"):
        _rendered(llama, two_calls, TOOLS)

    # Mistral's template takes only 9-character ids: OpenAI-style ids are mapped, the same way
    # in the call and in its answer.
    mistral = _codec(tmp_path / "mistral", MISTRAL_TEMPLATE)
    text = _rendered(mistral, HISTORY, TOOLS)
    ids = re.findall(r'"id": "(\w+)"', text) + re.findall(r'"call_id": "(\w+)"', text)
    assert len(ids) == 2 and ids[0] == ids[1] and len(ids[0]) == 9
    assert "[AVAILABLE_TOOLS]" in _rendered(mistral, HISTORY[:1], TOOLS)  # by the last user message

    # GLM: the call in the history as the template writes calls, which is how the format
    # writes one (and so what the parser and the grammar expect)
    glm = _codec(tmp_path / "glm", GLM45_TEMPLATE)
    text = _rendered(glm, HISTORY, TOOLS)
    assert '"name": "get_weather"' in text.split("\n</tools>")[0]
    written = G.write_call("get_weather", {"city": "Paris"})
    assert written == (
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "</tool_call>"
    )
    assert written in text
    assert "<|observation|>\n<tool_response>\nsunny\n</tool_response>" in text


# --- the service, on fabricated outputs (no model writes calls unconstrained) ---------------------


@dataclass
class _Engine:
    """Stands in for the engine: every choice "generates" the given token ids, then EOS."""

    outputs: list[list[int]]
    eos_ids: frozenset[int] = frozenset({2})

    async def generate(
        self, request: GenerationRequest, choice: int = 0, stats: GenerationStats | None = None
    ) -> Any:
        for token in [*self.outputs[choice % len(self.outputs)], 2]:
            if stats is not None:
                stats.tokens += 1
            yield SampledToken(token, None, [])


def _service(codec: TextCodec, outputs: list[str]) -> CompletionService:
    ids = [codec.tokenizer.encode(text, add_special_tokens=False).ids for text in outputs]
    for text, tokens in zip(outputs, ids, strict=True):
        assert codec.tokenizer.decode(tokens) == text  # the tiny vocabulary can write it
    engine: Any = _Engine(ids)
    return CompletionService(engine, codec, "m", 4096, GatewayMetrics())


def _answer(service: CompletionService, body: dict[str, Any]) -> bytes:
    """The HTTP body the gateway would send for ``body``."""
    req = parse_request(ChatCompletionRequest, {"model": "m", **body})

    async def run() -> bytes:
        prep = service.prepare(req, "chatcmpl-1")
        if not prep.stream:
            result = await service.complete(prep)
            return result.model_dump_json().encode()
        return b"".join([event async for event in await service.open_stream(prep)])

    return asyncio.run(run())


def _client(body: bytes, stream: bool) -> openai.OpenAI:
    headers = {"content-type": "text/event-stream" if stream else "application/json"}
    transport = httpx.MockTransport(
        lambda request: httpx.Response(200, headers=headers, content=body)
    )
    return openai.OpenAI(
        api_key="k", base_url="http://test/v1", http_client=httpx.Client(transport=transport)
    )


TWO_CALLS = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
    '\n</tool_call>\n<tool_call>\n{"name": "lookup", "arguments": {"query": "fox"}}\n</tool_call>'
)


@pytest.mark.unit
def test_calls_become_tool_calls_for_the_openai_client(tmp_path: Path) -> None:
    service = _service(_codec(tmp_path / "qwen", QWEN25_TEMPLATE), [TWO_CALLS])
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}
    reply = _client(_answer(service, body), False).chat.completions.create(
        model="m", messages=body["messages"], tools=TOOLS
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 2
    assert [c.function.name for c in calls] == ["get_weather", "lookup"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 3}
    assert all(CALL_ID.match(c.id) and c.type == "function" for c in calls)
    assert len({c.id for c in calls}) == 2
    # parallel_tool_calls: false keeps the first call
    wire = json.loads(_answer(service, {**body, "parallel_tool_calls": False}))
    assert [c["function"]["name"] for c in wire["choices"][0]["message"]["tool_calls"]] == [
        "get_weather"
    ]
    # tool_choice "none": the model must not call tools; its text stays text
    wire = json.loads(_answer(service, {**body, "tool_choice": "none"}))
    message = wire["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"] == TWO_CALLS
    assert wire["choices"][0]["finish_reason"] == "stop"


@pytest.mark.unit
def test_streamed_calls_accumulate_in_the_openai_client(tmp_path: Path) -> None:
    service = _service(_codec(tmp_path / "qwen", QWEN25_TEMPLATE), [TWO_CALLS])
    body = {
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": TOOLS,
        "stream": True,
        "n": 2,
    }
    raw = _answer(service, body)
    events = [
        json.loads(line[6:]) for line in raw.decode().split("\n\n") if line.startswith("data: {")
    ]
    deltas = [
        e["choices"][0]["delta"] for e in events if e["choices"] and e["choices"][0]["index"] == 0
    ]
    opening = [
        d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]
    ]
    assert [(o["index"], o["type"], o["function"]) for o in opening] == [
        (0, "function", {"name": "get_weather", "arguments": ""}),
        (1, "function", {"name": "lookup", "arguments": ""}),
    ]
    assert "".join(d.get("content", "") for d in deltas) == "Let me look."
    client = _client(raw, True)
    with client.chat.completions.stream(
        model="m", messages=body["messages"], tools=TOOLS, n=2
    ) as stream:
        final = stream.get_final_completion()
    assert len(final.choices) == 2
    for choice in final.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me look."
        calls = choice.message.tool_calls or []
        assert [c.function.name for c in calls] == ["get_weather", "lookup"]
        assert json.loads(calls[1].function.arguments) == {"query": "fox"}
        assert all(CALL_ID.match(c.id) for c in calls)


GLM_CALLS = (
    "Let me look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
    "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    "<tool_call>lookup<arg_key>query</arg_key><arg_value>42</arg_value></tool_call>"
)


@pytest.mark.unit
@pytest.mark.parametrize("stream", [False, True])
def test_glm_calls_become_tool_calls_for_the_openai_client(tmp_path: Path, stream: bool) -> None:
    """GLM's calls (not JSON) reach the ``openai`` client as ``tool_calls``, whole and
    streamed; lookup's ``query`` is a string in its schema, so ``42`` stays ``"42"``."""
    service = _service(_codec(tmp_path / "glm", GLM45_TEMPLATE), [GLM_CALLS])
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}
    client = _client(_answer(service, {**body, "stream": stream}), stream)
    if stream:
        with client.chat.completions.stream(
            model="m", messages=body["messages"], tools=TOOLS
        ) as events:
            choice: Any = events.get_final_completion().choices[0]
    else:
        choice = (
            client.chat.completions.create(model="m", messages=body["messages"], tools=TOOLS)
        ).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather", "lookup"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 3}
    assert json.loads(calls[1].function.arguments) == {"query": "42"}
    assert all(CALL_ID.match(c.id) for c in calls)


@pytest.mark.unit
def test_text_answers_with_tools_offered_are_plain_content(tmp_path: Path) -> None:
    service = _service(_codec(tmp_path / "qwen", QWEN25_TEMPLATE), ["It is sunny in Paris."])
    body = {"messages": HISTORY, "tools": TOOLS}
    wire = json.loads(_answer(service, body))
    assert wire["choices"][0]["message"] == {
        "role": "assistant",
        "content": "It is sunny in Paris.",
        "refusal": None,
    }
    assert wire["choices"][0]["finish_reason"] == "stop"
    raw = _answer(service, {**body, "stream": True})
    assert b"tool_calls" not in raw and b'"finish_reason":"stop"' in raw


@pytest.mark.unit
def test_a_template_without_tools_refuses_them(tmp_path: Path) -> None:
    service = _service(_codec(tmp_path / "plain", CHAT_TEMPLATE), ["hi"])
    with pytest.raises(APIError) as info:
        _answer(service, {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS})
    assert info.value.status == 400 and info.value.param == "tools"
    assert "does not support tools" in info.value.message
    # with tool_choice "none" the tools are not offered: nothing to refuse
    wire = json.loads(
        _answer(
            service,
            {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": "none"},
        )
    )
    assert wire["choices"][0]["message"]["content"] == "hi"


# --- the real gateway over HTTP ------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with hermes_fleet(tmp_path_factory.mktemp("tools")) as made:
        yield made


def _post(
    fleet: Fleet, body: Any, path: str = "/v1/chat/completions", **kwargs: Any
) -> httpx.Response:
    if "content" not in kwargs:
        kwargs["json"] = body
    return httpx.post(f"{fleet.url}{path}", timeout=120, **kwargs)


def _error(response: httpx.Response, status: int, param: str | None) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    return str(error["message"])


USER = [{"role": "user", "content": "the weather in Paris?"}]


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True])
def test_tools_and_formats_are_validated_over_http(fleet: Fleet, stream: bool) -> None:
    good: dict[str, Any] = {"model": fleet.model, "messages": USER, "max_tokens": 2}
    if stream:
        good["stream"] = True
    named = {"type": "function", "function": {"name": "nowhere"}}
    schema_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        (
            {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
            "tools[0].function.name",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
            "tools[0].function.parameters",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": named}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": named}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {**schema_format, "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
        ),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [*USER, {"role": "tool", "content": "sunny"}]}, "messages[1].tool_call_id"),
        ({"messages": [*USER, {"role": "assistant", "content": None}]}, "messages[1].content"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ]
    if not stream:
        cases.append(({"stream_options": {"include_usage": True}}, "stream_options"))
    for fields, param in cases:
        _error(_post(fleet, {**good, **fields}), 400, param)
    # the chat-only fields on the legacy endpoint
    legacy = {"model": fleet.model, "prompt": "once", "max_tokens": 2, "stream": stream}
    for fields, param in [
        ({"tools": TOOLS}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ]:
        message = _error(_post(fleet, {**legacy, **fields}, "/v1/completions"), 400, param)
        assert "/v1/chat/completions" in message
    # a form is not JSON: 415, in the envelope
    for path in ("/v1/chat/completions", "/v1/completions"):
        form = _post(fleet, None, path, content=b"model=tool-model&prompt=hi", headers={
            "content-type": "application/x-www-form-urlencoded"
        })  # fmt: skip
        assert "application/json" in _error(form, 415, None)
    # JSON with a charset, and JSON with no Content-Type at all, are read
    raw = json.dumps(good).encode()
    for headers in ({"content-type": "application/json; charset=utf-8"}, {}):
        response = _post(fleet, None, content=raw, headers=headers)
        assert response.status_code == 200, response.text


@pytest.mark.integration
def test_tools_reach_the_prompt_and_history_round_trips(fleet: Fleet) -> None:
    client = fleet.client()
    plain = client.chat.completions.create(model=fleet.model, messages=USER, max_tokens=2)
    offered = client.chat.completions.create(
        model=fleet.model,
        messages=USER,
        max_tokens=2,
        tools=TOOLS,  # type: ignore[arg-type]
    )
    assert plain.usage is not None and offered.usage is not None
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools, offered
    # tool_choice "none": the tools are not offered to the template
    none = client.chat.completions.create(
        model=fleet.model,
        messages=USER,
        max_tokens=2,
        tools=TOOLS,
        tool_choice="none",  # type: ignore[arg-type]
    )
    assert none.usage is not None and none.usage.prompt_tokens == plain.usage.prompt_tokens
    # a conversation with a call and its answer, through the template; n > 1 with tools
    reply = client.chat.completions.create(
        model=fleet.model,
        messages=HISTORY,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=4,
        n=2,
        temperature=0,
    )
    assert reply.usage is not None and reply.usage.prompt_tokens > offered.usage.prompt_tokens
    assert [c.finish_reason for c in reply.choices] != [] and len(reply.choices) == 2
    streamed = client.chat.completions.create(
        model=fleet.model,
        messages=HISTORY,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
        stream=True,
    )
    assert [c for c in streamed][-1].choices[0].finish_reason is not None


# Schemas with one way to fill them: a random model under a grammar that leaves it room (a
# free string, more properties) may write until max_tokens.
FINITE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {key: {"enum": [value]}},
                "required": [key],
                "additionalProperties": False,
            },
        },
    }
    for name, key, value in [("get_weather", "city", "Paris"), ("lookup", "query", "fox")]
]


# Constrained decoding (server/engine/constraints.py): the tiny random model writes a valid call only
# because the grammar makes it.
@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_choice_make_a_call(fleet: Fleet, stream: bool) -> None:
    client = fleet.client()
    for choice, names in [
        ("required", {"get_weather", "lookup"}),
        ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
    ]:
        kwargs: dict[str, Any] = dict(
            model=fleet.model, messages=USER, tools=FINITE_TOOLS, tool_choice=choice, max_tokens=60,
            temperature=0, parallel_tool_calls=False,
        )  # fmt: skip
        if stream:
            with client.chat.completions.stream(**kwargs) as events:
                completion = events.get_final_completion()
            reply: Any = completion
        else:
            reply = client.chat.completions.create(**kwargs)
        assert isinstance(reply.choices[0].message.tool_calls, list), reply
        call = reply.choices[0].message.tool_calls[0]
        assert call.function.name in names and CALL_ID.match(call.id)
        arguments = json.loads(call.function.arguments)
        assert isinstance(arguments, dict)
        assert arguments == (
            {"city": "Paris"} if call.function.name == "get_weather" else {"query": "fox"}
        )
        assert reply.choices[0].message.content is None
        assert reply.choices[0].finish_reason == "tool_calls"


@pytest.mark.integration
def test_the_openapi_schema_documents_the_new_fields(fleet: Fleet) -> None:
    schema = httpx.get(f"{fleet.url}/openapi.json").json()
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls", "response_format"} <= set(chat)
    assert "functions" not in chat
    legacy = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert "tools" not in legacy and "response_format" not in legacy
    assert ChatCompletion.model_json_schema()  # (the response model builds its schema)


@pytest.mark.integration
def test_json_schema_output_validates_on_every_sampled_request(fleet: Fleet) -> None:
    """20 seeded requests at temperature 1 with response_format json_schema: every answer
    parses and validates (json_object: every answer is a JSON object); without it, none of
    them is a valid answer."""
    import jsonschema

    client = fleet.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA}}
    answers = []
    for seed in range(20):
        reply = client.chat.completions.create(
            model=fleet.model, messages=USER, response_format=fmt, temperature=1.0, seed=seed,
            max_tokens=64,
        )  # fmt: skip
        answers.append(reply.choices[0].message.content or "")
        jsonschema.validate(json.loads(answers[-1]), SCHEMA)
        assert reply.choices[0].finish_reason == "stop"
    assert len(set(answers)) > 10  # sampled, not one forced answer
    several = client.chat.completions.create(
        model=fleet.model, messages=USER, response_format=fmt, temperature=1.0, seed=99, n=3,
        max_tokens=64,
    )  # fmt: skip
    assert len(several.choices) == 3  # each choice its own matcher
    for choice in several.choices:
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
    stopped = 0
    for seed in range(4):
        reply = client.chat.completions.create(
            model=fleet.model, messages=USER, response_format={"type": "json_object"},
            temperature=1.0, seed=seed, max_tokens=128,
        )  # fmt: skip
        # the guarantee: an answer that does not stop at max_tokens is valid; one that does
        # (free strings may run on) used every token
        assert reply.choices[0].finish_reason in ("stop", "length")
        if reply.choices[0].finish_reason == "length":
            assert reply.usage is not None and reply.usage.completion_tokens == 128
        else:
            assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
            stopped += 1
        free = client.chat.completions.create(
            model=fleet.model, messages=USER, temperature=1.0, seed=seed, max_tokens=64
        )
        with pytest.raises(ValueError):
            jsonschema.validate(json.loads(free.choices[0].message.content or ""), SCHEMA)
    assert stopped >= 2  # (not vacuous: these seeds are fixed)


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip_call_result_answer(fleet: Fleet, stream: bool) -> None:
    """A required call (arguments valid for its schema), the tool's result sent back with
    its tool_call_id, and a final answer as text, streamed and not."""
    client = fleet.client()

    def ask(messages: list[Any], choice: Any) -> dict[str, Any]:
        return turn(
            client, fleet.model, messages, choice, stream, FINITE_TOOLS, max_tokens=60,
            parallel_tool_calls=False,
        )  # fmt: skip

    first = ask(USER, "required")
    assert first["finish"] == "tool_calls" and first["calls"] and first["content"] is None
    calls = first["calls"]
    for call in calls:
        assert CALL_ID.match(call["id"]) and call["name"] in {"get_weather", "lookup"}
        assert json.loads(call["arguments"]) in ({"city": "Paris"}, {"query": "fox"})
    history: list[Any] = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls
            ],
        },
        *(
            {"role": "tool", "tool_call_id": c["id"], "content": json.dumps({"result": "sunny"})}
            for c in calls
        ),
    ]
    final = ask(history, "none")
    assert final["calls"] == [] and final["content"]
    assert final["finish"] in ("stop", "length")


# A tiny template in GLM's tool-call form (what GLM-4.5's writes), for the tiny model.
TINY_GLM_TEMPLATE = (
    "{% if tools %}<s>tools: {{ tools | map(attribute='function') | map(attribute='name') "
    "| join(', ') }}; call one as <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>"
    "</tool_call>\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}"
    "{% for k, v in c.function.arguments.items() %}<arg_key>{{ k }}</arg_key>"
    "<arg_value>{{ v }}</arg_value>{% endfor %}</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def glm_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    base = tmp_path_factory.mktemp("glm-tools")
    source, export = export_chat_model(
        base, name="glm-tool-model", chat_template=TINY_GLM_TEMPLATE, json=True
    )
    procs, addresses = start_stages(export, base)
    gateway, url = start_gateway(addresses, base / "gateway.log", [])
    try:
        yield Fleet(url, "glm-tool-model", source, export, addresses, gateway=gateway)
    finally:
        gateway.stop()
        for proc in procs:
            proc.stop()


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_makes_a_glm_call(glm_fleet: Fleet, stream: bool) -> None:
    """A model whose template writes GLM's calls: ``tool_choice`` required or named constrains
    the output to a call in GLM's form (not JSON), which reaches the client as ``tool_calls``
    with its arguments as the schema holds them."""
    client = glm_fleet.client()
    for choice, names in [
        ("required", {"get_weather", "lookup"}),
        ({"type": "function", "function": {"name": "lookup"}}, {"lookup"}),
    ]:
        kwargs: dict[str, Any] = dict(
            model=glm_fleet.model, messages=USER, tools=FINITE_TOOLS, tool_choice=choice,
            max_tokens=60, temperature=0,
        )  # fmt: skip
        if stream:
            with client.chat.completions.stream(**kwargs) as events:
                reply: Any = events.get_final_completion()
        else:
            reply = client.chat.completions.create(**kwargs)
        calls = reply.choices[0].message.tool_calls
        assert isinstance(calls, list) and calls, reply
        for call in calls:
            assert call.function.name in names and CALL_ID.match(call.id)
            assert json.loads(call.function.arguments) == (
                {"city": "Paris"} if call.function.name == "get_weather" else {"query": "fox"}
            )
        assert reply.choices[0].finish_reason == "tool_calls"
