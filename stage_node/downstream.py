"""The stage's link to the next stage, and the batches it carries: steps computed together go
on as one ``pb.StepBatch`` (their hidden states packed row after row) on one long-lived Push
stream; the last stage's link back to stage 0 carries the steps it makes itself."""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc
import numpy as np

from protos import pipeshard_v1_pb2 as pb
from protos import pipeshard_v1_pb2_grpc as pb_grpc
from protos.codec import (
    HIDDEN_DTYPES,
    numpy_to_tensor,
    tensor_to_numpy,
)
from protos.transport import call_metadata, open_channel
from shard_runtime.runner import (
    InvalidStageInput,
)
from stage_node.metrics import StageMetrics
from stage_node.settings import StageSettings

log = logging.getLogger(__name__)

# How often a stage checks that the next stage answers over the network, and how long an
# answer may take (see Downstream._watch).
PROBE_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 1.0

# A step to pass on with its output rows (hidden states), or None for a rollback or an error.
Outgoing = tuple[pb.Step, np.ndarray | None]


def pack(items: list[Outgoing], dtype: np.dtype) -> pb.StepBatch:
    """Steps computed together, as one message: their hidden states packed row after row."""
    batch = pb.StepBatch()
    rows = []
    for step, out in items:
        step.ClearField("token_ids")
        step.num_tokens = 0 if out is None else len(out)
        if out is not None:
            rows.append(out)
        batch.steps.append(step)
    if rows:
        batch.hidden.CopyFrom(numpy_to_tensor(np.concatenate(rows), dtype))
    return batch


def unpack(batch: pb.StepBatch, first: bool) -> list[tuple[pb.Step, np.ndarray | Exception]]:
    """Each step of a batch with its input: token ids on stage 0, its rows of the packed
    hidden states after it (or why they cannot be read: a malformed batch fails its steps)."""
    if first:
        return [(s, np.asarray(s.token_ids, dtype=np.int64)) for s in batch.steps]
    counts = [s.num_tokens for s in batch.steps]
    try:
        hidden = tensor_to_numpy(batch.hidden) if batch.HasField("hidden") else None
        rows = 0 if hidden is None else hidden.shape[0]
        if rows != sum(counts) or (hidden is not None and hidden.ndim != 2):
            raise InvalidStageInput(
                f"the batch's hidden states hold {rows} rows for steps of {sum(counts)} tokens"
            )
    except Exception as exc:
        return [(s, exc) for s in batch.steps]
    out: list[tuple[pb.Step, np.ndarray | Exception]] = []
    offset = 0
    for step, count in zip(batch.steps, counts, strict=True):
        if hidden is None:
            out.append((step, np.zeros((0, 0), dtype=np.float32)))
        else:
            out.append((step, hidden[offset : offset + count]))
        offset += count
    return out


