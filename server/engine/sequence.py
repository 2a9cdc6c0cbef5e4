"""A generation as the scheduler (server/engine/scheduler.py) tracks it: its phase, the step it
has in the ring (:class:`Work`), what it frees on the stages (:class:`Release`), and the two ways
admission turns one away (:class:`QueueFull`, :class:`QueueTimeout`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class QueueFull(Exception):
    """The waiting queue is full: the caller should retry later (HTTP 429)."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class QueueTimeout(Exception):
    """A request waited in the queue longer than the configured limit."""


class Phase(enum.Enum):
    QUEUED = "queued"
    SUSPENDED = "suspended"  # lost its sessions to a ring failure; waits to re-prefill
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass(frozen=True)
class Work:
    """One step to send through the ring for one sequence."""

    seq_id: str
    tokens: tuple[int, ...]
    start_position: int
    prefill: bool  # a prompt chunk (else one decode token)
    samples: bool  # the sampled token is the sequence's next token (last chunk or decode)
    rollback: int = 0  # positions the stages forget first (rejected speculative tokens)
    session_id: str = ""  # the stages' session (default: seq_id)
    group: int = 0  # micro-batch group (see SchedulerConfig.groups)
    # Prefix caching: open the session on the stages' cached blocks of the prefix (no ring
    # step; Scheduler.on_prefix takes the answer)
    lookup: bool = False

    @property
    def session(self) -> str:
        return self.session_id or self.seq_id


@dataclass(frozen=True)
class Release:
    """Free a sequence's session on the stages (when ``session_id``) and, if ``final``, the
    rest of what it holds (a draft session). ``positions``: what the session may hold on the
    stages (the KV blocks the scheduler counts as taken until the release is done)."""

    seq_id: str
    session_id: str | None
    final: bool
    positions: int = field(default=0, compare=False)


@dataclass
class Sequence:
    """One generation (one choice of one request): its own KV session on every stage."""

    seq_id: str
    prompt: list[int]
    max_tokens: int
    arrival: float
    phase: Phase = Phase.QUEUED
    admitted: float | None = None
    fed: int = 0  # prefill positions (prompt, then generated when resuming) sent so far
    session_length: int = 0  # positions the stages hold for this sequence
    generated: list[int] = field(default_factory=list)
    in_flight: Work | None = None
    last_served: float = 0.0
    cancelled: bool = False
    error: BaseException | None = None
    incarnation: int = 0  # sessions lost to ring failures so far
    lost_since: float | None = None
    resumes: int = 0  # times the sequence re-prefilled after a loss
    group: int = 0  # micro-batch group (set at admission; lockstep groups rebalance)
    preempted: bool = False  # suspended to free KV blocks (not by a failure); no expiry
    preemptions: int = 0
    refusals: int = 0  # steps a stage refused for want of KV blocks or sessions
    session_losses: int = 0  # steps a stage refused because it no longer held the session
    waits_for: int = -1  # refused: resume once more than this many sequences have finished
    # positions the ring's own decode steps (follow) may take beyond the step in flight
    ring_claim: int = 0
    looked_up: int = -1  # the incarnation whose session was opened on cached prefix blocks
    cached: int = 0  # prompt positions the first session took from the stages' prefix cache
    ignore_eos: bool = False  # an end-of-sequence token does not end it (only max_tokens)

    @property
    def opened(self) -> bool:
        """Whether a step went into the ring, or the session was opened on cached prefix
        blocks (so stages may hold a session to free)."""
        return self.fed > 0 or self.looked_up == self.incarnation

    @property
    def session_id(self) -> str:
        """Its session on the stages; a new one after each loss, so late frees cannot hit it."""
        return self.seq_id if self.incarnation == 0 else f"{self.seq_id}.r{self.incarnation}"

    @property
    def prefix(self) -> list[int]:
        """What a prefill feeds: the prompt, plus generated tokens when resuming."""
        return self.prompt + self.generated if self.generated else self.prompt
