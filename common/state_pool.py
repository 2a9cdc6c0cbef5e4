"""How many sessions a hybrid model's paged stage holds in its linear-attention state pool.

One arithmetic for the three places that need it: the stage sizes its pool by it
(``shard_runtime.paged``), the gateway's admission counts sessions against the pool a stage
reports in ``StageInfo`` (``state_slots``, ``state_window``) by it, and `pipeshard plan`
prints it. A *slot* is one row of every state table of the stage (every linear-attention
layer's conv and recurrent state).

A session holds its latest state and the states after each of its last ``window`` positions;
a step first lets go of the states it pushes out of the window, then takes the slots it
writes. At its fullest, a verification of ``window`` proposals and a bonus position, it holds
``window`` + 2 (the state it reads and one after each position it feeds); a new session's
first prompt chunk that keeps a prefix state holds 3 (its zeros, its end, the state at its
last full block's end). The stage keeps one scratch slot of its own (the writes nobody reads).
"""

from __future__ import annotations

SCRATCH_SLOTS = 1  # a stage's scratch slot
DEFAULT_STATE_SESSIONS = 8  # sessions a stage's pool holds by default (at most max_sessions)


def slots_per_session(window: int) -> int:
    """The most slots one session holds at a rollback ``window``."""
    if window < 0:
        raise ValueError(f"a state window must be at least 0, got {window}")
    return max(window + 2, 3)


def pool_slots(sessions: int, window: int) -> int:
    """The slots a pool needs for ``sessions`` sessions at ``window``, its scratch slot too."""
    if sessions < 1:
        raise ValueError(f"a state pool holds at least one session, got {sessions}")
    return sessions * slots_per_session(window) + SCRATCH_SLOTS


def pool_sessions(slots: int, window: int) -> int:
    """The sessions a pool of ``slots`` slots (its scratch slot among them) holds at
    ``window``, each at its fullest."""
    return max(0, (slots - SCRATCH_SLOTS) // slots_per_session(window))
