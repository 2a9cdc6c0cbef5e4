"""The engine: token ids and sampling parameters in, sampled tokens out, over the stage ring.

``GenerationRequest (ids, params) -> Scheduler (one sequence and one session per choice) ->
PipelineClient steps, many sequences in the ring at once -> SampledToken stream``.

The scheduling policy lives in :mod:`server.scheduler` (a synchronous state machine); this
module is the thin async loop around it: it sends each tick's work through the ring, feeds the
results back, hands tokens to the waiting generators and frees the sessions of finished
sequences on every stage however they ended (finished, stopped early by the caller, failed, or
cancelled because the client went away). Text, JSON and chat templates live above.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace

from server.metrics import GatewayMetrics
from server.pipeline import PipelineClient
from server.scheduler import (
    Phase,
    QueueFull,
    QueueTimeout,
    Scheduler,
    SchedulerConfig,
    Sequence,
    Work,
)
from stage_node.sampling import SampledToken, SamplingParams

__all__ = ["Engine", "GenerationRequest", "GenerationStats", "QueueFull", "QueueTimeout"]
log = logging.getLogger(__name__)
_EXPIRY_CHECK_S = 0.5


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1


@dataclass
class GenerationStats:
    queued_s: float = 0.0
    first_token_s: float | None = None
    tokens: int = 0


@dataclass
class _Stream:
    """What the engine knows of one sequence beyond the scheduler's view."""

    sampling: SamplingParams
    queue: asyncio.Queue[SampledToken | BaseException | None] = field(default_factory=asyncio.Queue)


class Engine:
    def __init__(
        self,
        pipeline: PipelineClient,
        eos_ids: frozenset[int],
        max_context: int,
        config: SchedulerConfig | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.eos_ids = eos_ids
        self.max_context = max_context
        self.config = config or SchedulerConfig()
        self.scheduler = Scheduler(self.config, eos_ids)
        self.metrics = metrics
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._steps: set[asyncio.Task[None]] = set()

    @property
    def queued(self) -> int:
        return self.scheduler.queued

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    def choice_sampling(self, request: GenerationRequest, choice: int) -> SamplingParams:
        """Each of n choices draws differently, reproducibly from the request's seed."""
        seed = (request.sampling.seed or 0) + choice
        return replace(request.sampling, seed=seed)

    async def generate(
        self, request: GenerationRequest, choice: int = 0, stats: GenerationStats | None = None
    ) -> AsyncGenerator[SampledToken, None]:
        """Yield up to ``max_tokens`` sampled tokens; stops after an end-of-sequence token.

        Raises QueueFull at once when the queue is full, QueueTimeout when the request waited
        too long, PipelineError when a step fails.
        """
        stats = stats or GenerationStats()
        seq_id = f"{request.request_id}-{choice}"
        arrival = time.monotonic()
        seq = Sequence(seq_id, list(request.prompt_ids), request.max_tokens, arrival)
        self.scheduler.add(seq)  # raises QueueFull
        stream = _Stream(self.choice_sampling(request, choice))
        self._streams[seq_id] = stream
        self._kick()
        try:
            while True:
                item = await stream.queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                if stats.first_token_s is None:
                    admitted = seq.admitted or arrival
                    stats.queued_s = admitted - arrival
                    stats.first_token_s = time.monotonic() - admitted
                stats.tokens += 1
                yield item
        finally:
            self._streams.pop(seq_id, None)
            self.scheduler.cancel(seq_id)
            self._kick()

    # -- the loop ---------------------------------------------------------------------------
    def _kick(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._loop())
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            now = time.monotonic()
            for seq_id in self.scheduler.expire(now):
                self._end(seq_id)
            for item in self.scheduler.next_work(now):
                task = asyncio.create_task(self._run_step(item))
                self._steps.add(task)
                task.add_done_callback(self._steps.discard)
            releases = self.scheduler.take_releases()
            if releases:
                self._release(releases)
            self._observe()
            if not self.scheduler.sequences:
                return  # idle; the next request starts the loop again
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), _EXPIRY_CHECK_S)

    async def _run_step(self, item: Work) -> None:
        stream = self._streams.get(item.seq_id)
        seq = self.scheduler.sequences[item.seq_id]
        sampling = stream.sampling if stream is not None else SamplingParams()
        # The stage needs the generated tokens only for presence/frequency penalties.
        penalised = sampling.presence_penalty or sampling.frequency_penalty
        try:
            out = await self.pipeline.step(
                item.seq_id,
                item.tokens,
                item.start_position,
                sampling=sampling,
                history=list(seq.generated) if penalised and not item.prefill else (),
            )
        except Exception as exc:
            self.scheduler.on_error(item.seq_id, exc)
            self._end(item.seq_id)
        else:
            token = out.tokens[0] if out.tokens else None
            emitted = self.scheduler.on_result(
                item.seq_id, token.token_id if token is not None else None
            )
            if emitted and token is not None and stream is not None:
                stream.queue.put_nowait(token)
            if seq.phase is Phase.DONE:
                self._end(item.seq_id)
        finally:
            self._wake.set()

    def _end(self, seq_id: str) -> None:
        """Tell a finished sequence's consumer that it ended (and how)."""
        seq = self.scheduler.sequences.get(seq_id)
        stream = self._streams.get(seq_id)
        if stream is not None:
            stream.queue.put_nowait(seq.error if seq is not None and seq.error else None)

    def _release(self, seq_ids: list[str]) -> None:
        async def release() -> None:
            try:
                await self.pipeline.release(*seq_ids)
            except Exception:
                log.warning("releasing sessions %s failed", seq_ids, exc_info=True)

        task = asyncio.create_task(release())
        self._steps.add(task)
        task.add_done_callback(self._steps.discard)

    def _observe(self) -> None:
        admitted = self.scheduler.take_admitted()
        if self.metrics is None:
            return
        for seq in admitted:
            self.metrics.queue_seconds.observe((seq.admitted or seq.arrival) - seq.arrival)
        self.metrics.queued.set(self.scheduler.queued)
        self.metrics.running.set(len(self.scheduler.running))
        self.metrics.steps_in_flight.set(self.scheduler.in_flight)

    async def close(self) -> None:
        tasks = [t for t in (self._loop_task, *self._steps) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
