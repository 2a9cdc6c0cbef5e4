"""Chat and text completions: OpenAI requests in, engine generations out, JSON or SSE back.

``ChatCompletionRequest -> (template, tokenizer) prompt ids + SamplingParams ->
Engine.generate per choice -> (detokenizer, stop strings) text -> ChatCompletion / chunks``
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from protos.sampling import SampledToken
from server.api.constraint_lowering import chat_spec, with_reasoning
from server.api.detokenizer import IncrementalDetokenizer
from server.api.errors import APIError
from server.api.reasoning import (
    choose_reasoning,
    make_parser,
    opened_by_prompt,
    template_reads,
)
from server.api.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    effective_max_tokens,
    include_usage,
    stop_list,
    template_messages,
    to_sampling_params,
)
from server.api.responses import (
    ChatChoiceLogprobs,
    ChatCompletion,
    ChatCompletionChoice,
    ChatResponseMessage,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FinishReason,
    ToolCall,
    ToolCallFunction,
    Usage,
    chat_token_logprob,
)
from server.api.sse import (
    chat_content_chunk,
    chat_final_chunk,
    chat_reasoning_chunk,
    chat_tool_call_chunks,
    chat_usage_chunk,
    completion_final_chunk,
    completion_text_chunk,
    completion_usage_chunk,
    first_chat_chunk,
    sse_done,
    sse_error,
    sse_event,
    sse_keepalive,
)
from server.api.tokenization import TextCodec
from server.api.tools import (
    ParsedToolCall,
    ToolCallParser,
    ToolFormat,
    detect_tool_format,
    new_call_id,
    parse_tool_calls,
    template_tools,
)
from server.engine.constraint_spec import ConstraintSpec
from server.engine.constraints import Constraint, ConstraintError, build_constraint
from server.engine.loop import (
    Engine,
    GenerationRequest,
    GenerationStats,
    QueueFull,
    QueueTimeout,
    SchedulingFailed,
    ShuttingDown,
)
from server.metrics import GatewayMetrics
from server.ring import BadStep, NoCapacity, RingError, StageUnavailable, StepTimeout

log = logging.getLogger(__name__)

# the HTTP status, OpenAI error type and code of each kind of ring failure (others: 500)
_STATUS: dict[type[RingError], tuple[int, str, str | None]] = {
    StageUnavailable: (503, "service_unavailable", "stage_unavailable"),
    StepTimeout: (504, "timeout", "stage_timeout"),
    NoCapacity: (429, "rate_limit_exceeded", "capacity"),
    BadStep: (400, "invalid_request_error", None),
}


def ring_api_error(exc: RingError) -> APIError:
    status, kind, code = next(
        (v for t, v in _STATUS.items() if isinstance(exc, t)), (500, "server_error", None)
    )
    return APIError(status, str(exc), type=kind, code=code)


def generation_api_error(exc: BaseException) -> APIError | None:
    """The HTTP error for a failure of the generation below, or None if it is not one."""
    if isinstance(exc, RingError):
        return ring_api_error(exc)
    if isinstance(exc, QueueFull):
        return APIError(
            429,
            f"The server is busy: {exc}. Retry later.",
            type="rate_limit_exceeded",
            code="queue_full",
            headers={"Retry-After": str(math.ceil(exc.retry_after))},
        )
    if isinstance(exc, SchedulingFailed):
        return APIError(500, f"The request was ended: {exc}.", type="server_error")
    if isinstance(exc, ShuttingDown):
        return APIError(
            503, f"{exc}; retry shortly.", type="service_unavailable", code="server_shutting_down"
        )
    if isinstance(exc, QueueTimeout):
        return APIError(
            503, f"The server is busy: {exc}.", type="service_unavailable", code="queue_timeout"
        )
    return None


@dataclass
class ChoiceResult:
    index: int
    text: str = ""
    reasoning: str = ""  # the model's thinking (chat with a reasoning parser)
    reasoning_tokens: int = 0
    finish_reason: FinishReason = "length"
    tokens: int = 0
    cached_tokens: int = 0  # prompt positions taken from the stages' prefix cache
    chat_logprobs: list[ChatTokenLogprob] = field(default_factory=list)
    legacy_logprobs: CompletionLogprobs = field(default_factory=CompletionLogprobs)
    parser: ToolCallParser | None = None  # streaming with tools: the calls in the output
    calls: int = 0  # tool calls streamed


@dataclass(frozen=True)
class ToolParsing:
    """Tools are offered (``tool_choice`` is not ``"none"``): the output is read for calls."""

    format: ToolFormat
    parallel: bool  # parallel_tool_calls (false: only the first call is kept)
    # each offered function's parameters schema, by name (GLM's string arguments)
    schemas: dict[str, Any] = field(default_factory=dict)

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.format, self.parallel, self.schemas)


def finish_with_calls(finish: FinishReason, calls: int) -> FinishReason:
    """``tool_calls`` when the model ended its answer (not cut at the limit) after calls."""
    return "tool_calls" if calls and finish == "stop" else finish


@dataclass
class Prepared:
    """A request turned into engine input, with what is needed to shape the answer."""

    request_id: str
    created: int
    model: str
    generation: GenerationRequest
    stop: list[str]
    logprobs: bool
    stream: bool
    include_usage: bool
    chat: bool
    tools: ToolParsing | None = None
    reasoning: str = "none"  # the reasoning parser (server/api/reasoning.py); none: all is text
    thinking_open: bool = False  # the prompt ends inside a <think> the template opened


@dataclass
class ChoiceEvent:
    index: int
    text: str
    token: SampledToken | None
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0  # with the finish reason: prompt positions from the prefix cache
    reasoning: str = ""  # reasoning text in this piece (the model's thinking), never in text


@dataclass
class ChoiceTally:
    """What a choice's event stream counts beside its events."""

    reasoning_tokens: int = 0  # generated tokens of the reasoning (its tags included)