class Downstream:
    """The link to the next stage: one long-lived Push stream fed from a queue. With ``loop``
    it is the last stage's link back to stage 0, for the steps it makes itself (Step.follow):
    they carry token ids, not hidden states."""

    def __init__(
        self,
        address: str,
        settings: StageSettings,
        manifest_hash: str,
        metrics: StageMetrics,
        loop: bool = False,
    ) -> None:
        self.address = address
        self.loop = loop
        self.metrics = metrics
        self.channel = open_channel(address, settings.tls_ca, settings.tls_server_name)
        self.stub = pb_grpc.StageStub(self.channel)
        secret = settings.secret.get_secret_value() if settings.secret else None
        self.metadata = call_metadata(secret, manifest_hash)
        # steps to send with their output rows, and the calls whose stream ended (see _pump)
        self.queue: asyncio.Queue[Outgoing | object] = asyncio.Queue()
        self.hidden_dtype = HIDDEN_DTYPES[settings.hidden_dtype]
        self.ok = False  # until the stream to the next stage is connected
        # whether the next stage answers a health probe (see _watch)
        self.reachable = True
        self.closed = False
        self._task: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._settings = settings

    @property
    def healthy(self) -> bool:
        """The stream to the next stage is connected and the next stage answers."""
        return self.ok and self.reachable

    def connect(self) -> None:
        if self.closed:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._pump())
        if not self.loop and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.create_task(self._watch())

    def send(self, step: pb.Step, rows: np.ndarray | None) -> None:
        if self.closed:  # stopping: the gateway sees the stage go and fails or retries the step
            return
        self.connect()
        self.queue.put_nowait((step, rows))

    def _take(self, first: Outgoing, call: object) -> tuple[pb.StepBatch, bool]:
        """Everything queued now goes out as one batch; also says whether ``call`` ended."""
        items, ended = [first], False
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, tuple):
                items.append(item)
            elif item is call:
                ended = True
        if self.loop:
            return pb.StepBatch(steps=[step for step, _ in items]), ended
        return pack(items, self.hidden_dtype), ended

    async def _pump(self) -> None:
        batch: pb.StepBatch | None = None
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
                watch = asyncio.ensure_future(call)
                watch.add_done_callback(functools.partial(self._ended, call))
                ended = False
                while not ended:
                    if batch is None:
                        item = await self.queue.get()
                        if not isinstance(item, tuple):
                            ended = item is call  # else an earlier stream's end
                            continue
                        batch, ended = self._take(item, call)
                    await call.write(batch)
                    size = batch.ByteSize()
                    self.metrics.bytes.labels("out").inc(size)
                    self.metrics.link_bytes.labels("out", self.address).inc(size)
                    batch = None
                code, details = await call.code(), await call.details()
                raise ConnectionError(f"the stream to the next stage ended: {details or code}")
            except asyncio.CancelledError:
                return
            except Exception as exc:
                # A step written just before the stream broke may be lost; the gateway sees
                # the stage go down (its health probes) or the step's deadline pass. The batch
                # whose write failed is sent again on the next stream.
                if self.ok:
                    log.warning("next stage %s: %s", self.address, exc)
                self.ok = False
                await asyncio.sleep(0.2)

    async def _watch(self) -> None:
        """Probe the next stage's Health every PROBE_INTERVAL_S on a connection of its own.

        A stream over a link that silently drops packets (a partition, a pulled cable) stays
        "connected" until TCP gives up, minutes later; meanwhile the gateway would see this
        stage as linked. The probe has a connection of its own (a local subchannel pool), so it
        never waits behind a large prefill batch queued on the stream's connection; after a
        failed probe it reconnects, so a link that comes back is seen at once.
        """
        settings = self._settings
        channel: grpc.aio.Channel | None = None
        try:
            while not self.closed:
                if channel is None:
                    channel = open_channel(
                        self.address,
                        settings.tls_ca,
                        settings.tls_server_name,
                        options=[("grpc.use_local_subchannel_pool", 1)],
                    )
                    stub = pb_grpc.StageStub(channel)
                try:
                    await stub.Health(
                        pb.HealthRequest(), metadata=self.metadata, timeout=PROBE_TIMEOUT_S
                    )
                    if not self.reachable:
                        log.info("next stage %s answers again", self.address)
                    self.reachable = True
                except grpc.aio.AioRpcError as exc:
                    if self.reachable and self.ok:
                        log.warning("next stage %s does not answer: %s", self.address, exc.code())
                    self.reachable = False
                    await channel.close()
                    channel = None
                await asyncio.sleep(PROBE_INTERVAL_S)
        except asyncio.CancelledError:
            pass
        finally:
            if channel is not None:
                await channel.close()

    def _ended(self, call: object, future: asyncio.Future[object]) -> None:
        if not future.cancelled():
            future.exception()  # retrieved: a broken stream is expected here
        self.queue.put_nowait(call)

    async def close(self) -> None:
        self.closed, self.ok = True, False
        for task in (self._task, self._watcher):
            if task is not None:
                task.cancel()
        await self.channel.close()
