"""The gateway's client of the stage ring over gRPC: the :class:`server.ring.Ring` the engine
uses in production, and the only gateway module that knows gRPC.

``StepRequest -> pb.Step -> stage 0 -> ... -> last stage -> pb.StepResult -> StepOutput``

It checks that the stages form one export's ring before use (same manifest hash, stage indices
in order, layer ranges without gap or overlap), links each stage to the next, pushes steps to
stage 0 on one long-lived stream and receives results from the last stage on a subscription.
A health monitor marks stages up or down: a stage that refuses connections fails the steps in
flight with UNAVAILABLE at once (and frees their sessions on the stages still up). A stage, or
a stage's link to the next, that has not answered for ``link_loss_timeout`` (a cut link: packets
go nowhere, nothing is refused) fails them the same way: the gateway's connection to it is
replaced (cancelling the calls stalled on it), and when it answers again every stage's link is
made afresh, so nothing waits on a connection that TCP is still backing off on. A stage that
answers its probes but not a step is caught by the step deadline. When a stage comes back, the
ring is re-checked and re-linked.
Every failure leaves this module as a :class:`server.ring.RingError` of the kind its status
code says (:func:`ring_error`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc

from common.state_pool import SCRATCH_SLOTS, slots_per_session
from protos import pipeshard_v1_pb2 as pb
from protos import pipeshard_v1_pb2_grpc as pb_grpc
from protos.codec import sampled_from_pb
from protos.manifest import ShardManifest
from protos.step import StepRequest
from protos.transport import call_metadata, open_channel
from server.ring import (
    BadStep,
    NoCapacity,
    RingError,
    RingRefused,
    SessionLost,
    StageUnavailable,
    StepOutput,
    StepTimeout,
    run_step,
)

log = logging.getLogger(__name__)
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_ERRORS: dict[grpc.StatusCode, type[RingError]] = {
    grpc.StatusCode.UNAVAILABLE: StageUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: StepTimeout,
    grpc.StatusCode.RESOURCE_EXHAUSTED: NoCapacity,
    grpc.StatusCode.NOT_FOUND: SessionLost,
    grpc.StatusCode.INVALID_ARGUMENT: BadStep,
    grpc.StatusCode.FAILED_PRECONDITION: RingRefused,
    grpc.StatusCode.UNAUTHENTICATED: RingRefused,
}


def ring_error(code: grpc.StatusCode, message: str, stage: int | None = None) -> RingError:
    """The engine's error for a step or call that failed with ``code`` (the stages' codes:
    stage_node.service.status_for)."""
    return _ERRORS.get(code, RingError)(message, stage)


@dataclass
class StageState:
    index: int
    address: str
    up: bool = False
    link_ok: bool = True  # this stage's stream to the next stage is connected
    detail: str = "not checked yet"
    unreleased: set[str] = field(default_factory=set)  # frees it missed while unreachable
    info: pb.StageInfo | None = None
    # payload bytes of the steps the gateway sent to this stage and the results it got back
    bytes_out: int = 0
    bytes_in: int = 0
    stub: pb_grpc.StageStub | None = field(default=None, repr=False)
    channel: grpc.aio.Channel | None = field(default=None, repr=False)
    # The health probes' own connection (see PipelineClient._probe)
    probe_stub: pb_grpc.StageStub | None = field(default=None, repr=False)
    probe_channel: grpc.aio.Channel | None = field(default=None, repr=False)
    # when it last answered a probe, and when its link to the next stage was last seen up
    # (time.monotonic); see PipelineClient._check_link_loss
    answered_at: float = float("-inf")
    linked_at: float = float("-inf")
    # the steps in flight were abandoned for its silence or its link's: the links are made
    # afresh before it counts as up again
    cut_off: bool = False
    silent: bool = False  # its last probe went unanswered (not refused)


class PipelineClient:
    def __init__(
        self,
        addresses: Sequence[str],
        *,
        secret: str | None = None,
        tls_ca: Path | None = None,
        tls_server_name: str | None = None,
        step_timeout: float = 120.0,
        health_interval: float = 0.5,
        health_timeout: float = 1.0,
        link_loss_timeout: float = 5.0,
        client_id: str | None = None,
    ) -> None:
        if not addresses:
            raise ValueError("the pipeline needs at least one stage address")
        self.stages = [StageState(i, a) for i, a in enumerate(addresses)]
        self.secret = secret
        self.tls_ca = tls_ca
        self.tls_server_name = tls_server_name
        self.step_timeout = step_timeout
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.link_loss_timeout = link_loss_timeout
        self.client_id = client_id or uuid.uuid4().hex
        self.manifest: ShardManifest | None = None
        self.manifest_hash: str | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future[StepOutput], str]] = {}
        # steps for stage 0, and the Push calls that ended (see _run_push)
        self._push_queue: asyncio.Queue[pb.Step | object] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._push_task: asyncio.Task[None] | None = None
        self._results_task: asyncio.Task[None] | None = None
        self._closed = False
        self._relinking = asyncio.Lock()  # one stage's recovery links the ring at a time
        # when the last stage last sent a result without an error (see _monitor)
        self._ring_alive_at = float("-inf")
        self.probes_sent = 0

    # -- ring set-up -----------------------------------------------------------------------
    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return call_metadata(self.secret, self.manifest_hash)

    async def start(self, timeout: float = 120.0) -> ShardManifest:
        """Connect, check and link the ring; waits up to ``timeout`` for stages to come up."""
        for state in self.stages:
            self._open(state)
        infos = await self._wait_for_infos(timeout)
        self._check_ring(infos)
        await self._link()
        await self._subscribe()
        now = time.monotonic()
        for state in self.stages:
            state.answered_at = state.linked_at = now
        self._tasks.append(asyncio.create_task(self._monitor()))
        assert self.manifest is not None
        return self.manifest

    def _open(self, state: StageState) -> grpc.aio.Channel | None:
        """A new connection for the steps and calls to ``state``; returns the old channel."""
        old = state.channel
        state.channel = open_channel(state.address, self.tls_ca, self.tls_server_name)
        state.stub = pb_grpc.StageStub(state.channel)
        return old

    async def _wait_for_infos(self, timeout: float) -> list[pb.StageInfo]:
        deadline = time.monotonic() + timeout
        while True:
            results = await asyncio.gather(
                *(self._info(s) for s in self.stages), return_exceptions=True
            )
            missing = [
                (s, r)
                for s, r in zip(self.stages, results, strict=True)
                if isinstance(r, BaseException)
            ]
            if not missing:
                return [r for r in results if isinstance(r, pb.StageInfo)]
            for state, error in missing:
                if isinstance(error, grpc.aio.AioRpcError) and error.code() not in _TRANSIENT:
                    raise ring_error(
                        error.code(),
                        f"stage {state.index} at {state.address} refused: {error.details()}",
                        state.index,
                    )
            if time.monotonic() > deadline:
                state, error = missing[0]
                detail = error.details() if isinstance(error, grpc.aio.AioRpcError) else error
                raise StageUnavailable(
                    f"stage {state.index} at {state.address} is missing: {detail}",
                    state.index,
                )
            await asyncio.sleep(0.25)

    async def _info(self, state: StageState) -> pb.StageInfo:
        assert state.stub is not None
        info: pb.StageInfo = await state.stub.Info(
            pb.InfoRequest(), metadata=self._metadata(), timeout=self.health_timeout * 2
        )
        state.info = info
        return info

    def _check_ring(self, infos: list[pb.StageInfo]) -> None:
        first = infos[0]
        for state, info in zip(self.stages, infos, strict=True):
            where = f"stage at {state.address}"
            if info.manifest_sha256 != first.manifest_sha256:
                raise RingRefused(
                    f"{where} serves export {info.manifest_sha256}, but {self.stages[0].address} "
                    f"serves {first.manifest_sha256}: the stages come from different exports",
                    state.index,
                )
            if info.stage_index != state.index:
                raise RingRefused(
                    f"{where} serves stage {info.stage_index} but is listed as stage {state.index}",
                    state.index,
                )
        if first.num_stages != len(infos):
            raise RingRefused(
                f"the export has {first.num_stages} stages but {len(infos)} addresses were given: "
                f"stage {len(infos) if len(infos) < first.num_stages else first.num_stages} "
                "is missing"
                if len(infos) < first.num_stages
                else "too many stages",
            )
        expected = 0
        for state, info in zip(self.stages, infos, strict=True):
            if info.layer_start != expected:
                kind = "gap" if info.layer_start > expected else "overlap"
                raise RingRefused(
                    f"layer {kind}: stage {state.index} starts at layer {info.layer_start}, "
                    f"expected {expected}",
                    state.index,
                )
            expected = info.layer_end
        if expected != first.num_layers:
            raise RingRefused(
                f"the stages cover {expected} of {first.num_layers} layers",
            )
        self.manifest_hash = first.manifest_sha256
        self.manifest = ShardManifest.model_validate_json(first.manifest_json)
        for state in self.stages:
            state.up, state.detail = True, "serving"

    async def _link(self, fresh: bool = False) -> None:
        """Link each stage to the next (and the last back to stage 0). ``fresh``: unlink every
        stage first, so that each opens new connections: a link that went through a cut may
        still be "connected" on a TCP connection backing off its retransmissions, and the
        steps sent on it would wait for that (its calls are cancelled with it)."""
        if fresh:
            await asyncio.gather(*(self._link_one(s, "", "") for s in self.stages))
        calls = []
        for state in self.stages:
            last = state.index + 1 == len(self.stages)
            nxt = "" if last else self.stages[state.index + 1].address
            # the last stage links back to stage 0 for the ring's own steps (Step.follow)
            loop = self.stages[0].address if last and self.ring_loop else ""
            calls.append(self._link_one(state, nxt, loop))
        await asyncio.gather(*calls)

    async def _link_one(self, state: StageState, nxt: str, loop: str) -> None:
        assert state.stub is not None
        await state.stub.Link(
            pb.LinkRequest(next_address=nxt, loop_address=loop),
            metadata=self._metadata(),
            timeout=self.health_timeout * 2,
        )

    async def _subscribe(self) -> None:
        last = self.stages[-1]
        assert last.stub is not None
        call = last.stub.Results(
            pb.ResultsRequest(client_id=self.client_id), metadata=self._metadata()
        )
        await call.initial_metadata()  # the last stage has registered our queue
        old, self._results_task = (
            self._results_task,
            asyncio.create_task(self._read_results(call, last.stub)),
        )
        if old is not None and not old.done():
            # (the last stage came back from a silence) results it sent on the old
            # subscription before this one may still be on their way (a connection that TCP
            # is retransmitting on): it is read until the steps then in flight have ended
            waiting = [f for f, _ in self._pending.values() if not f.done()]
            if waiting:
                retire = asyncio.create_task(self._retire(old, waiting))
                self._tasks.append(retire)  # (cancelled on close)
                retire.add_done_callback(self._tasks.remove)
            else:
                old.cancel()

    @staticmethod
    async def _retire(reader: asyncio.Task[None], steps: list[asyncio.Future[StepOutput]]) -> None:
        try:
            await asyncio.wait(steps)
        finally:
            reader.cancel()

    async def _read_results(
        self, call: AsyncIterator[pb.StepResult], stub: pb_grpc.StageStub
    ) -> None:
        last = self.stages[-1]
        try:
            async for result in call:
                last.bytes_in += result.ByteSize()
                if not result.HasField("error"):
                    self._ring_alive_at = time.monotonic()
                entry = self._pending.pop(result.step_id, None)
                if entry is None or entry[0].done():
                    continue
                future = entry[0]
                if result.HasField("error"):
                    code = _status_code(result.error.code)
                    future.set_exception(ring_error(code, result.error.message, result.error.stage))
                else:
                    future.set_result(
                        StepOutput(
                            tokens=[sampled_from_pb(t) for t in result.tokens],
                            session_length=result.session_length,
                        )
                    )
        except grpc.aio.AioRpcError as exc:
            # (not when its connection was replaced: _check_link_loss failed its steps)
            if not self._closed and last.stub is stub:
                self._stage_down(last, exc.details() or exc.code().name)
        except asyncio.CancelledError:
            pass

    # -- health ---------------------------------------------------------------------------
    async def _monitor(self) -> None:
        """Probe every stage each ``health_interval``, except while the ring proves itself:
        a result computed without error went through every stage and link, so until that
        result is an interval old, the stages that are up and linked are not probed (under
        load the probes would only take CPU from the stages). A stage that stalls stops the
        results, and the probes resume when the last one is an interval old (the worst case
        of fixed ticks too). After each round, a stage or link silent for too long fails the
        steps in flight (_check_link_loss)."""
        delay = self.health_interval
        while not self._closed:
            await asyncio.sleep(delay)
            age = time.monotonic() - self._ring_alive_at
            proven = age < self.health_interval
            delay = self.health_interval - age if proven else self.health_interval
            await asyncio.gather(
                *(self._probe(s) for s in self.stages if not (proven and s.up and s.link_ok))
            )
            self._check_link_loss()

    async def _probe(self, state: StageState) -> None:
        """One health probe, on a connection of its own: it never waits behind a large step
        on the steps' connection, and after a probe that failed the next one connects afresh,
        so a stage behind a link that comes back is seen at once (the steps' connection may
        still be backing off its retransmissions: see _check_link_loss)."""
        if state.probe_channel is None:
            state.probe_channel = open_channel(
                state.address,
                self.tls_ca,
                self.tls_server_name,
                options=[("grpc.use_local_subchannel_pool", 1)],
            )
            state.probe_stub = pb_grpc.StageStub(state.probe_channel)
        assert state.probe_stub is not None
        self.probes_sent += 1
        try:
            reply = await state.probe_stub.Health(
                pb.HealthRequest(), metadata=self._metadata(), timeout=self.health_timeout
            )
        except grpc.aio.AioRpcError as exc:
            channel, state.probe_channel, state.probe_stub = state.probe_channel, None, None
            await channel.close()
            # A stage that does not answer in time counts as silent (stalled, or cut off),
            # and stays so while its probes fail: a new connection to a suspended process
            # fails otherwise (the kernel accepts it, the handshake never comes), and that is
            # no stage that went away. One that refuses at once went away.
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED or state.silent:
                state.detail = "not answering (stalled?)"
                state.up, state.silent = False, True
            else:
                self._stage_down(state, exc.details() or exc.code().name)
            return
        now = time.monotonic()
        state.answered_at, state.silent = now, False
        state.link_ok = reply.downstream_ok
        if state.link_ok:
            state.linked_at = now
        if not state.up or (state.cut_off and state.link_ok):
            await self._recover(state)

    def _check_link_loss(self) -> None:
        """Fail the steps in flight through a stage that has not answered, or whose link to
        the next stage has been down, for ``link_loss_timeout`` (a result from the ring
        counts as an answer of every stage): they go the way of a stage that went down
        (the engine waits for the ring to heal, then re-prefills). A stage merely busy with
        a long step answers its probes (they run beside the inference call) and is not
        touched; its step has the step deadline."""
        now = time.monotonic()
        alive = self._ring_alive_at
        for state in self.stages:
            if state.cut_off:
                continue
            silent = now - max(state.answered_at, alive)
            unlinked = now - max(state.linked_at, alive)
            # (a link to a stage that is down counts as that stage's failure)
            nxt = self.stages[(state.index + 1) % len(self.stages)]
            if state.silent and silent > self.link_loss_timeout:
                why = f"has not answered for {silent:.1f}s"
            elif not state.link_ok and nxt.up and unlinked > self.link_loss_timeout:
                why = f"cannot reach stage {nxt.index} at {nxt.address} for {unlinked:.1f}s"
            else:
                continue
            state.cut_off = True
            in_flight = len({sid for f, sid in self._pending.values() if not f.done()})
            log.warning(
                "stage %d at %s %s: link lost; the steps in flight of %d session(s) abandoned",
                state.index,
                state.address,
                why,
                in_flight,
            )
            self._fail_pending(
                StageUnavailable(f"stage {state.index} at {state.address} {why}", state.index)
            )
            self._drop_queued_steps()
            if state.silent:
                # its calls stalled on the old connection are cancelled (a late reply on
                # them is never read); new calls connect afresh
                old = self._open(state)
                if old is not None:
                    task = asyncio.create_task(old.close())
                    task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def _drop_queued_steps(self) -> None:
        """Steps still waiting for the Push stream were failed with the rest: never send them
        (a first chunk would open a session nobody frees). The ends of Push calls stay."""
        kept = []
        while not self._push_queue.empty():
            item = self._push_queue.get_nowait()
            if not isinstance(item, pb.Step):
                kept.append(item)
        for item in kept:
            self._push_queue.put_nowait(item)

    def _stage_down(self, state: StageState, detail: str) -> None:
        was_up = state.up
        state.up, state.silent, state.detail = False, False, f"unavailable: {detail}"
        if was_up:
            log.warning("stage %d at %s is down: %s", state.index, state.address, detail)
        self._fail_pending(
            StageUnavailable(
                f"stage {state.index} at {state.address} is unavailable",
                state.index,
            )
        )

    def _fail_pending(self, error: RingError) -> None:
        sessions = set()
        for future, session_id in self._pending.values():
            if not future.done():
                future.set_exception(error)
                sessions.add(session_id)
        self._pending.clear()
        self._release_soon(sessions)

    def _release_soon(self, sessions: set[str]) -> None:
        if sessions and not self._closed:
            task = asyncio.create_task(self.release(*sessions))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _recover(self, state: StageState) -> None:
        try:
            info = await self._info(state)
        except grpc.aio.AioRpcError:
            return
        if info.manifest_sha256 != self.manifest_hash or info.stage_index != state.index:
            state.detail = (
                f"came back serving stage {info.stage_index} of export {info.manifest_sha256}"
            )
            return
        async with self._relinking:
            # after a link loss every stage links afresh (see _link)
            fresh = [s for s in self.stages if s.cut_off]
            try:
                await self._link(fresh=bool(fresh))
                results = self._results_task
                if state is self.stages[-1] or results is None or results.done():
                    await self._subscribe()
            except grpc.aio.AioRpcError as exc:
                state.detail = f"reconnecting: {exc.details()}"
                return
            now = time.monotonic()
            for cut in fresh:
                cut.cut_off = False
            if fresh:  # every link is new: none has been down for long (_check_link_loss)
                for other in self.stages:
                    other.linked_at = max(other.linked_at, now)
        if state.up:
            log.info("stage %d at %s: its link is back; linked afresh", state.index, state.address)
        else:
            log.info("stage %d at %s is back", state.index, state.address)
        state.up, state.detail = True, "serving"
        if state.unreleased:
            await self._release_on(state, sorted(state.unreleased))

    @property
    def kv_pools(self) -> tuple[tuple[int, int], ...]:
        """(block size, blocks) of each paged stage's KV pool."""
        return tuple(
            (s.info.kv_block_size, s.info.kv_blocks)
            for s in self.stages
            if s.info is not None and s.info.kv_backend == "paged"
        )

    @property
    def prefix_block_size(self) -> int | None:
        """The KV block size in which every stage keeps prompt prefixes for later sessions, or
        None where one keeps none (stateful, or its prefix cache off) or their sizes differ."""
        infos = [s.info for s in self.stages]
        if not infos or any(
            i is None or i.kv_backend != "paged" or not i.prefix_cache for i in infos
        ):
            return None
        sizes = {i.kv_block_size for i in infos if i is not None}
        return sizes.pop() if len(sizes) == 1 else None

    @property
    def state_pools(self) -> tuple[tuple[int, int], ...]:
        """(slots for sessions, slots a session holds at most) of each hybrid paged stage's
        state pool, from what it reports (``state_slots``, its scratch slot among them, and
        ``state_window``)."""
        return tuple(
            (s.info.state_slots - SCRATCH_SLOTS, slots_per_session(s.info.state_window))
            for s in self.stages
            if s.info is not None and s.info.kv_backend == "paged" and s.info.state_slots
        )

    @property
    def max_rollback(self) -> int | None:
        windows = [
            s.info.state_window
            for s in self.stages
            if s.info is not None and s.info.kv_backend == "paged" and s.info.state_slots
        ]
        return min(windows) if windows else None

    @property
    def ring_loop(self) -> bool:
        """Whether the last stage feeds decode steps back to stage 0 itself (Step.follow)."""
        info = self.stages[-1].info
        return info is not None and info.ring_loop

    @property
    def paged(self) -> bool:
        """Whether every stage runs the paged KV backend (batched inference)."""
        return len(self.kv_pools) == len(self.stages)

    @property
    def ready(self) -> bool:
        return all(s.up and s.link_ok and not s.cut_off for s in self.stages)

    def check_ready(self) -> None:
        """Raise UNAVAILABLE naming the first stage that is down or cut off from the next."""
        if self.manifest is None:
            raise RuntimeError("call start() first")
        for state in self.stages:
            if not state.up:
                raise StageUnavailable(
                    f"stage {state.index} at {state.address} is {state.detail}",
                    state.index,
                )
            if not state.link_ok or state.cut_off:
                nxt = self.stages[(state.index + 1) % len(self.stages)]
                raise StageUnavailable(
                    f"stage {state.index} cannot reach stage {nxt.index} at {nxt.address}"
                    if not state.link_ok
                    else f"stage {state.index} at {state.address} is linking afresh after a "
                    "link loss",
                    nxt.index if not state.link_ok else state.index,
                )

    # -- steps -----------------------------------------------------------------------------
    async def _run_push(self) -> None:
        first = self.stages[0]
        stub = first.stub
        assert stub is not None
        try:
            call = stub.Push(metadata=self._metadata())
            # The call ends only when its stream breaks or stage 0 ends it (stopping). Its end
            # goes into the queue as a marker: noticed at once, not at the first write after
            # the stage is back (which would lose that step too).
            ended = asyncio.ensure_future(call)
            ended.add_done_callback(lambda f: self._push_ended(call, f))
            while True:
                batch = pb.StepBatch(steps=await self._push_batch(call, ended))
                await call.write(batch)
                first.bytes_out += batch.ByteSize()
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            # (not when its connection was replaced: _check_link_loss failed its steps)
            if not self._closed and first.stub is stub:
                detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                self._stage_down(first, detail or type(exc).__name__)
            # what is still queued was failed with the rest (_fail_pending): never send it
            while not self._push_queue.empty():
                self._push_queue.get_nowait()

    async def _push_batch(self, call: object, ended: asyncio.Future[object]) -> list[pb.Step]:
        """The next steps for stage 0: all those issued in the same scheduler tick, which
        travel (and are computed) together. Raises when ``call`` has ended."""
        steps: list[pb.Step] = []
        while not steps:
            items = [await self._push_queue.get()]
            await asyncio.sleep(0)
            while not self._push_queue.empty():
                items.append(self._push_queue.get_nowait())
            for item in items:
                if isinstance(item, pb.Step):
                    steps.append(item)
                elif item is call:  # (else an earlier call's end)
                    error = ended.exception()
                    raise error or ConnectionError("stage 0 ended the stream")
        return steps

    def _push_ended(self, call: object, future: asyncio.Future[object]) -> None:
        if not future.cancelled():
            future.exception()  # retrieved: a broken stream is expected here
        self._push_queue.put_nowait(call)

    async def step(
        self,
        session_id: str,
        tokens: Sequence[int],
        start_position: int,
        *,
        timeout: float | None = None,
        **fields: Any,
    ) -> StepOutput:
        """One step without follow: ``StepRequest(session_id, tokens, start_position,
        **fields)`` through :meth:`steps` (a shorthand for tests and tools)."""
        request = StepRequest(session_id, tuple(tokens), start_position, **fields)
        return await run_step(self, request, timeout)

    async def steps(
        self, step: StepRequest, timeout: float | None = None
    ) -> AsyncGenerator[StepOutput, None]:
        """Feed ``step.token_ids`` at ``step.start_position`` through the ring; the last stage
        samples ``step.num_logits`` rows (with ``step.draft_tokens`` it verifies them instead:
        speculative decoding, the accepted ones plus a correction or bonus token).

        With ``step.follow`` (a decode step without draft tokens or masks, on a ring with
        :attr:`ring_loop`) the ring then decodes up to ``follow`` more tokens on its own: the
        last stage feeds each sampled token straight back to stage 0, without the round trip
        through the gateway, until a token in ``step.stop_ids``. Yields each step's output in
        turn, each within ``timeout`` of the one before; the consumer stops when it likes (the
        ring's further steps are dropped once the session is released).

        A ring failure (StageUnavailable, StepTimeout), or a step refused at once because the
        ring is not whole, leaves the session's state unknown or lost, so the session is
        released on every stage still reachable; other errors (bad input) leave the session
        as it was.
        """
        session_id, follow = step.session_id, step.follow
        try:
            self.check_ready()
        except RingError:
            # a session between steps when the ring broke: what is left of it is of no use
            if step.start_position:
                self._release_soon({session_id})
            raise
        if follow and not (self.ring_loop and not step.draft_tokens and not step.token_masks):
            raise ValueError("the ring decodes on its own only plain decode steps, on a loop")
        timeout = self.step_timeout if timeout is None else timeout
        step_id = next(self._ids)
        for _ in range(follow):  # the ring's own steps take the ids after it
            next(self._ids)
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[StepOutput]] = []
        for i in range(follow + 1):
            futures.append(loop.create_future())
            self._pending[step_id + i] = (futures[-1], session_id)
        deadline = int((time.time() + timeout * (1 + follow)) * 1000)
        envelope = replace(
            step, step_id=step_id, client_id=self.client_id, deadline_unix_ms=deadline
        )
        self._push_queue.put_nowait(envelope.to_pb())
        if self._push_task is None or self._push_task.done():
            self._push_task = asyncio.create_task(self._run_push())
        try:
            for i, future in enumerate(futures):
                try:
                    yield await asyncio.wait_for(future, timeout)
                except TimeoutError:
                    raise StepTimeout(
                        f"step of session {session_id!r} took longer than {timeout:g}s",
                    ) from None
                emitted = future.result().tokens
                if i < follow and (not emitted or emitted[-1].token_id in step.stop_ids):
                    return  # the ring stopped there
        except RingError as exc:
            if exc.retryable:
                self._release_soon({session_id})
            raise
        finally:
            for i, future in enumerate(futures):
                self._pending.pop(step_id + i, None)
                # the ring's later steps that were never awaited: a failure of the ring
                # (_fail_pending) set their exceptions too, and the one awaited raised it
                if future.done() and not future.cancelled():
                    future.exception()
                else:
                    future.cancel()

    async def acquire(self, session_id: str, hashes: Sequence[bytes]) -> int:
        """Open ``session_id`` on every stage on the cached KV blocks of its prefix (``hashes``,
        see server/engine/prefix.py); the blocks it starts with, the same on every stage (stages
        that held more cut theirs down to it). On failure the session is released wherever it was
        opened and the error raised (UNAVAILABLE when a stage cannot be reached)."""
        self.check_ready()
        wanted = list(hashes)
        try:
            # later rounds only cut down (held blocks stay held); a hybrid model's stage may cut
            # further, to a block whose end state it keeps, so rounds go on while they disagree
            for _ in range(len(self.stages) + 1):
                counts = await asyncio.gather(
                    *(self._acquire_on(s, session_id, wanted) for s in self.stages)
                )
                held = min(counts)
                if all(c == held for c in counts):
                    return held
                wanted = wanted[:held]
            raise RingError(f"stages disagree on session {session_id!r}'s prefix")
        except BaseException:  # in the background: a cancelled caller does not wait for it
            self._release_soon({session_id})
            raise

    async def _acquire_on(self, state: StageState, session_id: str, hashes: list[bytes]) -> int:
        assert state.stub is not None
        try:
            reply = await state.stub.Acquire(
                pb.AcquireRequest(session_id=session_id, block_hashes=hashes),
                metadata=self._metadata(),
                timeout=self.health_timeout * 2,
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in _TRANSIENT:
                code = grpc.StatusCode.UNAVAILABLE
            raise ring_error(
                code, f"stage {state.index}: {exc.details() or code.name}", state.index
            ) from None
        return int(reply.blocks)

    async def release(self, *session_ids: str) -> int:
        """Free sessions on every stage that is reachable; returns how many stages answered."""
        if not session_ids:
            return 0

        return sum(await asyncio.gather(*(self._release_on(s, session_ids) for s in self.stages)))

    async def _release_on(self, state: StageState, session_ids: Sequence[str]) -> bool:
        """Free sessions on one stage; ones it misses are freed when it is back (a stalled
        stage keeps its sessions, a restarted one has none to free)."""
        assert state.stub is not None
        try:
            await state.stub.Release(
                pb.ReleaseRequest(session_ids=list(session_ids)),
                metadata=self._metadata(),
                timeout=self.health_timeout * 2,
            )
        except grpc.aio.AioRpcError:
            state.unreleased.update(session_ids)
            return False
        state.unreleased.difference_update(session_ids)
        return True

    async def tokenizer_files(self) -> dict[str, bytes]:
        """The export's tokenizer files from the first stage that has them."""
        problems = []
        for state in self.stages:
            assert state.stub is not None
            try:
                reply = await state.stub.Tokenizer(
                    pb.TokenizerRequest(), metadata=self._metadata(), timeout=30
                )
            except grpc.aio.AioRpcError as exc:
                problems.append(f"stage {state.index}: {exc.details()}")
                continue
            return {f.name: f.data for f in reply.files}
        raise RingError(
            "no stage has the tokenizer files (" + "; ".join(problems) + ")",
        )

    async def stage_infos(self) -> list[pb.StageInfo | None]:
        async def one(state: StageState) -> pb.StageInfo | None:
            try:
                return await self._info(state)
            except grpc.aio.AioRpcError:
                return None

        return list(await asyncio.gather(*(one(s) for s in self.stages)))

    async def close(self) -> None:
        self._closed = True
        for task in [*self._tasks, self._push_task, self._results_task]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        self._fail_pending(RingError("pipeline client closed"))
        for state in self.stages:
            for channel in (state.channel, state.probe_channel):
                if channel is not None:
                    await channel.close()


def _status_code(value: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN
