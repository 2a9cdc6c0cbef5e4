"""Reasoning parsers (server/api/reasoning.py): the model's thinking split from its answer, fed
piece by piece as text streams in (tags split across pieces, no end tag, a template-opened
think, harmony's channels), the parser chosen from the chat template, and the grammars that
constrain an answer only after the reasoning (walked over a tiny tokenizer)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import llguidance
import pytest

from server.api.reasoning import (
    HarmonyCall,
    HarmonyParser,
    ReasoningParser,
    ThinkParser,
    choose_reasoning,
    make_parser,
    opened_by_prompt,
    template_reads,
)
from server.api.tools import HARMONY as HARMONY_FORMAT
from server.api.tools import HERMES, detect_tool_format, parse_tool_calls
from server.engine.constraint_spec import ToolSchema
from server.engine.constraints import (
    Constraint,
    Grammars,
    after_analysis,
    after_reasoning,
    json_schema_constraint,
    tool_call_constraint,
)

pytestmark = pytest.mark.unit


def _run(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    out = [parser.feed(p) for p in pieces]
    out.append(parser.finish())
    return "".join(r for r, _ in out), "".join(c for _, c in out), out


def _splits(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 100])
def test_think_block_written_by_the_model_split_across_pieces(size: int) -> None:
    text = "<think>\nlet me see: 2 < 3\n</think>\n\nThe answer is 4."
    reasoning, content, out = _run(ThinkParser(), _splits(text, size))
    assert reasoning == "\nlet me see: 2 < 3\n"
    assert content == "The answer is 4."
    # no piece of the answer ever carries markup, no piece of the reasoning either
    assert all("<" not in c and ">" not in c for _, c in out)
    assert all("think>" not in r for r, _ in out)


@pytest.mark.parametrize("size", [1, 4, 100])
def test_template_opened_think(size: int) -> None:
    text = "hmm, a fox.</think>The fox jumps."
    reasoning, content, _ = _run(ThinkParser(opened=True), _splits(text, size))
    assert (reasoning, content) == ("hmm, a fox.", "The fox jumps.")


def test_no_end_tag_is_all_reasoning_and_no_start_tag_all_answer() -> None:
    assert _run(ThinkParser(), ["<think>", "still ", "thinking </th"])[:2] == (
        "still thinking </th",
        "",
    )
    assert _run(ThinkParser(opened=True), ["still ", "thinking"])[:2] == ("still thinking", "")
    assert _run(ThinkParser(), ["The ", "answer <think>"])[:2] == ("", "The answer <think>")
    assert _run(ThinkParser(), ["<th", "is is it"])[:2] == ("", "<this is it")
    assert _run(ThinkParser(), ["  ", "<"])[:2] == ("", "<")
    assert _run(ThinkParser(), [])[:2] == ("", "")


def test_streaming_holds_back_only_a_possible_tag() -> None:
    parser = ThinkParser()
    assert parser.feed("<think>abc") == ("abc", "")
    assert parser.feed("de</") == ("de", "")  # "</" may start </think>: held
    assert parser.feed("b>") == ("</b>", "")  # it did not
    assert parser.feed("</think") == ("", "")
    assert parser.feed(">\n") == ("", "")  # the answer's leading white space is dropped
    assert parser.feed("Yes") == ("", "Yes")
    assert parser.feed(" </think> no") == ("", " </think> no")  # after the end: all answer
    assert parser.finish() == ("", "")


def test_think_counts_reasoning_tokens_with_its_tags() -> None:
    parser = ThinkParser()
    for piece in ["<", "think", ">", "a", "b", "</think>", "\n", "c"]:
        parser.feed(piece)
    assert parser.tokens == 6  # <, think, >, a, b and </think>
    opened = ThinkParser(opened=True)
    for piece in ["a", "</think>", "b"]:
        opened.feed(piece)
    assert opened.tokens == 2
    plain = ThinkParser()
    for piece in ["<", "b>", "c"]:
        plain.feed(piece)
    assert plain.tokens == 0


HARMONY = (
    "<|channel|>analysis<|message|>User asks weather. Use tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_harmony_channels(size: int) -> None:
    parser = HarmonyParser()
    reasoning, content, out = _run(parser, _splits(HARMONY, size))
    assert reasoning == "User asks weather. Use tool."
    assert content == ""
    assert parser.calls == [HarmonyCall("get_weather", '{"city": "Paris"}')]
    final = (
        "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Hello <b>there</b>!<|return|>"
    )
    parser = HarmonyParser()
    reasoning, content, out = _run(parser, _splits(final, size))
    assert (reasoning, content, parser.calls) == ("Simple.", "Hello <b>there</b>!", [])
    assert all("<|" not in c for _, c in out)


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_harmony_calls_reach_the_answer_as_calls_when_tools_are_offered(size: int) -> None:
    parser = make_parser("harmony", calls=True)
    before = "<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant"
    reasoning, content, _ = _run(parser, _splits(before + HARMONY, size))
    assert reasoning == "User asks weather. Use tool."
    text, calls = parse_tool_calls(content, HARMONY_FORMAT, parallel=True)
    assert text == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    # recipient before the channel, arguments that are not JSON, no end token (the turn ended)
    other = " to=functions.run<|channel|>commentary<|message|>ls -l"
    _, content, _ = _run(make_parser("harmony", calls=True), _splits(other, size))
    _, calls = parse_tool_calls(content, HARMONY_FORMAT, parallel=True)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("run", {"input": "ls -l"})]


def test_a_harmony_template_gets_harmony_s_tool_format() -> None:
    template = (
        "{{ '<|start|>assistant to=functions.' + tool_call.name + '<|channel|>commentary' }}"
        "{% if tools %}namespace functions{% endif %}"
    )
    assert detect_tool_format(template) is HARMONY_FORMAT


def test_harmony_preamble_is_answer_and_text_without_markup_too() -> None:
    text = "<|channel|>commentary<|message|>Checking.<|end|>"
    assert _run(HarmonyParser(), [text])[:2] == ("", "Checking.")
    assert _run(HarmonyParser(), ["just ", "text"])[:2] == ("", "just text")
    long = "x" * 600
    assert _run(HarmonyParser(), _splits(long, 50))[:2] == ("", long)


def test_harmony_counts_the_analysis_tokens() -> None:
    parser = HarmonyParser()
    pieces = ["<|channel|>", "analysis", "<|message|>", "a", "b", "<|end|>"]
    pieces += ["<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "c"]
    for piece in pieces:
        parser.feed(piece)
    assert parser.tokens == 6


QWEN3 = (
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)
GPT_OSS = "{{ '<|start|>assistant<|channel|>' }} Reasoning: {{ reasoning_effort }}"


def test_the_parser_is_chosen_from_the_template_or_the_architecture() -> None:
    assert choose_reasoning("auto", QWEN3) == "think"
    assert choose_reasoning("auto", "<think>\n") == "think"
    assert choose_reasoning("auto", GPT_OSS) == "harmony"
    assert choose_reasoning("auto", {"default": GPT_OSS}) == "harmony"
    assert choose_reasoning("auto", "{{ messages }}") == "none"
    assert choose_reasoning("auto", None, "gpt_oss") == "harmony"
    assert choose_reasoning("none", QWEN3) == "none"
    assert choose_reasoning("think", None) == "think"
    with pytest.raises(ValueError):
        choose_reasoning("r1", None)


def test_template_opened_think_is_read_from_the_prompt() -> None:
    assert opened_by_prompt("<|im_start|>assistant\n<think>\n")
    assert not opened_by_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opened_by_prompt("<|im_start|>assistant\n")
    assert opened_by_prompt("<think>a</think> ok <think>")
    assert isinstance(make_parser("think", True), ThinkParser)


def test_template_variables() -> None:
    assert template_reads(QWEN3, "enable_thinking")
    assert template_reads(GPT_OSS, "reasoning_effort")
    assert not template_reads(QWEN3, "reasoning_effort")
    assert not template_reads("{{ message.enable_thinking_x }}", "enable_thinking")
    assert not template_reads("{{ m.enable_thinking }}", "enable_thinking")  # an attribute


def test_every_split_of_a_think_output_gives_the_same_text() -> None:
    text = "<think>a</thi</think>b"
    expected = _run(ThinkParser(), [text])[:2]
    assert expected == ("a</thi", "b")
    for cuts in itertools.combinations(range(1, len(text)), 3):
        bounds = (0, *cuts, len(text))
        pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
        assert _run(ThinkParser(), pieces)[:2] == expected, pieces


# --- constraints after the reasoning (server/engine/constraints.py) ----------------------------

HARMONY_TOKENS = [
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
]


@pytest.fixture(scope="module")
def grammar_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny tokenizer that can write JSON, with harmony's markup as special tokens."""
    from transformers import PreTrainedTokenizerFast

    from testing_support.tiny_models import CORPUS, JSON_CORPUS, make_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(folder, corpus=CORPUS + JSON_CORPUS)
    hf = PreTrainedTokenizerFast.from_pretrained(str(folder))
    hf.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    return hf


