"""The shard runner: one compiled stage shard, one OpenVINO infer request per live sequence.

``numpy chunk (token ids or hidden states) + positions -> shard inputs -> hidden states / logits``

Each sequence (``session``) owns an infer request and so its own KV state; sessions never share
a request (``AsyncInferQueue`` would hand out any idle one and break that affinity). The compiled
model is shared: memory grows by a KV cache per session, not by a model copy.
Rollback trims the tail of every state tensor, so the session continues exactly as if the
rolled-back positions had never been fed. A hybrid model's recurrent (linear-attention) state
has no positions to trim: such a stage keeps a copy of it from before each chunk of several
positions, and rolls back within that chunk (a speculative verification's rejected tokens) by
restoring the copy and feeding the chunk's accepted part again; further back it refuses.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov

from protos.manifest import ShardManifest, StageEntry, load_manifest

log = logging.getLogger(__name__)


class StageError(Exception):
    """Base for errors a stage reports to its caller (mapped to gRPC status codes later)."""


class InvalidStageInput(StageError):
    """Wrong dtype, shape, positions or rollback count; the session is left as it was."""


class SessionNotFound(StageError):
    """The session is unknown (never opened, released, or expired)."""


class CapacityExceeded(StageError):
    """Too many sessions, or a session would exceed the model's maximum context."""


@dataclass(frozen=True)
class RunnerOptions:
    """How to compile a shard. Every compile goes through OpenVINO's model cache when set."""

    device: str = "CPU"
    threads: int = 0  # 0: OpenVINO's default for the device
    # None: f16 on CPU (exact rollback, see compile_properties), the device's default elsewhere;
    # "default": the device's default everywhere (u8 on x86 CPUs); anything else is passed on.
    kv_cache_precision: str | None = None
    # None: f32 on CPU (see compile_properties), the device's default elsewhere; "default": the
    # device's default everywhere; anything else is passed as INFERENCE_PRECISION_HINT.
    inference_precision: str | None = None
    cache_dir: Path | None = None  # OpenVINO CACHE_DIR: a restart does not recompile
    max_sessions: int = 64
    streams: int = 1  # sessions computed at the same time (NUM_STREAMS on CPU)
    properties: dict[str, Any] = field(default_factory=dict)  # passed through verbatim
    # paged backend: a row's numbers do not depend on the rest of its inference call
    # (PagedRunner.forward says how and what it costs)
    batch_invariant: bool = True

    @classmethod
    def from_settings(cls, settings: object, **given: Any) -> RunnerOptions:
        """The options a role's settings give, the one place they are built: each field from
        the setting of the same name (``cache_dir`` from ``ov_cache_dir``, ``properties``
        from ``ov_properties``), as `pipeshard stage`'s settings and `verify`'s flags name
        them. A setting the object lacks or leaves None keeps the default here; ``given``
        wins over both."""
        values: dict[str, Any] = {}
        for option in fields(cls):
            value = getattr(settings, _SETTING_NAMES.get(option.name, option.name), None)
            if value is not None:
                values[option.name] = value
        return cls(**(values | given))

    def compile_properties(self) -> dict[str, Any]:
        props: dict[str, Any] = {}
        cpu = self.device.upper().startswith("CPU")
        if cpu and self.threads > 0:
            props["INFERENCE_NUM_THREADS"] = self.threads
        if cpu and self.streams > 1:
            props["NUM_STREAMS"] = self.streams
        # The CPU plugin's default u8 KV cache makes rollback lossy: trimming reads the state
        # back dequantized and quantizes it again, so speculative decoding would drift from
        # plain decoding (measured: 3 of 8 prompts identical over 64 greedy tokens). An f16
        # cache round-trips exactly (8 of 8) for twice the u8 cache's memory.
        kv = self.kv_cache_precision or ("f16" if cpu else None)
        if kv and kv != "default":
            props["KV_CACHE_PRECISION"] = kv
        # On CPUs with bf16 the plugin computes in bf16 by default, and where a graph is cut
        # into stages changes where it rounds: a split model then differs from the unsplit one.
        # In f32 it is identical bit for bit, at the same speed for compressed weights.
        precision = self.inference_precision or ("f32" if cpu else None)
        if precision and precision != "default":
            props["INFERENCE_PRECISION_HINT"] = precision
        if self.cache_dir is not None:
            props["CACHE_DIR"] = str(self.cache_dir)
        props.update(self.properties)
        return props


# RunnerOptions fields whose setting has another name (the rest: the same).
_SETTING_NAMES = {"cache_dir": "ov_cache_dir", "properties": "ov_properties"}


