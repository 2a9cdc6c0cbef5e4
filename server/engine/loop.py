"""The engine: token ids and sampling parameters in, sampled tokens out, over the stage ring.

``GenerationRequest (ids, params) -> Scheduler (one sequence and one session per choice) ->
Ring steps (server/ring.py), many sequences in the ring at once -> SampledToken stream``.

The scheduling policy lives in :mod:`server.engine.scheduler` (a synchronous state machine); this
module is the thin async loop around it: it sends each tick's work through the ring, feeds the
results back, hands tokens to the waiting generators and frees the sessions of finished
sequences on every stage however they ended (finished, stopped early by the caller, failed, or
cancelled because the client went away). Text, JSON and chat templates live above.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace
from typing import Any

from protos.sampling import SampledToken, SamplingParams
from protos.step import StepRequest
from server.engine.constraints import Constraint, ConstraintError, Grammars, Matcher
from server.engine.prefix import PrefixLookup
from server.engine.scheduler import Scheduler, SchedulerConfig
from server.engine.sequence import Phase, QueueFull, QueueTimeout, Release, Sequence, Work
from server.engine.spec_policy import SpeculationPolicy
from server.engine.speculative import Proposer
from server.engine.step_plan import StepPlan, grammar_masks
from server.metrics import GatewayMetrics
from server.ring import NoCapacity, Ring, RingError, SessionLost

__all__ = [
    "Engine",
    "GenerationRequest",
    "GenerationStats",
    "QueueFull",
    "QueueTimeout",
    "SchedulingFailed",
    "ShuttingDown",
]
log = logging.getLogger(__name__)
_EXPIRY_CHECK_S = 0.5
_RING_CHECK_S = 0.1  # while sequences wait for the ring to heal


class ShuttingDown(Exception):
    """The server is stopping: a request refused, or ended before it finished (HTTP 503)."""


class SchedulingFailed(Exception):
    """The gateway's own scheduling failed (a bug): every request in progress ends with it
    (HTTP 500) instead of waiting forever, and the gateway goes on with new ones."""


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1
    constraint: Constraint | None = None  # what the output must match (constrained decoding)
    # Stop handling (vLLM's extensions): ignore_eos, the end-of-sequence ids are not an end
    # (only max_tokens is); min_tokens, they are never sampled before that many tokens are out
    ignore_eos: bool = False
    min_tokens: int = 0


@dataclass
class GenerationStats:
    queued_s: float = 0.0
    first_token_s: float | None = None
    tokens: int = 0
    cached_tokens: int = 0  # prompt positions the stages took from their prefix cache


@dataclass
class _Stream:
    """What the engine knows of one sequence beyond the scheduler's view."""

    sampling: SamplingParams
    queue: asyncio.Queue[SampledToken | BaseException | None] = field(default_factory=asyncio.Queue)
    matcher: Matcher | None = None  # constrained decoding: where the output is in its grammar
    stop_ids: tuple[int, ...] = ()  # where the ring's own decoding stops (none: ignore_eos)
    suppress_before: int = 0  # min_tokens: no end-of-sequence id before this position
    prompt_seen: tuple[int, ...] = ()  # repetition_penalty: the prompt's distinct token ids


