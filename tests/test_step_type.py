"""protos.step.StepRequest is pb.Step's one native form: every field of the wire message is in
it (but the stage's error and the packing count), and it survives the trip over the wire."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from protos import pipeshard_v1_pb2 as pb
from protos.sampling import SamplingParams
from protos.step import StepRequest
from shard_runtime.step import next_ring_step

pytestmark = pytest.mark.unit

# set by the stages, not by whoever sends a step: a failure, and the rows of packed hidden states
NOT_REQUESTED = {"error", "num_tokens"}


def test_the_dataclass_has_every_field_of_the_wire_step() -> None:
    wire = {f.name for f in pb.Step.DESCRIPTOR.fields} - NOT_REQUESTED
    assert wire == {f.name for f in fields(StepRequest)}


def test_a_step_survives_the_wire() -> None:
    step = StepRequest(
        session_id="s",
        token_ids=(4, 5, 6),
        start_position=9,
        rollback=2,
        num_logits=3,
        sampling=SamplingParams(
            temperature=0.5,
            top_p=0.75,
            top_k=5,
            seed=-3,
            logit_bias={1: 2.0},
            min_p=0.25,
            repetition_penalty=1.5,
        ),
        history=(7, 8),
        draft_tokens=(5, 6),
        group=2,
        solo=True,
        follow=0,
        stop_ids=(1,),
        block_hashes=(b"h",),
        token_masks=(b"\xff", b"\x0f", b"\x01"),
        suppress_ids=(1, 2),
        suppress_before=14,
        prompt_ids_seen=(3, 4),
        step_id=11,
        client_id="c",
        deadline_unix_ms=123,
    )
    message = step.to_pb()
    assert message.num_tokens == 3
    back = StepRequest.from_pb(pb.Step.FromString(message.SerializeToString()))
    assert back == step
    every = {f.name for f in fields(StepRequest)}
    assert {n for n in every if getattr(back, n) == getattr(StepRequest("s"), n)} == {
        "session_id",
        "follow",
    }  # the test sets every other field, so none is dropped on the way


def test_the_rings_own_next_step() -> None:
    sampling = SamplingParams(temperature=0.5, presence_penalty=0.5)
    step = StepRequest("s", (3,), 10, sampling=sampling, history=(1,), follow=2, stop_ids=(0,))
    step = replace(step, step_id=4, group=1, solo=True)
    nxt = next_ring_step(step, [9], 11)
    assert nxt is not None
    assert (nxt.token_ids, nxt.start_position, nxt.step_id, nxt.follow) == ((9,), 11, 5, 1)
    assert nxt.history == (1, 9) and nxt.group == 1 and nxt.solo and nxt.sampling == sampling
    assert next_ring_step(step, [0], 11) is None  # a stop token
    assert next_ring_step(nxt, [9], 12) is not None
    assert next_ring_step(StepRequest("s", (3,), 10), [9], 11) is None  # no follow left
