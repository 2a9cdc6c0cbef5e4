"""Tool calls through the model's own chat template: which way the model writes a call, and the
turn of its output into OpenAI ``tool_calls``.

``chat template text -> (detect_tool_format) ToolFormat``; the template renders the offered
tools into the prompt (``apply_chat_template(..., tools=...)``); the model writes its calls in
its format; ``generated text -> (ToolCallParser, fed piece by piece) content + tool calls``.

The formats (the text around each JSON call is what :class:`ToolFormat` names, which the
constrained decoding of ``tool_choice`` ``"required"`` or a named function also follows):

* ``hermes`` (Qwen2.5, Qwen3, Hermes and many fine-tunes; the template mentions
  ``<tool_call>``): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one
  block per call, with text before or between them allowed;
* ``llama3_json`` (Llama 3.1 and later; ``<|python_tag|>`` / ``Environment: ipython`` /
  ``"parameters"``): the whole answer is ``{"name": ..., "parameters": {...}}`` (several
  separated by ``; ``), possibly after the ``<|python_tag|>`` token;
* ``mistral`` (``[TOOL_CALLS]``): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``,
  after any text;
* ``glm`` (GLM-4.5, 4.6, 4.7; the template writes ``<arg_key>``): not JSON but
  ``<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>`` (GLM-4.7
  without the newlines), one block per call, text before or between them allowed; a value is
  the string itself where the tool's schema says ``"type": "string"``, else JSON (a value that
  is not JSON stays a string), as the template writes them.

A call whose JSON does not parse (or has no string ``name``) stays text of the answer; so does a
GLM block that is not a name followed by key/value pairs.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from server.engine.constraint_spec import ToolSyntax

__all__ = [
    "FORMATS",
    "ParsedToolCall",
    "ToolCallParser",
    "ToolFormat",
    "detect_tool_format",
    "new_call_id",
    "parse_tool_calls",
    "template_tools",
]


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes its tool calls: ``calls_start``, then each call as ``call_start``
    JSON ``call_end`` with ``call_separator`` between calls, then ``calls_end``; the JSON is
    ``{"name": ..., <arguments_key>: {...}}``. ``tags`` are the markers the tokenizer usually
    holds as single (added) tokens; ``whole_answer``: the calls are the whole answer (no text
    before them)."""

    name: str
    calls_start: str
    call_start: str
    call_end: str
    call_separator: str
    calls_end: str
    arguments_key: str
    tags: tuple[str, ...] = ()
    whole_answer: bool = False
    # the model's special tokens must stay in the text the parser reads (mistral's
    # [TOOL_CALLS] is a special token, dropped by a decoder that skips them)
    keep_special_tokens: bool = False
    # a template that accepts only call ids of 9 letters and digits (Mistral's)
    short_call_ids: bool = False
    # the arguments are <arg_key>/<arg_value> pairs after the name, not JSON (GLM's)
    xml_arguments: bool = False
    # calls are harmony messages in the commentary channel (gpt-oss): the reasoning parser
    # reads them and hands each on to the answer as this format's call text
    harmony: bool = False

    @property
    def syntax(self) -> ToolSyntax:
        """How this format writes a call, as the engine's grammar takes it."""
        style: Literal["json", "xml", "harmony"] = (
            "harmony" if self.harmony else "xml" if self.xml_arguments else "json"
        )
        return ToolSyntax(
            style=style,
            calls_start=self.calls_start,
            call_start=self.call_start,
            call_end=self.call_end,
            call_separator=self.call_separator,
            calls_end=self.calls_end,
            arguments_key=self.arguments_key,
            tags=self.tags,
        )

    def write_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """One call as the model writes it (what the parser reads back)."""
        if self.xml_arguments:
            pairs = "".join(
                f"<arg_key>{key}</arg_key>\n<arg_value>"
                f"{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}"
                "</arg_value>\n"
                for key, value in arguments.items()
            )
            return f"{self.call_start}{name}\n{pairs}{self.call_end}"
        body = json.dumps({"name": name, self.arguments_key: dict(arguments)}, ensure_ascii=False)
        return f"{self.call_start}{body}{self.call_end}"

    def call_id(self, ident: str) -> str:
        """``ident`` as this model's template accepts a tool call id (the same every time)."""
        if not self.short_call_ids or re.fullmatch(r"[a-zA-Z0-9]{9}", ident):
            return ident
        return hashlib.sha256(ident.encode()).hexdigest()[:9]


