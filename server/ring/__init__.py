"""The engine's view of the stage ring: the operations it needs and the failures they raise.

``Engine -> Ring.steps(StepRequest) -> StepOutput`` (sampled tokens). Two implementations:
:class:`server.ring.grpc_client.PipelineClient` talks to stage processes over gRPC (the only gateway
module that knows gRPC: it translates status codes into the errors below at its boundary), and
:class:`server.ring.local.LocalRing` runs every stage in this process (tests, and the engine
without processes).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Protocol

from protos.manifest import ShardManifest
from protos.sampling import SampledToken
from protos.step import StepRequest


class RingError(Exception):
    """A step or the ring failed; ``stage`` is the stage that failed it, where known."""

    retryable = False  # whether the same step may succeed once the ring is whole again

    def __init__(self, message: str, stage: int | None = None) -> None:
        super().__init__(message)
        self.stage = stage


class StageUnavailable(RingError):
    """A stage cannot be reached (down, restarting, or cut off from the next one): the
    session's state on the ring is lost or unknown."""

    retryable = True


class StepTimeout(RingError):
    """A step took longer than its deadline (a stage stalled, or the ring is overloaded)."""

    retryable = True


class NoCapacity(RingError):
    """A stage has no KV blocks or sessions left for this step: retry it after others."""


class SessionLost(RingError):
    """A stage no longer holds the session (it restarted, or freed the session)."""


class BadStep(RingError):
    """The stages refused the step's input (a token out of the vocabulary, a position past
    the session's end): the session is left as it was."""


class RingRefused(RingError):
    """The stages do not form one ring for this gateway: another export, stages missing or out
    of order, layers not covered, or a wrong shared secret."""


@dataclass(frozen=True)
class StepOutput:
    tokens: list[SampledToken]
    session_length: int


class StageStatus(Protocol):
    """What the gateway's readiness report says of one stage."""

    @property
    def index(self) -> int: ...
    @property
    def address(self) -> str: ...
    @property
    def up(self) -> bool: ...
    @property
    def link_ok(self) -> bool: ...  # its link to the next stage is connected
    @property
    def detail(self) -> str: ...
    @property
    def bytes_out(self) -> int: ...  # payload bytes of the steps the gateway sent it
    @property
    def bytes_in(self) -> int: ...  # payload bytes of the results the gateway got from it


class Ring(Protocol):
    """The stages of one export, as the engine and the gateway's start-up use them."""

    @property
    def manifest_hash(self) -> str | None: ...
    @property
    def stages(self) -> Sequence[StageStatus]: ...
    @property
    def ready(self) -> bool:
        """Whether every stage is up and linked."""
        ...

    @property
    def ring_loop(self) -> bool:
        """Whether the last stage feeds decode steps back to stage 0 itself (follow)."""
        ...

    @property
    def paged(self) -> bool: ...
    @property
    def kv_pools(self) -> tuple[tuple[int, int], ...]:
        """(block size, blocks) of each paged stage's KV pool."""
        ...

    @property
    def prefix_block_size(self) -> int | None:
        """The block size every stage keeps prompt prefixes in (None: no prefix cache)."""
        ...

    @property
    def max_rollback(self) -> int | None:
        """Positions a session can be rolled back on every stage (None: any): a hybrid
        model's paged stages keep the recurrent states of a window of positions."""
        ...

    @property
    def state_pools(self) -> tuple[tuple[int, int], ...]:
        """(slots for sessions, slots a session holds at most) of each hybrid paged stage's
        linear-attention state pool (common.state_pool): admission counts them."""
        ...

    async def start(self, timeout: float = 120.0) -> ShardManifest:
        """Connect to and check the stages; raises RingRefused or StageUnavailable."""
        ...

    async def close(self) -> None: ...
    def check_ready(self) -> None:
        """Raise StageUnavailable naming the first stage that is down or cut off."""
        ...

    def steps(
        self, step: StepRequest, timeout: float | None = None
    ) -> AsyncGenerator[StepOutput, None]:
        """Run ``step``; yields its output, then (with ``step.follow``) those of the decode
        steps the ring runs on its own, each within ``timeout`` of the one before, until a
        token in ``step.stop_ids``. A retryable failure frees the session on the ring."""
        ...

    async def acquire(self, session_id: str, hashes: Sequence[bytes]) -> int:
        """Open ``session_id`` on the cached KV blocks of its prefix; the blocks it starts with."""
        ...

    async def release(self, *session_ids: str) -> int:
        """Free sessions on every stage that is reachable; how many stages answered."""
        ...

    async def tokenizer_files(self) -> dict[str, bytes]: ...


async def run_step(ring: Ring, step: StepRequest, timeout: float | None = None) -> StepOutput:
    """One step's output (no follow)."""
    results = ring.steps(step, timeout)
    try:
        return await anext(results)
    finally:
        await results.aclose()
