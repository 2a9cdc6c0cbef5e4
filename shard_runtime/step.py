"""What every stage does with one ring step, whichever way the step reached it: the stage's
gRPC service (stage_node) and the in-process ring (server.ring.local) both compute steps with
these, so that they sample the same tokens.

``StepRequest -> check_deadline, rollback -> runner.forward on each stage -> last_stage_tokens
(-> next_ring_step, when the ring decodes on its own)``
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from protos.sampling import SampledToken
from protos.step import StepRequest
from shard_runtime.runner import InvalidStageInput
from shard_runtime.sampling import apply_masks, sample, suppress
from shard_runtime.speculative import verify


class StepExpired(Exception):
    """The step's deadline passed before this stage got to it."""


def check_deadline(step: StepRequest, stage: int) -> None:
    if step.deadline_unix_ms and time.time() * 1000 > step.deadline_unix_ms:
        raise StepExpired(f"step {step.step_id} arrived at stage {stage} after its deadline")


def check_fed(step: StepRequest, fed: int) -> bool:
    """Whether the step feeds positions (``fed`` of them): False for a pure rollback; a step
    with neither tokens nor a rollback is refused."""
    if fed:
        return True
    if step.rollback:
        return False
    raise InvalidStageInput("a step must carry tokens or a rollback")


def last_stage_tokens(rows: np.ndarray, step: StepRequest, fed: int) -> list[SampledToken]:
    """The last stage's output for a step that fed ``fed`` positions, from its logits
    ``rows`` (the last ``len(rows)`` positions): the token masks applied, then the draft
    tokens verified (speculative decoding) or each row sampled at its own position. Rows at
    positions before ``suppress_before`` never sample ``suppress_ids`` (min_tokens)."""
    first = step.start_position + fed - len(rows)
    history = list(step.history)
    seen = step.prompt_ids_seen
    if step.token_masks:
        rows = apply_masks(rows, step.token_masks)
    if step.suppress_ids and first + 1 < step.suppress_before:
        rows = suppress(rows, step.suppress_ids, first + 1, step.suppress_before)
    if step.draft_tokens:
        return verify(rows, step.draft_tokens, step.sampling, first + 1, history, seen)
    return [sample(row, step.sampling, first + i + 1, history, seen) for i, row in enumerate(rows)]


def next_ring_step(step: StepRequest, emitted: Sequence[int], length: int) -> StepRequest | None:
    """The ring's own next decode step after ``step`` emitted ``emitted`` and left its session
    holding ``length`` positions (``step.follow``); None where the ring stops there (no
    follow left, or a token in ``step.stop_ids``). It is the same step one position on: what
    only the step the gateway sent carries (a rollback, a draft, masks, prefix blocks) is
    not carried over; the min_tokens suppression (by absolute position) and the prompt's ids
    are, and the emitted tokens join the history where a penalty needs it."""
    if not step.follow or not emitted or emitted[-1] in step.stop_ids:
        return None
    penalised = step.sampling.uses_history
    return replace(
        step,
        step_id=step.step_id + 1,
        token_ids=tuple(emitted[-1:]),
        start_position=length,
        rollback=0,
        num_logits=1,
        history=(*step.history, *emitted) if penalised else (),
        draft_tokens=(),
        follow=step.follow - 1,
        block_hashes=(),
        token_masks=(),
    )
