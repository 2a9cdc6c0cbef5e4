"""What the experiments of one `pipeshard bench` run share.

The stage processes are started once (stage k pinned to its cores, its inference threads set)
and serve every experiment; the draft is loaded once in this process (the coordinator: it plays
the gateway's part for experiments 1, 3, 4 and 5 and drives the HTTP clients of experiment 2).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from benchmarks.processes import Proc
    from protos.manifest import ShardManifest
    from server.engine.speculative import DraftProposer

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Knobs:
    """How much each experiment measures; ``--quick`` takes the small set."""

    rounds: int = 3
    tokens: int = 64  # decode tokens per measurement (experiments 1 and 2)
    users: tuple[int, ...] = (1, 2, 4, 8)
    spec_prompts: int = 8
    spec_tokens: int = 32  # tokens per prompt (experiments 3 and 4)
    ks: tuple[int, ...] = (1, 2, 3, 4, 8)
    spec_delays: tuple[float, ...] = (0.0, 100.0)  # the K sweep is run at each
    delays: tuple[float, ...] = (0.0, 10.0, 50.0, 100.0)
    latency_prompts: int = 8
    latency_users: tuple[int, ...] = (1, 2)
    lengths: tuple[int, ...] = (128, 512, 2048)


FULL = Knobs()
QUICK = Knobs(
    rounds=2,
    tokens=16,
    users=(1, 2),
    spec_prompts=4,
    spec_tokens=16,
    ks=(3,),
    spec_delays=(0.0,),
    delays=(0.0, 100.0),
    latency_prompts=2,
    latency_users=(2,),
    lengths=(128, 512),
)


def knobs(quick: bool, **overrides: Any) -> Knobs:
    return replace(QUICK if quick else FULL, **{k: v for k, v in overrides.items() if v})


@dataclass(frozen=True)
class Pinning:
    """Which cores and how many inference threads each process gets."""

    stage_cores: tuple[str, ...]  # stage k: stage_cores[k % len]
    worker_cores: str  # the monolithic genai baseline and the in-process chains
    coordinator_cores: str  # this process and the gateway processes
    threads: int  # inference threads of every stage, worker and draft

    def stage(self, index: int) -> str:
        return self.stage_cores[index % len(self.stage_cores)]

    def prefix(self) -> list[str]:
        return ["taskset", "-c", self.coordinator_cores]

    def rows(self, num_stages: int, draft: bool) -> list[dict[str, str]]:
        """Every kind of process of the run, its cores and threads, for the report."""
        threads = str(self.threads)
        rows = [
            {
                "process": f"stage {k} (`pipeshard stage`)",
                "cores": self.stage(k),
                "threads": threads,
            }
            for k in range(num_stages)
        ]
        rows += [
            {
                "process": "monolithic openvino-genai worker (experiments 1, 2, 5)",
                "cores": self.worker_cores,
                "threads": threads,
            },
            {
                "process": "in-process chain workers (experiment 1: every stage in one process)",
                "cores": self.worker_cores,
                "threads": f"{threads} per stage",
            },
            {
                "process": "coordinator (this process: gateway engine, pipeline client, latency "
                "proxies, HTTP clients" + (", the draft" if draft else "") + ")",
                "cores": self.coordinator_cores,
                "threads": f"draft {threads}" if draft else "-",
            },
            {
                "process": "gateways (`pipeshard serve`, experiment 2"
                + (", one of them with the draft" if draft else "")
                + ")",
                "cores": self.coordinator_cores,
                "threads": f"draft {threads}" if draft else "-",
            },
        ]
        return rows


@dataclass
class Bench:
    """One run's shared state: the export, the baseline, the stage processes, the draft."""

    export: Path
    manifest: ShardManifest
    baseline: Path | None
    variants: dict[str, Path]  # "s1", "s1-nobeam": 1-stage exports of the same weights
    variant_notes: list[str]
    knobs: Knobs
    pin: Pinning
    ov_cache: Path
    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pipeshard-bench-")))
    addresses: list[str] = field(default_factory=list)
    metric_ports: list[int] = field(default_factory=list)
    procs: list[Proc] = field(default_factory=list)
    _proposer: DraftProposer | None = None
    _prompts: list[list[int]] | None = None
    # One event loop for the whole run: grpc.aio keeps state bound to the loop it first ran on,
    # and a fresh loop per call (asyncio.run) leaves it calling into closed ones.
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` to completion on the run's event loop."""
        return self._loop.run_until_complete(coroutine)

    @property
    def draft_dir(self) -> Path | None:
        draft = self.manifest.draft
        return self.export / draft.directory if draft is not None else None

    @property
    def eos(self) -> list[int]:
        from benchmarks.report import reachable_eos

        return reachable_eos(self.manifest)

    @property
    def max_context(self) -> int:
        return self.manifest.model.max_context

    def start(self) -> None:
        from benchmarks.processes import start_pinned_stages

        log.info("starting %d stage processes (logs in %s)", self.manifest.num_stages, self.logs)
        self.procs, self.addresses, self.metric_ports = start_pinned_stages(
            self.export,
            self.logs,
            metrics=True,
            cores=self.pin.stage_cores,
            threads=self.pin.threads,
            extra=["--ov-cache-dir", str(self.ov_cache), "--log-level", "WARNING"],
        )

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()
        self.procs = []
        self._loop.close()

    def worker(self, kind: str, path: Path, **options: Any) -> dict[str, Any]:
        """A measurement in its own process on the worker cores (benchmarks/workers.py)."""
        from benchmarks import workers

        return workers.measure(
            kind,
            path,
            cores=self.pin.worker_cores,
            threads=self.pin.threads,
            cache_dir=self.ov_cache,
            **options,
        )

    def proposer(self) -> DraftProposer:
        """The draft model, loaded once, in this process (as the gateway runs it)."""
        if self._proposer is None:
            from server.engine.speculative import DraftProposer
            from shard_runtime.runner import RunnerOptions

            assert self.draft_dir is not None
            options = RunnerOptions(threads=self.pin.threads, cache_dir=self.ov_cache)
            self._proposer = DraftProposer(self.draft_dir, options, self.manifest.model.vocab_size)
        return self._proposer

    def chat_prompts(self, count: int) -> list[list[int]]:
        """The speculative benchmark's 8 chat prompts (code, prose, translation, lists) as ids."""
        if self._prompts is None:
            from benchmarks.speculative import chat_ids

            self._prompts = chat_ids(self.export)
        return self._prompts[:count]


def pin_this_process(cores: str) -> None:
    """Pin the coordinator (this process and the threads it starts) to ``cores``."""
    os.sched_setaffinity(0, parse_cores(cores))


def parse_cores(cores: str) -> set[int]:
    """``0,2-3`` -> {0, 2, 3}."""
    chosen: set[int] = set()
    for part in cores.split(","):
        low, _, high = part.partition("-")
        chosen.update(range(int(low), int(high or low) + 1))
    return chosen