def _walk(hf: Any, constraint: Constraint, text: str) -> tuple[bool, bool]:
    """Whether the grammar takes ``text`` (as the tokenizer writes it), and is then complete."""
    eos = [hf.convert_tokens_to_ids("</s>"), hf.convert_tokens_to_ids("<|return|>")]
    tokenizer = Grammars(hf, len(hf), eos).tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, constraint.grammar, log_level=0)
    taken = all(matcher.consume_token(t) for t in hf.encode(text, add_special_tokens=False))
    return taken, taken and matcher.is_accepting()


ANSWER = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_a_schema_after_a_think_block(grammar_tokenizer: Any) -> None:
    schema = json_schema_constraint(ANSWER)
    opened = after_reasoning(schema, opened=True)
    assert _walk(grammar_tokenizer, opened, 'the fox </thi nk <b> </think>\n\n{"a":3}') == (
        True,
        True,
    )
    assert _walk(grammar_tokenizer, opened, 'the fox </think>{"b":3}')[0] is False
    assert _walk(grammar_tokenizer, opened, "the fox </think> the")[0] is False
    assert _walk(grammar_tokenizer, opened, "the fox") == (True, False)  # not complete
    free = after_reasoning(schema, opened=False)
    assert _walk(grammar_tokenizer, free, '<think>hmm</think>\n{"a":1}') == (True, True)
    assert _walk(grammar_tokenizer, free, '{"a":1}') == (True, True)  # no thinking at all
    assert _walk(grammar_tokenizer, free, "hmm")[0] is False  # text before: only in a block
    forced = after_reasoning(schema, opened=True, think_tokens=2)
    two = grammar_tokenizer.decode(grammar_tokenizer.encode("the fox")[:2])
    assert _walk(grammar_tokenizer, forced, two + '</think>{"a":1}') == (True, True)
    assert _walk(grammar_tokenizer, forced, "the fox")[0] is False  # a third token: refused


