"""Shard runner sessions: exact rollback, independence, and bad input that changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from shard_runtime.chain import LocalChain
from shard_runtime.runner import (
    CapacityExceeded,
    InvalidStageInput,
    RunnerOptions,
    SessionNotFound,
    ShardRunner,
)
from tests.conftest import EXACT, ExportFn

pytestmark = pytest.mark.component

PROMPT = [5, 17, 33, 99, 100, 7, 42, 8, 61, 3]


def greedy_continue(chain: LocalChain, session: str, logits: np.ndarray, steps: int) -> list[int]:
    tokens = []
    for _ in range(steps):
        tokens.append(int(np.argmax(logits[-1])))
        logits = chain.forward(session, np.array(tokens[-1:]))
    return tokens


@pytest.mark.parametrize(("arch", "junk"), [("qwen2", 1), ("qwen2", 4), ("gemma3", 6)])
def test_rollback_equals_never_fed(tiny_export: ExportFn, arch: str, junk: int) -> None:
    chain = LocalChain(tiny_export(arch, 2), EXACT)
    clean = chain.forward("clean", np.array(PROMPT))
    expected = greedy_continue(chain, "clean", clean, 12)

    chain.forward("dirty", np.array(PROMPT[:4]))
    chain.forward("dirty", np.array(PROMPT[4:]))
    chain.forward("dirty", np.array([11, 12, 13, 14, 15, 16][:junk]))  # rejected draft tokens
    chain.rollback("dirty", junk)
    assert all(r.session_length("dirty") == len(PROMPT) for r in chain.runners)
    # Re-feed the last prompt token through a rollback of 1 as well: crosses a chunk boundary.
    chain.rollback("dirty", 1)
    dirty = chain.forward("dirty", np.array(PROMPT[-1:]))
    np.testing.assert_allclose(dirty[-1], clean[-1], atol=1e-5)
    assert greedy_continue(chain, "dirty", dirty, 12) == expected


def test_rollback_everything_then_reuse(tiny_export: ExportFn) -> None:
    chain = LocalChain(tiny_export("llama", 2), EXACT)
    first = chain.forward("s", np.array(PROMPT))
    chain.rollback("s", len(PROMPT))
    again = chain.forward("s", np.array(PROMPT))
    np.testing.assert_allclose(first, again, atol=1e-6)


def test_sessions_are_independent(tiny_export: ExportFn) -> None:
    chain = LocalChain(tiny_export("qwen2", 2), EXACT)
    alone = chain.forward("alone", np.array(PROMPT))
    chain.release("alone")
    chain.forward("other", np.array([1, 2, 3]))
    interleaved = chain.forward("mine", np.array(PROMPT[:5]))
    chain.forward("other", np.array([4, 5]))
    interleaved = chain.forward("mine", np.array(PROMPT[5:]))
    np.testing.assert_allclose(interleaved[-1], alone[-1], atol=1e-6)
    assert chain.runners[1].session_count == 2
    chain.release("mine")
    chain.release("other")
    assert all(r.session_count == 0 for r in chain.runners)


def test_num_logits_returns_trailing_rows(tiny_export: ExportFn) -> None:
    chain = LocalChain(tiny_export("qwen2", 1), EXACT)
    all_rows = chain.forward("a", np.array(PROMPT), num_logits=len(PROMPT))
    last = chain.forward("b", np.array(PROMPT), num_logits=1)
    assert all_rows.shape == (len(PROMPT), 256) and last.shape == (1, 256)
    np.testing.assert_allclose(all_rows[-1], last[0], atol=1e-6)


def test_bad_input_is_refused_and_changes_nothing(tiny_export: ExportFn) -> None:
    export_dir = tiny_export("qwen2", 2)
    first = ShardRunner(export_dir, 0, EXACT)
    second = ShardRunner(export_dir, 1, EXACT)
    hidden = first.forward("s", np.array(PROMPT))
    assert hidden.shape == (len(PROMPT), 64) and hidden.dtype == np.float32
    logits = second.forward("s", hidden)

    bad_calls = [
        (InvalidStageInput, lambda: first.forward("s", np.array([[1, 2]]))),  # 2-D ids
        (InvalidStageInput, lambda: first.forward("s", np.array([1.5]))),  # float ids
        (InvalidStageInput, lambda: first.forward("s", np.array([999]))),  # outside vocab
        (InvalidStageInput, lambda: first.forward("s", np.array([], dtype=np.int64))),
        (InvalidStageInput, lambda: first.forward("s", np.array([1]), np.array([3]))),  # order
        (InvalidStageInput, lambda: second.forward("s", np.zeros((1, 63), np.float32))),
        (InvalidStageInput, lambda: second.forward("s", np.zeros((1, 64), np.int32))),
        (InvalidStageInput, lambda: second.forward("s", hidden[:1], num_logits=2)),
        (InvalidStageInput, lambda: first.rollback("s", -1)),
        (InvalidStageInput, lambda: first.rollback("s", len(PROMPT) + 1)),
        (SessionNotFound, lambda: first.rollback("nobody", 1)),
        (SessionNotFound, lambda: first.forward("nobody", np.array([1]), np.array([4]))),
    ]
    for error, call in bad_calls:
        with pytest.raises(error):
            call()
    assert first.session_length("s") == second.session_length("s") == len(PROMPT)
    assert not first.has_session("nobody")

    # The session still continues exactly as an untouched one.
    nxt = int(np.argmax(logits[-1]))
    got = second.forward("s", first.forward("s", np.array([nxt])))
    fresh_first, fresh_second = ShardRunner(export_dir, 0, EXACT), ShardRunner(export_dir, 1, EXACT)
    fresh_second.forward("t", fresh_first.forward("t", np.array(PROMPT)))
    want = fresh_second.forward("t", fresh_first.forward("t", np.array([nxt])))
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_capacity_limits(tiny_export: ExportFn) -> None:
    export_dir = tiny_export("qwen2", 1)
    runner = ShardRunner(export_dir, 0, RunnerOptions(max_sessions=2))
    runner.forward("a", np.array([1, 2]))
    runner.forward("b", np.array([1, 2]))
    with pytest.raises(CapacityExceeded):
        runner.forward("c", np.array([1, 2]))
    assert runner.release("a") and not runner.release("a")
    runner.forward("c", np.array([1, 2]))
    with pytest.raises(CapacityExceeded):  # the tiny models' maximum context is 256
        runner.forward("b", np.ones(255, dtype=np.int64))
    assert runner.session_length("b") == 2
