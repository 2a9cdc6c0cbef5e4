"""All stages of an export chained in one process: the reference the network ring must match.

``token ids -> stage 0 -> hidden -> ... -> last stage -> logits``
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import openvino as ov

from protos.manifest import ShardManifest, load_manifest
from protos.sampling import SampledToken
from protos.step import StepRequest
from shard_runtime.paged import GIB, PagedRunner, PagedStep
from shard_runtime.runner import RunnerOptions, ShardRunner
from shard_runtime.step import check_deadline, check_fed, last_stage_tokens


class LocalChain:
    """Every stage of an export as in-process runners sharing one OpenVINO core, on either
    KV backend."""

    def __init__(
        self,
        export_dir: Path,
        options: RunnerOptions | None = None,
        kv_backend: Literal["stateful", "paged"] = "stateful",
        kv_cache_bytes: int | None = None,
    ) -> None:
        """``kv_cache_bytes``: each paged stage's KV pool (default: PagedRunner's)."""
        self.manifest: ShardManifest = load_manifest(export_dir)
        core = ov.Core()
        self.runners: list[ShardRunner | PagedRunner] = []
        for i in range(self.manifest.num_stages):
            if kv_backend == "paged":
                self.runners.append(
                    PagedRunner(
                        export_dir,
                        i,
                        options,
                        kv_cache_bytes=GIB if kv_cache_bytes is None else kv_cache_bytes,
                        core=core,
                        manifest=self.manifest,
                    )
                )
            else:
                self.runners.append(
                    ShardRunner(export_dir, i, options, core=core, manifest=self.manifest)
                )

    def forward(self, session_id: str, token_ids: np.ndarray, num_logits: int = 1) -> np.ndarray:
        """Feed token ids to every stage in turn; returns logits ``[num_logits, vocab]``."""
        data: np.ndarray = np.asarray(token_ids, dtype=np.int64)
        first = self.runners[0]
        start = first.session_length(session_id) if first.has_session(session_id) else 0
        positions = np.arange(start, start + len(data), dtype=np.int64)
        for runner in self.runners:
            if isinstance(runner, PagedRunner):
                step = PagedStep(session_id, data, start, num_logits)
                runner.place(step)
                data = runner.forward([step])[0]
            else:
                data = runner.forward(session_id, data, positions, num_logits)
        return data

    def step(self, step: StepRequest, hidden_dtype: np.dtype | None = None) -> list[SampledToken]:
        """One ring step as the stages compute it (shard_runtime.step): the rollback, every
        stage in turn, and the last stage's tokens (none for a pure rollback). Hidden states
        pass between stages in ``hidden_dtype`` (None: as computed), as the stages send them.
        Raises the runners' errors (InvalidStageInput, SessionNotFound, CapacityExceeded,
        StepExpired)."""
        data: np.ndarray = np.asarray(step.token_ids, dtype=np.int64)
        for runner in self.runners:
            if hidden_dtype is not None and not runner.is_first:
                data = data.astype(hidden_dtype)
            check_deadline(step, runner.stage.index)
            if step.rollback:
                runner.rollback(step.session_id, step.rollback)
            if not check_fed(step, len(data)):
                return []
            num_logits = max(1, step.num_logits)
            if isinstance(runner, PagedRunner):
                item = PagedStep(
                    step.session_id,
                    runner.check_chunk(data),
                    step.start_position,
                    num_logits,
                    solo=step.solo,
                    hashes=step.block_hashes,
                )
                runner.place(item)
                data = runner.forward([item])[0]
            else:
                start = step.start_position
                positions = np.arange(start, start + len(data), dtype=np.int64)
                data = runner.forward(step.session_id, data, positions, num_logits)
        return last_stage_tokens(data, step, len(step.token_ids))

    def session_length(self, session_id: str) -> int:
        """Positions the last stage holds of a session (0: none)."""
        last = self.runners[-1]
        return last.session_length(session_id) if last.has_session(session_id) else 0

    def rollback(self, session_id: str, count: int) -> None:
        for runner in self.runners:
            runner.rollback(session_id, count)

    def release(self, session_id: str) -> None:
        for runner in self.runners:
            runner.release(session_id)

    def greedy(
        self, session_id: str, prompt: list[int], steps: int
    ) -> tuple[list[int], np.ndarray]:
        """Prefill ``prompt``, decode ``steps`` greedy tokens; return the tokens and logits."""
        logits = self.forward(session_id, np.asarray(prompt))[-1]
        tokens: list[int] = []
        rows = []
        for step in range(steps):
            rows.append(logits)
            tokens.append(int(np.argmax(logits)))
            if step + 1 < steps:
                logits = self.forward(session_id, np.asarray(tokens[-1:]))[-1]
        return tokens, np.stack(rows)
