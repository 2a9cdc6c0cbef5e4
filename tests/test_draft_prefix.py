"""The draft's own prefix cache: a sequence whose prefix another one took in before starts from
the cached KV blocks, and proposes what a draft without a cache proposes."""

from __future__ import annotations

import numpy as np
import pytest

from protos.manifest import load_manifest
from protos.sampling import SamplingParams
from server.engine.speculative import DraftProposer
from tests.conftest import EXACT, ExportFn

pytestmark = pytest.mark.component

GREEDY = SamplingParams()


def _warm(proposer: DraftProposer, seq_id: str, prompt: list[int]) -> int:
    """Take the whole prompt in (as the engine does, a chunk per call); positions fed."""
    before = proposer.fed
    while not proposer.warm(seq_id, prompt):
        pass
    return proposer.fed - before


def _propose(proposer: DraftProposer, seq_id: str, context: list[int], k: int) -> list[int]:
    """Proposals for ``context``, once the draft has caught up (a chunk per call before)."""
    for _ in range(len(context) // proposer.chunk + 2):
        if tokens := proposer.propose(seq_id, context, k, GREEDY).tokens:
            return tokens
    raise AssertionError("the draft never proposed")


def _decode(
    proposers: list[DraftProposer], seq_id: str, prompt: list[int], steps: int
) -> list[list[int]]:
    """Greedy steps as the engine takes them: each proposes 4, the first two are accepted and a
    token of the target's follows (a rejection: the rest is rolled back on the next call). Every
    proposer sees the same contexts; their proposals per step (which must agree)."""
    context = list(prompt)
    out = []
    for step in range(steps):
        proposals = [p.propose(seq_id, context, 4, GREEDY).tokens for p in proposers]
        assert all(len(t) == 4 for t in proposals)
        assert all(t == proposals[0] for t in proposals), proposals
        out.append(proposals[0])
        context += [*proposals[0][:2], 7 + step]
    return out


@pytest.fixture(scope="module")
def draft(tiny_export: ExportFn) -> tuple[DraftProposer, DraftProposer, int]:
    """A draft with a prefix cache, the same without one, and the block size."""
    export = tiny_export("qwen2", 1)
    vocab = load_manifest(export).model.vocab_size
    cached = DraftProposer(export, EXACT, vocab, chunk=16, kv_cache_bytes=1 << 22)
    plain = DraftProposer(
        export, EXACT, vocab, chunk=16, kv_cache_bytes=1 << 22, prefix_cache_blocks=0
    )
    return cached, plain, cached.runner.blocks.block_size


def test_a_shared_prefix_is_taken_from_the_cache_and_proposals_are_unchanged(
    draft: tuple[DraftProposer, DraftProposer, int],
) -> None:
    cached, plain = draft[0], draft[1]
    size = draft[2]
    rng = np.random.default_rng(0)
    system = rng.integers(3, 250, 3 * size + 5).tolist()  # a long shared start
    first = [*system, *rng.integers(3, 250, 9).tolist()]
    second = [*system, *rng.integers(3, 250, 12).tolist()]
    # the first conversation: its prompt and the tokens accepted later fill blocks
    for p in (cached, plain):
        assert _warm(p, "a", first) == len(first) - 1
    _decode([cached, plain], "a", first, 4)
    for p in (cached, plain):
        p.release("a")
    assert cached.runner.blocks.hits == 0 and cached.runner.blocks.cached > 0
    # the second starts on the cached blocks of the shared start (whole blocks only)
    fed_cached, fed_plain = _warm(cached, "b", second), _warm(plain, "b", second)
    assert cached.runner.blocks.hits == 3
    assert fed_plain == len(second) - 1 and fed_cached == fed_plain - 3 * size
    assert plain.runner.blocks.hits == 0
    # and proposes exactly what the draft that took everything in proposes
    _decode([cached, plain], "b", second, 6)
    # a third sequence that is the second's next turn takes everything the second published
    third = [*second, *rng.integers(3, 250, 2 * size).tolist()]
    hits = cached.runner.blocks.hits
    before = cached.fed
    proposed = _propose(cached, "c", third, 4)  # first seen by a proposal
    taken = cached.runner.blocks.hits - hits
    assert taken >= (len(second) - 1) // size
    assert cached.fed - before == len(third) - taken * size + 3  # and 3 proposals
    assert proposed == _propose(plain, "c", third, 4)
    for p in (cached, plain):
        for seq in ("b", "c"):
            p.release(seq)
        assert p.runner.session_count == 0


def test_a_cut_inside_a_shared_block_starts_the_sequence_again(
    draft: tuple[DraftProposer, DraftProposer, int],
) -> None:
    """The same context proposed on twice, its last token ending a block another sequence
    took from the cache: that token's logits are computed again on a fresh session."""
    cached, plain, size = draft
    rng = np.random.default_rng(1)
    context = rng.integers(3, 250, 2 * size).tolist()
    first = _propose(cached, "x", context, 3)  # publishes both blocks
    hits = cached.runner.blocks.hits
    assert _warm(cached, "y", [*context, 5, 6]) == 1  # shares both blocks with "x"
    assert cached.runner.blocks.hits == hits + 2
    assert _propose(cached, "x", context, 3) == first
    assert first == _propose(plain, "x", context, 3)
    for seq in ("x", "y"):
        cached.release(seq)
    plain.release("x")
    assert cached.runner.session_count == 0


def test_a_sequence_the_pool_cannot_hold_gets_plain_steps(tiny_export: ExportFn) -> None:
    export = tiny_export("qwen2", 1)
    vocab = load_manifest(export).model.vocab_size
    small = DraftProposer(export, EXACT, vocab, kv_cache_bytes=1)  # one block
    size = small.runner.blocks.block_size
    short = list(range(3, 3 + size - 6))
    assert small.warm("a", short)
    assert len(small.propose("a", short, 4, GREEDY).tokens) == 4  # fits in the one block
    # a second sequence finds no free block: no proposal, no error
    assert small.warm("b", short)
    assert small.propose("b", short, 4, GREEDY).tokens == []
    small.release("b")
    # the first grows past its block: proposals stop, and come back once it is rolled back
    longer = [*short, *range(100, 110)]
    assert small.propose("a", longer, 4, GREEDY).tokens == []
    assert len(small.propose("a", short, 2, GREEDY).tokens) == 2
    small.release("a")
    assert small.runner.session_count == 0 and small.runner.blocks.free == 1
