"""Settings of one stage process: command-line flags over `PIPESHARD_STAGE_*` variables."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.net import check_listen, check_tls_pair, default_ov_cache


def hung_call(age: float, limit: float) -> str | None:
    """Why a stage counts as hung: the inference call in progress has run ``age`` seconds,
    past ``limit`` (its compute_timeout); None while it has not."""
    if age <= limit:
        return None
    return f"an inference call has run for {age:.2f} s (over {limit:g} s): is the device hung?"


class StageSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PIPESHARD_STAGE_", extra="forbid")

    shards: Path = Field(description="export folder (manifest.json + this stage's folder)")
    stage: int = Field(ge=0, description="which stage of the export this process serves")
    listen: str = Field(default="127.0.0.1:50051", description="gRPC address HOST:PORT")
    device: str = Field(default="CPU", description="OpenVINO device: CPU, GPU, NPU, AUTO, ...")
    threads: int = Field(default=0, ge=0, description="inference threads (0: OpenVINO default)")
    cpus: str | None = Field(default=None, description="pin the process to these CPUs, e.g. 0,1")
    streams: int = Field(
        default=1, ge=1, description="stateful backend: sessions computed at the same time"
    )
    kv_backend: Literal["auto", "stateful", "paged"] = Field(
        default="auto",
        description="KV cache: an infer request per session (stateful), or a shared block pool "
        "with every ready session in one inference call (paged); auto: paged unless "
        "max_sessions is 1",
    )
    kv_cache_size: float = Field(
        default=1.0, gt=0, description="paged backend: GiB of KV blocks this stage holds"
    )
    prefix_cache_blocks: int | None = Field(
        default=None,
        ge=0,
        description="paged backend: KV blocks of known prompt prefixes kept for later sessions "
        "when no session holds them (default: every free block; evicted oldest first when "
        "sessions need the room); 0: no prefix cache",
    )
    state_sessions: int | None = Field(
        default=None,
        ge=1,
        description="paged backend, hybrid models: sessions the linear-attention state pool "
        "holds at once, each at the full state_window (state_window + 2 slots a session, and "
        "a scratch slot); the gateway admits no more at once (default: max_sessions, at most "
        "8)",
    )
    state_cache_size: float | None = Field(
        default=None,
        gt=0,
        description="paged backend, hybrid models: GiB of linear-attention state slots, "
        "instead of state_sessions (as many sessions as it holds at the window; one session "
        "at least, its window cut to fit)",
    )
    state_window: int = Field(
        default=8,
        ge=0,
        le=64,
        description="paged backend, hybrid models: positions a session can be rolled back "
        "(a speculative verification's rejected tokens; at least the gateway's spec_max_k), "
        "each costing a state slot per session",
    )
    max_batch: int = Field(
        default=64, ge=1, description="paged backend: sessions in one inference call at most"
    )
    batch_invariant: bool = Field(
        default=True,
        description="paged backend on CPU: a row's result does not depend on the rest of its "
        "inference call, so greedy output is the same alone, batched and speculative",
    )
    kv_cache_precision: str | None = Field(
        default=None, description="KV_CACHE_PRECISION (default f16 on CPU; 'default': the device's)"
    )
    inference_precision: str | None = Field(
        default=None,
        description="INFERENCE_PRECISION_HINT (default f32 on CPU; 'default': the device's own)",
    )
    ov_cache_dir: Path | None = Field(
        default_factory=default_ov_cache, description="OpenVINO model cache (CACHE_DIR)"
    )
    ov_properties: dict[str, str] = Field(
        default_factory=dict,
        description="any other OpenVINO compile properties, passed through as given, e.g. "
        "DYNAMIC_QUANTIZATION_GROUP_SIZE=0 (environment: a JSON object)",
    )
    max_sessions: int = Field(default=64, ge=1, description="sessions held at once")
    compute_timeout: float = Field(
        default=600.0,
        gt=0,
        description="seconds an inference call may run before the stage counts as hung (a "
        "stuck GPU/NPU driver): the systemd watchdog is no longer fed",
    )
    session_idle_timeout: float = Field(
        default=300.0, gt=0, description="seconds before an untouched session is freed"
    )
    # fp16 kept greedy output identical to the unsplit model on every test prompt and halves
    # the bytes per hop; fp32 makes the split bit-identical to the unsplit model.
    hidden_dtype: Literal["fp16", "fp32"] = Field(
        default="fp16", description="dtype of hidden states sent to the next stage"
    )
    secret: SecretStr | None = Field(default=None, description="shared secret for every call")
    tls_cert: Path | None = Field(default=None, description="PEM certificate this stage serves")
    tls_key: Path | None = Field(default=None, description="PEM private key of tls_cert")
    tls_ca: Path | None = Field(
        default=None, description="PEM CA bundle to verify the next stage (enables TLS to it)"
    )
    tls_server_name: str | None = Field(
        default=None, description="expected name in the next stage's certificate"
    )
    metrics_port: int | None = Field(default=None, description="Prometheus /metrics port")
    log_level: str = Field(default="INFO")

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        return check_listen(value)

    @model_validator(mode="after")
    def _check_tls(self) -> StageSettings:
        check_tls_pair(self.tls_cert, self.tls_key)
        return self

    @model_validator(mode="after")
    def _check_state_pool(self) -> StageSettings:
        if self.state_sessions is not None and self.state_cache_size is not None:
            raise ValueError(
                "give state_sessions (sessions the state pool holds) or state_cache_size "
                "(its GiB), not both"
            )
        if self.state_sessions is not None and self.state_sessions > self.max_sessions:
            raise ValueError(
                f"state_sessions ({self.state_sessions}) is more than max_sessions "
                f"({self.max_sessions}): the stage never holds more sessions than that"
            )
        return self

    def resolved_kv_backend(self) -> Literal["stateful", "paged"]:
        """``auto``: paged, faster from 2 concurrent users on (docs/benchmarks.md, "Retired
        measurements"), unless the stage serves one session at a time."""
        if self.kv_backend != "auto":
            return self.kv_backend
        return "paged" if self.max_sessions > 1 else "stateful"

    def cpu_list(self) -> set[int] | None:
        return parse_cpus(self.cpus) if self.cpus else None


def parse_cpus(text: str) -> set[int]:
    """A CPU list as taskset takes it (``0,2-3``) as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def pin_process(cpus: set[int]) -> None:
    """Pin every thread of this process to ``cpus``: ``sched_setaffinity(0)`` pins only the
    calling thread (and the threads it starts later), and a library may have started one
    already at import. Threads that end meanwhile are skipped (this one is among the tasks)."""
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            os.sched_setaffinity(int(task.name), cpus)
