"""The engine: token ids and sampling parameters in, sampled tokens out, over the stage ring.

``GenerationRequest (ids, params) -> PipelineClient steps (one session per choice) ->
SampledToken stream``. Text, JSON and chat templates live in the HTTP layer above.
A session is released on every stage however the generation ends: finished, stopped early by
the caller (a stop string), failed, or cancelled because the client went away.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace

from server.pipeline import PipelineClient
from stage_node.sampling import SampledToken, SamplingParams

log = logging.getLogger(__name__)


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


class QueueFull(Exception):
    """More requests are waiting than the gateway queues."""


class Engine:
    def __init__(
        self,
        pipeline: PipelineClient,
        eos_ids: frozenset[int],
        max_context: int,
        max_concurrent: int = 16,
        max_queued: int = 256,
    ) -> None:
        self.pipeline = pipeline
        self.eos_ids = eos_ids
        self.max_context = max_context
        self.max_queued = max_queued
        self._slots = asyncio.Semaphore(max_concurrent)
        self.running = 0
        self.queued = 0

    def choice_sampling(self, request: GenerationRequest, choice: int) -> SamplingParams:
        """Each of n choices draws differently, reproducibly from the request's seed."""
        seed = (request.sampling.seed or 0) + choice
        return replace(request.sampling, seed=seed)

    async def generate(
        self, request: GenerationRequest, choice: int = 0, stats: GenerationStats | None = None
    ) -> AsyncGenerator[SampledToken, None]:
        """Yield up to ``max_tokens`` sampled tokens; stops after an end-of-sequence token."""
        stats = stats or GenerationStats()
        if self.queued >= self.max_queued:
            raise QueueFull(f"{self.queued} requests are already waiting")
        session = f"{request.request_id}-{choice}"
        sampling = self.choice_sampling(request, choice)
        waited = time.perf_counter()
        self.queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.queued -= 1
        stats.queued_s = time.perf_counter() - waited
        self.running += 1
        started = time.perf_counter()
        try:
            history: list[int] = []
            position = len(request.prompt_ids)
            out = await self.pipeline.step(session, request.prompt_ids, 0, sampling=sampling)
            stats.first_token_s = time.perf_counter() - started
            while True:
                token = out.tokens[0]
                history.append(token.token_id)
                stats.tokens = len(history)
                yield token
                if token.token_id in self.eos_ids or len(history) >= request.max_tokens:
                    return
                out = await self.pipeline.step(
                    session, [token.token_id], position, sampling=sampling, history=history
                )
                position += 1
        finally:
            self.running -= 1
            self._slots.release()
            # Shielded: runs to the end even when the client's disconnect cancelled us.
            release = asyncio.ensure_future(self.pipeline.release(session))
            try:
                await asyncio.shield(release)
            except asyncio.CancelledError:
                pass
            except Exception:
                log.warning("releasing session %s failed", session, exc_info=True)
