"""Reasoning output: the model's thinking split from its answer, as text streams in.

``chat template (or architecture) -> (choose_reasoning) parser name``; per choice,
``decoded text pieces -> (ReasoningParser.feed) (reasoning, content) pieces -> finish()``.

The parsers:

* ``think`` (Qwen3, QwQ, DeepSeek-R1 distills, GLM): ``<think>reasoning</think>answer``. The
  start tag is written by the model at the start of its output, or already opened by the chat
  template (the rendered prompt ends inside an open ``<think>``: :func:`opened_by_prompt`). An
  output that does not start with ``<think>`` (and was not opened) is all answer; one whose
  ``</think>`` never comes is all reasoning.
* ``harmony`` (gpt-oss): messages ``<|channel|>NAME<|message|>...<|end|>``, each after
  ``<|start|>assistant``; the ``analysis`` channel is reasoning, ``final`` the answer,
  ``commentary`` with a recipient (``to=functions.NAME``) a tool call (kept in
  :attr:`HarmonyParser.calls`; when tools were offered, handed to the answer as a call block
  that the tool-call parser reads, never as text) and without one a preamble, which is answer.
  The markup tokens are special tokens: the decoder must keep them (:attr:`keeps_special`).
* ``none``: everything is answer.

Parsers are incremental: a piece that may be the start of a tag is held back until the next
piece (or :meth:`finish`) says what it is, so ``content`` never carries reasoning markup.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from server.api.tools import HARMONY

PARSERS = ("none", "think", "harmony")
THINK_START = "<think>"
THINK_END = "</think>"

# architectures whose reasoning format is known without looking at the template
_BY_ARCHITECTURE = {"gpt_oss": "harmony"}


def template_text(template: Any) -> str:
    """A template's source: a string, or the texts of named templates."""
    if isinstance(template, str):
        return template
    if isinstance(template, Mapping):
        return "\n".join(template_text(t) for t in template.values())
    if isinstance(template, list):
        return "\n".join(
            template_text(t.get("template") if isinstance(t, Mapping) else t) for t in template
        )
    return ""


def choose_reasoning(setting: str, template: Any, architecture: str = "") -> str:
    """The parser for a model: ``setting`` (``auto``, or a name of :data:`PARSERS`), with
    ``auto`` read from the chat template (harmony's ``<|channel|>``; ``<think>`` or
    ``enable_thinking``) or else the architecture."""
    if setting != "auto":
        if setting not in PARSERS:
            raise ValueError(f"unknown reasoning parser {setting!r} (one of auto, {PARSERS})")
        return setting
    text = template_text(template)
    if "<|channel|>" in text:
        return "harmony"
    if THINK_START in text or THINK_END in text or "enable_thinking" in text:
        return "think"
    return _BY_ARCHITECTURE.get(architecture, "none")


def opened_by_prompt(prompt: str) -> bool:
    """The rendered prompt ends inside a ``<think>`` block the template opened (its last
    ``<think>`` has no ``</think>`` after it)."""
    start = prompt.rfind(THINK_START)
    return start >= 0 and prompt.find(THINK_END, start) < 0


def closed_by_prompt(prompt: str) -> bool:
    """The rendered prompt ends with a closed ``<think></think>`` block (a template that
    switched thinking off, as Qwen3's does for ``enable_thinking: false``)."""
    return prompt.rstrip().endswith(THINK_END)


def template_reads(template: Any, name: str) -> bool:
    """Whether the chat template reads the variable ``name`` (its source names it)."""
    return re.search(rf"(?<![\w.]){re.escape(name)}\b", template_text(template)) is not None