class StageSession:
    """One sequence's KV state on this stage: its infer request and how many positions it holds."""

    def __init__(self, session_id: str, request: ov.InferRequest) -> None:
        self.session_id = session_id
        self.request = request
        self.length = 0
        self.lock = threading.Lock()
        self.last_used = time.monotonic()
        # A hybrid model's stage: its linear-attention states before the last chunk of more
        # than one position, and that chunk (see ShardRunner.rollback)
        self.checkpoint: Checkpoint | None = None


@dataclass
class Checkpoint:
    """A session's linear-attention states (by variable name) as they were before ``chunk``
    was fed at position ``start``."""

    states: dict[str, np.ndarray]
    chunk: np.ndarray
    start: int


def is_recurrent_state(name: str) -> bool:
    """A linear-attention layer's conv or recurrent state (exporter.graph's
    ``cache_params.*`` ports), not a KV cache."""
    return "cache_params." in name


class ShardBase:
    """What every stage runner shares: the manifest, this stage's entry and input checks."""

    def __init__(
        self,
        export_dir: Path,
        stage_index: int,
        options: RunnerOptions | None = None,
        *,
        manifest: ShardManifest | None = None,
    ) -> None:
        self.options = options or RunnerOptions()
        self.manifest = manifest or load_manifest(export_dir)
        if not 0 <= stage_index < self.manifest.num_stages:
            raise ValueError(
                f"stage {stage_index} does not exist: the export has {self.manifest.num_stages}"
            )
        self.stage: StageEntry = self.manifest.stages[stage_index]
        self.is_first = stage_index == 0
        self.is_last = stage_index == self.manifest.num_stages - 1
        self.model_xml = export_dir / self.stage.model_xml
        if not self.model_xml.is_file():
            raise ValueError(
                f"{self.model_xml} is missing: copy the stage folder with its manifest"
            )
        # Hybrid models' linear-attention layers on this stage: each keeps a recurrent state per
        # session (and its convolution's last inputs) that a rollback by position cannot undo
        self.recurrent_layers = self.manifest.model.recurrent_layers(
            self.stage.layer_start, self.stage.layer_end
        )
        self.hidden_size = self.manifest.model.hidden_size
        # hidden states in: twice as wide after a cut inside an MLP (protos.manifest.StageEntry)
        self.input_width = self.stage.input_width(self.hidden_size)
        self.max_context = self.manifest.model.max_context

    def release_weight_pages(self) -> int:
        """Drop this process's resident pages of the stage's mapped weights: the IR's model.bin
        and OpenVINO's cache blobs (``RunnerOptions.cache_dir``); returns the bytes advised.

        OpenVINO maps the weights file it compiles from (the IR, or on a cache hit the blob)
        and the compiled model keeps the mapping, but the CPU plugin computes from its own
        copies of the weights (an MoE stage's experts in its GatherMatmul layout, the other
        matrices repacked on the first inference): the pages it read them from stay in RSS as
        file-backed memory next to the copies, about twice the stage's weights. Those pages
        are clean and shared read-only, so MADV_DONTNEED only unmaps them from this process:
        whatever is still read from the file faults back in from the page cache, and the rest
        is page cache the kernel may reclaim (in a process holding several stages with one
        cache folder, their blobs' pages too: they fault back alike). Linux only; elsewhere
        (or if the call fails) a no-op."""
        if not sys.platform.startswith("linux"):
            return 0
        weights = str(self.model_xml.with_suffix(".bin").resolve())
        cache = self.options.cache_dir
        blobs = str(cache.resolve()) + "/" if cache is not None else None
        try:
            with open("/proc/self/maps") as maps:
                spans = []
                for line in maps:
                    parts = line.split(maxsplit=5)
                    if len(parts) < 6:
                        continue
                    path = parts[5].rstrip("\n")
                    ours = path == weights or (blobs is not None and path.startswith(blobs))
                    # read-only shared file mappings only: never a page this process wrote
                    if ours and parts[1][:2] == "r-" and parts[1][3] == "s":
                        start, end = (int(x, 16) for x in parts[0].split("-"))
                        spans.append((start, end - start))
            libc = ctypes.CDLL(None, use_errno=True)
            madvise = libc.madvise
            madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            return 0
        advised = 0
        for start, length in spans:
            if madvise(start, length, 4) == 0:  # MADV_DONTNEED
                advised += length
        return advised

    def check_chunk(self, data: np.ndarray) -> np.ndarray:
        """Validate one step's input; token ids [T] (stage 0) or hidden states [T, W] (f32):
        W is ``input_width``."""
        if self.is_first:
            if data.ndim != 1 or not np.issubdtype(data.dtype, np.integer):
                raise InvalidStageInput(
                    f"stage 0 takes a 1-D array of token ids, got {data.dtype} {list(data.shape)}"
                )
            vocab = self.manifest.model.vocab_size
            if data.size and (data.min() < 0 or data.max() >= vocab):
                raise InvalidStageInput(f"token ids must lie in [0, {vocab})")
            return data.astype(np.int64, copy=False)
        if data.ndim != 2 or data.shape[1] != self.input_width:
            raise InvalidStageInput(
                f"stage {self.stage.index} takes hidden states [tokens, {self.input_width}], "
                f"got {list(data.shape)}"
            )
        if data.dtype not in (np.float32, np.float16):
            raise InvalidStageInput(f"hidden states must be float32 or float16, got {data.dtype}")
        return data.astype(np.float32, copy=False)

    def check_step(
        self, session_id: str, length: int, count: int, start: int, num_logits: int
    ) -> None:
        """A chunk of ``count`` positions at ``start`` must continue a session holding
        ``length`` and fit the model's context; the last stage samples 1..count rows."""
        if count == 0:
            raise InvalidStageInput("a chunk must hold at least one token")
        if start != length:
            raise InvalidStageInput(
                f"positions must continue session {session_id!r} at {length} for {count} tokens"
            )
        total = length + count
        if total > self.max_context:
            raise CapacityExceeded(
                f"session {session_id!r} would hold {total} positions "
                f"(maximum context {self.max_context})"
            )
        if self.is_last and not 1 <= num_logits <= count:
            raise InvalidStageInput(f"num_logits must lie in [1, {count}], got {num_logits}")

    def rollback(self, session_id: str, count: int) -> None:
        """Forget the last ``count`` positions of a session (rejected draft tokens)."""
        raise NotImplementedError


