"""One step of one session through the ring, as the gateway asks for it and every stage reads
it: the native form of ``pb.Step``, and the only code that converts between the two.

A per-step field is declared in the proto, here, and used where it matters (the gateway's
engine that sets it, the stage code that reads it); nothing in between names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protos import pipeshard_v1_pb2 as pb
from protos.codec import sampling_from_pb, sampling_to_pb
from protos.sampling import SamplingParams


@dataclass(frozen=True)
class StepRequest:
    """Feed ``token_ids`` of ``session_id`` at ``start_position`` and sample ``num_logits``
    rows at the last stage (see ``pb.Step`` for each field's meaning)."""

    session_id: str
    token_ids: tuple[int, ...] = ()  # stage 0's input (later stages get hidden states)
    start_position: int = 0
    rollback: int = 0
    num_logits: int = 1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    history: tuple[int, ...] = ()  # generated tokens, for the penalties
    draft_tokens: tuple[int, ...] = ()  # speculative decoding: the last stage verifies them
    group: int = 0  # micro-batch group
    solo: bool = False  # computed in calls of its own
    follow: int = 0  # decode steps the ring then runs on its own
    stop_ids: tuple[int, ...] = ()  # where the ring's own decoding stops
    block_hashes: tuple[bytes, ...] = ()  # prefix cache: the KV blocks this step fills
    token_masks: tuple[bytes, ...] = ()  # constrained decoding: one per sampled row
    suppress_ids: tuple[int, ...] = ()  # min_tokens: never sampled before suppress_before
    suppress_before: int = 0
    prompt_ids_seen: tuple[int, ...] = ()  # repetition_penalty: the prompt's distinct ids
    # The envelope, set by the ring client that sends the step
    step_id: int = 0
    client_id: str = ""
    deadline_unix_ms: int = 0  # 0: none

    def to_pb(self) -> pb.Step:
        return pb.Step(
            session_id=self.session_id,
            step_id=self.step_id,
            client_id=self.client_id,
            token_ids=self.token_ids,
            num_tokens=len(self.token_ids),
            start_position=self.start_position,
            rollback=self.rollback,
            num_logits=self.num_logits,
            sampling=sampling_to_pb(self.sampling),
            history=self.history,
            deadline_unix_ms=self.deadline_unix_ms,
            draft_tokens=self.draft_tokens,
            group=self.group,
            solo=self.solo,
            follow=self.follow,
            stop_ids=self.stop_ids,
            block_hashes=self.block_hashes,
            token_masks=self.token_masks,
            suppress_ids=self.suppress_ids,
            suppress_before=self.suppress_before,
            prompt_ids_seen=self.prompt_ids_seen,
        )

    @classmethod
    def from_pb(cls, step: pb.Step) -> StepRequest:
        return cls(
            session_id=step.session_id,
            token_ids=tuple(step.token_ids),
            start_position=step.start_position,
            rollback=step.rollback,
            num_logits=step.num_logits,
            sampling=sampling_from_pb(step.sampling),
            history=tuple(step.history),
            draft_tokens=tuple(step.draft_tokens),
            group=step.group,
            solo=step.solo,
            follow=step.follow,
            stop_ids=tuple(step.stop_ids),
            block_hashes=tuple(step.block_hashes),
            token_masks=tuple(step.token_masks),
            suppress_ids=tuple(step.suppress_ids),
            suppress_before=step.suppress_before,
            prompt_ids_seen=tuple(step.prompt_ids_seen),
            step_id=step.step_id,
            client_id=step.client_id,
            deadline_unix_ms=step.deadline_unix_ms,
        )