HERMES = ToolFormat(
    name="hermes",
    calls_start="",
    call_start="<tool_call>\n",
    call_end="\n</tool_call>",
    call_separator="\n",
    calls_end="",
    arguments_key="arguments",
    tags=("<tool_call>", "</tool_call>"),
)
LLAMA3_JSON = ToolFormat(
    name="llama3_json",
    calls_start="",
    call_start="",
    call_end="",
    call_separator="; ",
    calls_end="",
    arguments_key="parameters",
    tags=("<|python_tag|>",),
    whole_answer=True,
)
MISTRAL = ToolFormat(
    name="mistral",
    calls_start="[TOOL_CALLS][",
    call_start="",
    call_end="",
    call_separator=", ",
    calls_end="]",
    arguments_key="arguments",
    tags=("[TOOL_CALLS]",),
    keep_special_tokens=True,
    short_call_ids=True,
)
GLM = ToolFormat(
    name="glm",
    calls_start="",
    call_start="<tool_call>",
    call_end="</tool_call>",
    call_separator="\n",
    calls_end="",
    arguments_key="arguments",
    tags=("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    # GLM's tokenizer holds its tags as added tokens, which a GGUF may mark as control tokens
    keep_special_tokens=True,
    xml_arguments=True,
)
# gpt-oss writes ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS
# <|call|>``; server/api/reasoning.py's HarmonyParser turns each such message into a call
# block of this format in the answer's text, which the ToolCallParser then reads.
HARMONY = replace(HERMES, name="harmony", tags=(), keep_special_tokens=True, harmony=True)
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, GLM, HARMONY)}


def _template_texts(template: Any) -> str:
    """A template's text: a string, or the texts of a dict / list of named templates."""
    if isinstance(template, str):
        return template
    if isinstance(template, Mapping):
        return "\n".join(_template_texts(t) for t in template.values())
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        return "\n".join(
            _template_texts(t.get("template") if isinstance(t, Mapping) else t) for t in template
        )
    return ""


def detect_tool_format(template: Any) -> ToolFormat | None:
    """The tool-call format a chat template renders and expects, or None when it has none
    (the model cannot be offered tools)."""
    text = _template_texts(template)
    if not text or "tools" not in text:
        return None
    if "<|channel|>" in text and "to=functions" in text:  # harmony (gpt-oss)
        return HARMONY
    if "<arg_key>" in text and "<tool_call>" in text:  # before hermes: GLM also has <tool_call>
        return GLM
    if "<tool_call>" in text:
        return HERMES
    if "[TOOL_CALLS]" in text:
        return MISTRAL
    if "<|python_tag|>" in text or "Environment: ipython" in text:
        return LLAMA3_JSON
    if "<|start_header_id|>" in text and '"parameters"' in text:
        return LLAMA3_JSON
    return None


def template_tools(tools: Iterable[Any]) -> list[dict[str, Any]]:
    """The offered tools (``ToolDefinition`` models) as the dicts a chat template renders:
    ``{"type": "function", "function": {"name", "description"?, "parameters"}}``."""
    out = []
    for tool in tools:
        function: dict[str, Any] = {"name": tool.function.name}
        if tool.function.description is not None:
            function["description"] = tool.function.description
        function["parameters"] = (
            tool.function.parameters
            if tool.function.parameters is not None
            else {"type": "object", "properties": {}}
        )
        out.append({"type": "function", "function": function})
    return out


