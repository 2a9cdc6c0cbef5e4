"""How a stage computes steps: the interface between the gRPC service and the model.

``StepInput (session, tokens or hidden states, positions, rollback, sampling) -> backend ->
hidden states (next stage) or sampled tokens (last stage)``

The service hands a backend a *batch* of steps of different sessions and runs up to
``parallelism`` batches at once; a session never has two steps in one batch or in two batches
at the same time. :class:`StatefulBackend` (one OpenVINO infer request and KV state per
session, one compiled model shared by all) computes a batch one step after another. A backend
with paged KV can take the same batch and run every session's tokens in one inference call;
nothing above this interface (service, ring, gateway scheduler) changes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from stage_node.metrics import StageMetrics
from stage_node.runner import InvalidStageInput, ShardRunner
from stage_node.sampling import SampledToken, SamplingParams, sample
from stage_node.speculative import DraftDistribution, verify


class StepExpired(Exception):
    """The step's deadline passed before this stage got to it."""


@dataclass(frozen=True)
class StepInput:
    session_id: str
    step_id: int
    data: np.ndarray  # token ids [T] on stage 0, hidden states [T, H] after it
    start_position: int
    rollback: int = 0
    num_logits: int = 1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    history: Sequence[int] = ()
    deadline_unix_ms: int = 0
    draft_tokens: Sequence[int] = ()  # speculative decoding: verify these (last stage)
    draft_dists: Sequence[DraftDistribution] = ()


# Hidden states for the next stage, sampled tokens on the last stage, None for a pure
# rollback, or the exception that failed this step (other steps of the batch are unaffected).
StepOutcome = np.ndarray | list[SampledToken] | None | Exception


class StageBackend(Protocol):
    parallelism: int  # batches computed at the same time

    def compute(self, batch: Sequence[StepInput]) -> list[StepOutcome]:
        """Run every step of ``batch`` (distinct sessions); one outcome per step, in order."""
        ...


class StatefulBackend:
    """One infer request per session (OpenVINO stateful KV cache); steps run one by one."""

    def __init__(self, runner: ShardRunner, metrics: StageMetrics, parallelism: int = 1) -> None:
        self.runner = runner
        self.metrics = metrics
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
        index = self.runner.stage.index
        if step.deadline_unix_ms and time.time() * 1000 > step.deadline_unix_ms:
            raise StepExpired(f"step {step.step_id} arrived at stage {index} after its deadline")
        if step.rollback:
            started = time.perf_counter()
            self.runner.rollback(step.session_id, step.rollback)
            self.metrics.rollback_seconds.observe(time.perf_counter() - started)
        count = len(step.data)
        if count == 0:
            if step.rollback:
                return None  # a pure rollback
            raise InvalidStageInput("a step must carry tokens or a rollback")
        positions = np.arange(step.start_position, step.start_position + count, dtype=np.int64)
        num_logits = max(1, step.num_logits)
        phase = "verify" if step.draft_tokens else "prefill" if count > 1 else "decode"
        started = time.perf_counter()
        out = self.runner.forward(step.session_id, step.data, positions, num_logits)
        self.metrics.forward_seconds.labels(phase).observe(time.perf_counter() - started)
        self.metrics.tokens.labels(phase).inc(count)
        if not self.runner.is_last:
            return out
        first = step.start_position + count - num_logits
        history = list(step.history)
        if step.draft_tokens:
            return verify(
                out, step.draft_tokens, step.draft_dists, step.sampling, first + 1, history
            )
        return [sample(row, step.sampling, first + i + 1, history) for i, row in enumerate(out)]