class Engine:
    def __init__(
        self,
        ring: Ring,
        eos_ids: frozenset[int],
        max_context: int,
        config: SchedulerConfig | None = None,
        metrics: GatewayMetrics | None = None,
        proposer: Proposer | None = None,
        spec_k: int = 0,
        spec_max_k: int = 8,
        spec_max_users: int = 0,
        grammars: Grammars | None = None,
    ) -> None:
        self.ring = ring
        self.eos_ids = eos_ids
        self._stop_ids = sorted(eos_ids)  # where the ring stops decoding on its own
        self.max_context = max_context
        self.config = config or SchedulerConfig()
        if proposer is not None and self.config.kv_pools:
            # a speculative step feeds up to K draft tokens beside the last token
            headroom = 1 + (spec_k or spec_max_k)
            self.config = replace(self.config, kv_headroom=headroom)
        self.scheduler = Scheduler(self.config, eos_ids)
        # Prefix caching: each sequence's block hashes (server/engine/prefix.py), which its prompt
        # chunks publish and its lookup asks for
        block_size = ring.prefix_block_size if self.config.prefix_cache else None
        self.prefix = (
            PrefixLookup(ring.manifest_hash or "", block_size) if block_size is not None else None
        )
        self._counted = (0, 0)  # the scheduler's resumes and preemptions already in metrics
        self.metrics = metrics
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._steps: set[asyncio.Task[None]] = set()
        self._releasing: set[asyncio.Task[None]] = set()
        self.stopping = False  # new requests are refused (shut_down)
        # Speculative decoding (server/engine/spec_policy.py)
        self.speculation = (
            SpeculationPolicy(proposer, spec_k or None, spec_max_k, spec_max_users, metrics)
            if proposer is not None
            else None
        )
        self.grammars = grammars  # constrained decoding (requests with a Constraint)
        # Without batching, a sequence's steps are computed alone on every stage. Its one-row
        # decode steps may then go unpadded (pb.Step.solo): they take the one-row kernel path
        # every time. Not with speculation: a verification has several rows, and its tokens
        # must equal those of one-row decodes, so every call then stays on the several-row path.
        self.solo = self.config.solo and proposer is None
        if self.config.solo and proposer is not None:
            log.info(
                "no batching with speculation: stages pad one-row steps as when batching, so "
                "output is identical to plain decoding on a batching server (not always to a "
                "--no-batching server without speculation)"
            )

    @property
    def spec_max_users(self) -> int:
        """Speculation only while at most this many requests decode at once (0: no limit)."""
        return self.speculation.max_users if self.speculation is not None else 0

    def choice_sampling(self, request: GenerationRequest, choice: int) -> SamplingParams:
        """Each of n choices draws differently, reproducibly from the request's seed."""
        seed = (request.sampling.seed or 0) + choice
        return replace(request.sampling, seed=seed)

    async def generate(
        self, request: GenerationRequest, choice: int = 0, stats: GenerationStats | None = None
    ) -> AsyncGenerator[SampledToken, None]:
        """Yield up to ``max_tokens`` sampled tokens; stops after an end-of-sequence token.

        Raises QueueFull at once when the queue is full, QueueTimeout when the request waited
        too long, a RingError (server/ring.py) at once when the ring is not whole (a stage is
        down: StageUnavailable) and when a step fails for good: with bad input, or when a lost
        ring does not heal within the resume grace (the sequence waits for it, then
        re-prefills and goes on).
        """
        if self.stopping:
            raise ShuttingDown("the server is shutting down")
        self.ring.check_ready()
        stats = stats or GenerationStats()
        seq_id = f"{request.request_id}-{choice}"
        arrival = time.monotonic()
        seq = Sequence(seq_id, list(request.prompt_ids), request.max_tokens, arrival)
        seq.ignore_eos = request.ignore_eos
        self.scheduler.add(seq)  # raises QueueFull
        sampling = self.choice_sampling(request, choice)
        stream = _Stream(
            sampling,
            stop_ids=() if request.ignore_eos else tuple(self._stop_ids),
            suppress_before=len(seq.prompt) + request.min_tokens if request.min_tokens else 0,
            prompt_seen=(
                tuple(sorted(set(request.prompt_ids))) if sampling.repetition_penalty != 1.0 else ()
            ),
        )
        if request.constraint is not None:
            if self.grammars is None:
                raise ConstraintError("this gateway cannot constrain its output")
            stream.matcher = self.grammars.matcher(request.constraint)
        self._streams[seq_id] = stream
        self._kick()
        try:
            while True:
                item = await stream.queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                if stats.first_token_s is None:
                    admitted = seq.admitted or arrival
                    stats.queued_s = admitted - arrival
                    stats.first_token_s = time.monotonic() - admitted
                    stats.cached_tokens = seq.cached
                    if self.metrics is not None and seq.cached:
                        self.metrics.prompt_cached_tokens.inc(seq.cached)
                stats.tokens += 1
                yield item
        finally:
            self._streams.pop(seq_id, None)
            self.scheduler.cancel(seq_id)
            self._kick()

    # -- the loop ---------------------------------------------------------------------------
    def _kick(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._loop())
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                self._schedule()
            except Exception as exc:
                self._fail_all(exc)
            if not self.scheduler.sequences:
                return  # idle; the next request starts the loop again
            waiting = any(s.phase is Phase.SUSPENDED for s in self.scheduler.sequences.values())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._wake.wait(), _RING_CHECK_S if waiting else _EXPIRY_CHECK_S
                )

    def _schedule(self) -> None:
        """One turn of the loop: expire, send the next steps, free sessions, update metrics."""
        now = time.monotonic()
        for seq_id in self.scheduler.expire(now):
            self._end(seq_id)
        for item in self.scheduler.next_work(now, ring_ready=self.ring.ready):
            task = asyncio.create_task(self._run_step(item))
            self._steps.add(task)
            task.add_done_callback(self._steps.discard)
        releases = self.scheduler.take_releases()
        if releases:
            self._release(releases)
        self._observe()

    def _fail_all(self, exc: Exception) -> None:
        """The scheduler raised (a bug): rather than leave its requests waiting forever, end
        every one in progress with SchedulingFailed and free their sessions; steps still in
        flight end with them. A scheduler that cannot even do that is replaced by a new one."""
        log.exception("scheduling failed; every request in progress ends with an error")
        error = SchedulingFailed(f"the gateway's scheduler failed ({exc!r}); see its log")
        try:
            self.scheduler.abort_all(error)
            self._release(self.scheduler.take_releases())
        except Exception:
            log.exception("the scheduler cannot end its requests; starting a new one")
            self.scheduler = Scheduler(self.scheduler.config, self.scheduler.eos_ids)
        for stream in self._streams.values():
            stream.queue.put_nowait(error)

    def _sampling_extras(self, stream: _Stream | None, seq: Sequence, item: Work) -> dict[str, Any]:
        """What a sampling step carries for min_tokens and repetition_penalty: the
        end-of-sequence ids while the sequence is short of min_tokens, and the prompt's ids."""
        if stream is None or not item.samples:
            return {}
        extras: dict[str, Any] = {"prompt_ids_seen": stream.prompt_seen}
        # the step samples positions from len(prompt) + len(generated) on
        if stream.suppress_before > len(seq.prompt) + len(seq.generated):
            extras["suppress_ids"] = tuple(self._stop_ids)
            extras["suppress_before"] = stream.suppress_before
        return extras

    async def _run_step(self, item: Work) -> None:
        stream = self._streams.get(item.seq_id)
        seq = self.scheduler.sequences.get(item.seq_id)
        if seq is None or seq.phase is Phase.DONE:
            return  # ended before its step went out (_fail_all): no session to open
        sampling = stream.sampling if stream is not None else SamplingParams()
        # The stage needs the generated tokens only for the penalties.
        penalised = sampling.uses_history
        # the first step of a session: its lookup (prefix caching), or its first prompt chunk
        opening = item.lookup or (
            item.prefill and item.start_position == 0 and not self.config.prefix_cache
        )
        speculation = self.speculation
        if (
            speculation is not None
            and opening
            and speculation.active(len(self.scheduler.sequences))
        ):
            # the draft takes in the prompt while the stages prefill it (once: not on resumes;
            # not while speculation pauses for load: it catches up if it ever proposes)
            task = asyncio.create_task(speculation.warm(seq))
            self._steps.add(task)
            task.add_done_callback(self._steps.discard)
        try:
            if item.lookup:
                assert self.prefix is not None
                hashes = self.prefix.reusable(seq.seq_id, seq.prefix)
                # a prompt without a whole block to reuse opens with its first chunk, as ever
                blocks = await self.ring.acquire(item.session, hashes) if hashes else 0
                self.scheduler.on_prefix(item.seq_id, blocks * self.prefix.block_size)
                return
            began = time.perf_counter()  # the step's time includes waiting for the draft
            plan = await self._plan(seq, item, sampling)
            matcher = stream.matcher if stream is not None and item.samples else None
            masks: list[bytes] = []
            if matcher is not None:
                masks, plan = grammar_masks(matcher, plan, sampling.temperature == 0.0)
            started = time.perf_counter()
            follow = 0 if matcher is not None else self._follow_budget(seq, item, plan)
            step = StepRequest(
                session_id=item.session,
                token_ids=plan.tokens,
                start_position=item.start_position,
                rollback=item.rollback,
                num_logits=plan.num_logits,
                sampling=sampling,
                history=tuple(seq.generated) if penalised and item.samples else (),
                draft_tokens=plan.draft,
                group=item.group,
                solo=self.solo,
                follow=follow,
                stop_ids=stream.stop_ids if follow and stream is not None else (),
                block_hashes=tuple(self._block_hashes(seq, item)),
                token_masks=tuple(masks),
                **self._sampling_extras(stream, seq, item),
            )
            results = self.ring.steps(step)
            async with contextlib.aclosing(results):
                out = await anext(results)
                if speculation is not None and plan.draft:
                    ended = time.perf_counter()
                    speculation.learn(seq.seq_id, plan, out.tokens, ended - started, ended - began)
                elif speculation is not None and not item.prefill:
                    speculation.learn_plain(plan, time.perf_counter() - began)
                while True:
                    taken = self.scheduler.on_result(
                        item.seq_id, [t.token_id for t in out.tokens], out.session_length or None
                    )
                    if matcher is not None:
                        matcher.advance([t.token_id for t in out.tokens[:taken]])
                    if stream is not None:
                        for token in out.tokens[:taken]:
                            stream.queue.put_nowait(token)
                    if seq.phase is Phase.DONE:
                        self._end(item.seq_id)
                        break
                    ring = self.scheduler.follow(item.seq_id) if follow else None
                    if ring is None:
                        break
                    # the ring's own next step, already on its way: take it as if sent
                    item, follow = ring, follow - 1
                    out = await anext(results)
        except NoCapacity as exc:
            # a stage had no KV blocks (or sessions) left for it: retry after others
            log.info("sequence %s preempted: %s", item.seq_id, exc)
            if not self.scheduler.on_preempted(item.seq_id, exc):
                self._end(item.seq_id)
        except RingError as exc:
            if exc.retryable:
                log.warning("sequence %s lost its step: %s", item.seq_id, exc)
                if self.scheduler.on_lost(item.seq_id, exc, time.monotonic()):
                    return  # it re-prefills when the ring is whole again
            elif isinstance(exc, SessionLost):
                # a stage no longer holds the session: it restarted between health checks or
                # freed the session; the others may still hold it (they are told to free it)
                log.warning(
                    "sequence %s: step at position %d of session %s: %s; re-prefilling",
                    item.seq_id,
                    item.start_position,
                    item.session,
                    exc,
                )
                if self.scheduler.on_session_lost(item.seq_id, exc, time.monotonic()):
                    return
            else:
                self.scheduler.on_error(item.seq_id, exc)
            self._end(item.seq_id)
        except Exception as exc:
            if item.seq_id in self.scheduler.sequences:  # not ended and forgotten meanwhile
                self.scheduler.on_error(item.seq_id, exc)
            self._end(item.seq_id)
        finally:
            self._wake.set()

    def _block_hashes(self, seq: Sequence, item: Work) -> list[bytes]:
        """The hashes of the KV blocks this step fills, for the stages' prefix caches."""
        if self.prefix is None:
            return []
        end = item.start_position + len(item.tokens)
        return self.prefix.filled(seq.seq_id, seq.prefix, item.start_position, end, item.prefill)

    def _follow_budget(self, seq: Sequence, item: Work, plan: StepPlan) -> int:
        """Tokens the ring may decode on its own after this step (SchedulerConfig.ring_decode:
        steps without speculation, on a ring whose last stage loops back to stage 0; batched
        groups only while none waits to join them), within max_tokens, the context and the
        KV pools (the scheduler claims their positions now: Scheduler.ring_steps)."""
        if not (self.config.ring_decode and item.samples and not plan.draft):
            return 0
        if not self.ring.ring_loop:
            return 0
        if not self.solo and not self._may_run_alone(seq, item):
            return 0
        held = item.start_position + len(plan.tokens)  # positions after this step
        left = seq.max_tokens - len(seq.generated) - 1
        wanted = max(0, min(self.config.ring_decode, left, self.max_context - held))
        return self.scheduler.ring_steps(seq.seq_id, held, wanted) if wanted else 0

    def _may_run_alone(self, seq: Sequence, item: Work) -> bool:
        """Batched groups: whether the step may run on the ring by itself. Only while no
        sequence waits to join a group's decode steps (none queued, every other running one
        decoding); a prompt's last chunk only where no other sequence shares its group (it
        would run apart from the group's decode steps, which wait for it)."""
        if self.scheduler.queued:
            return False
        others = [
            self.scheduler.sequences[sid] for sid in self.scheduler.running if sid != seq.seq_id
        ]
        if any(o.phase is not Phase.DECODE for o in others):
            return False
        return not item.prefill or all(o.group != seq.group for o in others)

    async def _plan(self, seq: Sequence, item: Work, sampling: SamplingParams) -> StepPlan:
        """The step's tokens: the work item's, plus draft proposals when speculating."""
        if item.prefill or self.speculation is None:
            return StepPlan(item.tokens)
        level = sum(1 for s in self.scheduler.sequences.values() if s.phase is Phase.DECODE)
        return await self.speculation.plan(
            seq, item.tokens, item.start_position, sampling, level, self.max_context
        )

    def _end(self, seq_id: str) -> None:
        """Tell a finished sequence's consumer that it ended (and how)."""
        seq = self.scheduler.sequences.get(seq_id)
        stream = self._streams.get(seq_id)
        if stream is not None:
            stream.queue.put_nowait(seq.error if seq is not None and seq.error else None)

    def _release(self, releases: list[Release]) -> None:
        for done in releases:
            if done.final and self.prefix is not None:
                self.prefix.forget(done.seq_id)
            if done.final and self.speculation is not None:
                self.speculation.release(done.seq_id)
        sessions = [r.session_id for r in releases if r.session_id]
        if not sessions:
            return

        async def release() -> None:
            try:
                await self.ring.release(*sessions)
            except Exception:
                log.warning("releasing sessions %s failed", sessions, exc_info=True)
            finally:
                # their KV blocks count as taken until now: a step sent before the release
                # got through could reach a stage first and find its pool still full
                self.scheduler.released(sessions)
                self._wake.set()

        task = asyncio.create_task(release())
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    def _observe(self) -> None:
        admitted = self.scheduler.take_admitted()
        if self.metrics is None:
            return
        for seq in admitted:
            self.metrics.queue_seconds.observe((seq.admitted or seq.arrival) - seq.arrival)
        resumes, preemptions = self.scheduler.resumes, self.scheduler.preemptions
        self.metrics.resumed.inc(resumes - self._counted[0])
        self.metrics.preemptions.inc(preemptions - self._counted[1])
        self._counted = (resumes, preemptions)
        self.metrics.queued.set(self.scheduler.queued)
        self.metrics.running.set(len(self.scheduler.running))
        self.metrics.steps_in_flight.set(self.scheduler.in_flight)

    async def shut_down(self, grace: float) -> None:
        """The server is stopping: refuse new requests, give the ones in flight ``grace``
        seconds to finish, then end every one left, queued or running, with ShuttingDown (a
        503, or an error event on a stream), so that no client waits on a stopped server.
        While the ring is down (its stages stopping too, as on Ctrl-C of ``pipeshard up``)
        nothing can finish: they end at once."""
        self.stopping = True
        deadline = time.monotonic() + grace
        while self.scheduler.sequences and time.monotonic() < deadline:
            if not self.ring.ready:
                break
            await asyncio.sleep(0.05)
        await self._abort_all()

    async def _abort_all(self) -> None:
        tasks = [t for t in (self._loop_task, *self._steps) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Sessions of finished and of interrupted sequences are freed, not abandoned.
        ended = self.scheduler.abort_all(ShuttingDown("the server is shutting down"))
        if ended:
            log.warning("shutting down: %d request(s) ended unfinished", len(ended))
        for seq_id in ended:
            self._end(seq_id)

    async def close(self) -> None:
        self.stopping = True
        await self._abort_all()
        releases = self.scheduler.take_releases()
        if releases:
            self._release(releases)
        if self._releasing:
            await asyncio.wait(self._releasing, timeout=5.0)
        if self.speculation is not None:
            await self.speculation.close()
