"""The paged KV backend's model side: a block pool shared by every session of this stage.

``[steps of many sessions] -> packed tokens / hidden states + block tables -> one inference``

The stage's stateful IR is turned into a PagedAttention model when it loads
(:func:`paged_model`): OpenVINO's ``paged_attention_transformation`` replaces each layer's
KV ``ReadValue``/``Assign`` state with per-layer ``key_cache.N`` / ``value_cache.N`` inputs
(one pool of fixed-size blocks) and inputs that say where each session's positions live
(``past_lens``, ``subsequence_begins``, ``block_indices``, ``block_indices_begins``). Two edits
make it fit a stage: the main input takes the packed tokens of all sessions (``[T]`` ids, or
``[T, H]`` hidden states), and on the last stage the "last ``num_logits`` rows" slice becomes a
gather of ``logits_indices``, so the head runs only for the rows each session samples.

The :class:`BlockManager` is pure bookkeeping (tested without a model): a session's block table
grows as it is fed, rollback shortens it and frees trailing blocks (no copy: the next feed
overwrites the stale slots), and release frees them all at once.

A hybrid model's linear-attention layers become ``PagedCausalConv1D`` + ``PagedGatedDeltaNet``
over state tables, a row per *state slot* (:class:`StateSlots`): each step names the slot its
session's state is read from and the slots the states after its positions are written to
(``la.block_indices``, ``la.cache_interval``), so a rollback selects an earlier slot and the
prefix cache keeps the state at a cached block's end.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from common.state_pool import (
    DEFAULT_STATE_SESSIONS,
    pool_sessions,
    pool_slots,
    slots_per_session,
)
from protos.manifest import ShardManifest
from shard_runtime.memory import available_memory
from shard_runtime.runner import (
    CapacityExceeded,
    InvalidStageInput,
    RunnerOptions,
    SessionNotFound,
    ShardBase,
)

log = logging.getLogger(__name__)
GIB = 1 << 30
PAGED_OP = "PagedAttentionExtension"
MIN_STATE_SLOTS = 4  # of a hybrid stage's state pool (PagedRunner._make_state_tables)
SLIDING_WINDOW_INPUT = 10  # of PagedAttentionExtension: q, k, v, caches, lengths, ..., scale


def check_pools_fit(kv_bytes: int, state_bytes: int) -> None:
    """Refuse pools that need more memory than this machine has left (see
    :mod:`shard_runtime.memory`), naming the settings that size them."""
    left = available_memory()
    if left is None or kv_bytes + state_bytes <= left:
        return
    parts = f"{kv_bytes / GIB:.2f} GiB of KV blocks (--kv-cache-size)"
    if state_bytes:
        parts += (
            f" and {state_bytes / GIB:.2f} GiB of linear-attention state slots "
            "(--state-sessions, --state-window or --state-cache-size)"
        )
    raise ValueError(
        f"the paged pools need {parts}, more than the {left / GIB:.2f} GiB of memory left: "
        "lower them"
    )


class BlocksExhausted(CapacityExceeded):
    """The block pool cannot hold a session's next positions (RESOURCE_EXHAUSTED)."""


@dataclass
class BlockTable:
    length: int = 0  # positions the session holds
    blocks: list[int] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)


