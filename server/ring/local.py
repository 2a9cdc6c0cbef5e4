"""The ring in this process: every stage of an export as in-process runners
(:class:`shard_runtime.chain.LocalChain`), behind the same :class:`server.ring.Ring` interface as
the gRPC client, so that the engine and the HTTP layer run without stage processes.

``StepRequest -> LocalChain.step (the stages' own step code, shard_runtime.step) -> StepOutput``

Steps run one at a time on one worker thread, in the order they are sent (no batching across
sessions: every step is a call of its own). The runners' errors become the ring's typed errors
here, as the stages' status codes do in the gRPC client. The ring decodes on its own
(``StepRequest.follow``) as a stage ring does, with the stages' own rule for the next step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, TypeVar

from common.state_pool import SCRATCH_SLOTS, slots_per_session
from protos.codec import HIDDEN_DTYPES
from protos.manifest import ShardManifest, manifest_hash
from protos.step import StepRequest
from server.ring import (
    BadStep,
    NoCapacity,
    RingError,
    SessionLost,
    StageUnavailable,
    StepOutput,
    StepTimeout,
)
from shard_runtime.chain import LocalChain
from shard_runtime.paged import PagedRunner
from shard_runtime.runner import (
    CapacityExceeded,
    InvalidStageInput,
    RunnerOptions,
    SessionNotFound,
)
from shard_runtime.step import StepExpired, next_ring_step

T = TypeVar("T")


@dataclass
class LocalStage:
    index: int
    address: str = "in-process"
    up: bool = True
    link_ok: bool = True
    detail: str = "serving"
    bytes_out: int = 0  # in-process: nothing crosses a network
    bytes_in: int = 0


def ring_error(exc: Exception, stage: int | None = None) -> RingError:
    """The ring's error for a runner's (the same kinds as stage_node.service.status_for)."""
    if isinstance(exc, RingError):
        return exc
    if isinstance(exc, InvalidStageInput | ValueError):
        return BadStep(str(exc), stage)
    if isinstance(exc, SessionNotFound):
        return SessionLost(str(exc), stage)
    if isinstance(exc, CapacityExceeded):
        return NoCapacity(str(exc), stage)
    if isinstance(exc, StepExpired):
        return StepTimeout(str(exc), stage)
    return RingError(f"{type(exc).__name__}: {exc}", stage)


class LocalRing:
    """Every stage of the export in ``export_dir``, in this process, on either KV backend."""

    def __init__(
        self,
        export_dir: Path,
        options: RunnerOptions | None = None,
        kv_backend: Literal["stateful", "paged"] = "paged",
        step_timeout: float = 120.0,
        hidden_dtype: Literal["fp16", "fp32"] = "fp16",
        kv_cache_bytes: int | None = None,
    ) -> None:
        """``hidden_dtype``: what hidden states are rounded to between stages (the stages'
        --hidden-dtype, fp16 by default: the same numbers as a ring of stage processes);
        ``kv_cache_bytes``: each paged stage's KV pool (the stages' --kv-cache-size)."""
        self.export_dir = export_dir
        self.hidden_dtype = HIDDEN_DTYPES[hidden_dtype]
        self.chain = LocalChain(export_dir, options, kv_backend, kv_cache_bytes)
        self.manifest: ShardManifest = self.chain.manifest
        self._hash = manifest_hash(export_dir)
        self._stages = [LocalStage(i) for i in range(self.manifest.num_stages)]
        self.step_timeout = step_timeout
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="local-ring")
        self._closed = False

    # -- what the ring is ---------------------------------------------------------------------
    @property
    def manifest_hash(self) -> str:
        return self._hash

    @property
    def stages(self) -> list[LocalStage]:
        return self._stages

    @property
    def ready(self) -> bool:
        return not self._closed and all(s.up for s in self._stages)

    @property
    def ring_loop(self) -> bool:
        return True

    @property
    def paged(self) -> bool:
        return all(isinstance(r, PagedRunner) for r in self.chain.runners)

    @property
    def kv_pools(self) -> tuple[tuple[int, int], ...]:
        return tuple(
            (r.blocks.block_size, r.blocks.num_blocks)
            for r in self.chain.runners
            if isinstance(r, PagedRunner)
        )

    @property
    def prefix_block_size(self) -> int | None:
        runners = self.chain.runners
        if not all(isinstance(r, PagedRunner) and r.blocks.enabled for r in runners):
            return None
        sizes = {r.blocks.block_size for r in runners if isinstance(r, PagedRunner)}
        return sizes.pop() if len(sizes) == 1 else None

    @property
    def state_pools(self) -> tuple[tuple[int, int], ...]:
        return tuple(
            (r.states.num_slots - SCRATCH_SLOTS, slots_per_session(r.states.window))
            for r in self.chain.runners
            if isinstance(r, PagedRunner) and r.states is not None
        )

    @property
    def max_rollback(self) -> int | None:
        windows = [
            r.states.window
            for r in self.chain.runners
            if isinstance(r, PagedRunner) and r.states is not None
        ]
        return min(windows) if windows else None

    async def start(self, timeout: float = 120.0) -> ShardManifest:
        return self.manifest

    async def close(self) -> None:
        self._closed = True
        self._worker.shutdown(wait=True, cancel_futures=True)

    def check_ready(self) -> None:
        if self._closed:
            raise StageUnavailable("the in-process ring is closed")
        for stage in self._stages:
            if not stage.up:
                raise StageUnavailable(f"stage {stage.index} is {stage.detail}", stage.index)

    # -- steps --------------------------------------------------------------------------------
    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    def _compute(self, step: StepRequest) -> StepOutput:
        """(On the worker thread.)"""
        try:
            tokens = self.chain.step(step, self.hidden_dtype)
        except Exception as exc:
            raise ring_error(exc) from exc
        return StepOutput(tokens, self.chain.session_length(step.session_id))

    async def steps(
        self, step: StepRequest, timeout: float | None = None
    ) -> AsyncGenerator[StepOutput, None]:
        self.check_ready()
        if step.follow and (step.draft_tokens or step.token_masks):
            raise ValueError("the ring decodes on its own only plain decode steps")
        timeout = self.step_timeout if timeout is None else timeout
        current: StepRequest | None = step
        while current is not None:
            deadline = int((time.time() + timeout) * 1000)
            try:
                out = await self._run(self._compute, replace(current, deadline_unix_ms=deadline))
            except RingError as exc:
                if exc.retryable:  # as the gRPC ring: the session's state is of no use
                    await self.release(step.session_id)
                raise
            yield out
            emitted = [t.token_id for t in out.tokens]
            current = next_ring_step(current, emitted, out.session_length)

    async def acquire(self, session_id: str, hashes: Sequence[bytes]) -> int:
        self.check_ready()
        runners = [r for r in self.chain.runners if isinstance(r, PagedRunner)]
        if len(runners) < len(self.chain.runners):
            return 0  # stateful stages keep no prefixes: the session opens with its first step

        def acquire() -> int:
            wanted = list(hashes)
            # later rounds only cut down (held blocks stay held); a hybrid model's stage may cut
            # further, to a block whose end state it keeps, so rounds go on while they disagree
            for _ in range(len(runners) + 1):
                counts = [r.acquire(session_id, wanted) for r in runners]
                held = min(counts)
                if all(c == held for c in counts):
                    return held
                wanted = wanted[:held]
            raise RingError(f"stages disagree on session {session_id!r}'s prefix")

        try:
            held = await self._run(acquire)
        except Exception as exc:
            await self.release(session_id)
            raise ring_error(exc) from exc
        return held

    async def release(self, *session_ids: str) -> int:
        if not session_ids or self._closed:
            return 0

        def release() -> None:
            for session_id in session_ids:
                self.chain.release(session_id)

        await self._run(release)
        return len(self._stages)

    async def tokenizer_files(self) -> dict[str, bytes]:
        folder = self.export_dir / self.manifest.tokenizer.directory
        files = sorted(p for p in folder.glob("*") if p.is_file()) if folder.is_dir() else []
        if not files:
            raise RingError(f"no tokenizer files in {folder}")
        return {p.name: p.read_bytes() for p in files}