def test_the_reasoning_allows_every_token_but_the_special_ones(grammar_tokenizer: Any) -> None:
    import llguidance.numpy as lnp

    hf = grammar_tokenizer
    constraint = after_reasoning(json_schema_constraint(ANSWER), opened=True)
    tokenizer = Grammars(hf, len(hf), [hf.convert_tokens_to_ids("</s>")]).tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, constraint.grammar, log_level=0)
    mask = lnp.allocate_token_bitmask(1, len(hf))
    lnp.fill_next_token_bitmask(matcher, mask, 0)
    allowed = {t for t in range(len(hf)) if (int(mask[0][t // 32]) >> (t % 32)) & 1}
    special = set(hf.all_special_ids)
    assert allowed == set(range(len(hf))) - special


def test_a_required_call_after_a_think_block(grammar_tokenizer: Any) -> None:
    function = ToolSchema(
        "lookup", {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    )
    call = tool_call_constraint([function], HERMES.syntax, parallel=False)
    constraint = after_reasoning(call, opened=True)
    text = 'hmm</think>\n<tool_call>\n{"name":"lookup","arguments":{"q":"x"}}\n</tool_call>'
    assert _walk(grammar_tokenizer, constraint, text) == (True, True)
    assert _walk(grammar_tokenizer, constraint, "hmm</think>\nthe")[0] is False


def test_a_forced_harmony_call_after_an_optional_analysis(grammar_tokenizer: Any) -> None:
    def tool(name: str, properties: dict[str, Any]) -> ToolSchema:
        schema = {"type": "object", "properties": properties, "required": list(properties)}
        return ToolSchema(name, schema)

    tools = [
        tool("get_weather", {"city": {"type": "string"}}),
        tool("add", {"a": {"type": "integer"}}),
    ]
    vocab = dict(grammar_tokenizer.get_vocab())
    constraint = tool_call_constraint(tools, HARMONY_FORMAT.syntax, parallel=True, vocab=vocab)
    header = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    call = header + '{"city":"Paris"}'
    analysed = "<|channel|>analysis<|message|>the fox<|end|><|start|>assistant" + call
    assert _walk(grammar_tokenizer, constraint, analysed) == (True, True)
    assert _walk(grammar_tokenizer, constraint, call) == (True, True)
    other = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a":1}'
    assert _walk(grammar_tokenizer, constraint, other) == (True, True)
    extra = call.replace('"Paris"}', '"Paris","b":1}')  # a key the schema does not name
    assert _walk(grammar_tokenizer, constraint, extra)[0] is False
    unknown = call.replace("get_weather", "get_time")
    assert _walk(grammar_tokenizer, constraint, unknown)[0] is False
    final = '<|channel|>final<|message|>{"city":"Paris"}'  # an answer instead of the call
    assert _walk(grammar_tokenizer, constraint, final)[0] is False
    # the call, read back by the parser the served choice uses
    _, content, _ = _run(make_parser("harmony", calls=True), [analysed])
    _, calls = parse_tool_calls(content, HARMONY_FORMAT, parallel=True)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]


def test_a_schema_in_harmony_s_final_channel(grammar_tokenizer: Any) -> None:
    constraint = after_analysis(json_schema_constraint(ANSWER))
    analysed = (
        "<|channel|>analysis<|message|>the fox {<|end|><|start|>assistant"
        '<|channel|>final<|message|>{"a":1}'
    )
    assert _walk(grammar_tokenizer, constraint, analysed) == (True, True)
    assert _walk(grammar_tokenizer, constraint, '<|channel|>final<|message|>{"a":1}') == (
        True,
        True,
    )
    assert _walk(grammar_tokenizer, constraint, "<|channel|>final<|message|>the")[0] is False
    assert _walk(grammar_tokenizer, constraint, '{"a":1}')[0] is False  # the header comes first
