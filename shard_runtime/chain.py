"""All stages of an export chained in one process: the reference the network ring must match.

``token ids -> stage 0 -> hidden -> ... -> last stage -> logits``
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import openvino as ov

from protos.manifest import ShardManifest, load_manifest
from shard_runtime.paged import PagedRunner, PagedStep
from shard_runtime.runner import RunnerOptions, ShardRunner


class LocalChain:
    """Every stage of an export as in-process runners sharing one OpenVINO core, on either
    KV backend."""

    def __init__(
        self,
        export_dir: Path,
        options: RunnerOptions | None = None,
        kv_backend: Literal["stateful", "paged"] = "stateful",
    ) -> None:
        self.manifest: ShardManifest = load_manifest(export_dir)
        core = ov.Core()
        runner = PagedRunner if kv_backend == "paged" else ShardRunner
        self.runners: list[ShardRunner | PagedRunner] = [
            runner(export_dir, i, options, core=core, manifest=self.manifest)
            for i in range(self.manifest.num_stages)
        ]

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
