"""The stage's gRPC service: steps in, steps (or results) out, in order within a session.

``pb.Step -> (codec) numpy -> ShardRunner.forward -> numpy -> (codec) pb.Step or pb.StepResult``

Steps arrive on long-lived ``Push`` streams. Each step runs after the previous step of the same
session (a chain of tasks per session) and concurrently with other sessions' steps, up to
``streams`` at a time, in arrival order (the inference pool is FIFO). The model side is a
:class:`stage_node.backend.StageBackend`. A step that fails here is not dropped: it travels on
with its error set, so the last stage reports it to the gateway that sent it, and the gateway
never waits in vain.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np

from protos import pipeshard_v1_pb2 as pb
from protos import pipeshard_v1_pb2_grpc as pb_grpc
from protos.codec import (
    HIDDEN_DTYPES,
    numpy_to_tensor,
    sampled_to_pb,
    sampling_from_pb,
    tensor_to_numpy,
)
from protos.transport import call_metadata, open_channel
from stage_node.backend import StatefulBackend, StepExpired, StepInput, StepOutcome
from stage_node.metrics import StageMetrics
from stage_node.runner import (
    CapacityExceeded,
    InvalidStageInput,
    SessionNotFound,
    ShardRunner,
)
from stage_node.settings import StageSettings

log = logging.getLogger(__name__)
VERSION = "0.1.0"


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


class Downstream:
    """The link to the next stage: one long-lived Push stream fed from a queue."""

    def __init__(self, address: str, settings: StageSettings, manifest_hash: str) -> None:
        self.address = address
        self.channel = open_channel(address, settings.tls_ca, settings.tls_server_name)
        self.stub = pb_grpc.StageStub(self.channel)
        secret = settings.secret.get_secret_value() if settings.secret else None
        self.metadata = call_metadata(secret, manifest_hash)
        # steps to send, and the calls whose stream ended (see _pump)
        self.queue: asyncio.Queue[pb.Step | object] = asyncio.Queue()
        self.ok = False  # until the stream to the next stage is connected
        self._task: asyncio.Task[None] | None = None

    def connect(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._pump())

    def send(self, step: pb.Step) -> None:
        self.connect()
        self.queue.put_nowait(step)

    async def _pump(self) -> None:
        step: pb.Step | None = None
        while True:
            try:
                # wait_for_ready: while the next stage is down, wait for it to come back
                # instead of failing fast.
                call = self.stub.Push(metadata=self.metadata, wait_for_ready=True)
                await call.wait_for_connection()
                self.ok = True
                # The call ends only when the stream breaks: notice that at once, not at the
                # next write, so health checks never report a dead link as connected. The
                # call itself goes into the queue as the marker of its end.
                ended = asyncio.ensure_future(call)
                ended.add_done_callback(functools.partial(self._ended, call))
                while True:
                    if step is None:
                        item = await self.queue.get()
                        if not isinstance(item, pb.Step):
                            if item is call:
                                raise ConnectionError("the stream to the next stage ended")
                            continue  # an earlier stream's end
                        step = item
                    await call.write(step)
                    step = None
            except asyncio.CancelledError:
                return
            except Exception as exc:
                # A step written just before the stream broke may be lost; the gateway sees
                # the stage go down (its health probes) or the step's deadline pass. The step
                # whose write failed is sent again on the next stream.
                if self.ok:
                    log.warning("next stage %s: %s", self.address, exc)
                self.ok = False
                await asyncio.sleep(0.2)

    def _ended(self, call: object, future: asyncio.Future[object]) -> None:
        if not future.cancelled():
            future.exception()  # retrieved: a broken stream is expected here
        self.queue.put_nowait(call)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.channel.close()


class StageService(pb_grpc.StageServicer):
    def __init__(
        self,
        runner: ShardRunner,
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
        self.backend = StatefulBackend(runner, metrics, settings.streams)
        self.pool = ThreadPoolExecutor(self.backend.parallelism, thread_name_prefix="infer")
        self.downstream: Downstream | None = None
        self.results: dict[str, asyncio.Queue[pb.StepResult]] = {}
        self._tails: dict[str, asyncio.Task[None]] = {}

    # -- control RPCs ---------------------------------------------------------------------
    async def Info(self, request: pb.InfoRequest, context: Any) -> pb.StageInfo:
        manifest = self.runner.manifest
        return pb.StageInfo(
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
        )

    async def Health(self, request: pb.HealthRequest, context: Any) -> pb.HealthReply:
        return pb.HealthReply(
            serving=True,
            sessions_in_use=self.runner.session_count,
            downstream=self.downstream.address if self.downstream else "",
            downstream_ok=self.downstream.ok if self.downstream else True,
        )

    async def Link(self, request: pb.LinkRequest, context: Any) -> pb.LinkReply:
        if self.runner.is_last and request.next_address:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the last stage has no next stage"
            )
        if self.downstream is not None and self.downstream.address == request.next_address:
            return pb.LinkReply()
        old, self.downstream = self.downstream, None
        if request.next_address:
            self.downstream = Downstream(request.next_address, self.settings, self.manifest_hash)
            self.downstream.connect()
            log.info("stage %d linked to next stage %s", self.index, request.next_address)
        if old is not None:
            await old.close()
        return pb.LinkReply()

    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseReply:
        released = sum(self.runner.release(sid) for sid in request.session_ids)
        self.metrics.sessions.set(self.runner.session_count)
        return pb.ReleaseReply(released=released)

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
        queue: asyncio.Queue[pb.StepResult] = asyncio.Queue()
        self.results[request.client_id] = queue  # a reconnecting gateway takes over its id
        await context.send_initial_metadata(())  # tells the gateway it is subscribed
        try:
            while True:
                result = await queue.get()
                self.metrics.bytes.labels("out").inc(result.ByteSize())
                yield result
        finally:
            if self.results.get(request.client_id) is queue:
                del self.results[request.client_id]

    # -- the data path --------------------------------------------------------------------
    async def Push(self, request_iterator: AsyncIterator[pb.Step], context: Any) -> pb.PushSummary:
        count = 0
        async for step in request_iterator:
            self.metrics.bytes.labels("in").inc(step.ByteSize())
            self._schedule(step)
            count += 1
        return pb.PushSummary(steps=count)

    def _schedule(self, step: pb.Step) -> None:
        sid = step.session_id
        previous = self._tails.get(sid)
        task = asyncio.create_task(self._run_after(previous, step))
        self._tails[sid] = task

        def forget(done: asyncio.Task[None]) -> None:
            if self._tails.get(sid) is done:
                del self._tails[sid]

        task.add_done_callback(forget)

    async def _run_after(self, previous: asyncio.Task[None] | None, step: pb.Step) -> None:
        if previous is not None:
            await asyncio.wait([previous])
        try:
            await self._run(step)
        except Exception:  # never let one step take the stage down
            log.exception("step %s/%d could not be delivered", step.session_id, step.step_id)

    async def _run(self, step: pb.Step) -> None:
        output: StepOutcome = None
        self.metrics.steps_in_flight.inc()
        try:
            if not step.HasField("error"):
                output = await asyncio.get_running_loop().run_in_executor(
                    self.pool, self._compute, step
                )
            if isinstance(output, Exception):
                code, message = status_for(output)
                self.metrics.errors.labels(code.name).inc()
                step.error.CopyFrom(
                    pb.StepError(code=code.value[0], message=message, stage=self.index)
                )
                output = None
            self.metrics.sessions.set(self.runner.session_count)
            if self.runner.is_last:
                self._deliver(step, output)
            else:
                self._forward(step, output)
        finally:
            self.metrics.steps_in_flight.dec()

    def _compute(self, step: pb.Step) -> StepOutcome:
        """Runs in the inference pool: the step's input from the wire, then the backend."""
        started = time.perf_counter()
        try:
            if self.runner.is_first:
                data = np.asarray(step.token_ids, dtype=np.int64)
            elif step.HasField("hidden"):
                data = tensor_to_numpy(step.hidden)
            else:
                data = np.zeros((0, self.runner.hidden_size), dtype=np.float32)
            item = StepInput(
                session_id=step.session_id,
                step_id=step.step_id,
                data=data,
                start_position=step.start_position,
                rollback=step.rollback,
                num_logits=step.num_logits,
                sampling=sampling_from_pb(step.sampling),
                history=step.history,
                deadline_unix_ms=step.deadline_unix_ms,
                draft_tokens=step.draft_tokens,
                draft_dists=[(d.ids, d.probs) for d in step.draft_dists],
            )
        except Exception as exc:
            return exc
        try:
            return self.backend.compute([item])[0]
        finally:
            self.metrics.busy_seconds.inc(time.perf_counter() - started)

    def _forward(self, step: pb.Step, output: Any) -> None:
        step.ClearField("token_ids")
        if output is not None:
            step.hidden.CopyFrom(numpy_to_tensor(output, self.hidden_dtype))
        else:
            step.ClearField("hidden")
        if self.downstream is None:
            log.error("stage %d is not linked to a next stage; dropping step", self.index)
            self.metrics.errors.labels(grpc.StatusCode.UNAVAILABLE.name).inc()
            return
        self.metrics.bytes.labels("out").inc(step.ByteSize())
        self.downstream.send(step)

    def _deliver(self, step: pb.Step, tokens: Any) -> None:
        result = pb.StepResult(session_id=step.session_id, step_id=step.step_id)
        if step.HasField("error"):
            result.error.CopyFrom(step.error)
        elif tokens:
            result.tokens.extend(sampled_to_pb(t) for t in tokens)
        if self.runner.has_session(step.session_id):
            result.session_length = self.runner.session_length(step.session_id)
        queue = self.results.get(step.client_id)
        if queue is None:
            log.warning("no gateway subscribed as %r; dropping result", step.client_id)
            return
        queue.put_nowait(result)

    async def close(self) -> None:
        if self.downstream is not None:
            await self.downstream.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