def new_call_id() -> str:
    """A fresh tool call id, as OpenAI makes them: ``call_<24 hex>``."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ParsedToolCall:
    """One call found in the output: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str


def _call_from(value: Any, fmt: ToolFormat) -> ParsedToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    keys = (fmt.arguments_key, "arguments", "parameters")
    key = next((k for k in keys if k in value), None)
    arguments = value[key] if key is not None else {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _decode_calls(text: str, fmt: ToolFormat, separators: str) -> list[ParsedToolCall] | None:
    """``text`` as one or more JSON calls separated by ``separators`` (and white space), or
    None if it is anything else."""
    decoder = json.JSONDecoder()
    calls: list[ParsedToolCall] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        try:
            value, end = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        items = value if isinstance(value, list) and fmt is MISTRAL else [value]
        for item in items:
            call = _call_from(item, fmt)
            if call is None:
                return None
            calls.append(call)
        pos = end
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
    return calls or None


_GLM_NAME = re.compile(r"[\w.:-]+")
_GLM_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _declared_type(schemas: Mapping[str, Any], function: str, argument: str) -> Any:
    parameters = schemas.get(function)
    if not isinstance(parameters, Mapping):
        return None
    properties = parameters.get("properties")
    if not isinstance(properties, Mapping) or not isinstance(properties.get(argument), Mapping):
        return None
    return properties[argument].get("type")


def _decode_glm_call(body: str, schemas: Mapping[str, Any]) -> ParsedToolCall | None:
    """``NAME <arg_key>K</arg_key> <arg_value>V</arg_value> ...`` (the text between the tags of
    one GLM block), or None if it is anything else."""
    at = body.find("<arg_key>")
    name = (body if at < 0 else body[:at]).strip()
    if not _GLM_NAME.fullmatch(name):  # a function's name, not JSON or tags
        return None
    arguments: dict[str, Any] = {}
    pos = len(body) if at < 0 else at
    while pos < len(body):
        match = _GLM_PAIR.match(body, pos)
        if match is None:
            if body[pos:].strip():
                return None
            break
        key, raw = match[1].strip(), match[2]
        if not key or key in arguments:
            return None
        value: Any = raw
        if _declared_type(schemas, name, key) != "string":
            try:
                value = json.loads(raw)
            except ValueError:
                value = raw  # not JSON: the string as written
        arguments[key] = value
        pos = match.end()
    return ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False))


# Output events of the parser: text of the answer, or a complete call.
Event = str | ParsedToolCall