class CompletionService:
    def __init__(
        self,
        engine: Engine,
        codec: TextCodec,
        model: str,
        max_context: int,
        metrics: GatewayMetrics,
        reasoning_parser: str = "auto",
        architecture: str = "",
        close_schemas: bool = True,
        aliases: Sequence[str] = (),
        keepalive_s: float = 0.0,
    ) -> None:
        self.engine = engine
        # streams: how long the first token may take before the stream starts without it
        self.keepalive_s = keepalive_s
        # tool arguments and strict schemas: objects take only the keys they name
        self.close_schemas = close_schemas
        self.codec = codec
        self.model = model
        self.aliases = frozenset(aliases)  # other names of the model, accepted in requests
        self.max_context = max_context
        self.metrics = metrics
        self.tool_format = detect_tool_format(codec.chat_template)
        # how chat output is split into reasoning and answer (the setting, or the template's)
        self.reasoning = choose_reasoning(reasoning_parser, codec.chat_template, architecture)
        self._vocab: dict[str, int] | None = None

    def build_constraint(self, spec: ConstraintSpec | None, param: str) -> Constraint | None:
        """The grammar ``spec`` asks for (server/engine/constraints.py), or a 400 naming
        ``param``, the request field it came from."""
        if spec is None:
            return None
        vocab = None
        if spec.kind == "tool_call":
            if self._vocab is None:  # tags that are single tokens (built once, on first use)
                self._vocab = dict(self.codec.chat.get_vocab())
            vocab = self._vocab
        try:
            return build_constraint(spec, vocab)
        except ConstraintError as exc:
            raise APIError(400, f"Invalid value for '{param}': {exc}", param=param) from None

    def serves(self, model: str) -> bool:
        """Whether ``model`` names the served model (its id or one of its aliases)."""
        return model == self.model or model in self.aliases

    def _template_kwargs(self, req: ChatCompletionRequest) -> dict[str, Any]:
        """The template variables a request sets (``chat_template_kwargs``, ``reasoning_effort``),
        each one the template reads, or a 400 naming the field."""
        template = self.codec.chat_template
        kwargs = dict(req.chat_template_kwargs or {})
        unread = [key for key in kwargs if not template_reads(template, key)]
        if unread:
            raise APIError(
                400,
                f"Invalid value for 'chat_template_kwargs': the chat template of '{self.model}' "
                f"does not use the variable {unread[0]!r}.",
                param="chat_template_kwargs",
            )
        if req.reasoning_effort is not None:
            if not template_reads(template, "reasoning_effort"):
                raise APIError(
                    400,
                    f"The model '{self.model}' cannot honour 'reasoning_effort': its chat "
                    "template takes no reasoning effort.",
                    param="reasoning_effort",
                )
            kwargs["reasoning_effort"] = req.reasoning_effort
        return kwargs

    # -- preparing ------------------------------------------------------------------------
    def prepare(self, req: ChatCompletionRequest | CompletionRequest, request_id: str) -> Prepared:
        if not self.serves(req.model):
            raise APIError(
                404,
                f"The model '{req.model}' does not exist; this server serves '{self.model}'.",
                param="model",
                code="model_not_found",
            )
        chat = isinstance(req, ChatCompletionRequest)
        constraint: Constraint | None = None
        tools: ToolParsing | None = None
        reasoning, thinking_open = "none", False
        if isinstance(req, ChatCompletionRequest):
            mode = req.tool_mode()
            if mode is not None:
                if self.tool_format is None:
                    raise APIError(
                        400,
                        f"The model '{self.model}' cannot be offered tools: its chat template "
                        "does not support tools (send the request without 'tools', or with "
                        "tool_choice 'none').",
                        param="tools",
                    )
                tools = ToolParsing(
                    self.tool_format,
                    req.parallel_tool_calls is not False,
                    {t.function.name: t.function.parameters for t in req.tools or ()},
                )
            fmt = self.tool_format
            messages = template_messages(req.messages, fmt.call_id if fmt else None)
            offered = template_tools(req.tools or ()) if mode is not None else None
            kwargs = self._template_kwargs(req)
            try:
                text = self.codec.chat_text(messages, tools=offered, template_kwargs=kwargs)
            except ValueError as exc:
                raise APIError(400, str(exc), param="messages") from exc
            prompt = self.codec.encode_rendered(text)
            reasoning = self.reasoning
            thinking_open = reasoning == "think" and opened_by_prompt(text)
            logprobs = bool(req.logprobs)
            # free inside the reasoning, constrained from its end
            spec = with_reasoning(
                chat_spec(req, mode, fmt, self.close_schemas),
                reasoning,
                text,
                thinking_open,
                harmony_calls=fmt is not None and fmt.harmony,
            )
            param = "tools" if spec is not None and spec.kind == "tool_call" else "response_format"
            constraint = self.build_constraint(spec, param)
        else:
            if isinstance(req.prompt, str):
                prompt = self.codec.encode(req.prompt)
            else:
                prompt = list(req.prompt)
                vocab = self.codec.vocab_size
                if any(not 0 <= t < vocab for t in prompt):
                    raise APIError(
                        400, f"prompt token ids must lie in [0, {vocab})", param="prompt"
                    )
            logprobs = req.logprobs is not None and req.logprobs > 0
        if not prompt:
            raise APIError(400, "The prompt is empty.", param="prompt" if not chat else "messages")
        room = self.max_context - len(prompt)
        max_tokens = effective_max_tokens(req)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_context} tokens. However, you "
                f"requested {len(prompt) + (max_tokens or 1)} tokens ({len(prompt)} in the "
                f"prompt, {max_tokens or 1} for the completion).",
                param="max_tokens" if room >= 1 else "messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        limit = max_tokens if max_tokens is not None else room
        if req.min_tokens and req.min_tokens > limit:
            raise APIError(
                400,
                f"Invalid value for 'min_tokens': {req.min_tokens} is more than the "
                f"{limit} tokens the completion may have (max_tokens, or the context left).",
                param="min_tokens",
            )
        if constraint is not None:
            for name in ("ignore_eos", "min_tokens"):
                if getattr(req, name):
                    raise APIError(
                        400,
                        f"'{name}' cannot be used with constrained output (response_format or "
                        "a required or named tool): the grammar decides where the output ends.",
                        param=name,
                    )
        sampling = to_sampling_params(req, vocab_size=self.codec.vocab_size)
        if sampling.seed is None:
            sampling = replace(sampling, seed=secrets.randbits(63))
        generation = GenerationRequest(
            request_id=request_id,
            prompt_ids=prompt,
            max_tokens=max_tokens if max_tokens is not None else room,
            sampling=sampling,
            n=req.n or 1,
            constraint=constraint,
            ignore_eos=bool(req.ignore_eos),
            min_tokens=req.min_tokens or 0,
        )
        return Prepared(
            request_id=request_id,
            created=int(time.time()),
            model=self.model,
            generation=generation,
            stop=stop_list(req),
            logprobs=logprobs,
            stream=bool(req.stream),
            include_usage=include_usage(req),
            chat=chat,
            tools=tools,
            reasoning=reasoning,
            thinking_open=thinking_open,
        )

    # -- generating one choice --------------------------------------------------------------
    async def _choice_events(
        self, prep: Prepared, index: int, tally: ChoiceTally | None = None
    ) -> AsyncGenerator[ChoiceEvent, None]:
        """Text pieces of one choice as they become safe to emit (the answer in ``text``, the
        reasoning in ``reasoning``), then its finish reason; ``tally`` counts its reasoning
        tokens."""
        parser = make_parser(
            prep.reasoning,
            prep.thinking_open,
            calls=prep.tools is not None and prep.tools.format.harmony,
        )
        # (a tool format whose call marker is a special token needs it in the text; so do
        # harmony's channels)
        keep_special = parser.keeps_special or (
            prep.tools is not None and prep.tools.format.keep_special_tokens
        )
        detok = IncrementalDetokenizer(
            self.codec.tokenizer,
            prep.generation.prompt_ids,
            prep.stop,
            skip_special_tokens=not keep_special,
            min_tokens=prep.generation.min_tokens,
        )
        stats = GenerationStats()
        received = time.perf_counter()
        last = received
        finish: FinishReason = "length"
        outcome: str | None = None  # how the choice ended: its finish reason, cancelled or error
        try:
            async with contextlib.aclosing(
                self.engine.generate(prep.generation, index, stats)
            ) as tokens:
                async for token in tokens:
                    now = time.perf_counter()
                    if stats.tokens == 1:
                        self.metrics.time_to_first_token.observe(now - received)
                    else:
                        self.metrics.inter_token_latency.observe(now - last)
                    last = now
                    self.metrics.generated_tokens.inc()
                    if self._ends(prep, token.token_id):
                        finish = "stop"
                        yield ChoiceEvent(index, "", token)  # counted in usage, no text
                        break
                    thought, piece = parser.feed(detok.add(token.token_id))
                    if tally is not None:
                        tally.reasoning_tokens = parser.tokens
                    yield ChoiceEvent(index, piece, token, reasoning=thought)
                    if detok.stopped:
                        finish = "stop"
                        break
                # Inside the block: the answer goes out before the sessions are released.
                thought, tail = parser.feed("" if detok.stopped else detok.finish())
                more_thought, more_tail = parser.finish()
                outcome = finish
                yield ChoiceEvent(
                    index,
                    tail + more_tail,
                    None,
                    finish,
                    stats.cached_tokens,
                    reasoning=thought + more_thought,
                )
        except (asyncio.CancelledError, GeneratorExit):
            outcome = outcome or "cancelled"  # the client left (or the request was cancelled)
            raise
        finally:
            outcome = outcome or "error"
            self.metrics.choices.labels(outcome).inc()
            elapsed = time.perf_counter() - received
            ttft = f"{stats.first_token_s * 1000:.0f} ms" if stats.first_token_s else "-"
            log.info(
                "request %s choice %d: %d prompt + %d completion tokens, queued %.0f ms, "
                "first token %s, %.1f s in all, finish %s",
                prep.request_id,
                index,
                len(prep.generation.prompt_ids),
                stats.tokens,
                stats.queued_s * 1000,
                ttft,
                elapsed,
                outcome,
            )

    def _ends(self, prep: Prepared, token_id: int) -> bool:
        """Whether ``token_id`` ends the choice (an end-of-sequence id, unless ignore_eos)."""
        return token_id in self.engine.eos_ids and not prep.generation.ignore_eos

    def _token_bytes(self, token_id: int) -> bytes:
        piece = self.codec.tokenizer.id_to_token(token_id) or ""
        return _byte_level_bytes(piece)

    def _record(self, prep: Prepared, result: ChoiceResult, event: ChoiceEvent) -> None:
        if event.token is None:
            return
        result.tokens += 1
        eos = self._ends(prep, event.token.token_id)
        if eos or not prep.logprobs or event.token.logprob is None:
            return
        raw = self._token_bytes(event.token.token_id)
        top = [(self._token_bytes(t), lp) for t, lp in event.token.top]
        if prep.chat:
            result.chat_logprobs.append(chat_token_logprob(raw, event.token.logprob, top))
        else:
            lp = result.legacy_logprobs
            lp.text_offset.append(len(result.text))
            lp.tokens.append(raw.decode("utf-8", errors="replace"))
            lp.token_logprobs.append(event.token.logprob)
            lp.top_logprobs.append({t.decode("utf-8", errors="replace"): v for t, v in top})

    async def _run_choice(self, prep: Prepared, index: int) -> ChoiceResult:
        result = ChoiceResult(index)
        tally = ChoiceTally()
        async for event in self._choice_events(prep, index, tally):
            self._record(prep, result, event)
            result.text += event.text
            result.reasoning += event.reasoning
            result.reasoning_tokens = tally.reasoning_tokens
            if event.finish_reason:
                result.finish_reason = event.finish_reason
                result.cached_tokens = event.cached_tokens
        return result

    # -- non-streaming --------------------------------------------------------------------
    async def complete(self, prep: Prepared) -> ChatCompletion | Completion:
        self.metrics.prompt_tokens.inc(len(prep.generation.prompt_ids) * prep.generation.n)
        try:
            results = await asyncio.gather(
                *(self._run_choice(prep, i) for i in range(prep.generation.n))
            )
        except Exception as exc:
            error = generation_api_error(exc)
            if error is None:
                raise
            raise error from exc
        usage = self._usage(prep, results)
        if prep.chat:
            return ChatCompletion(
                id=prep.request_id,
                created=prep.created,
                model=prep.model,
                usage=usage,
                choices=[
                    ChatCompletionChoice(
                        index=r.index,
                        message=message,
                        logprobs=ChatChoiceLogprobs(content=r.chat_logprobs)
                        if prep.logprobs
                        else None,
                        finish_reason=finish,
                    )
                    for r, (message, finish) in zip(
                        results, (self._message(prep, r) for r in results), strict=True
                    )
                ],
            )
        return Completion(
            id=prep.request_id,
            created=prep.created,
            model=prep.model,
            usage=usage,
            choices=[
                CompletionChoice(
                    index=r.index,
                    text=r.text,
                    logprobs=r.legacy_logprobs if prep.logprobs else None,
                    finish_reason=r.finish_reason,
                )
                for r in results
            ],
        )

    @staticmethod
    def _usage(prep: Prepared, results: list[ChoiceResult]) -> Usage:
        """Usage of all choices; with reasoning, ``completion_tokens_details.reasoning_tokens``."""
        return Usage.of(
            len(prep.generation.prompt_ids) * prep.generation.n,
            sum(r.tokens for r in results),
            sum(r.cached_tokens for r in results),
            sum(r.reasoning_tokens for r in results) if prep.reasoning != "none" else None,
        )

    @staticmethod
    def _message(prep: Prepared, result: ChoiceResult) -> tuple[ChatResponseMessage, FinishReason]:
        """A whole choice's message (its tool calls read from its answer, never from its
        reasoning) and finish reason."""
        thought = result.reasoning or None
        if prep.tools is None:
            message = ChatResponseMessage(content=result.text, reasoning_content=thought)
            return message, result.finish_reason
        content, calls = parse_tool_calls(
            result.text, prep.tools.format, prep.tools.parallel, prep.tools.schemas
        )
        if not calls:
            return ChatResponseMessage(
                content=content, reasoning_content=thought
            ), result.finish_reason
        message = ChatResponseMessage(
            content=content or None,
            reasoning_content=thought,
            tool_calls=[_tool_call(call) for call in calls],
        )
        return message, finish_with_calls(result.finish_reason, len(calls))

    # -- the events of one choice, for the other API dialects ---------------------------------
    async def open_events(
        self, prep: Prepared, tally: ChoiceTally | None = None
    ) -> AsyncGenerator[ChoiceEvent, None]:
        """The events of a one-choice request (its text pieces, then its finish reason), for
        an API that shapes its own answer (server/api/anthropic.py, responses_api.py). The
        first event is awaited here, so a failure before any output (a full queue, a stage
        down) is raised as an :class:`APIError` by this call; a later one is raised as one
        by the iteration. Close the generator to end the generation early; ``tally`` counts
        its reasoning tokens."""
        if prep.generation.n != 1:
            raise ValueError("open_events serves one choice")
        self.metrics.prompt_tokens.inc(len(prep.generation.prompt_ids))
        stream = self._choice_events(prep, 0, tally)
        try:
            first = await anext(stream)
        except BaseException as exc:
            await stream.aclose()
            error = generation_api_error(exc)
            if error is not None:
                raise error from exc
            raise
        return self._events_after(first, stream)

    @staticmethod
    async def _events_after(
        first: ChoiceEvent, stream: AsyncGenerator[ChoiceEvent, None]
    ) -> AsyncGenerator[ChoiceEvent, None]:
        try:
            yield first
            async for event in stream:
                yield event
        except Exception as exc:
            error = generation_api_error(exc)
            if error is not None:
                raise error from exc
            raise
        finally:
            await stream.aclose()

    # -- streaming ------------------------------------------------------------------------
    async def open_stream(self, prep: Prepared) -> AsyncIterator[bytes]:
        """Start every choice and wait for its first event, so that errors before any output
        are raised here (and become plain HTTP errors); then return the SSE byte stream. A
        first event slower than ``keepalive_s`` (a long prefill) is not waited for: the stream
        starts, keep-alive comments hold it open, and a failure comes as an error event."""
        self.metrics.prompt_tokens.inc(len(prep.generation.prompt_ids) * prep.generation.n)
        tallies = [ChoiceTally() for _ in range(prep.generation.n)]
        streams = [self._choice_events(prep, i, t) for i, t in enumerate(tallies)]
        firsts = [asyncio.ensure_future(anext(stream)) for stream in streams]
        try:
            await asyncio.wait(firsts, timeout=self.keepalive_s or None)
            for first in firsts:
                if first.done():
                    first.result()  # raises its failure
        except BaseException as exc:
            for first in firsts:
                first.cancel()
            await asyncio.gather(*firsts, return_exceptions=True)
            for stream in streams:
                await stream.aclose()
            error = generation_api_error(exc)
            if error is not None:
                raise error from exc
            raise
        return self._sse(prep, streams, firsts, tallies)

    async def _sse(
        self,
        prep: Prepared,
        streams: list[AsyncGenerator[ChoiceEvent, None]],
        firsts: Sequence[asyncio.Future[ChoiceEvent]],
        tallies: list[ChoiceTally],
    ) -> AsyncIterator[bytes]:
        queue: asyncio.Queue[ChoiceEvent | BaseException | None] = asyncio.Queue()

        async def pump(
            first: asyncio.Future[ChoiceEvent], stream: AsyncGenerator[ChoiceEvent, None]
        ) -> None:
            try:
                await queue.put(await first)
                async for event in stream:
                    await queue.put(event)
            except BaseException as exc:  # surfaced on the stream as one error event
                await queue.put(exc)
                return
            await queue.put(None)

        tasks = [asyncio.create_task(pump(f, s)) for f, s in zip(firsts, streams, strict=True)]
        results = [ChoiceResult(i) for i in range(len(streams))]
        pending = len(streams)
        try:
            if prep.chat:
                for i in range(len(streams)):
                    content = None if prep.tools is not None else ""
                    opening = first_chat_chunk(
                        prep.request_id, prep.created, prep.model, i, content
                    )
                    yield sse_event(opening)
            while pending:
                if not queue.empty():  # (the per-token case: no timer)
                    item = queue.get_nowait()
                else:
                    try:  # a keep-alive comment while nothing comes (a long prefill)
                        item = await asyncio.wait_for(queue.get(), self.keepalive_s or None)
                    except TimeoutError:
                        yield sse_keepalive()
                        continue
                if item is None:
                    pending -= 1
                    continue
                if isinstance(item, BaseException):
                    if isinstance(item, asyncio.CancelledError):
                        raise item
                    error = generation_api_error(item) or APIError(
                        500, f"generation failed: {item}", type="server_error"
                    )
                    log.warning("request %s failed while streaming: %s", prep.request_id, item)
                    yield sse_error(error)
                    yield sse_done()
                    return
                if item.finish_reason:
                    results[item.index].cached_tokens = item.cached_tokens
                for chunk in self._chunks(prep, results[item.index], item):
                    yield chunk
            if prep.include_usage:
                for result, tally in zip(results, tallies, strict=True):
                    result.reasoning_tokens = tally.reasoning_tokens
                usage = self._usage(prep, results)
                make = chat_usage_chunk if prep.chat else completion_usage_chunk
                yield sse_event(make(prep.request_id, prep.created, prep.model, usage))
            yield sse_done()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, *firsts, return_exceptions=True)
            for stream in streams:
                with contextlib.suppress(BaseException):
                    await stream.aclose()

    def _chunks(self, prep: Prepared, result: ChoiceResult, event: ChoiceEvent) -> list[bytes]:
        before = len(result.chat_logprobs) if prep.chat else len(result.legacy_logprobs.tokens)
        self._record(prep, result, event)
        out: list[bytes] = []
        ident = (prep.request_id, prep.created, prep.model)
        if prep.chat and prep.tools is not None:
            out.extend(self._tool_chunks(prep, result, event, before))
        elif prep.chat:
            new_lp = result.chat_logprobs[before:] if prep.logprobs else None
            if event.reasoning:  # the tokens' logprobs go with the first piece of their text
                with_lp, new_lp = new_lp or None, None
                chunk = chat_reasoning_chunk(*ident, event.reasoning, event.index, with_lp)
                out.append(sse_event(chunk))
            if event.text or new_lp:
                out.append(
                    sse_event(
                        chat_content_chunk(
                            *ident, event.text, event.index, new_lp if new_lp else None
                        )
                    )
                )
            if event.finish_reason:
                out.append(sse_event(chat_final_chunk(*ident, event.finish_reason, event.index)))
        else:
            lp = result.legacy_logprobs
            piece = None
            if prep.logprobs and len(lp.tokens) > before:
                piece = CompletionLogprobs(
                    tokens=lp.tokens[before:],
                    token_logprobs=lp.token_logprobs[before:],
                    top_logprobs=lp.top_logprobs[before:],
                    text_offset=lp.text_offset[before:],
                )
            if event.finish_reason:
                out.append(
                    sse_event(
                        completion_final_chunk(
                            *ident,
                            event.finish_reason,
                            event.index,
                            event.text,
                            piece,
                        )
                    )
                )
            elif event.text or piece:
                out.append(sse_event(completion_text_chunk(*ident, event.text, event.index, piece)))
        result.text += event.text
        result.reasoning += event.reasoning
        return out

    def _tool_chunks(
        self, prep: Prepared, result: ChoiceResult, event: ChoiceEvent, before: int
    ) -> list[bytes]:
        """A chat stream with tools: the answer's text as content, each call once complete
        (its id and name, then its arguments), ``finish_reason: "tool_calls"`` after calls."""
        assert prep.tools is not None
        if result.parser is None:
            result.parser = prep.tools.parser()
        ident = (prep.request_id, prep.created, prep.model)
        events = result.parser.feed(event.text)  # the answer only: calls come after reasoning
        if event.finish_reason:
            events += result.parser.finish()
        new_lp = result.chat_logprobs[before:] if prep.logprobs else []
        out: list[bytes] = []
        if event.reasoning:  # the tokens' logprobs go with the first piece of their text
            lp, new_lp = new_lp or None, []
            out.append(sse_event(chat_reasoning_chunk(*ident, event.reasoning, event.index, lp)))
        for item in events:
            if isinstance(item, ParsedToolCall):
                chunks = chat_tool_call_chunks(
                    *ident, result.calls, new_call_id(), item.name, item.arguments, event.index
                )
                out.extend(sse_event(chunk) for chunk in chunks)
                result.calls += 1
            else:
                lp, new_lp = new_lp or None, []  # the tokens' logprobs go with the first text
                out.append(sse_event(chat_content_chunk(*ident, item, event.index, lp)))
        if new_lp:  # logprobs of tokens whose text is held back (or is a call)
            out.append(sse_event(chat_content_chunk(*ident, "", event.index, new_lp)))
        if event.finish_reason:
            finish = finish_with_calls(event.finish_reason, result.calls)
            out.append(sse_event(chat_final_chunk(*ident, finish, event.index)))
        return out


def _tool_call(call: ParsedToolCall) -> ToolCall:
    return ToolCall(
        id=new_call_id(), function=ToolCallFunction(name=call.name, arguments=call.arguments)
    )


def _byte_level_bytes(piece: str) -> bytes:
    """The raw bytes of a byte-level BPE token string (GPT-2 style byte-to-unicode map)."""
    table = _unicode_to_byte()
    if all(ch in table for ch in piece):
        return bytes(table[ch] for ch in piece)
    return piece.encode("utf-8")


_TABLE: dict[str, int] = {}


def _unicode_to_byte() -> dict[str, int]:
    if not _TABLE:
        visible = (
            list(range(ord("!"), ord("~") + 1))
            + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1))
        )
        codes = visible[:]
        extra = 0
        for b in range(256):
            if b not in visible:
                visible.append(b)
                codes.append(256 + extra)
                extra += 1
        _TABLE.update({chr(c): b for b, c in zip(visible, codes, strict=True)})
    return _TABLE
