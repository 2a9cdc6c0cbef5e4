"""How many sessions a planned stage holds with the stages' defaults: `pipeshard plan`'s
last table for each plan.

A paged stage holds sessions in two pools. Its KV blocks (``--kv-cache-size``, 1 GiB, in
blocks of 32 positions) are shared by position: as many sessions as their positions fit. A
hybrid model's stage also holds linear-attention state slots, a fixed number a session
(common.state_pool), sized for ``--state-sessions`` sessions at the full ``--state-window``.
The gateway admits no more sessions at once than the pools hold (docs/scheduling.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from exporter.plan import RUNTIME_OVERHEAD_BYTES
from exporter.presets import (
    GIB,
    KV_BLOCK_POSITIONS,
    KV_CACHE_DEFAULT_GIB,
    PAGED_STATE_WINDOW,
    PresetPlan,
    StageCost,
    state_sessions,
)


@dataclass(frozen=True)
class StageSessions:
    index: int
    state_sessions: int | None  # its state pool's, at the full window (None: no such pool)
    kv_positions: int | None  # its default KV pool's (None: no full attention on the stage)

    def at(self, context: int) -> int | None:
        """Sessions of ``context`` positions each that the default KV pool holds."""
        if self.kv_positions is None:
            return None
        return self.kv_positions // (math.ceil(context / KV_BLOCK_POSITIONS) * KV_BLOCK_POSITIONS)


def kv_positions(stage: StageCost, kv_gib: float = KV_CACHE_DEFAULT_GIB) -> int | None:
    """Positions a stage's KV pool of ``kv_gib`` GiB holds: whole blocks of
    KV_BLOCK_POSITIONS, as the stage cuts its pool (None: the stage has no full attention:
    its placeholder's blocks cost next to nothing)."""
    if not stage.kv_position_bytes:
        return None
    block = stage.kv_position_bytes * KV_BLOCK_POSITIONS
    return int(kv_gib * GIB) // block * KV_BLOCK_POSITIONS


def stage_sessions(plan: PresetPlan) -> list[StageSessions]:
    sessions = state_sessions(plan.sequences)
    return [
        StageSessions(s.index, sessions if s.slot_bytes else None, kv_positions(s))
        for s in plan.stages
    ]


def kv_gib_for(plan: PresetPlan, sessions: int) -> float:
    """The --kv-cache-size (GiB, in tenths, rounded up) with which every stage holds
    ``sessions`` sessions of the plan's context each."""
    blocks = math.ceil(plan.context / KV_BLOCK_POSITIONS) * sessions
    most = max(s.kv_position_bytes for s in plan.stages) * KV_BLOCK_POSITIONS * blocks
    return math.ceil(most / GIB * 10) / 10


def stage_total(stage: StageCost, kv_gib: float) -> int:
    """A stage's memory with a KV pool of ``kv_gib`` GiB (where it has full attention)."""
    kv = int(kv_gib * GIB) if stage.kv_position_bytes else 0
    return stage.weight_bytes + kv + stage.state_bytes + RUNTIME_OVERHEAD_BYTES


def format_sessions(plan: PresetPlan) -> str:
    """The sessions table of a plan, and what holds the plan's sessions at its context
    (nothing for a plan that does not fit)."""
    if not plan.fits:
        return ""
    rows = stage_sessions(plan)
    hybrid = any(r.state_sessions is not None for r in rows)
    sessions = state_sessions(plan.sequences)
    context = plan.context
    pools = f"--kv-cache-size {KV_CACHE_DEFAULT_GIB:g} GiB"
    if hybrid:
        pools += f"; a state pool of {sessions} sessions at --state-window {PAGED_STATE_WINDOW}"
    head = "| stage |" + (" state pool: sessions |" if hybrid else "")
    lines = [
        f"Sessions a stage holds with its defaults ({pools}):",
        "",
        f"{head} KV pool: positions | sessions at {context} positions |",
        "| ---: |" + (" ---: |" if hybrid else "") + " ---: | ---: |",
    ]
    for r in rows:
        state = (f" {r.state_sessions} |" if r.state_sessions else " - |") if hybrid else ""
        kv = "any" if r.kv_positions is None else f"{r.kv_positions:,}"
        at = r.at(context)
        lines.append(f"| {r.index} |{state} {kv} | {'any' if at is None else at} |")
    positions = [r.kv_positions for r in rows if r.kv_positions is not None]
    lines.append("")
    if not positions:
        lines.append(f"{sessions} sessions at {context} positions each fit the default pools.")
        return "\n".join(lines)
    need = kv_gib_for(plan, sessions)
    if need <= KV_CACHE_DEFAULT_GIB:
        lines.append(f"{sessions} sessions at {context} positions each fit the default pools.")
        return "\n".join(lines)
    fullest = max(stage_total(s, need) for s in plan.stages)
    fits = all(stage_total(s, need) <= s.budget for s in plan.stages)
    each = min(positions) // KV_BLOCK_POSITIONS // sessions * KV_BLOCK_POSITIONS
    lines.append(
        f"{sessions} sessions at {context} positions each: --kv-cache-size {need:g} on every "
        f"stage (then at most {fullest / GIB:.1f} GiB a stage: "
        f"{'fits its host' if fits else 'more than its host holds'}); the default KV pool "
        f"holds {sessions} "
        f"sessions of up to {each:,} positions each."
    )
    return "\n".join(lines)