class BlockManager:
    """Fixed-size KV blocks handed to sessions: allocation, rollback, release, exhaustion, and
    the prefix cache.

    Prefix cache: a full block whose positions hold a known token prefix gets that prefix's
    hash (:meth:`publish`: the gateway computes the hashes, chained over the token ids from
    position 0, so a hash names the block's content and everything before it). A new session
    may start from the longest run of hashed blocks that matches its own prefix
    (:meth:`acquire`): the blocks are then shared, counted per holder, and never written again
    (a session only writes past its length, and a hashed block lies wholly below it). A hashed
    block that no session holds stays cached, in least-recently-used order, until a session
    needs its room: ``free`` counts it, and allocation evicts the oldest first.
    """

    def __init__(self, num_blocks: int, block_size: int, max_cached: int | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a block pool needs at least one block of at least one position")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # None: cached blocks may take every block no session holds; 0: no prefix cache
        self.max_cached = num_blocks if max_cached is None else max_cached
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: low ids are used first
        self.tables: dict[str, BlockTable] = {}
        self._holders = [0] * num_blocks  # sessions holding each block
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # hashed, held by none: LRU first
        self.hits = 0  # blocks a new session took from the cache
        self.evictions = 0  # cached blocks given to other content

    @property
    def free(self) -> int:
        """Blocks a session can take: unused ones and cached ones no session holds."""
        return len(self._free) + len(self._cached)

    @property
    def used(self) -> int:
        """Blocks held by sessions (a shared block once)."""
        return self.num_blocks - self.free

    @property
    def cached(self) -> int:
        """Hashed blocks no session holds (kept for a later prefix hit)."""
        return len(self._cached)

    @property
    def enabled(self) -> bool:
        return self.max_cached > 0

    def is_cached(self, digest: bytes) -> bool:
        """Whether a block holds the prefix named ``digest``."""
        return digest in self._block_of

    def blocks_for(self, length: int) -> int:
        return math.ceil(length / self.block_size)

    def open(self, session_id: str) -> BlockTable:
        if session_id in self.tables:
            raise ValueError(f"session {session_id!r} is already open")
        table = self.tables[session_id] = BlockTable()
        return table

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._cached.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
            self.evictions += 1
        self._holders[block] = 1
        return block

    def _drop(self, block: int) -> None:
        """A session lets go of ``block``."""
        self._holders[block] -= 1
        if self._holders[block]:
            return
        if block not in self._hash_of:
            self._free.append(block)
            return
        self._cached[block] = None
        while len(self._cached) > self.max_cached:
            oldest, _ = self._cached.popitem(last=False)
            del self._block_of[self._hash_of.pop(oldest)]
            self._free.append(oldest)
            self.evictions += 1

    def grow(self, session_id: str, length: int) -> None:
        """Make the session's table cover ``length`` positions (all or nothing)."""
        table = self.tables[session_id]
        need = self.blocks_for(length) - len(table.blocks)
        if need > self.free:
            raise BlocksExhausted(
                f"KV blocks exhausted: session {session_id!r} needs {need} more block(s) of "
                f"{self.block_size} positions, {self.free} of {self.num_blocks} are free"
            )
        for _ in range(max(0, need)):
            table.blocks.append(self._take())

    def truncate(self, session_id: str, length: int) -> None:
        """Shorten a session to ``length`` positions and free the blocks it no longer needs.
        A shared block cannot be cut into: it would be written again."""
        table = self.tables[session_id]
        if not 0 <= length <= table.length:
            raise ValueError(f"cannot shorten a session of {table.length} to {length}")
        keep = self.blocks_for(length)
        if length % self.block_size and table.blocks[keep - 1] in self._hash_of:
            last = table.blocks[keep - 1]
            if self._holders[last] > 1:
                raise ValueError(
                    f"cannot shorten session {session_id!r} to {length}: position {length} "
                    "lies in a KV block shared with another session"
                )
            del self._block_of[self._hash_of.pop(last)]  # its own again: written from here
        while len(table.blocks) > keep:
            self._drop(table.blocks.pop())
        table.length = length

    def release(self, session_id: str) -> bool:
        table = self.tables.pop(session_id, None)
        if table is None:
            return False
        for block in reversed(table.blocks):
            self._drop(block)
        return True

    def publish(self, session_id: str, first: int, hashes: list[bytes]) -> None:
        """Name the session's blocks ``first``, ``first + 1``, ... by ``hashes`` (each must be
        full). A hash already naming another block (the same prefix computed twice) keeps it."""
        if not self.enabled:
            return
        table = self.tables[session_id]
        if (first + len(hashes)) * self.block_size > table.length or first < 0:
            raise ValueError(
                f"session {session_id!r} holds {table.length} positions: blocks {first}.."
                f"{first + len(hashes) - 1} of {self.block_size} are not all full"
            )
        for block, digest in zip(table.blocks[first:], hashes, strict=False):
            if block in self._hash_of or digest in self._block_of:
                continue
            self._hash_of[block] = digest
            self._block_of[digest] = block

    def acquire(self, session_id: str, hashes: list[bytes]) -> int:
        """Open ``session_id`` on the longest run of cached blocks named by ``hashes`` (its
        prefix, block by block); the number of blocks it starts with. An open session that has
        taken nothing else (a second call with fewer hashes) is cut down to them."""
        table = self.tables.get(session_id)
        if table is not None:
            held = len(table.blocks)
            if table.length != held * self.block_size or any(
                self._hash_of.get(b) != h for b, h in zip(table.blocks, hashes, strict=False)
            ):
                raise ValueError(f"session {session_id!r} is already open")
            self.truncate(session_id, min(held, len(hashes)) * self.block_size)
            return len(table.blocks)
        table = self.open(session_id)
        if not self.enabled:
            return 0
        for digest in hashes:
            block = self._block_of.get(digest)
            if block is None:
                break
            if self._holders[block] == 0:
                del self._cached[block]
            self._holders[block] += 1
            table.blocks.append(block)
        table.length = len(table.blocks) * self.block_size
        self.hits += len(table.blocks)
        return len(table.blocks)


class StateSlots:
    """Slots of a hybrid stage's linear-attention state tables (one row of every conv and
    recurrent state table per slot) and which states each session can return to.

    A session's state is fixed-size, not per position: it is kept by position, ``{position:
    slot}``, the state after that many positions. The latest one is always kept (the next
    step reads it); the ones after each of the last ``window`` positions too where the calls
    that fed them stored them (see :meth:`PagedRunner.forward`), so a rollback of up to
    ``window`` positions selects an earlier slot instead of computing anything again.

    Prefix cache: the state at the end of a cached KV block, by the block's hash
    (:meth:`put_prefix`): a new session that starts on the cached blocks of its prefix starts
    from a copy of it. No session holds these: like cached KV blocks they count as free, and
    the least recently used goes when a session needs its slot (``max_prefix`` at most).
    """

    def __init__(self, num_slots: int, window: int, max_prefix: int = 0) -> None:
        if num_slots < 1:
            raise ValueError("a state pool needs at least one slot")
        self.num_slots = num_slots
        self.window = window
        self.max_prefix = max_prefix
        self._free = list(range(num_slots - 1, -1, -1))
        self.states: dict[str, dict[int, int]] = {}
        self.prefix: OrderedDict[bytes, int] = OrderedDict()  # LRU first

    @property
    def free(self) -> int:
        """Slots a session can take: unused ones and prefix states."""
        return len(self._free) + len(self.prefix)

    @property
    def used(self) -> int:
        """Slots sessions hold."""
        return self.num_slots - self.free

    @property
    def cached(self) -> int:
        """Prefix states (of the free ones)."""
        return len(self.prefix)

    def take(self, count: int, why: str) -> list[int]:
        if count > self.free:
            raise BlocksExhausted(
                f"state slots exhausted: {why} needs {count} linear-attention state slot(s), "
                f"{self.free} of {self.num_slots} are free"
            )
        while len(self._free) < count:  # the oldest prefix states go first
            self._free.append(self.prefix.popitem(last=False)[1])
        return [self._free.pop() for _ in range(count)]

    def put_prefix(self, digest: bytes, slot: int) -> None:
        """Keep ``slot`` as the state at the end of the block named ``digest``."""
        if digest in self.prefix or not self.max_prefix:
            self.give([slot])
            return
        self.prefix[digest] = slot
        while len(self.prefix) > self.max_prefix:
            self._free.append(self.prefix.popitem(last=False)[1])

    def prefix_slot(self, digest: bytes) -> int | None:
        slot = self.prefix.get(digest)
        if slot is not None:
            self.prefix.move_to_end(digest)
        return slot

    def give(self, slots: list[int]) -> None:
        self._free.extend(reversed(slots))

    def keep(self, session_id: str, length: int, below: int | None = None) -> None:
        """Drop the session's states that a rollback from ``length`` cannot reach (further
        back than ``window``) and those after ``length``; ``below``: also every state before
        that position but the one at ``length``."""
        held = self.states.get(session_id)
        if not held:
            return
        floor = length - self.window if below is None else below
        drop = [p for p in held if p != length and (p < floor or p > length)]
        self.give([held.pop(p) for p in drop])

    def release(self, session_id: str) -> None:
        held = self.states.pop(session_id, None)
        if held:
            self.give(list(held.values()))


def paged_model(
    model: ov.Model,
    is_first: bool,
    is_last: bool,
    windows: list[int] | None = None,
    recurrent: bool = False,
) -> ov.Model:
    """Turn a stateful stage IR into a PagedAttention one (in place; returns it).

    ``windows``: per layer of the stage, its sliding window (0: full attention); the stage's
    own masks carried it, and the transformation drops masks.

    ``recurrent``: the stage holds a hybrid model's linear-attention layers, which the
    transformation turns into ``PagedCausalConv1D`` + ``PagedGatedDeltaNet`` over state tables
    (``conv_state_table.N``, ``gated_delta_state_table.N``) and ``la.*`` inputs. Its fusions
    check shapes as they go, so the main input takes its packed shape first; and it refuses a
    model without attention, so a stage of linear-attention layers only gets a placeholder
    attention (one head of width one over the positions, its output times zero)."""
    from openvino._offline_transformations import paged_attention_transformation

    main = "input_ids" if is_first else "inputs_embeds"
    if recurrent:
        if not any(op.get_type_name() == "ScaledDotProductAttention" for op in model.get_ops()):
            _add_placeholder_attention(model)
            model.validate_nodes_and_infer_types()
        for param in model.get_parameters():
            if main in param.output(0).get_names():
                # the transformation unsqueezes the main input at axis 1 itself (see below);
                # the graph is checked again once it has
                shape = [-1] if is_first else [-1, param.get_partial_shape()[2]]
                param.set_partial_shape(ov.PartialShape(shape))
    paged_attention_transformation(model, False, False)
    attention = [op for op in model.get_ordered_ops() if op.get_type_name() == PAGED_OP]
    if windows is not None and any(windows):
        if len(attention) != len(windows):
            raise ValueError(
                f"expected {len(windows)} attention layers in the stage, found {len(attention)}"
            )
        for op, window in zip(attention, windows, strict=True):
            if window:
                op.input(SLIDING_WINDOW_INPUT).replace_source_output(
                    ops.constant(np.int32(window)).output(0)
                )
    for param in list(model.get_parameters()):
        names = param.output(0).get_names()
        if main in names and not recurrent:  # a hybrid's: shaped before the transformation
            # The transformation unsqueezes the main input at axis 1 itself: the caller
            # passes the packed tokens of every session, [T] or [T, H].
            shape = [-1] if is_first else [-1, param.get_partial_shape()[2]]
            param.set_partial_shape(ov.PartialShape(shape))
        elif "num_logits" in names:
            _gather_logit_rows(model, param)
    model.validate_nodes_and_infer_types()
    return model


def _add_placeholder_attention(model: ov.Model) -> None:
    """Give a stage without attention layers an attention the paged transformation can work
    on: one head of width one over the positions (a KV state beside the stage's own, behind
    the same ``beam_idx`` Gather), whose output, summed and times zero, is added to the first
    output. It adds a tiny KV cache (``key_cache.0``, ``value_cache.0``) and changes no number."""
    from openvino.op.util import Variable, VariableInfo

    params = {name: p for p in model.get_parameters() for name in p.output(0).get_names()}
    positions, beam = params["position_ids"], params["beam_idx"]
    row = ops.convert(positions, ov.Type.f32)  # [B, T]
    x = ops.unsqueeze(ops.unsqueeze(row, ops.constant(np.int64(1))), ops.constant(np.int64(-1)))
    batch = ops.gather(
        ops.shape_of(positions), ops.constant(np.array([0], dtype=np.int64)), ops.constant(0)
    )
    empty = ops.concat([batch, ops.constant(np.array([1, 0, 1], dtype=np.int64))], 0)
    kv = []
    for kind in ("key", "value"):
        info = VariableInfo()
        info.data_shape = ov.PartialShape([-1, 1, -1, 1])
        info.data_type = ov.Type.f32
        info.variable_id = f"past_key_values.placeholder.{kind}"
        variable = Variable(info)
        past = ops.read_value(ops.broadcast(ops.constant(np.float32(0)), empty), variable)
        full = ops.concat([ops.gather(past, beam, ops.constant(np.int64(0))), x], 2)
        model.add_sinks([ops.assign(full, variable)])
        model.add_variables([variable])
        kv.append(full)
    attended = ops.scaled_dot_product_attention(
        x,
        kv[0],
        kv[1],
        ops.constant(np.zeros((1, 1, 1, 1), np.float32)),
        ops.constant(np.float32(1.0)),
        causal=False,
    )
    total = ops.reduce_sum(attended, ops.constant(np.array([0, 1, 2, 3], dtype=np.int64)), False)
    zero = ops.multiply(total, ops.constant(np.float32(0.0)))
    result = model.get_results()[0]
    result.input(0).replace_source_output(
        ops.add(result.input(0).get_source_output(), zero).output(0)
    )


def _gather_logit_rows(model: ov.Model, num_logits: Any) -> None:
    """Replace ``hidden[:, T - num_logits:]`` (exporter/graph.py) with a gather of
    the packed rows named by a new ``logits_indices`` input."""
    (subtract,) = [t.get_node() for t in num_logits.output(0).get_target_inputs()]
    (arange,) = [t.get_node() for t in subtract.output(0).get_target_inputs()]
    (gather,) = [t.get_node() for t in arange.output(0).get_target_inputs()]
    if gather.get_type_name() != "Gather":
        raise ValueError("the last stage's num_logits slice has an unexpected shape")
    indices = ops.parameter([-1], ov.Type.i64, name="logits_indices")
    indices.output(0).set_names({"logits_indices"})
    rows = ops.gather(gather.input(0).get_source_output(), indices, ops.constant(0, ov.Type.i64))
    gather.output(0).replace(rows.output(0))
    model.remove_parameter(num_logits)
    model.add_parameters([indices])


@dataclass(frozen=True)
class PagedStep:
    """One session's part of a batch, checked and placed (see :meth:`PagedRunner.forward`)."""

    session_id: str
    data: np.ndarray  # [T] ids or [T, H] hidden states
    start: int
    num_logits: int = 1
    # Always computed alone (pb.Step.solo): a one-row call is not padded, because this
    # session's decode rows take the one-row path every time.
    solo: bool = False
    # Prefix cache: the hashes of the session's blocks start // block_size, +1, ... that this
    # step completes with known tokens, published once it has run (pb.Step.block_hashes).
    hashes: tuple[bytes, ...] = ()


@dataclass
class _StatePlan:
    """What one step of a hybrid stage's session reads and writes in the state tables."""

    interval: int  # la.cache_interval
    slots: list[int]  # la.block_indices: the slot read, then the slots written
    kept: dict[int, int]  # the session's states (position: slot) once the call has run
    own: list[int]  # the slots taken for the call (given back if it fails)
    # prefix cache: (hash of the last block the step completes, that block's end, the slot its
    # state is written to; None: copied from ``kept`` after the call)
    prefix: tuple[bytes, int, int | None] | None = None


class PagedRunner(ShardBase):
    """One stage shard over a shared KV block pool; a batch of sessions per inference call."""

    kv_backend = "paged"

    def __init__(
        self,
        export_dir: Path,
        stage_index: int,
        options: RunnerOptions | None = None,
        *,
        kv_cache_bytes: int = GIB,
        prefix_cache_blocks: int | None = None,
        core: ov.Core | None = None,
        manifest: ShardManifest | None = None,
        pad_lone_rows: bool | None = None,
        state_cache_bytes: int | None = None,
        state_sessions: int | None = None,
        state_window: int = 8,
    ) -> None:
        """``prefix_cache_blocks``: cached blocks no session holds kept at most (None: as many
        as are free; 0: no prefix cache). ``pad_lone_rows``: whether one-row calls are padded
        to two (None: where this machine needs it for batch invariance, measured at load).

        A hybrid model's stage (linear-attention layers) also holds a pool of state slots
        (:class:`StateSlots`), sized for ``state_sessions`` sessions at the full
        ``state_window`` (:mod:`common.state_pool`; None: ``max_sessions``, at most
        ``DEFAULT_STATE_SESSIONS``), or instead ``state_cache_bytes`` of them (no more than
        ``max_sessions`` sessions can use; ``MIN_STATE_SLOTS`` at least; the window is cut to
        what the pool holds for one session). ``state_window``: how many positions a session
        can be rolled back (a speculative verification's rejected tokens, a draft's
        proposals): the states after each of its last ``state_window`` positions are kept
        where they were fed in calls of at most ``state_window`` + 1 positions.

        Raises ValueError where the pools (KV blocks and state slots) need more memory than
        the machine has left, before allocating them."""
        super().__init__(export_dir, stage_index, options, manifest=manifest)
        if state_window < 0:
            raise ValueError(f"state_window must be at least 0, got {state_window}")
        if state_sessions is not None and state_cache_bytes is not None:
            raise ValueError("give the state pool's sessions or its bytes, not both")
        if state_sessions is not None and not 1 <= state_sessions <= self.options.max_sessions:
            raise ValueError(
                f"state_sessions must be 1 to max_sessions ({self.options.max_sessions}), "
                f"got {state_sessions}"
            )
        recurrent = bool(self.recurrent_layers)
        core = core or ov.Core()
        facts = self.manifest.model
        layer_types = facts.layer_types[self.stage.layer_start : self.stage.layer_end]
        windows = [
            (facts.sliding_window or 0) if kind == "sliding_attention" else 0
            for kind in layer_types
        ]
        model = paged_model(
            core.read_model(self.model_xml), self.is_first, self.is_last, windows, recurrent
        )
        self.compiled = core.compile_model(model, self.options.device, self._compile_properties())
        self.release_weight_pages()
        self.request = self.compiled.create_infer_request()
        caches = [p for p in self.compiled.inputs if "_cache." in p.get_any_name()]
        # Cache shapes come from the compiled model ([blocks, kv heads, block size, head dim]
        # on CPU; other devices choose their own layout, precision and block size).
        shapes = {
            p.get_any_name(): [d.get_length() for d in p.get_partial_shape()[1:]] for p in caches
        }
        block_bytes = sum(
            int(np.prod(shapes[p.get_any_name()])) * p.get_element_type().size for p in caches
        )
        # the block size is the value cache's third axis on CPU and GPU alike (GPU lays the
        # key cache out transposed)
        block_size = next(v for k, v in shapes.items() if k.startswith("value_cache."))[1]
        num_blocks = max(1, kv_cache_bytes // max(1, block_bytes))
        if recurrent and all(kind == "linear_attention" for kind in layer_types):
            # the placeholder attention's blocks (see paged_model) cost next to nothing: as
            # many as every session at the longest context, twice over (the prefix cache),
            # not the whole budget
            most = 2 * self.options.max_sessions * math.ceil(self.max_context / block_size)
            num_blocks = min(num_blocks, most)
        prefix_enabled = prefix_cache_blocks is None or prefix_cache_blocks > 0
        # hybrid stages: the linear-attention state tables, a slot per row
        self._tables: list[ov.Tensor] = []
        self.states: StateSlots | None = None
        self.state_cache_bytes = 0
        self._slot_bytes = 0
        num_slots = 0
        if recurrent:
            num_slots, state_window = self._state_pool_size(
                state_sessions, state_cache_bytes, state_window, prefix_enabled
            )
        check_pools_fit(num_blocks * block_bytes, num_slots * self._slot_bytes)
        self._caches: list[ov.Tensor] = []
        for port in caches:
            tensor = ov.Tensor(port.get_element_type(), [num_blocks, *shapes[port.get_any_name()]])
            self.request.set_tensor(port.get_any_name(), tensor)
            self._caches.append(tensor)
        # Batch invariance (see forward) on CPU, whose kernels it was measured on (other
        # devices compute as they do; untested here): verifications split into one-position
        # subsequences, and where this machine computes a lone row differently from a row
        # among others, one block kept aside to pad one-row calls.
        cpu = self.options.device.upper().startswith("CPU")
        # A hybrid's verification stays one subsequence: one-position subsequences of one
        # session would update its recurrent state side by side (the kernel runs sequences in
        # parallel), so it takes the several-token attention path, as the stateful backend does.
        invariant = self.options.batch_invariant and cpu
        self._split_verification = invariant and not recurrent
        self._scratch_block: int | None = None
        self.blocks = BlockManager(num_blocks, block_size, prefix_cache_blocks)
        self.kv_cache_bytes = num_blocks * block_bytes
        self._lock = threading.Lock()
        self._pending: dict[str, _StatePlan] = {}
        self._scratch_slot = -1
        if recurrent:
            self._make_state_tables(num_slots, state_window)
        if pad_lone_rows is None:
            pad_lone_rows = invariant and num_blocks > 1 and not self._measured_invariant()
        if pad_lone_rows and num_blocks > 1:
            self._scratch_block = num_blocks - 1
            self.blocks = BlockManager(num_blocks - 1, block_size, prefix_cache_blocks)
        # On a stage with MoE layers the pad row is a copy of the lone row (see forward), so
        # that it routes to the same experts instead of paying for its own.
        self._pad_with_copy = self._scratch_block is not None and self._has_experts()
        log.info(
            "paged KV: %d blocks of %d positions, %.1f MiB (%s)%s",
            num_blocks,
            block_size,
            self.kv_cache_bytes / (1 << 20),
            caches[0].get_element_type(),
            "; one-row calls padded to two" if self._scratch_block is not None else "",
        )
        if self.states is not None:
            log.info(
                "linear-attention state: %d slots of %.2f MiB, %.1f MiB (layers %s; rollback "
                "up to %d positions)",
                self.states.num_slots,
                self._slot_bytes / (1 << 20),
                self.state_cache_bytes / (1 << 20),
                self.recurrent_layers,
                self.states.window,
            )

    def _compile_properties(self) -> dict[str, Any]:
        """The runner options' compile properties, less the model cache on CPU: OpenVINO's CPU
        plugin writes a paged model's blob but cannot load it again (its PagedAttention nodes
        lose the ``k_head_size`` / ``num_k_heads`` runtime info they need on the way through
        the blob), so every start would write a blob the size of the stage's weights that no
        later start reads (tests/test_runner.py checks that this still holds)."""
        props = self.options.compile_properties()
        if self.options.device.upper().startswith("CPU") and props.pop("CACHE_DIR", None):
            log.info(
                "paged stage on CPU: compiled without the OpenVINO model cache (the CPU plugin "
                "cannot load a cached PagedAttention model)"
            )
        return props

    def _state_pool_size(
        self, sessions: int | None, budget: int | None, window: int, prefix: bool
    ) -> tuple[int, int]:
        """The state pool's slots and the window they hold (sets ``_slot_bytes``): enough for
        ``sessions`` sessions at ``window`` (None: max_sessions, at most
        DEFAULT_STATE_SESSIONS), or as many as ``budget`` bytes hold, no more than the
        sessions can use (and prefix states, two per session), ``MIN_STATE_SLOTS`` at least
        (a new session's first step writing a prefix state: its zeros, its end, the prefix
        state, and the scratch slot); a budget too small for one session at ``window`` cuts
        the window to what it holds."""
        ports = [p for p in self.compiled.inputs if "state_table." in p.get_any_name()]
        self._slot_bytes = sum(
            int(np.prod([d.get_length() for d in p.get_partial_shape()[1:]]))
            * p.get_element_type().size
            for p in ports
        )
        most = self.options.max_sessions
        if budget is None:
            wanted = min(most, DEFAULT_STATE_SESSIONS) if sessions is None else sessions
            return max(MIN_STATE_SLOTS, pool_slots(wanted, window)), window
        usable = pool_slots(most, window) + (2 * most if prefix else 0)
        num_slots = max(MIN_STATE_SLOTS, min(usable, budget // max(1, self._slot_bytes)))
        if pool_sessions(num_slots, window) < 1:
            # one session alone must always fit: its window's states, the state it reads and
            # the slots one step writes (common.state_pool)
            cut = num_slots - slots_per_session(0)
            log.warning(
                "state window cut from %d to %d positions: %d state slots of %.2f MiB hold no "
                "more for one session (raise --state-cache-size, or give --state-sessions)",
                window,
                cut,
                num_slots,
                self._slot_bytes / (1 << 20),
            )
            window = cut
        return num_slots, window

    def _make_state_tables(self, num_slots: int, window: int) -> None:
        """Allocate the state tables, ``num_slots`` rows each, and take the scratch slot: it
        takes the writes nobody reads (a padded row's state, a prompt chunk's states at block
        ends before the one kept)."""
        for port in self.compiled.inputs:
            name = port.get_any_name()
            if "state_table." not in name:
                continue
            row = [d.get_length() for d in port.get_partial_shape()[1:]]
            tensor = ov.Tensor(port.get_element_type(), [num_slots, *row])
            self.request.set_tensor(name, tensor)
            self._tables.append(tensor)
        self.states = StateSlots(num_slots, window, num_slots if self.blocks.enabled else 0)
        self.state_cache_bytes = num_slots * self._slot_bytes
        (self._scratch_slot,) = self.states.take(1, "the scratch slot")

    def _zero_slot(self, slot: int) -> None:
        """A new session's initial state: zeros in every table."""
        for tensor in self._tables:
            tensor.data[slot] = 0

    def _copy_slot(self, source: int, target: int) -> None:
        for tensor in self._tables:
            tensor.data[target] = tensor.data[source]

    def _has_experts(self) -> bool:
        """Whether the compiled stage computes MoE experts (GatherMatmul nodes)."""
        for op in self.compiled.get_runtime_model().get_ops():
            info = op.get_rt_info()
            if "layerType" in info and str(info["layerType"].astype(str)) == "GatherMatmul":
                return True
        return False

    def _copy_block(self, source: int, target: int) -> None:
        """Copy KV block ``source`` to ``target`` in every cache (its bytes, whatever their
        precision and packing)."""
        for tensor in self._caches:
            raw = tensor.data.reshape(-1).view(np.uint8)
            size = raw.size // tensor.get_shape()[0]
            raw[target * size : (target + 1) * size] = raw[source * size : (source + 1) * size]

    @property
    def pads_lone_rows(self) -> bool:
        """Whether this stage pads one-row calls to two (batch invariance on a machine that
        needs it; solo steps excepted)."""
        return self._scratch_block is not None

    def _measured_invariant(self) -> bool:
        """lone_row_is_invariant, or False where the pools cannot hold its two probe sessions
        (a hybrid stage's smallest state pool): then one-row calls are padded unmeasured."""
        try:
            return self.lone_row_is_invariant()
        except BlocksExhausted:
            return False

    def lone_row_is_invariant(self) -> bool:
        """Whether a row computed alone equals the same row computed beside another, bit for
        bit, on this machine. It depends on the CPU, the thread count and the row's past
        (measured: one thread agreed and two did not on one host; on another, one thread did
        not, and a two-row call cost 1.4x a one-row call; on a third, with two threads, rows
        agreed until a lone sequence's past spanned two KV blocks, which its attention then
        splits across the threads), so each stage asks its own kernels when it loads (before
        any padding is set up: a padded stage's lone rows are never computed alone): a first
        row, and a row after a past of several blocks, the hidden states of a later stage also
        at a small scale (a difference in attention can vanish in the rounding of a large
        residual; found on a tiny model whose real inputs were smaller than the probe's)."""
        rng = np.random.default_rng(0)

        def data(count: int, scale: float) -> np.ndarray:
            if self.is_first:
                return rng.integers(1, self.manifest.model.vocab_size, count, dtype=np.int64)
            return (scale * rng.standard_normal((count, self.input_width))).astype(np.float32)

        size = self.blocks.block_size  # two sessions of past + 1 positions must fit the pool
        long_past = max(
            0, min(4 * size + 1, self.max_context - 1, self.blocks.num_blocks // 2 * size - 1)
        )
        cases = {(0, 1.0), (long_past, 1.0)}
        if not self.is_first:
            cases.add((long_past, 0.01))
        for past, scale in sorted(cases):
            rows = [(data(past, scale), data(1, scale)) for _ in "ab"]
            alone = [self._probe([row])[0] for row in rows]
            together = self._probe(rows)
            if not all(np.array_equal(a, b) for a, b in zip(alone, together, strict=True)):
                return False
        return True

    def _probe(self, rows: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """Each (past, row): a session that holds ``past`` (fed alone), then ``row`` on top of
        it, the rows in one call; the rows' outputs."""
        sessions = [f"__probe-{i}__" for i in range(len(rows))]
        try:
            for sid, (past, _) in zip(sessions, rows, strict=True):
                if len(past):
                    prefill = PagedStep(sid, past, 0)
                    self.place(prefill)
                    self.forward([prefill])
            steps = [
                PagedStep(sid, row, len(past))
                for sid, (past, row) in zip(sessions, rows, strict=True)
            ]
            for step in steps:
                self.place(step)
            return [out.copy() for out in self.forward(steps)]
        finally:
            for sid in sessions:
                self.release(sid)

    # -- sessions (same surface as ShardRunner) ---------------------------------------------
    @property
    def session_count(self) -> int:
        return len(self.blocks.tables)

    def has_session(self, session_id: str) -> bool:
        return session_id in self.blocks.tables

    def session_length(self, session_id: str) -> int:
        return self._table(session_id).length

    def _table(self, session_id: str) -> BlockTable:
        table = self.blocks.tables.get(session_id)
        if table is None:
            raise SessionNotFound(f"session {session_id!r} is not open on stage {self.stage.index}")
        return table

    def release(self, session_id: str) -> bool:
        with self._lock:
            if self.states is not None:
                self._give_back_pending(session_id)
                self.states.release(session_id)
            return self.blocks.release(session_id)

    def release_idle(self, max_idle_s: float) -> list[str]:
        cutoff = time.monotonic() - max_idle_s
        with self._lock:
            idle = [sid for sid, t in self.blocks.tables.items() if t.last_used < cutoff]
            for sid in idle:
                self.blocks.release(sid)
                if self.states is not None:
                    self._give_back_pending(sid)
                    self.states.release(sid)
        return idle

    def rollback(self, session_id: str, count: int) -> None:
        """Forget a session's last ``count`` positions: bookkeeping, no copy."""
        with self._lock:
            table = self._table(session_id)
            if not 0 <= count <= table.length:
                raise InvalidStageInput(
                    f"cannot roll back {count} positions of a session holding {table.length}"
                )
            keep = table.length - count
            held = {} if self.states is None else self.states.states.get(session_id, {})
            if self.states is not None and count and keep and keep not in held:
                raise InvalidStageInput(
                    f"stage {self.stage.index} cannot roll back {count} positions: its "
                    f"linear-attention layers {self.recurrent_layers} hold a recurrent "
                    f"state, kept only after each of the last {self.states.window} "
                    "positions fed in calls of at most one more position (positions "
                    f"{sorted(held)} of {table.length} here)"
                )
            self.blocks.truncate(session_id, keep)  # may refuse: then nothing has changed
            if self.states is not None and count:
                if keep == 0:  # back to the start: zeros again, when it is next fed
                    self.states.release(session_id)
                else:
                    self.states.keep(session_id, keep)

    def acquire(self, session_id: str, hashes: list[bytes]) -> int:
        """Open a session on the cached blocks of its prefix (see BlockManager.acquire); the
        number of blocks it starts with (0 without a prefix cache: then only opened)."""
        with self._lock:
            if session_id not in self.blocks.tables and len(self.blocks.tables) >= (
                self.options.max_sessions
            ):
                raise CapacityExceeded(
                    f"stage {self.stage.index} holds {len(self.blocks.tables)} sessions "
                    f"(limit {self.options.max_sessions})"
                )
            try:
                if self.states is not None and self.blocks.enabled:
                    return self._acquire_with_state(session_id, hashes)
                return self.blocks.acquire(session_id, hashes)
            except ValueError as exc:
                raise InvalidStageInput(str(exc)) from None

    def _acquire_with_state(self, session_id: str, hashes: list[bytes]) -> int:
        """A hybrid stage's acquire (holding the lock): only up to the last cached block whose
        end state is kept (a prompt chunk's last full block, see _place_states), and the
        session starts from a copy of that state."""
        assert self.states is not None
        usable = 0
        for i, digest in enumerate(hashes):
            if not self.blocks.is_cached(digest):
                break
            if digest in self.states.prefix:
                usable = i + 1
        table = self.blocks.tables.get(session_id)
        before = None if table is None else table.length
        taken = self.blocks.acquire(session_id, hashes[:usable])
        length = taken * self.blocks.block_size
        if before == length and length in self.states.states.get(session_id, {}):
            return taken
        self.states.release(session_id)  # opened, never fed: at most the state acquired
        source = self.states.prefix_slot(hashes[taken - 1]) if taken else None
        # a slot to copy into, without evicting the state to copy (the most recently used)
        if source is None or self.states.free - 1 < 1:
            self.blocks.truncate(session_id, 0)
            return 0
        (slot,) = self.states.take(1, f"session {session_id!r}")
        self._copy_slot(source, slot)
        self.states.states[session_id] = {length: slot}
        return taken

    # -- compute ----------------------------------------------------------------------------
    def place(self, step: PagedStep) -> None:
        """Check a step against its session and reserve the blocks it writes; raises (and
        changes nothing) when it cannot run. A new session opens at position 0."""
        count = len(step.data)
        size = self.blocks.block_size
        if (step.start // size + len(step.hashes)) * size > step.start + count:
            raise InvalidStageInput(
                f"{len(step.hashes)} block hashes for a step at position {step.start} of "
                f"{count} tokens: it completes {(step.start + count) // size - step.start // size}"
                f" block(s) of {size}"
            )
        with self._lock:
            table = self.blocks.tables.get(step.session_id)
            if table is None:
                if step.start != 0:
                    raise SessionNotFound(
                        f"session {step.session_id!r} is not open on stage {self.stage.index} "
                        f"(a new session starts at position 0, got {step.start})"
                    )
                if len(self.blocks.tables) >= self.options.max_sessions:
                    raise CapacityExceeded(
                        f"stage {self.stage.index} holds {len(self.blocks.tables)} sessions "
                        f"(limit {self.options.max_sessions})"
                    )
                self.check_step(step.session_id, 0, count, step.start, step.num_logits)
                self.blocks.open(step.session_id)
                try:
                    self.blocks.grow(step.session_id, count)
                    self._place_states(step)
                except BlocksExhausted:
                    self.blocks.release(step.session_id)
                    raise
                return
            self.check_step(step.session_id, table.length, count, step.start, step.num_logits)
            self.blocks.grow(step.session_id, table.length + count)
            try:
                self._place_states(step)
            except BlocksExhausted:
                self.blocks.truncate(step.session_id, table.length)  # the reserved blocks back
                raise

    def _place_states(self, step: PagedStep) -> None:
        """A hybrid stage: reserve the state slots a step writes (holding the lock). A call of
        at most ``window`` + 1 positions stores the state after each of them
        (``la.cache_interval`` 1: a later rollback into it selects one), a longer one only the
        last (interval 0), or, when it names blocks for the prefix cache, the states at block
        ends (interval: the block size), of which the one at the end of its last full block is
        kept for the cache and the others go to the scratch slot. States the step pushes out
        of the window are let go first."""
        if self.states is None:
            return
        sid, count, start = step.session_id, len(step.data), step.start
        self._give_back_pending(sid)
        held = self.states.states.setdefault(sid, {})
        fresh = start not in held
        if fresh and start:
            raise InvalidStageInput(f"session {sid!r} holds no state at position {start}")
        size, end = self.blocks.block_size, start + count
        cache = bool(step.hashes) and self.states.max_prefix > 0
        edge = (start // size + len(step.hashes)) * size  # the last full block's end
        if count <= self.states.window + 1:  # a verification of k proposals and a bonus
            interval, writes = 1, count
        elif cache:
            interval, writes = size, 1 + (start % size + count - 1) // size
        else:
            interval, writes = 0, 1
        at_edge = edge // size - start // size  # where interval `size` writes the edge state
        real = writes if interval != size else 1 + (edge != end)
        below = end - self.states.window
        need = real + fresh
        going = sum(1 for p in held if p != start and p < below)
        if need > self.states.free + going:  # refused before anything changes
            self.states.take(need, f"session {sid!r} ({count} positions)")
        self.states.keep(sid, start, below=below)
        slots = self.states.take(need, f"session {sid!r} ({count} positions)")
        if fresh:  # a new session's initial state: zeros
            held[0] = slots.pop()
            self._zero_slot(held[0])
        plan = _StatePlan(interval, [held[start], *slots], {}, slots)
        if interval == 1:
            plan.kept = {start + 1 + i: slot for i, slot in enumerate(slots)}
        elif interval == 0:
            plan.kept = {end: slots[0]}
        else:
            written = [self._scratch_slot] * writes
            written[-1] = slots[0]
            plan.kept = {end: slots[0]}
            if edge != end:
                written[at_edge - 1] = slots[1]
            plan.slots = [held[start], *written]
        if cache:
            direct = slots[1] if interval == size and edge != end else None
            plan.prefix = (step.hashes[-1], edge, direct)
        self._pending[sid] = plan

    def _keep_states(self, session_id: str, start: int, count: int) -> None:
        """After a call: the states it wrote become the session's (see _place_states), and
        the state at its last full block's end the prefix cache's."""
        assert self.states is not None
        plan = self._pending.pop(session_id)
        held = self.states.states.setdefault(session_id, {})
        held.update(plan.kept)
        if plan.prefix is not None:
            digest, edge, slot = plan.prefix
            if slot is None and digest not in self.states.prefix and self.states.free > 1:
                (slot,) = self.states.take(1, "a prefix state")
                self._copy_slot(held[edge], slot)
            if slot is not None:
                self.states.put_prefix(digest, slot)
        self.states.keep(session_id, start + count)

    def _give_back_pending(self, session_id: str) -> None:
        plan = self._pending.pop(session_id, None)
        if plan is not None and self.states is not None:
            self.states.give(plan.own)

    def forward(self, steps: list[PagedStep]) -> list[np.ndarray]:
        """Run placed steps (distinct sessions) in one inference call.

        Returns per step its hidden states ``[T, H]``, or on the last stage the logits
        ``[num_logits, V]`` of its last rows. On failure every step's session is left as it
        was before the call (its reserved blocks are given back).

        Batch invariance (``RunnerOptions.batch_invariant``, on by default): a row's numbers
        do not depend on what else is in the call, so greedy output is the same alone, with
        other users and with speculation. Two CPU kernel choices would break that (measured
        on the 1.5B model, where either flips near-ties):

        - A several-token query takes another attention path than a one-token decode. A step
          whose every position is sampled (a speculative verification) is therefore fed as
          one-position subsequences over the same block table; all KV is written before
          attention, so each position attends to the ones before it as a decode would.
        - On some machines (the CPU and the thread count decide; each stage checks when it
          loads) a call of one row takes another path than a call of several rows. There a
          call of one row is padded to two (a scratch block for the body, the last row
          gathered twice for the head). A solo step (``PagedStep.solo``: the gateway computes
          the session alone, always, with ``--no-batching``) is not padded: its rows take the
          one-row path every time, which is just as independent of load and costs less.

        The pad row is a token at position 0 on the scratch block, except on a stage with MoE
        layers, where such a row would route to experts of its own (up to twice the experts
        of a lone decode). There it is a copy of the real row: the same input at the same
        position over the same past, its last, partly filled block copied to the scratch
        block, where the pad writes its own KV. It computes what the real row computes, so it
        picks the same experts in every layer, and the real row's numbers are those of the
        other pad (the call has the same two subsequences, and its longest past is the real
        row's either way).
        """
        counts = [len(s.data) for s in steps]
        begins = np.zeros(len(steps) + 1, dtype=np.int32)
        np.cumsum(counts, out=begins[1:])
        subs: list[tuple[int, int, list[int]]] = []  # (past length, tokens, block table)
        # hybrid stages, per subsequence: (cache interval, state slots: read, then written)
        la: list[tuple[int, list[int]]] = []
        with self._lock:
            for s in steps:
                if self.states is not None:
                    plan = self._pending[s.session_id]
                    la.append((plan.interval, plan.slots))
            for s, c in zip(steps, counts, strict=True):
                held = self.blocks.tables[s.session_id].blocks
                if self._split_verification and 1 < c <= s.num_logits:
                    subs.extend(
                        (s.start + i, 1, held[: self.blocks.blocks_for(s.start + i + 1)])
                        for i in range(c)
                    )
                else:
                    subs.append((s.start, c, held))
        data = [s.data for s in steps]
        positions = [
            np.arange(s.start, s.start + c, dtype=np.int64)
            for s, c in zip(steps, counts, strict=True)
        ]
        # solo steps come one per call and take the one-row path every time
        scratch = None if len(steps) == 1 and steps[0].solo else self._scratch_block
        if scratch is not None and int(begins[-1]) == 1:
            if self._pad_with_copy:
                (start, _, held), size = subs[0], self.blocks.block_size
                if start % size:  # the pad's past in its last block: a copy of the real row's
                    self._copy_block(held[start // size], scratch)
                subs.append((start, 1, [*held[: start // size], scratch]))
                data.append(steps[0].data)
                positions.append(positions[0])
            else:
                subs.append((0, 1, [scratch]))
                data.append(np.zeros_like(steps[0].data))
                positions.append(np.zeros(1, dtype=np.int64))
            if la:  # the pad reads the real row's state and writes its own slot
                la.append((0, [la[0][1][0], self._scratch_slot]))
        sub_begins = np.zeros(len(subs) + 1, dtype=np.int32)
        np.cumsum([n for _, n, _ in subs], out=sub_begins[1:])
        block_begins = np.zeros(len(subs) + 1, dtype=np.int32)
        np.cumsum([len(t) for _, _, t in subs], out=block_begins[1:])
        inputs: dict[str, Any] = {
            "input_ids" if self.is_first else "inputs_embeds": np.concatenate(data),
            "position_ids": np.concatenate(positions),
            "past_lens": np.array([start for start, _, _ in subs], dtype=np.int32),
            "subsequence_begins": sub_begins,
            "block_indices_begins": block_begins,
            "block_indices": np.fromiter(
                (b for _, _, t in subs for b in t), dtype=np.int32, count=int(block_begins[-1])
            ),
            "max_context_len": np.array(
                max(s.start + c for s, c in zip(steps, counts, strict=True)), np.int32
            ),
        }
        if la:
            la_begins = np.zeros(len(la) + 1, dtype=np.int32)
            np.cumsum([len(slots) for _, slots in la], out=la_begins[1:])
            inputs["la.block_indices"] = np.array([b for _, t in la for b in t], dtype=np.int32)
            inputs["la.block_indices_begins"] = la_begins
            inputs["la.past_lens"] = inputs["past_lens"]
            inputs["la.cache_interval"] = np.array([i for i, _ in la], dtype=np.int32)
        if self.is_last:
            picks = [np.arange(e - s.num_logits, e) for s, e in zip(steps, begins[1:], strict=True)]
            if scratch is not None and sum(s.num_logits for s in steps) == 1:
                picks.append(picks[-1])  # the head's product of one row, padded to two
            inputs["logits_indices"] = np.concatenate(picks).astype(np.int64)
        try:
            result = np.asarray(self.request.infer(inputs)[0])
        except Exception:
            with self._lock:
                for s in steps:
                    self._give_back_pending(s.session_id)
                    if self.has_session(s.session_id):
                        self.blocks.truncate(s.session_id, self.blocks.tables[s.session_id].length)
            raise
        now = time.monotonic()
        with self._lock:
            for s, c in zip(steps, counts, strict=True):
                table = self.blocks.tables.get(s.session_id)
                if self.states is not None:
                    if table is None:
                        self._give_back_pending(s.session_id)
                    else:
                        self._keep_states(s.session_id, s.start, c)
                if table is not None:  # released while computing: its blocks are gone
                    table.length, table.last_used = s.start + c, now
                    if s.hashes:
                        first = s.start // self.blocks.block_size
                        self.blocks.publish(s.session_id, first, list(s.hashes))
        rows = result.reshape(result.shape[0], result.shape[-1])  # padded rows come last
        if self.is_last:
            ends = np.cumsum([s.num_logits for s in steps])
            return [rows[e - s.num_logits : e] for s, e in zip(steps, ends, strict=True)]
        return [rows[b:e] for b, e in itertools.pairwise(begins)]
