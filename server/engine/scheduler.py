"""The micro-batch scheduler: which sequences' steps enter the stage ring next.

A synchronous state machine with no I/O and no clock of its own, so it is tested without a
model; :class:`server.engine.loop.Engine` drives it from a thin async loop::

    add(seq) -> queued (or QueueFull)      cancel(id) -> leaves the queue, or stops after its step
    next_work(now, ring_ready) -> [Work]   on_result(id, tokens) / on_error(id, exc)
    follow(id) -> the ring's own next step (ring_decode), in flight
    on_lost(id, exc, now) -> suspended?    expire(now) -> [ids that waited too long]
    take_releases() -> [Release]           released(session ids) -> their KV blocks count free
    ring_steps(id, held, n) -> the ring's own steps the pools hold (their positions claimed)
    take_admitted() -> [sequences that left the queue]

Policy, each rule with its reason in docs/scheduling.md:

* **Admission**: at most ``max_running`` sequences hold KV sessions; up to ``max_queued`` more
  wait in a FIFO queue (:class:`QueueFull` beyond it, :class:`QueueTimeout` after
  ``queue_timeout`` seconds).
* **One step per sequence in the ring** (its next token needs the last), steps of different
  sequences in flight together, so every stage has work.
* **Decode first, prompts in chunks** of ``prefill_chunk`` tokens, at most
  ``max_prefill_in_flight`` in the ring, never a chunk of one token (:func:`chunk_end`): a
  long prompt delays the others by one chunk per token, not by the whole prompt.
* **Micro-batch groups** (``groups``, ``lockstep``, ``group_size``, ``busy_prefill_chunk``),
  or one group per sequence without batching (``solo``).
* **The ring decodes on its own** for up to ``ring_decode`` tokens (:meth:`Scheduler.follow`).
* **KV blocks** (``kv_pools``): admission and steps wait for room; the newest sequence is
  preempted when decoding would outgrow a pool. The count never runs behind the stages': a
  freed session's blocks count as taken until its release is done (:meth:`released`), and the
  ring's own decode steps claim their positions before they go out (:meth:`ring_steps`).
* **State slots** (``state_pools``, hybrid models' paged stages): every sequence that holds
  (or is about to hold) a session claims the most slots a session holds, from admission on,
  like its blocks: a new sequence waits in the queue until a pool has them.
* **Surviving a stage restart**: a sequence whose step the ring lost is suspended
  (:meth:`Scheduler.on_lost`) and re-prefills on a fresh session once the ring is whole, for up
  to ``resume_grace`` seconds; a lost session likewise (:meth:`Scheduler.on_session_lost`).
* A sequence's tokens depend only on its own steps, so its output does not depend on load.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass

from server.engine.sequence import Phase, QueueFull, QueueTimeout, Release, Sequence, Work

MAX_REFUSALS = 16  # a sequence whose steps stages refused this often ends with their error
MAX_SESSION_LOSSES = 3  # a sequence whose session stages lost this often ends with the error


def chunk_end(length: int, fed: int, budget: int) -> int:
    """Where the next prompt chunk ends: ``budget`` tokens on from ``fed``, but never a chunk
    of one token out of a longer rest, nor one that leaves a single token behind (it may then
    take one token more than the budget, or the two or three that are left). Where a prompt
    is cut depends on load; on CPUs where a one-row call takes another kernel path than a call
    of several rows, a lone prompt token would make its numbers depend on it too."""
    end = min(length, fed + max(budget, 2))
    if length - end == 1:
        end = end - 1 if end - fed > 2 else length
    return end


@dataclass(frozen=True)
class SchedulerConfig:
    # The defaults of the first six fields are the gateway's served ones: GatewaySettings takes
    # its defaults for them from here (max_running is its max_concurrent).
    max_running: int = 16  # sequences holding KV sessions on the stages
    max_queued: int = 64  # sequences waiting for a running slot
    queue_timeout: float = 120.0  # seconds a sequence may wait in the queue
    prefill_chunk: int = 256  # prompt tokens per prefill step
    max_prefill_in_flight: int = 1  # prefill chunks in the ring at once
    resume_grace: float = 30.0  # seconds a sequence lost to the ring waits for it to heal
    groups: int = 1  # micro-batch groups the running sequences are spread over (the stages)
    # prompt tokens per chunk while sequences of the same group decode (None: prefill_chunk):
    # a batched step then stays short, so the decoding sequences barely notice the prompt
    busy_prefill_chunk: int | None = None
    # KV block pools of paged stages, (block size, blocks) each: admission, prompt chunks and
    # decode steps then wait for room, and the newest sequence is preempted when decoding
    # sequences would outgrow a pool (empty: no accounting, stateful stages)
    kv_pools: tuple[tuple[int, int], ...] = ()
    kv_headroom: int = 1  # positions a decode step may add (1 + speculative draft tokens)
    # linear-attention state pools of a hybrid model's paged stages, (slots for sessions,
    # slots a session holds at most) each (common.state_pool): admission waits for a
    # session's slots as for its blocks
    state_pools: tuple[tuple[int, int], ...] = ()
    # a group's decode steps go out together, once all of its previous ones are back
    # (batched stages): its sequences then share every inference call instead of drifting apart
    lockstep: bool = False
    # with lockstep: one group per this many running sequences, up to ``groups`` (0: always
    # ``groups``). A batched step of a few sequences costs about what one sequence's does, so
    # two sequences go faster in one batch through the stages in turn than pipelined in two
    group_size: int = 0
    # every running sequence its own group (``groups`` >= ``max_running``), so no inference
    # call holds two sequences' rows; prompt tokens then share one budget across the ring
    # (``busy_prefill_chunk`` while any sequence decodes): docs/scheduling.md#no-batching
    solo: bool = False
    # with solo or lockstep: decode tokens the ring may then produce on its own after each
    # decode step (the last stage feeds each token straight back to stage 0:
    # docs/scheduling.md#the-ring-decodes-on-its-own); 0: every step goes through the gateway
    ring_decode: int = 0
    # prefix caching (paged stages that keep prefixes): a sequence's session first opens on
    # the stages' cached KV blocks of its prefix (a lookup Work), then prefills the rest
    prefix_cache: bool = False

    def __post_init__(self) -> None:
        for name in ("max_running", "prefill_chunk", "max_prefill_in_flight", "groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.busy_prefill_chunk is not None and self.busy_prefill_chunk < 1:
            raise ValueError("busy_prefill_chunk must be at least 1")
        if self.kv_headroom < 1 or any(b < 1 or n < 1 for b, n in self.kv_pools):
            raise ValueError("kv_headroom and the pools' block sizes and counts must be >= 1")
        if any(n < 0 or per < 1 for n, per in self.state_pools):
            raise ValueError("the state pools' slots must be >= 0 and a session's >= 1")
        if self.group_size < 0:
            raise ValueError("group_size must be >= 0")
        if self.solo and (self.groups < self.max_running or self.group_size):
            raise ValueError("solo needs a group per running sequence (groups >= max_running)")
        if self.ring_decode < 0 or (self.ring_decode and not (self.solo or self.lockstep)):
            raise ValueError("ring_decode must be >= 0, and needs solo or lockstep")
        if self.max_queued < 0 or self.queue_timeout <= 0 or self.resume_grace < 0:
            raise ValueError("max_queued and resume_grace must be >= 0 and queue_timeout > 0")


class Scheduler:
    def __init__(self, config: SchedulerConfig, eos_ids: Iterable[int] = ()) -> None:
        self.config = config
        self.eos_ids = frozenset(eos_ids)
        self.sequences: dict[str, Sequence] = {}
        self.queue: deque[str] = deque()
        self.running: list[str] = []  # admission order
        self._releases: list[Release] = []
        # sessions freed here whose release the stages have not done yet: positions each
        self._unfreed: dict[str, int] = {}
        self._admitted: list[Sequence] = []
        self._clock = 0.0  # the latest `now` seen, orders round-robin service
        self.preemptions = 0  # sequences preempted for KV blocks so far
        self.resumes = 0  # sequences re-prefilled after a ring failure so far
        self.finished = 0  # sequences that ended so far (and so gave their KV back)

    # -- admission --------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self.sequences:
            raise ValueError(f"sequence {seq.seq_id!r} is already scheduled")
        if not seq.prompt:
            raise ValueError("a sequence needs at least one prompt token")
        if seq.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        free = self.config.max_running - len(self.running)
        if len(self.queue) >= self.config.max_queued + max(0, free):
            raise QueueFull(
                f"{len(self.running)} requests are running and {len(self.queue)} are waiting "
                f"(limits {self.config.max_running} and {self.config.max_queued})",
                retry_after=self.retry_after(),
            )
        self.sequences[seq.seq_id] = seq
        self.queue.append(seq.seq_id)

    def retry_after(self) -> float:
        """A hint for HTTP Retry-After: seconds until a place is likely to free up."""
        return 1.0 + len(self.queue) / max(1, self.config.max_running)

    def expire(self, now: float) -> list[str]:
        """Sequences that waited too long: queued ones leave with QueueTimeout, suspended
        ones end with the error that suspended them."""
        expired = [
            sid
            for sid in self.queue
            if now - self.sequences[sid].arrival > self.config.queue_timeout
        ]
        for sid in expired:
            self.queue.remove(sid)
            seq = self.sequences[sid]
            seq.phase = Phase.DONE
            seq.error = QueueTimeout(
                f"request waited {now - seq.arrival:.1f}s in the queue "
                f"(limit {self.config.queue_timeout:g}s)"
            )
        for sid in list(self.running):
            seq = self.sequences[sid]
            if seq.lost_since is not None and now - seq.lost_since >= self.config.resume_grace:
                self._finish(seq)
                expired.append(sid)
        return expired

    def cancel(self, seq_id: str) -> None:
        """The caller lost interest: leave the queue now, or stop after the step in flight."""
        seq = self.sequences.get(seq_id)
        if seq is None or seq.phase is Phase.DONE:
            self.forget(seq_id)
            return
        seq.cancelled = True
        if seq.phase is Phase.QUEUED:
            self.queue.remove(seq_id)
            seq.phase = Phase.DONE
            self.forget(seq_id)
        elif seq.in_flight is None:
            self._finish(seq)
            self.forget(seq_id)

    def abort_all(self, error: BaseException) -> list[str]:
        """End every sequence, queued or running, with ``error`` (the gateway is stopping);
        the running ones' sessions are queued for release. Returns the ids ended."""
        ended = []
        while self.queue:
            seq = self.sequences[self.queue.popleft()]
            seq.phase, seq.error = Phase.DONE, error
            ended.append(seq.seq_id)
        for sid in list(self.running):
            self.on_error(sid, error)
            ended.append(sid)
        return ended

    def forget(self, seq_id: str) -> None:
        """Drop a finished sequence's bookkeeping (its consumer has seen the end)."""
        seq = self.sequences.get(seq_id)
        if seq is not None and seq.phase is Phase.DONE and seq.in_flight is None:
            del self.sequences[seq_id]

    def _admit(self, now: float) -> None:
        while self.queue and len(self.running) < self.config.max_running:
            seq = self.sequences[self.queue[0]]
            if any(self.sequences[sid].preempted for sid in self.running) or not self._fits(seq):
                return  # preempted sequences go first; then wait for KV blocks
            self.queue.popleft()
            members = self._members()
            self.running.append(seq.seq_id)
            seq.group = min(range(self.active_groups()), key=lambda g: len(members[g]))
            seq.phase = Phase.PREFILL
            seq.admitted = now
            seq.last_served = now
            self._admitted.append(seq)

    # -- micro-batch groups -------------------------------------------------------------------
    def active_groups(self) -> int:
        """Groups in use now: ``groups``, or one per ``group_size`` running sequences."""
        if not self.config.group_size:
            return self.config.groups
        return max(1, min(self.config.groups, len(self.running) // self.config.group_size))

    def _members(self) -> list[list[Sequence]]:
        """The running sequences of each group."""
        members: list[list[Sequence]] = [[] for _ in range(self.config.groups)]
        for sid in self.running:
            seq = self.sequences[sid]
            members[seq.group].append(seq)
        return members

    def _regroup(self, busy: set[int]) -> None:
        """Balance the active groups (lockstep): sequences of groups no longer in use, then
        of the largest group, move to the smallest. Only groups with no decode step in flight
        give sequences up, so a group's decode steps never split over two batches."""
        count = self.active_groups()
        members = self._members()

        def move(seq: Sequence) -> None:
            target = min(range(count), key=lambda g: (len(members[g]), g in busy))
            members[seq.group].remove(seq)
            members[target].append(seq)
            seq.group = target

        for group in range(count, self.config.groups):
            if group not in busy:
                for seq in list(members[group]):
                    move(seq)
        while True:
            sizes = [len(members[g]) for g in range(count)]
            large = max(range(count), key=lambda g: (sizes[g], g not in busy))
            if large in busy or sizes[large] - min(sizes) < 2:
                return
            move(members[large][-1])  # the newest

    # -- KV blocks of paged stages ------------------------------------------------------------
    def _claim(self, seq: Sequence) -> int:
        """Positions a sequence may hold on the stages after its next (or current) step.

        A prefilling sequence claims its whole prefix from admission on: were it to claim
        chunk by chunk, prefills that each hold part of their prompt could together leave no
        room for anyone's next chunk, with no decoding sequence to preempt or to wait for.
        The ring's own decode steps (:meth:`ring_steps`) add theirs."""
        if seq.phase is Phase.DECODE:
            length = len(seq.prompt) + len(seq.generated) - 1 + self.config.kv_headroom
        elif seq.phase is Phase.PREFILL:
            length = len(seq.prefix)
        else:
            return 0
        return max(length, seq.ring_claim)

    @property
    def _pools(self) -> bool:
        """Whether anything is counted (paged stages)."""
        return bool(self.config.kv_pools or self.config.state_pools)

    def _fits(self, seq: Sequence, length: int | None = None) -> bool:
        """Whether ``seq`` may hold ``length`` positions (default: its whole prefix) now: the
        pools hold it with the other running sequences' claims, or no other sequence holds
        KV (alone, it goes on whatever it needs: the stages refuse what their pools cannot
        hold, and it ends with their error after MAX_REFUSALS)."""
        if not self._pools:
            return True
        if self._room({seq.seq_id: len(seq.prefix) if length is None else length}):
            return True
        return not self._holders(other_than=seq) and not self._unfreed

    def _holders(self, other_than: Sequence | None = None) -> list[Sequence]:
        """Running sequences that hold (or are about to hold) KV on the stages, in admission
        order."""
        return [
            q
            for q in (self.sequences[sid] for sid in self.running)
            if q is not other_than and q.phase in (Phase.PREFILL, Phase.DECODE)
        ]

    def _room(self, claims: dict[str, int], unfreed: bool = True) -> bool:
        """Whether every pool holds the running sequences' claims (``claims`` overriding or
        adding some), and (``unfreed``) the sessions whose release is not done yet: their
        blocks, and in a state pool a session's most slots for each that claims any."""
        if not self._pools:
            return True
        lengths = {sid: self._claim(self.sequences[sid]) for sid in self.running}
        lengths.update(claims)
        held = list(lengths.values())
        if unfreed:
            held += self._unfreed.values()
        sessions = sum(1 for n in held if n > 0)
        return all(
            sum(-(-n // block_size) for n in held) <= blocks
            for block_size, blocks in self.config.kv_pools
        ) and all(sessions * per <= slots for slots, per in self.config.state_pools)

    def _make_room(self) -> None:
        """Preempt the newest sequences until the decoding ones fit the pools: each frees its
        sessions and re-prefills later (prompt + generated tokens, on a fresh session).
        Releases under way count as done here: they free their blocks soon."""
        while not self._room({}, unfreed=False):
            holders = self._holders()
            idle = [s for s in holders if s.in_flight is None]
            if len(holders) <= 1 or not idle:
                return  # nothing to preempt (or one sequence alone): the stages decide
            self._preempt(idle[-1])

    def _release(self, seq: Sequence, final: bool) -> None:
        """Queue the release of the sequence's session (the stages may hold one): its blocks
        count as taken until :meth:`released`. Called before its phase changes."""
        if not seq.opened:
            if final and seq.incarnation:
                self._releases.append(Release(seq.seq_id, None, final=True))
            return
        positions = max(self._claim(seq), seq.session_length, seq.fed)
        self._releases.append(Release(seq.seq_id, seq.session_id, final, positions))
        self._unfreed[seq.session_id] = positions

    def released(self, session_ids: Iterable[str]) -> None:
        """The stages have freed these sessions (or were told to and cannot be reached): their
        blocks are free for other sequences now."""
        for sid in session_ids:
            self._unfreed.pop(sid, None)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq, final=False)
        seq.incarnation += 1
        seq.ring_claim = 0
        seq.fed = seq.session_length = 0
        seq.phase, seq.preempted = Phase.SUSPENDED, True
        seq.preemptions += 1
        self.preemptions += 1

    def on_preempted(self, seq_id: str, error: BaseException) -> bool:
        """A stage ran out of KV blocks (or sessions) for the sequence's step: free its
        sessions and re-prefill it when there is room; False when it ends instead (preempted
        too often, or nobody waits for it)."""
        seq = self.sequences[seq_id]
        seq.in_flight = None
        seq.refusals += 1
        if seq.cancelled or seq.refusals > MAX_REFUSALS:
            self.on_error(seq_id, error)
            return False
        self._preempt(seq)
        # Back off: resume only once another sequence has ended (or none holds KV), else
        # refused sequences would keep taking each other's blocks.
        seq.waits_for = self.finished
        return True

    def _may_resume(self, seq: Sequence) -> bool:
        if seq.waits_for >= 0 and self.finished <= seq.waits_for and self._holders(seq):
            return False
        return self._fits(seq)

    # -- deciding the next steps ------------------------------------------------------------
    def next_work(self, now: float, ring_ready: bool = True) -> list[Work]:
        """Steps to send now: decode steps of every ready sequence, then prefill chunks.

        Suspended sequences re-prefill once ``ring_ready`` (every stage is up again);
        preempted ones once their prompt and generated tokens fit the KV pools, before new
        ones are admitted.
        """
        self._clock = max(self._clock, now)
        blocked = False  # preempted sequences resume oldest first
        for sid in self.running:
            seq = self.sequences[sid]
            if seq.phase is not Phase.SUSPENDED:
                continue
            if seq.preempted:
                blocked = blocked or not self._may_resume(seq)
                if not blocked:
                    seq.phase, seq.preempted, seq.waits_for = Phase.PREFILL, False, -1
            elif ring_ready:
                seq.phase, seq.lost_since = Phase.PREFILL, None
                seq.resumes += 1
                self.resumes += 1
        if self._pools:  # after the resumes: sequences back from a lost ring count
            self._make_room()
        self._admit(now)
        ready = [
            self.sequences[sid] for sid in self.running if self.sequences[sid].in_flight is None
        ]
        if self.config.lockstep:
            # decode steps wait for their group's decode steps in flight; prompt chunks go on
            # their own (a chunk in every call would slow each of the group's tokens)
            busy = set()
            for sid in self.running:
                w = self.sequences[sid].in_flight
                if w is not None and not w.prefill:
                    busy.add(w.group)
            self._regroup(busy)
            ready = [s for s in ready if s.phase is not Phase.DECODE or s.group not in busy]
        work: list[Work] = []
        decoding = sorted(
            (s for s in ready if s.phase is Phase.DECODE), key=lambda s: s.last_served
        )
        if self._unfreed and not self._room({}) and self._room({}, unfreed=False):
            # the room they need comes with releases still under way (steps sent now could
            # reach the stages first): they go once those are done (released wakes the loop)
            decoding = []
        for seq in decoding:
            position = len(seq.prompt) + len(seq.generated) - 1
            work.append(
                self._issue(
                    seq,
                    (seq.generated[-1],),
                    position,
                    prefill=False,
                    rollback=seq.session_length - position,
                )
            )
        # With busy_prefill_chunk (batched stages), a group's prompts share a token budget in
        # the ring: prefill_chunk, or busy_prefill_chunk while the group decodes (solo: one
        # budget for the ring, busy while any sequence decodes). Without it, each chunk is
        # prefill_chunk tokens.
        shared = self.config.busy_prefill_chunk is not None
        solo = self.config.solo

        def pool(group: int) -> int:
            return 0 if solo else group

        budget = [self.config.prefill_chunk] * self.config.groups
        chunks = 0
        for sid in self.running:
            seq = self.sequences[sid]
            if shared and seq.phase is Phase.DECODE:
                g = pool(seq.group)
                budget[g] = min(budget[g], self.config.busy_prefill_chunk or 0)
        for sid in self.running:
            w = self.sequences[sid].in_flight
            if w is not None and w.prefill and not w.lookup:
                chunks += 1
                budget[pool(w.group)] -= len(w.tokens) if shared else 0
        for seq in (s for s in ready if s.phase is Phase.PREFILL):  # admission order
            if self.config.prefix_cache and seq.fed == 0 and seq.looked_up != seq.incarnation:
                # first the stages' cached blocks of its prefix (an RPC beside the ring)
                work.append(self._issue(seq, (), 0, prefill=True, lookup=True))
                continue
            if chunks >= self.config.max_prefill_in_flight:
                break
            g = pool(seq.group)
            if budget[g] <= 0:
                continue
            prefix = seq.prefix
            end = chunk_end(len(prefix), seq.fed, budget[g])
            if not self._fits(seq, end):
                continue  # waits for KV blocks (in-flight steps outgrew the pools)
            budget[g] -= end - seq.fed if shared else 0
            work.append(self._issue(seq, tuple(prefix[seq.fed : end]), seq.fed, prefill=True))
            chunks += 1
        return work

    def _issue(
        self,
        seq: Sequence,
        tokens: tuple[int, ...],
        start: int,
        prefill: bool,
        rollback: int = 0,
        lookup: bool = False,
    ) -> Work:
        samples = not lookup and (not prefill or start + len(tokens) == len(seq.prefix))
        item = Work(
            seq.seq_id,
            tokens,
            start,
            prefill=prefill,
            samples=samples,
            rollback=rollback,
            session_id=seq.session_id if seq.incarnation else "",
            group=seq.group,
            lookup=lookup,
        )
        seq.in_flight = item
        if prefill:
            seq.fed = start + len(tokens)
        seq.last_served = self._clock
        return item

    # -- taking results ---------------------------------------------------------------------
    def on_result(
        self, seq_id: str, tokens: Sequence_[int], session_length: int | None = None
    ) -> int:
        """A step came back with the tokens it emitted; returns how many the sequence takes.

        A decode step emits one token, or with speculation the accepted draft tokens and a
        correction; the sequence takes them up to an end-of-sequence token or ``max_tokens``
        (they are ``sequences[seq_id].generated[-n:]``), after which it is done and its
        session is queued for release. ``session_length``: positions the stages hold now
        (default: everything fed); the next step rolls back what was not taken.
        """
        seq = self.sequences[seq_id]
        item = seq.in_flight
        if item is None or item.lookup:
            raise ValueError(f"sequence {seq_id!r} has no step in flight")
        seq.in_flight = None
        seq.error = None  # a resumed sequence healed
        if session_length is None:
            session_length = item.start_position + len(item.tokens)
        seq.session_length = session_length
        if seq.cancelled:  # nobody waits for it any more
            self._finish(seq)
            self.forget(seq_id)
            return 0
        if not item.samples:
            return 0  # a prompt chunk that is not the last
        if not tokens:
            raise ValueError(f"the step of {seq_id!r} should have emitted a token")
        seq.phase = Phase.DECODE
        taken = 0
        for token in tokens:
            seq.generated.append(token)
            taken += 1
            ended = token in self.eos_ids and not seq.ignore_eos
            if ended or len(seq.generated) >= seq.max_tokens:
                self._finish(seq)
                break
        return taken

    def on_prefix(self, seq_id: str, cached: int) -> None:
        """The lookup came back: the stages opened the sequence's session on ``cached``
        positions of its prefix from their cache (0: none); its prompt chunks start there."""
        seq = self.sequences[seq_id]
        item = seq.in_flight
        if item is None or not item.lookup:
            raise ValueError(f"sequence {seq_id!r} has no lookup in flight")
        if not 0 <= cached <= len(seq.prefix) - 1:
            raise ValueError(f"{cached} cached positions for a prefix of {len(seq.prefix)}")
        seq.in_flight = None
        seq.looked_up = seq.incarnation
        seq.fed = seq.session_length = cached
        if seq.incarnation == 0:
            seq.cached = cached
        if seq.cancelled:  # nobody waits for it any more
            self._finish(seq)
            self.forget(seq_id)

    def follow(self, seq_id: str) -> Work | None:
        """After :meth:`on_result`: the decode step the ring makes itself (``ring_decode``),
        now in flight, or None when the sequence is done (then the ring's step, if any, is
        dropped with the session)."""
        seq = self.sequences.get(seq_id)  # a cancelled one is forgotten at its result
        if seq is None or seq.cancelled or seq.phase is not Phase.DECODE or seq.in_flight:
            return None  # done, or its next step is already out
        position = len(seq.prompt) + len(seq.generated) - 1
        if seq.session_length != position:
            raise ValueError(f"{seq_id!r}: the ring's own step cannot roll back")
        return self._issue(seq, (seq.generated[-1],), position, prefill=False)

    def ring_steps(self, seq_id: str, held: int, wanted: int) -> int:
        """How many decode steps the ring may make on its own (``follow``) after the
        sequence's step in flight, which leaves its session holding ``held`` positions: up to
        ``wanted``, as many as the KV pools hold beside every other claim. The sequence claims
        their positions from now on: the stages take each before its result reaches the
        gateway (the last stage sends the next step first), and no room can be made for them
        then (the sequence has a step in flight all along)."""
        seq = self.sequences[seq_id]
        if not self._pools:
            return wanted
        for steps in range(wanted, 0, -1):
            if self._room({seq_id: max(self._claim(seq), held + steps)}):
                seq.ring_claim = max(seq.ring_claim, held + steps)
                return steps
        return 0

    def on_lost(self, seq_id: str, error: BaseException, now: float) -> bool:
        """The step was lost with the ring (a stage down or stalled): the stages' state of the
        sequence is unknown. Suspend it to re-prefill once the ring is whole again; returns
        False when it ends instead (``resume_grace`` 0, or nobody waits for it)."""
        seq = self.sequences[seq_id]
        if self.config.resume_grace <= 0 or seq.cancelled:
            self.on_error(seq_id, error)
            return False
        seq.in_flight = None
        seq.error = error  # what it ends with if the ring does not heal in time
        self._release(seq, final=False)
        seq.incarnation += 1
        seq.ring_claim = 0
        seq.fed = seq.session_length = 0
        seq.phase, seq.lost_since = Phase.SUSPENDED, now
        return True

    def on_session_lost(self, seq_id: str, error: BaseException, now: float) -> bool:
        """A stage no longer holds the sequence's session (it restarted between health
        checks, or freed the session): re-prefill on a fresh one, like a step lost with the
        ring; False when it ends instead (lost too often, or as :meth:`on_lost`)."""
        seq = self.sequences[seq_id]
        seq.session_losses += 1
        if seq.session_losses > MAX_SESSION_LOSSES:
            self.on_error(seq_id, error)
            return False
        return self.on_lost(seq_id, error, now)

    def on_error(self, seq_id: str, error: BaseException) -> None:
        """The step failed: the sequence ends with ``error``; stages may hold its session."""
        seq = self.sequences[seq_id]
        seq.in_flight = None
        seq.error = error
        self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        if seq.phase is Phase.DONE:
            return
        self._release(seq, final=True)
        seq.phase = Phase.DONE
        self.finished += 1
        if seq.seq_id in self.running:
            self.running.remove(seq.seq_id)

    def take_releases(self) -> list[Release]:
        """Sessions to free on every stage, of finished or suspended sequences (once each);
        call :meth:`released` once the stages have freed them."""
        out, self._releases = self._releases, []
        return out

    def take_admitted(self) -> list[Sequence]:
        """Sequences that left the queue for a running slot since the last call."""
        out, self._admitted = self._admitted, []
        return out

    # -- introspection ----------------------------------------------------------------------
    @property
    def queued(self) -> int:
        return len(self.queue)

    @property
    def in_flight(self) -> int:
        return sum(1 for sid in self.running if self.sequences[sid].in_flight is not None)
