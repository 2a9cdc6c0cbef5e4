"""How a stage computes steps: the interface between the gRPC service and the model.

``StepInput (the StepRequest, and its token ids or hidden states) -> backend ->
hidden states (next stage) or sampled tokens (last stage)``

The service hands a backend a *batch* of steps of different sessions and runs up to
``parallelism`` batches at once; a session never has two steps in one batch or in two batches
at the same time. :class:`StatefulBackend` (one OpenVINO infer request and KV state per
session, one compiled model shared by all) computes steps one by one, ``parallelism`` (the
CPU streams) at once. :class:`PagedBackend` runs every step of a batch - decode tokens,
prefill chunks and speculative verifications of different sessions - in one inference call
over a shared KV block pool (:mod:`shard_runtime.paged`), so the weights are read once per batch
instead of once per session.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from protos.sampling import SampledToken
from protos.step import StepRequest
from shard_runtime.paged import PagedRunner, PagedStep
from shard_runtime.runner import ShardBase, ShardRunner
from shard_runtime.step import check_deadline, check_fed, last_stage_tokens
from stage_node.metrics import StageMetrics


@dataclass(frozen=True)
class StepInput:
    request: StepRequest
    data: np.ndarray  # token ids [T] on stage 0, hidden states [T, H] after it


# Hidden states for the next stage, sampled tokens on the last stage, None for a pure
# rollback, or the exception that failed this step (other steps of the batch are unaffected).
StepOutcome = np.ndarray | list[SampledToken] | None | Exception


class StageBackend(Protocol):
    parallelism: int  # batches computed at the same time
    max_batch: int  # steps in one batch at most

    def compute(self, batch: Sequence[StepInput]) -> list[StepOutcome]:
        """Run every step of ``batch`` (distinct sessions); one outcome per step, in order."""
        ...


class _Backend:
    """What both backends share: deadlines, rollbacks, phases and sampling at the last stage."""

    def __init__(self, runner: ShardBase, metrics: StageMetrics) -> None:
        self.runner = runner
        self.metrics = metrics

    def _prepare(self, item: StepInput) -> bool:
        """Check the deadline and apply the rollback; False for a pure rollback (no tokens)."""
        step = item.request
        check_deadline(step, self.runner.stage.index)
        if step.rollback:
            started = time.perf_counter()
            self.runner.rollback(step.session_id, step.rollback)
            self.metrics.rollback_seconds.observe(time.perf_counter() - started)
        return check_fed(step, len(item.data))

    @staticmethod
    def phase(item: StepInput) -> str:
        if item.request.draft_tokens:
            return "verify"
        return "prefill" if len(item.data) > 1 else "decode"

    def _emit(self, item: StepInput, out: np.ndarray) -> np.ndarray | list[SampledToken]:
        """Hidden states pass on; the last stage samples (or verifies draft tokens)."""
        if not self.runner.is_last:
            return out
        return last_stage_tokens(out, item.request, len(item.data))


class StatefulBackend(_Backend):
    """One infer request per session (OpenVINO stateful KV cache); steps run one by one."""

    runner: ShardRunner
    max_batch = 1  # a batch would only queue steps behind each other: streams run them

    def __init__(self, runner: ShardRunner, metrics: StageMetrics, parallelism: int = 1) -> None:
        super().__init__(runner, metrics)
        self.parallelism = parallelism

    def compute(self, batch: Sequence[StepInput]) -> list[StepOutcome]:
        outcomes: list[StepOutcome] = []
        for step in batch:
            try:
                outcomes.append(self._one(step))
            except Exception as exc:
                outcomes.append(exc)
        return outcomes

    def _one(self, step: StepInput) -> np.ndarray | list[SampledToken] | None:
        if not self._prepare(step):
            return None
        count, request = len(step.data), step.request
        start = request.start_position
        positions = np.arange(start, start + count, dtype=np.int64)
        phase = self.phase(step)
        started = time.perf_counter()
        out = self.runner.forward(
            request.session_id, step.data, positions, max(1, request.num_logits)
        )
        self.metrics.forward_seconds.labels(phase).observe(time.perf_counter() - started)
        self.metrics.tokens.labels(phase).inc(count)
        self.metrics.batch_size.observe(1)
        self.metrics.batch_tokens.observe(count)
        return self._emit(step, out)


class PagedBackend(_Backend):
    """Every step of a batch in one inference call over the stage's shared KV block pool."""

    runner: PagedRunner
    parallelism = 1  # one inference call at a time owns the pool

    def __init__(self, runner: PagedRunner, metrics: StageMetrics, max_batch: int = 64) -> None:
        super().__init__(runner, metrics)
        self.max_batch = max_batch
        self._evictions = 0  # the pool's evictions already counted
        self._metrics_lock = threading.Lock()
        self.pool_metrics()

    def pool_metrics(self) -> None:
        """The KV block gauges and the evictions counter, now (from any thread)."""
        blocks = self.runner.blocks
        with self._metrics_lock:
            self.metrics.kv_blocks.labels("used").set(blocks.used)
            self.metrics.kv_blocks.labels("free").set(blocks.free)
            self.metrics.kv_blocks.labels("cached").set(blocks.cached)
            states = self.runner.states
            if states is not None:
                self.metrics.state_slots.labels("used").set(states.used)
                self.metrics.state_slots.labels("free").set(states.free)
            evictions = blocks.evictions
            self.metrics.kv_blocks_evicted.inc(evictions - self._evictions)
            self._evictions = evictions

    def compute(self, batch: Sequence[StepInput]) -> list[StepOutcome]:
        outcomes: list[StepOutcome] = [None] * len(batch)
        placed: list[tuple[int, PagedStep]] = []
        for i, step in enumerate(batch):
            try:
                if not self._prepare(step):
                    continue
                data = self.runner.check_chunk(step.data)
                request = step.request
                item = PagedStep(
                    request.session_id,
                    data,
                    request.start_position,
                    max(1, request.num_logits),
                    solo=request.solo,
                    hashes=request.block_hashes,
                )
                self.runner.place(item)
                placed.append((i, item))
            except Exception as exc:
                outcomes[i] = exc
        if placed:
            phases = {i: self.phase(batch[i]) for i, _ in placed}
            kinds = set(phases.values())
            phase = kinds.pop() if len(kinds) == 1 else "mixed"
            tokens = sum(len(item.data) for _, item in placed)
            started = time.perf_counter()
            try:
                outs = self.runner.forward([item for _, item in placed])
            except Exception as exc:
                for i, _ in placed:
                    outcomes[i] = exc
            else:
                self.metrics.forward_seconds.labels(phase).observe(time.perf_counter() - started)
                self.metrics.batch_size.observe(len(placed))
                self.metrics.batch_tokens.observe(tokens)
                for (i, _), out in zip(placed, outs, strict=True):
                    self.metrics.tokens.labels(phases[i]).inc(len(batch[i].data))
                    try:
                        outcomes[i] = self._emit(batch[i], out)
                    except Exception as exc:
                        outcomes[i] = exc
        self.pool_metrics()
        return outcomes