class ReasoningParser(Protocol):
    """Splits a choice's text into reasoning and answer, piece by piece."""

    keeps_special: bool  # the decoder must keep special tokens (the markup is made of them)
    # feeds (one per generated token) that were reasoning, its tags included: a feed while the
    # output might still open the reasoning counts once it does
    tokens: int

    def feed(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` that ``text`` (one token's text, after what was fed
        before) makes safe to emit."""
        ...

    def finish(self) -> tuple[str, str]:
        """The output ended: ``(reasoning, content)`` still held back."""
        ...


def _partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that is a proper start of one of ``tags``."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class NoReasoning:
    keeps_special = False
    tokens = 0

    def feed(self, text: str) -> tuple[str, str]:
        return "", text

    def finish(self) -> tuple[str, str]:
        return "", ""


class ThinkParser:
    """``<think>reasoning</think>answer``; ``opened``: the template already wrote ``<think>``.

    The answer's leading whitespace (the model's line breaks after ``</think>``) is dropped.
    """

    keeps_special = False

    def __init__(self, opened: bool = False) -> None:
        self._phase = "reasoning" if opened else "start"  # start -> reasoning -> answer
        self._held = ""
        self._answer_started = False
        self.tokens = 0
        self._pending = 0  # feeds while the output may still open <think>

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning = content = ""
        if self._phase == "reasoning":
            self.tokens += 1
        if self._phase == "start":
            self._pending += 1
            stripped = self._held.lstrip()
            if stripped.startswith(THINK_START):
                self._held = stripped[len(THINK_START) :]
                self._phase = "reasoning"
                self.tokens += self._pending
            elif THINK_START.startswith(stripped):
                return "", ""  # nothing yet, or a part of the start tag: wait
            else:
                self._phase = "answer"
        if self._phase == "reasoning":
            end = self._held.find(THINK_END)
            if end < 0:
                cut = len(self._held) - _partial_suffix(self._held, (THINK_END,))
                reasoning, self._held = self._held[:cut], self._held[cut:]
                return reasoning, ""
            reasoning = self._held[:end]
            self._held = self._held[end + len(THINK_END) :]
            self._phase = "answer"
        if self._phase == "answer":
            content, self._held = self._held, ""
            if not self._answer_started:
                content = content.lstrip()
                self._answer_started = bool(content)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._phase == "reasoning":
            return held, ""
        if self._phase == "start":  # whitespace or a part of <think> only: it was answer
            self._phase = "answer"
        return "", held if self._answer_started else held.lstrip()


@dataclass(frozen=True)
class HarmonyCall:
    """A tool call written in harmony's ``commentary`` channel: ``to=functions.NAME``."""

    name: str
    arguments: str


_H_MESSAGE = "<|message|>"
_H_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_H_MARKS = (*_H_ENDS, "<|start|>", "<|channel|>", _H_MESSAGE)
_MAX_HEADER = 512  # characters of a header without <|message|>: it was not markup


class HarmonyParser:
    """gpt-oss's harmony messages: ``analysis`` is reasoning, ``final`` and preambles are the
    answer, ``commentary`` to a function is a call (:attr:`calls`)."""

    keeps_special = True

    def __init__(self, calls_in_answer: bool = False) -> None:
        # each call also goes into the answer, as a block the tool-call parser reads
        # (server/api/tools.py HARMONY)
        self.calls_in_answer = calls_in_answer
        self._phase = "header"  # header (up to <|message|>) -> body (up to an end) -> header
        self._held = ""
        self._channel = ""
        self._recipient = ""
        self._call = ""
        self.calls: list[HarmonyCall] = []
        self.tokens = 0
        self._pending = 0  # feeds of the header being read

    def _header(self, header: str) -> None:
        match = re.search(r"<\|channel\|>\s*([A-Za-z_]+)", header)
        self._channel = match.group(1) if match else "final"
        to = re.search(r"to=([^\s<]+)", header)
        self._recipient = to.group(1) if to else ""
        self._call = ""
        if self._channel == "analysis":
            self.tokens += self._pending
        self._pending = 0

    def _route(self, text: str) -> tuple[str, str]:
        if not text:
            return "", ""
        if self._channel == "analysis":
            return text, ""
        if self._recipient:
            self._call += text
            return "", ""
        return "", text

    def _close(self) -> str:
        """End the message; a call's block for the answer (with ``calls_in_answer``)."""
        block = ""
        if self._recipient:
            name = self._recipient.removeprefix("functions.")
            arguments = self._call.strip()
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = {"input": arguments} if arguments else {}
                arguments = json.dumps(parsed)
            self.calls.append(HarmonyCall(name, arguments))
            if self.calls_in_answer:
                block = HARMONY.write_call(
                    name, parsed if isinstance(parsed, dict) else {"input": parsed}
                )
        self._recipient = self._call = ""
        return block

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning = content = ""
        if self._phase == "header":
            self._pending += 1
        elif self._channel == "analysis":
            self.tokens += 1
        while True:
            if self._phase == "header":
                at = self._held.find(_H_MESSAGE)
                if at < 0:
                    if len(self._held) > _MAX_HEADER:  # no markup: plain answer text
                        self._channel, self._recipient, self._phase = "final", "", "body"
                        self._pending = 0
                        continue
                    break
                self._header(self._held[:at])
                self._held = self._held[at + len(_H_MESSAGE) :]
                self._phase = "body"
            ends = [(i, tag) for tag in (*_H_ENDS, "<|start|>") if (i := self._held.find(tag)) >= 0]
            if not ends:
                cut = len(self._held) - _partial_suffix(self._held, _H_MARKS)
                r, c = self._route(self._held[:cut])
                self._held = self._held[cut:]
                reasoning, content = reasoning + r, content + c
                break
            at, tag = min(ends)
            r, c = self._route(self._held[:at])
            reasoning, content = reasoning + r, content + c + self._close()
            self._held = self._held[at + len(tag) :]
            self._phase = "header"
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._phase == "header":
            # an unfinished header is markup; text without any is the answer
            return ("", "") if "<|" in held else ("", held)
        reasoning, content = self._route(held)
        return reasoning, content + self._close()


def make_parser(name: str, opened: bool = False, calls: bool = False) -> ReasoningParser:
    """A fresh parser for one choice; ``opened``: the prompt ends inside a ``<think>`` the
    template opened (:func:`opened_by_prompt`); ``calls``: harmony's tool calls go into the
    answer as call blocks for the tool-call parser (tools were offered)."""
    if name == "think":
        return ThinkParser(opened=opened)
    if name == "harmony":
        return HarmonyParser(calls_in_answer=calls)
    if name == "none":
        return NoReasoning()
    raise ValueError(f"unknown reasoning parser {name!r}")
