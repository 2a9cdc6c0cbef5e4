"""The stage's gRPC service: steps in, steps (or results) out, in order within a session.

``pb.StepBatch -> (codec) numpy -> StageBackend.compute -> numpy -> (codec) pb.StepBatch`` (or
``pb.StepResult`` per step on the last stage)

Steps arrive in batches on long-lived ``Push`` streams. Each step runs after the previous step
of the same session (later ones wait in the session's queue). Steps that are ready at the same
time are computed together, in arrival order: the paged backend takes them all (up to
``max_batch``) in one inference call; the stateful backend runs them one at a time on each of
its ``streams``. Steps computed together go on to the next stage as one batch. The model side
is a :class:`stage_node.backend.StageBackend`. A step that fails here is not dropped: it
travels on with its error set, so the last stage reports it to the gateway that sent it, and
the gateway never waits in vain.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from queue import SimpleQueue
from typing import Any

import grpc
import numpy as np

from common.version import VERSION
from protos import pipeshard_v1_pb2 as pb
from protos import pipeshard_v1_pb2_grpc as pb_grpc
from protos.codec import HIDDEN_DTYPES, sampled_to_pb
from protos.step import StepRequest
from protos.transport import peer_host
from shard_runtime.paged import PagedRunner
from shard_runtime.runner import (
    CapacityExceeded,
    InvalidStageInput,
    SessionNotFound,
    ShardRunner,
)
from shard_runtime.step import StepExpired, next_ring_step
from stage_node.backend import (
    PagedBackend,
    StageBackend,
    StatefulBackend,
    StepInput,
    StepOutcome,
)
from stage_node.downstream import Downstream, unpack
from stage_node.metrics import StageMetrics
from stage_node.settings import StageSettings

log = logging.getLogger(__name__)
_RELEASED_KEPT = 4096  # freed session ids remembered (late steps of theirs fail uncounted)


def fail(step: pb.Step, code: grpc.StatusCode, message: str, stage: int) -> None:
    """Mark a step failed: later stages skip it and the last stage reports it."""
    step.error.CopyFrom(pb.StepError(code=code.value[0], message=message, stage=stage))


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one place where failures become gRPC status codes."""
    if isinstance(exc, InvalidStageInput | ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, SessionNotFound):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, CapacityExceeded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, StepExpired):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
    log.exception("unexpected failure in a step", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


# Steps computed together, and their outcomes
Computed = tuple[list[tuple[StepInput, pb.Step]], list[StepOutcome]]


class StageService(pb_grpc.StageServicer):
    def __init__(
        self,
        runner: ShardRunner | PagedRunner,
        settings: StageSettings,
        metrics: StageMetrics,
        manifest_hash: str,
        manifest_json: bytes,
    ) -> None:
        self.runner = runner
        self.settings = settings
        self.metrics = metrics
        self.manifest_hash = manifest_hash
        self.manifest_json = manifest_json
        self.index = runner.stage.index
        self.hidden_dtype = HIDDEN_DTYPES[settings.hidden_dtype]
        self.backend: StageBackend = (
            PagedBackend(runner, metrics, settings.max_batch)
            if isinstance(runner, PagedRunner)
            else StatefulBackend(runner, metrics, settings.streams)
        )
        # steps ready to compute, taken by the inference threads (under _cond)
        self._ready: deque[tuple[StepInput, pb.Step]] = deque()
        self._cond = threading.Condition()
        # outcomes the inference threads leave to the notifier (see _infer); None: closing
        self._outcomes: SimpleQueue[Computed | None] = SimpleQueue()
        self._loop = asyncio.get_running_loop()  # built by serve(), on its loop
        self._closed = False
        # steps waiting for their session's step in flight (an entry per session in flight)
        self._waiting: dict[str, deque[tuple[pb.Step, np.ndarray | Exception]]] = {}
        self.downstream: Downstream | None = None
        self.loop: Downstream | None = None  # the last stage's link back to stage 0
        self.results: dict[str, asyncio.Queue[pb.StepResult | None]] = {}  # None: stopping
        self._released: OrderedDict[str, None] = OrderedDict()
        self._pushes: set[asyncio.Task[Any]] = set()  # the Push calls reading their streams
        self._stopping = False
        # when each inference thread's call in progress started (perf_counter), by thread
        self._computing: dict[int, float] = {}
        metrics.compute_running.set_function(self.compute_seconds)
        self._threads = [
            threading.Thread(target=self._infer, name=f"infer-{i}", daemon=True)
            for i in range(self.backend.parallelism)
        ]
        self._threads.append(threading.Thread(target=self._notify, name="notify", daemon=True))
        for thread in self._threads:
            thread.start()

    def compute_seconds(self) -> float:
        """How long the oldest inference call in progress has run (0.0: none)."""
        started = list(self._computing.values())  # a copy: the inference threads change it
        return time.perf_counter() - min(started) if started else 0.0

    # -- control RPCs ---------------------------------------------------------------------
    async def Info(self, request: pb.InfoRequest, context: Any) -> pb.StageInfo:
        manifest = self.runner.manifest
        info = pb.StageInfo(
            manifest_sha256=self.manifest_hash,
            stage_index=self.index,
            num_stages=manifest.num_stages,
            layer_start=self.runner.stage.layer_start,
            layer_end=self.runner.stage.layer_end,
            num_layers=manifest.model.num_layers,
            max_sessions=self.runner.options.max_sessions,
            max_context=self.runner.max_context,
            sessions_in_use=self.runner.session_count,
            model_id=manifest.model.model_id,
            hidden_dtype=pb.DTYPE_FLOAT16 if self.hidden_dtype == np.float16 else pb.DTYPE_FLOAT32,
            device=self.runner.options.device,
            manifest_json=self.manifest_json,
            version=VERSION,
            next_address=self.downstream.address if self.downstream else "",
            kv_backend=self.runner.kv_backend,
            ring_loop=self.runner.is_last,
        )
        if isinstance(self.runner, PagedRunner):
            blocks = self.runner.blocks
            info.kv_block_size, info.kv_blocks = blocks.block_size, blocks.num_blocks
            info.kv_blocks_free, info.kv_blocks_cached = blocks.free, blocks.cached
            info.prefix_cache = blocks.enabled
            if self.runner.states is not None:
                info.state_slots = self.runner.states.num_slots
                info.state_slots_free = self.runner.states.free
                info.state_window = self.runner.states.window
        return info

    def _pool_metrics(self) -> None:
        """The KV block gauges after a release or an acquire (steps update them as they run)."""
        if isinstance(self.backend, PagedBackend):
            self.backend.pool_metrics()

    async def Health(self, request: pb.HealthRequest, context: Any) -> pb.HealthReply:
        return pb.HealthReply(
            serving=True,
            sessions_in_use=self.runner.session_count,
            downstream=self.downstream.address if self.downstream else "",
            downstream_ok=self.downstream.healthy if self.downstream else True,
            compute_seconds=self.compute_seconds(),
        )

    async def Link(self, request: pb.LinkRequest, context: Any) -> pb.LinkReply:
        if self.runner.is_last and request.next_address:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the last stage has no next stage"
            )
        if request.loop_address and not self.runner.is_last:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "only the last stage links back to stage 0"
            )
        if self.runner.is_last:
            await self._link_loop(request.loop_address)
            return pb.LinkReply()
        if self.downstream is not None and self.downstream.address == request.next_address:
            return pb.LinkReply()
        old, self.downstream = self.downstream, None
        if request.next_address:
            self.downstream = Downstream(
                request.next_address, self.settings, self.manifest_hash, self.metrics
            )
            self.downstream.connect()
            log.info("stage %d linked to next stage %s", self.index, request.next_address)
        if old is not None:
            await old.close()
        return pb.LinkReply()

    async def _link_loop(self, address: str) -> None:
        """The link back to stage 0 (none needed when this stage is stage 0 too)."""
        if self.runner.is_first or (self.loop is not None and self.loop.address == address):
            return
        old, self.loop = self.loop, None
        if address:
            self.loop = Downstream(
                address, self.settings, self.manifest_hash, self.metrics, loop=True
            )
            self.loop.connect()
            log.info("stage %d linked back to stage 0 at %s", self.index, address)
        if old is not None:
            await old.close()

    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseReply:
        for sid in request.session_ids:
            self._released[sid] = None
            self._released.move_to_end(sid)
        while len(self._released) > _RELEASED_KEPT:
            self._released.popitem(last=False)
        released = sum(self.runner.release(sid) for sid in request.session_ids)
        self.metrics.sessions.set(self.runner.session_count)
        self._pool_metrics()
        return pb.ReleaseReply(released=released)

    async def Acquire(self, request: pb.AcquireRequest, context: Any) -> pb.AcquireReply:
        if not isinstance(self.runner, PagedRunner):
            # the stateful backend keeps no prefixes: the session opens with its first step
            return pb.AcquireReply(blocks=0, block_size=0)
        try:
            blocks = self.runner.acquire(request.session_id, list(request.block_hashes))
        except Exception as exc:
            code, message = status_for(exc)
            await context.abort(code, message)
        self._released.pop(request.session_id, None)  # opened again: its steps are not late
        self.metrics.sessions.set(self.runner.session_count)
        self.metrics.prefix_blocks.inc(blocks)
        self._pool_metrics()
        return pb.AcquireReply(blocks=blocks, block_size=self.runner.blocks.block_size)

    async def Tokenizer(self, request: pb.TokenizerRequest, context: Any) -> pb.TokenizerFiles:
        folder = self.settings.shards / self.runner.manifest.tokenizer.directory
        files = sorted(p for p in folder.glob("*") if p.is_file()) if folder.is_dir() else []
        if not files:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no tokenizer files in {folder}")
        return pb.TokenizerFiles(
            files=[pb.NamedFile(name=p.name, data=p.read_bytes()) for p in files]
        )

    async def Results(
        self, request: pb.ResultsRequest, context: Any
    ) -> AsyncIterator[pb.StepResult]:
        if not self.runner.is_last:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "results come from the last stage"
            )
        queue: asyncio.Queue[pb.StepResult | None] = asyncio.Queue()
        self.results[request.client_id] = queue  # a reconnecting gateway takes over its id
        await context.send_initial_metadata(())  # tells the gateway it is subscribed
        try:
            peer = peer_host(context.peer())
            while (result := await queue.get()) is not None:
                size = result.ByteSize()
                self.metrics.bytes.labels("out").inc(size)
                self.metrics.link_bytes.labels("out", peer).inc(size)
                yield result
        finally:
            if self.results.get(request.client_id) is queue:
                del self.results[request.client_id]
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"stage {self.index} is stopping")

    # -- the data path --------------------------------------------------------------------
    # A session's steps run one after another: the first waits in ``_ready`` for compute, the
    # rest wait in the session's entry of ``_waiting`` (present while the session has a step
    # in flight) and start as soon as the one before has been passed on. Everything here but
    # the inference itself runs on the event loop, without a task per step: each step costs
    # only the loop iterations of its batch's compute call.
    async def Push(
        self, request_iterator: AsyncIterator[pb.StepBatch], context: Any
    ) -> pb.PushSummary:
        steps = batches = 0
        task = asyncio.current_task()
        assert task is not None
        self._pushes.add(task)
        link = self.metrics.link_bytes.labels("in", peer_host(context.peer()))
        try:
            async for batch in request_iterator:
                size = batch.ByteSize()
                self.metrics.bytes.labels("in").inc(size)
                link.inc(size)
                for step, data in unpack(batch, self.runner.is_first):
                    self._admit(step, data)
                    steps += 1
                batches += 1
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            # stop() ended the stream: the sender learns why, instead of grpc cancelling
            # the call at the end of the server's grace period (and logging it as an error)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"stage {self.index} is stopping")
        finally:
            self._pushes.discard(task)
        return pb.PushSummary(steps=steps, batches=batches)

    def _admit(self, step: pb.Step, data: np.ndarray | Exception) -> None:
        self.metrics.steps_in_flight.inc()
        if step.start_position == 0:  # opens the session (again): its ring steps are not late
            self._released.pop(step.session_id, None)
        waiting = self._waiting.get(step.session_id)
        if waiting is not None:  # an earlier step of this session is in flight
            waiting.append((step, data))
            return
        self._waiting[step.session_id] = deque([(step, data)])
        self._advance(step.session_id)

    def _advance(self, session_id: str) -> None:
        """Start the session's next waiting step; steps that need no compute (they failed
        upstream or cannot be read) pass on at once, in order."""
        waiting = self._waiting.get(session_id)
        while waiting:
            step, data = waiting.popleft()
            outcome: StepOutcome = None
            if not step.HasField("error"):
                item = data if isinstance(data, Exception) else self._step_input(step, data)
                if not isinstance(item, Exception):
                    self._make_ready(item, step)
                    return
                outcome = item
            self._pass_on([(step, outcome)])
        self._waiting.pop(session_id, None)

    def _pass_on(self, done: list[tuple[pb.Step, StepOutcome]]) -> None:
        """Send computed (or failed) steps on: to the next stage together, or to the gateway
        as results; a failure travels as the step's error."""
        try:
            self.metrics.sessions.set(self.runner.session_count)
            for step, output in done:
                if isinstance(output, Exception):
                    code, message = status_for(output)
                    # the ring's own step (Step.follow) of a request that ended meanwhile
                    # meets no session: the gateway ignores it, so it is no error here either
                    late = isinstance(output, SessionNotFound) and step.session_id in self._released
                    if not late:
                        self.metrics.errors.labels(code.name).inc()
                    fail(step, code, message, self.index)
                    output = None
                if self.runner.is_last:
                    self._deliver(step, output)
                else:
                    self._forward(step, output)
        except Exception:  # never let one batch take the stage down
            log.exception("steps %s could not be delivered", [s.session_id for s, _ in done])
        finally:
            self.metrics.steps_in_flight.dec(len(done))

    def _step_input(self, step: pb.Step, data: np.ndarray) -> StepInput | Exception:
        try:
            return StepInput(StepRequest.from_pb(step), data)
        except Exception as exc:
            return exc

    # -- batching: steps that are ready together are computed together ----------------------
    # ``backend.parallelism`` inference threads take the ready steps themselves: a thread that
    # finishes a call starts the next ready step at once, before the event loop has even woken
    # to pass the finished one on (on a stage pinned to one core that is the step of the other
    # user waiting in the pipeline), and a step made ready on the loop wakes an idle thread
    # directly, without a task or an executor in between.
    def _make_ready(self, item: StepInput, step: pb.Step) -> None:
        with self._cond:
            self._ready.append((item, step))
            self._cond.notify()

    def _infer(self) -> None:
        """An inference thread: take every ready step (up to the backend's batch size) and
        compute them as one batch; each session has at most one step ready or computing (see
        _advance). The loop passes the outcomes on. When another step is ready, the thread
        starts it first and leaves the outcomes to the notifier thread: waking the loop
        releases the GIL, and the loop's Python work (passing the step on) would otherwise
        come before this thread's next call - about a millisecond, on the busiest stage of
        a pipeline that every step."""
        done: Computed | None = None
        while True:
            with self._cond:
                while done is None and not self._ready and not self._closed:
                    self._cond.wait()
                batch = self._take_group() if self._ready and not self._closed else None
            if done is not None:
                if batch is not None:  # the notifier wakes the loop once this thread computes
                    self._outcomes.put(done)
                elif not self._post(done):
                    return
            if batch is not None:
                done = batch, self._compute_batch([item for item, _ in batch])
            elif self._closed:
                return
            else:
                done = None

    def _notify(self) -> None:
        """The notifier thread: hands outcomes left by the inference threads to the loop."""
        while (done := self._outcomes.get()) is not None and self._post(done):
            pass

    def _post(self, done: Computed) -> bool:
        """Has the loop pass computed steps on; False once the loop has closed."""
        try:
            self._loop.call_soon_threadsafe(self._computed, *done)
        except RuntimeError:  # the loop is closed: the stage has stopped
            return False
        return True

    def _computed(
        self, batch: list[tuple[StepInput, pb.Step]], outcomes: list[StepOutcome]
    ) -> None:
        """(On the loop.) Pass computed steps on; start their sessions' next steps."""
        self._pass_on([(step, out) for (_, step), out in zip(batch, outcomes, strict=True)])
        for _, step in batch:
            self._advance(step.session_id)

    def _take_group(self) -> list[tuple[StepInput, pb.Step]]:
        """The oldest ready step and every ready step of its micro-batch group (up to
        max_batch); other groups wait for the next call, so the stages pipeline groups. A
        solo step (pb.Step.solo) is computed alone and joins no other step's call. Called
        holding _cond."""
        first = self._ready.popleft()
        if first[0].request.solo:
            return [first]
        group = first[0].request.group
        batch: list[tuple[StepInput, pb.Step]] = [first]
        rest: deque[tuple[StepInput, pb.Step]] = deque()
        while self._ready:
            entry = self._ready.popleft()
            joins = entry[0].request.group == group and not entry[0].request.solo
            if joins and len(batch) < self.backend.max_batch:
                batch.append(entry)
            else:
                rest.append(entry)
        self._ready = rest
        return batch

    def _compute_batch(self, batch: list[StepInput]) -> list[StepOutcome]:
        """Runs on an inference thread."""
        started = time.perf_counter()
        thread = threading.get_ident()
        self._computing[thread] = started
        try:
            return self.backend.compute(batch)
        except Exception as exc:  # the backends fail steps, not calls; never lose a step
            log.exception("an inference call failed")
            return [exc] * len(batch)
        finally:
            del self._computing[thread]
            self.metrics.busy_seconds.inc(time.perf_counter() - started)

    def _forward(self, step: pb.Step, output: Any) -> None:
        if self.downstream is None:
            if step.HasField("error"):
                # Typically the last stage's link back to stage 0 re-sending a ring step
                # (Step.follow) to a restarted stage 0 before the gateway linked it: the
                # session was lost with the process this one replaced, and the gateway has
                # failed or resumed the request already. Nothing is lost by dropping it.
                log.warning(
                    "stage %d is not linked to a next stage yet; dropping a failed step of "
                    "session %s (%s)",
                    self.index,
                    step.session_id,
                    step.error.message,
                )
                return
            log.error("stage %d is not linked to a next stage; dropping step", self.index)
            self.metrics.errors.labels(grpc.StatusCode.UNAVAILABLE.name).inc()
            return
        self.downstream.send(step, output)

    def _deliver(self, step: pb.Step, tokens: Any) -> None:
        result = pb.StepResult(session_id=step.session_id, step_id=step.step_id)
        if step.HasField("error"):
            result.error.CopyFrom(step.error)
        elif tokens:
            result.tokens.extend(sampled_to_pb(t) for t in tokens)
        if self.runner.has_session(step.session_id):
            result.session_length = self.runner.session_length(step.session_id)
        if step.follow and tokens and not step.HasField("error"):
            # the ring's next step goes out first: stage 0 waits for it, the gateway does not
            self._follow(step, [t.token_id for t in tokens], result.session_length)
        queue = self.results.get(step.client_id)
        if queue is None:
            log.warning("no gateway subscribed as %r; dropping result", step.client_id)
            return
        queue.put_nowait(result)

    def _follow(self, step: pb.Step, emitted: list[int], length: int) -> None:
        """The ring decodes on its own: feed the token just sampled back to stage 0 as the
        session's next step (Step.follow), unless it ends the sequence."""
        if step.session_id in self._released:
            return
        ring_step = next_ring_step(StepRequest.from_pb(step), emitted, length)
        if ring_step is None:
            return
        nxt = ring_step.to_pb()
        if self.runner.is_first:  # a ring of one stage
            self.metrics.loop_steps.inc()
            self._admit(nxt, np.asarray(nxt.token_ids, dtype=np.int64))
        elif self.loop is not None:
            self.metrics.loop_steps.inc()
            self.loop.send(nxt, None)
        else:
            code = grpc.StatusCode.UNAVAILABLE
            self.metrics.errors.labels(code.name).inc()
            message = f"stage {self.index} has no link back to stage 0 for the ring's own steps"
            fail(nxt, code, message, self.index)
            self._deliver(nxt, None)

    async def stop(self) -> None:
        """End every long-lived stream before the server stops, so that none is left for
        grpc to cancel (it logs each as an error): the Push streams in and the gateways'
        result streams end with UNAVAILABLE "stage N is stopping", and the links to the other
        stages close. The gateway learns at once and fails or resumes the requests in flight
        (steps still computing here would reach it too late to count)."""
        self._stopping = True
        for task in list(self._pushes):
            task.cancel()
        for link in (self.downstream, self.loop):
            if link is not None:
                await link.close()
        for queue in self.results.values():
            queue.put_nowait(None)

    async def close(self) -> None:
        for link in (self.downstream, self.loop):
            if link is not None:
                await link.close()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._outcomes.put(None)
        # a call in progress ends before the runner goes (not a hung one: the threads are
        # daemons, so a hung device call does not keep the process from exiting)
        deadline = time.monotonic() + self.settings.compute_timeout  # for all of them
        for thread in self._threads:
            await asyncio.to_thread(thread.join, max(0.0, deadline - time.monotonic()))