class ShardRunner(ShardBase):
    """Runs one stage of an export for many independent sessions."""

    kv_backend = "stateful"

    def __init__(
        self,
        export_dir: Path,
        stage_index: int,
        options: RunnerOptions | None = None,
        *,
        core: ov.Core | None = None,
        manifest: ShardManifest | None = None,
    ) -> None:
        super().__init__(export_dir, stage_index, options, manifest=manifest)
        core = core or ov.Core()
        self.compiled = core.compile_model(
            core.read_model(self.model_xml), self.options.device, self.options.compile_properties()
        )
        self.release_weight_pages()
        self._input_names = {port.get_any_name() for port in self.compiled.inputs}
        self._sessions: dict[str, StageSession] = {}
        self._lock = threading.Lock()

    # -- sessions -------------------------------------------------------------------------
    @property
    def session_count(self) -> int:
        return len(self._sessions)

    def has_session(self, session_id: str) -> bool:
        return session_id in self._sessions

    def session_length(self, session_id: str) -> int:
        return self._get(session_id).length

    def _get(self, session_id: str) -> StageSession:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"session {session_id!r} is not open on stage {self.stage.index}")
        return session

    def _open(self, session_id: str) -> StageSession:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None:
                return session
            if len(self._sessions) >= self.options.max_sessions:
                raise CapacityExceeded(
                    f"stage {self.stage.index} holds {len(self._sessions)} sessions "
                    f"(limit {self.options.max_sessions})"
                )
            session = StageSession(session_id, self.compiled.create_infer_request())
            self._sessions[session_id] = session
            return session

    def release(self, session_id: str) -> bool:
        """Free a session's KV state; returns whether it existed."""
        with self._lock:
            return self._sessions.pop(session_id, None) is not None

    def release_idle(self, max_idle_s: float) -> list[str]:
        """Free sessions untouched for ``max_idle_s`` seconds (abandoned by their caller)."""
        cutoff = time.monotonic() - max_idle_s
        with self._lock:
            idle = [sid for sid, s in self._sessions.items() if s.last_used < cutoff]
            for sid in idle:
                del self._sessions[sid]
        return idle

    # -- compute --------------------------------------------------------------------------
    def forward(
        self,
        session_id: str,
        data: np.ndarray,
        positions: np.ndarray | None = None,
        num_logits: int = 1,
    ) -> np.ndarray:
        """Feed a chunk of tokens (stage 0) or hidden states at the given absolute positions.

        A session opens on its first chunk (positions starting at 0). Returns hidden states
        ``[T, H]``, or on the last stage logits ``[num_logits, V]`` for the chunk's last tokens.
        """
        chunk = self.check_chunk(data)
        count = len(chunk)
        if count == 0:
            raise InvalidStageInput("a chunk must hold at least one token")
        start = 0 if positions is None else int(positions[0]) if len(positions) else -1
        session = self._sessions.get(session_id)
        if session is None:
            if start != 0:
                raise SessionNotFound(
                    f"session {session_id!r} is not open on stage {self.stage.index} "
                    f"(a new session starts at position 0, got {start})"
                )
            session = self._open(session_id)
        with session.lock:
            expected = np.arange(session.length, session.length + count, dtype=np.int64)
            if positions is None:
                positions = expected
            elif positions.shape != expected.shape or not np.array_equal(positions, expected):
                raise InvalidStageInput(
                    f"positions must continue session {session_id!r} at {session.length} "
                    f"for {count} tokens"
                )
            self.check_step(session_id, session.length, count, session.length, num_logits)
            return self._feed(session, chunk, num_logits)

    def _feed(self, session: StageSession, chunk: np.ndarray, num_logits: int = 1) -> np.ndarray:
        """Run ``chunk`` (checked) on top of the session, holding its lock."""
        count = len(chunk)
        total = session.length + count
        positions = np.arange(session.length, total, dtype=np.int64)
        inputs: dict[str, Any] = {
            "input_ids" if self.is_first else "inputs_embeds": chunk[None],
            "attention_mask": np.ones((1, total), dtype=np.int64),
            "position_ids": positions[None, :],
        }
        if self.is_last:
            inputs["num_logits"] = np.array(num_logits, dtype=np.int64)
        if "beam_idx" in self._input_names:
            inputs["beam_idx"] = np.zeros(1, dtype=np.int32)
        if self.recurrent_layers:
            session.checkpoint = None
            if count > 1:  # a speculative verification may be rolled back into
                # (a session's first chunk starts from the initial states: nothing to copy)
                states = self._recurrent_states(session) if session.length else {}
                session.checkpoint = Checkpoint(states, chunk.copy(), session.length)
        result = session.request.infer(inputs)
        session.length = total
        session.last_used = time.monotonic()
        return np.asarray(result[0])[0]

    @staticmethod
    def _recurrent_states(session: StageSession) -> dict[str, np.ndarray]:
        return {
            s.name: s.state.data.copy()
            for s in session.request.query_state()
            if is_recurrent_state(s.name)
        }

    def rollback(self, session_id: str, count: int) -> None:
        """Forget the last ``count`` positions of a session (rejected draft tokens)."""
        session = self._get(session_id)
        with session.lock:
            if not 0 <= count <= session.length:
                raise InvalidStageInput(
                    f"cannot roll back {count} positions of a session holding {session.length}"
                )
            if count == 0:
                return
            keep = session.length - count
            if keep == 0:
                session.request.reset_state()
                session.checkpoint = None
            elif self.recurrent_layers:
                self._rollback_recurrent(session, count)
                return
            else:
                self._trim(session, keep)
            session.length = keep

    @staticmethod
    def _trim(session: StageSession, keep: int) -> None:
        """Keep the first ``keep`` positions of every KV state. A region of interest of the
        state tensor: one copy (in set_state), not three. Still O(context): a copy of every
        layer's kept positions."""
        for state in session.request.query_state():
            if is_recurrent_state(state.name):
                continue
            current = state.state
            end = list(current.shape)
            end[2] = keep
            begin = ov.Coordinate([0] * len(end))
            state.state = ov.Tensor(current, begin, ov.Coordinate(end))

    def _rollback_recurrent(self, session: StageSession, count: int) -> None:
        """A hybrid's stage: a recurrent state has no positions to trim. A rollback within the
        last chunk of several positions (a speculative verification's rejected tokens) goes
        back to the states before that chunk and feeds its accepted part again (output
        dropped): the session is then what feeding only that part would have made it."""
        checkpoint = session.checkpoint
        fed = 0 if checkpoint is None else len(checkpoint.chunk)
        if checkpoint is None or count > fed or session.length != checkpoint.start + fed:
            raise InvalidStageInput(
                f"stage {self.stage.index} cannot roll back {count} positions: its "
                f"linear-attention layers {self.recurrent_layers} hold a recurrent state, "
                "which only goes back to before the session's last chunk of several positions "
                f"({fed} positions)"
            )
        if checkpoint.start == 0:
            session.request.reset_state()
        else:
            for state in session.request.query_state():
                if is_recurrent_state(state.name):
                    state.state = ov.Tensor(checkpoint.states[state.name].copy())
            self._trim(session, checkpoint.start)
        session.length = checkpoint.start
        session.checkpoint = None
        accepted = checkpoint.chunk[: fed - count]
        if len(accepted):
            self._feed(session, accepted)
