"""`pipeshard bench llama-agree`'s comparison: the first differing position and both sides'
top-2 gaps there, from the two servers' replies (the servers themselves are llama.cpp, kept out
of CI: the tool runs against them by hand, docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from benchmarks.llama_agree import Step, agreement, clear_difference

pytestmark = pytest.mark.unit


def step(token: str, *top: tuple[str, float]) -> Step:
    return Step(token, list(top))


def test_agreement_counts_the_tokens_before_the_first_difference_and_keeps_its_gaps() -> None:
    ours = [
        step("a", ("a", -1.0), ("b", -3.0)),
        step("c", ("c", -2.0), ("d", -2.1)),
        step("e", ("e", -1.0), ("f", -4.0)),
    ]
    theirs = [
        step("a", ("a", -1.0), ("b", -3.2)),
        step("d", ("d", -2.0), ("c", -2.05)),
        step("e", ("e", -1.0), ("f", -4.0)),
    ]
    a = agreement(ours, theirs, prompt_tokens=5)
    assert (a.prompt_tokens, a.generated, a.agreed) == (5, 3, 1)
    assert a.pipeshard is not None and a.llama is not None
    assert (a.pipeshard.token, a.llama.token) == ("c", "d")
    assert a.pipeshard.gap == pytest.approx(0.1) and a.llama.gap == pytest.approx(0.05)
    assert not clear_difference(a, clear_gap=1.0)  # a near-tie swapped: no bug to find
    assert clear_difference(a, clear_gap=0.01)


def test_full_agreement_and_byte_tokens_that_may_look_alike() -> None:
    same = [step("x", ("x", -1.0), ("y", -5.0))] * 4
    a = agreement(same, same, prompt_tokens=2)
    assert (a.agreed, a.generated, a.pipeshard, a.llama) == (4, 4, None, None)
    assert not clear_difference(a, clear_gap=0.0)
    # two different byte tokens both read as U+FFFD: agreement there is not proof, and a
    # difference after them is not reported as clear
    ours = [step("\ufffd", ("\ufffd", -1.0)), step("p", ("p", -1.0), ("q", -9.0))]
    theirs = [step("\ufffd", ("\ufffd", -1.0)), step("q", ("q", -1.0), ("p", -9.0))]
    b = agreement(ours, theirs, prompt_tokens=2)
    assert (b.agreed, b.ambiguous) == (1, True)
    assert not clear_difference(b, clear_gap=1.0)