class ToolCallParser:
    """Splits generated text, fed piece by piece (as it streams), into the answer's text and
    the complete tool calls; the same for a whole text fed at once (:func:`parse_tool_calls`).

    Text that may still turn out to be (the start of) a call is held back until it is clear.
    The answer's text is the text outside the calls without white space at its ends (white
    space before, between or after calls is dropped), so streamed and whole answers agree.
    With ``parallel=False`` only the first call is kept (later ones are dropped).
    ``schemas``: each offered function's parameters schema by name (GLM's string arguments are
    read as written, the others as JSON).
    """

    def __init__(
        self, fmt: ToolFormat, parallel: bool = True, schemas: Mapping[str, Any] | None = None
    ) -> None:
        self.fmt = fmt
        self.parallel = parallel
        self.schemas = schemas or {}
        self.calls = 0  # calls emitted
        self._buffer = ""  # text not yet emitted nor parsed
        self._state = "text"  # "text", "call" (inside one hermes block), "tail" (to the end)
        self._started = False  # some of the answer's text was emitted
        self._held_space = ""  # white space held until text follows it
        self._plain = False  # a whole-answer format's answer turned out to be text

    # -- feeding -------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        out: list[Event] = []
        while True:
            if self._state == "text":
                if not self._scan_text(out):
                    break
            elif self._state == "call":
                end = self._buffer.find("</tool_call>")
                if end < 0:
                    break
                block = self._buffer[: end + len("</tool_call>")]
                self._buffer = self._buffer[len(block) :]
                self._state = "text"
                self._block(block, block[len("<tool_call>") : end], out)
            else:  # tail: the rest of the answer is calls; parsed at the end
                break
        return out

    def finish(self) -> list[Event]:
        """The end of the output: whatever was held back, parsed or as text."""
        out: list[Event] = []
        rest, self._buffer = self._buffer, ""
        if self._state == "call":
            # a block the model did not close (it stopped right after the JSON)
            self._block(rest, rest[len("<tool_call>") :], out)
        elif self._state == "tail":
            body = rest
            if self.fmt is MISTRAL:
                body = rest[rest.index("[TOOL_CALLS]") + len("[TOOL_CALLS]") :]
            else:
                body = body.strip().removeprefix("<|python_tag|>")
            calls = _decode_calls(body, self.fmt, ";,")
            if calls is None:
                self._text(rest, out)
            else:
                self._calls(calls, out)
        else:
            self._text(rest, out)
        self._state = "text"
        return out

    # -- the states ----------------------------------------------------------------------------
    def _scan_text(self, out: list[Event]) -> bool:
        """Emit the text that cannot be a call; True if the state changed (scan again)."""
        buffer = self._buffer
        if self.fmt.whole_answer:
            if not self._plain:
                head = buffer.lstrip()
                if not head or _may_start_call(head):
                    return False  # not clear yet
                if _starts_call(head):
                    self._state = "tail"
                    return True
                self._plain = True
            self._text(buffer, out)
            self._buffer = ""
            return False
        blocks = self.fmt is not MISTRAL  # hermes, glm: <tool_call> ... </tool_call> blocks
        marker = "<tool_call>" if blocks else "[TOOL_CALLS]"
        at = buffer.find(marker)
        if at >= 0:
            self._text(buffer[:at], out)
            self._buffer = buffer[at:]
            self._state = "call" if blocks else "tail"
            return True
        keep = _partial_suffix(buffer, marker)
        self._text(buffer[: len(buffer) - keep], out)
        self._buffer = buffer[len(buffer) - keep :]
        return False

    def _block(self, raw: str, body: str, out: list[Event]) -> None:
        if self.fmt.xml_arguments:
            call = _decode_glm_call(body, self.schemas)
            if call is None:
                self._text(raw, out)
            else:
                self._calls([call], out)
            return
        calls = _decode_calls(body, self.fmt, "")
        if calls is None or len(calls) != 1:
            self._text(raw, out)
        else:
            self._calls(calls, out)

    def _calls(self, calls: list[ParsedToolCall], out: list[Event]) -> None:
        for call in calls:
            if self.parallel or self.calls == 0:
                self.calls += 1
                out.append(call)

    def _text(self, text: str, out: list[Event]) -> None:
        if not self._started:
            text = text.lstrip()
        core = text.rstrip()
        if not core:  # white space only: held until text follows it
            self._held_space += text
            return
        out.append(self._held_space + core)
        self._held_space = text[len(core) :]
        self._started = True


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


_CALL_START = re.compile(r'(<\|python_tag\|>|\{\s*"name"\s*:)')


def _starts_call(head: str) -> bool:
    return bool(_CALL_START.match(head))


def _may_start_call(head: str) -> bool:
    """``head`` may still grow into the start of a whole-answer call."""
    if "<|python_tag|>".startswith(head):
        return True
    if not head.startswith("{"):
        return False
    rest = head[1:].lstrip()
    if '"name"'.startswith(rest):
        return True
    return rest.startswith('"name"') and not rest[len('"name"') :].strip()


def parse_tool_calls(
    text: str, fmt: ToolFormat, parallel: bool = True, schemas: Mapping[str, Any] | None = None
) -> tuple[str, list[ParsedToolCall]]:
    """A whole output: its text outside the calls (white space at the ends removed) and its
    calls."""
    parser = ToolCallParser(fmt, parallel, schemas)
    events = parser.feed(text) + parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    return content, [e for e in events if isinstance(e, ParsedToolCall)]
