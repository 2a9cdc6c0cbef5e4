"""When and how far the engine speculates: the policy between the step loop and the proposer.

``decode step -> SpeculationPolicy.plan (k from measured costs and acceptance, the draft's
proposals) -> StepPlan -> ring -> learn (accepted tokens, step times)``; ``warm`` lets the draft
take in a prompt while the stages prefill it. The proposer runs in one thread beside the event
loop, its work in order (proposals, warm-up, releases).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from protos.sampling import SampledToken, SamplingParams
from server.engine.sequence import Phase, Sequence
from server.engine.speculative import Acceptance, KByConcurrency, Proposer
from server.engine.step_plan import StepPlan
from server.metrics import GatewayMetrics

log = logging.getLogger(__name__)


class SpeculationPolicy:
    def __init__(
        self,
        proposer: Proposer,
        fixed_k: int | None = None,
        max_k: int = 8,
        max_users: int = 0,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.proposer = proposer
        self.fixed_k = fixed_k
        self.max_k = max_k
        # Above this many requests decoding at once every step is plain (0: no limit): where
        # the draft shares cores with the stages, it costs more than it saves once the ring
        # is full (see docs/benchmarks.md).
        self.max_users = max_users
        self.metrics = metrics
        self.k = KByConcurrency(max_k, fixed_k)  # server-wide costs, by concurrency
        self._acceptance: dict[str, Acceptance] = {}  # each request's own acceptance rate
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="draft")

    def active(self, users: int) -> bool:
        """Whether to speculate with this many requests decoding (speculation_max_users)."""
        return not self.max_users or users <= self.max_users

    async def warm(self, seq: Sequence) -> None:
        """The draft takes in the prompt one chunk per turn of its thread (proposals of other
        requests queued meanwhile go first), while the sequence lives."""
        loop, warm = asyncio.get_running_loop(), self.proposer.warm
        try:
            while seq.phase is not Phase.DONE:
                if await loop.run_in_executor(self._pool, warm, seq.seq_id, seq.prompt):
                    return
        except Exception:
            log.warning("draft warm-up of %s failed", seq.seq_id, exc_info=True)

    async def plan(
        self,
        seq: Sequence,
        tokens: tuple[int, ...],
        start_position: int,
        sampling: SamplingParams,
        level: int,
        max_context: int,
    ) -> StepPlan:
        """A decode step's plan: ``tokens`` plus the draft's proposals when speculating with
        ``level`` requests decoding (plain when paused for load, or nothing to propose)."""
        if not self.active(level):
            # plain: the draft catches up on these tokens when speculation resumes
            self._count_step("paused")
            return StepPlan(tokens, level=level)
        greedy = sampling.temperature == 0.0
        own = self._acceptance.get(seq.seq_id)
        k = self.k.choose(level, greedy, own.rate if own is not None else None)
        # no proposals beyond max_tokens or the context (greedy also gets a bonus token)
        k = min(k, seq.max_tokens - len(seq.generated) - int(greedy))
        k = min(k, max_context - start_position - 2)
        if k < 1:
            self._count_step("plain")
            return StepPlan(tokens, level=level)
        context = [*seq.prompt, *seq.generated]
        proposal = await asyncio.get_running_loop().run_in_executor(
            self._pool, self.proposer.propose, seq.seq_id, context, k, sampling, len(seq.prompt)
        )
        draft = proposal.tokens
        if not draft:
            self._count_step("plain")
            return StepPlan(tokens, level=level)
        self._count_step("speculative")
        # Greedy: feed every proposal and verify one more position (the bonus). Sampling: every
        # position tests a proposal.
        fed = (*tokens, *(draft if greedy else draft[:-1]))
        if self.metrics is not None:
            self.metrics.spec_k.observe(len(draft))
            self.metrics.draft_seconds.observe(proposal.seconds)
        return StepPlan(fed, tuple(draft), proposal.seconds, level)

    def learn(
        self,
        seq_id: str,
        plan: StepPlan,
        emitted: list[SampledToken],
        pass_s: float,
        step_s: float,
    ) -> None:
        """A speculative step's outcome: how many proposals the ring accepted, and its times."""
        accepted = 0
        for token, proposed in zip(emitted, plan.draft, strict=False):
            if token.token_id != proposed:
                break
            accepted += 1
        self.k.level(plan.level).update(
            len(plan.draft), accepted, len(plan.tokens), pass_s, plan.draft_s, step_s
        )
        own = self._acceptance.get(seq_id)
        if own is None:  # a new request starts from the server-wide rate
            own = self._acceptance[seq_id] = Acceptance(self.k.acceptance)
        own.update(len(plan.draft), accepted)
        if self.metrics is not None:
            self.metrics.spec_proposed.inc(len(plan.draft))
            self.metrics.spec_accepted.inc(accepted)

    def learn_plain(self, plan: StepPlan, step_s: float) -> None:
        """A plain decode step's time, at the concurrency it ran at."""
        self.k.level(plan.level).update_plain(step_s)

    def release(self, seq_id: str) -> None:
        """The sequence ended: the draft frees its state (in order after its proposals)."""
        self._acceptance.pop(seq_id, None)
        future = asyncio.get_running_loop().run_in_executor(
            self._pool, self.proposer.release, seq_id
        )
        future.add_done_callback(_log_failure)

    async def close(self) -> None:
        """Wait (up to 5 s) for the releases queued before, then stop the draft's thread."""
        with contextlib.suppress(Exception):
            barrier = asyncio.get_running_loop().run_in_executor(self._pool, _after_queued)
            await asyncio.wait_for(barrier, 5.0)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _count_step(self, mode: str) -> None:
        if self.metrics is not None:
            self.metrics.spec_steps.labels(mode=mode).inc()


def _after_queued() -> None:
    """Run on the draft's thread after what was queued before it: a barrier."""


def _log_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("draft work failed", exc_info=future.exception())
