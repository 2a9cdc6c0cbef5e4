"""Hybrid models (Qwen3.5: Gated DeltaNet linear attention beside gated full attention) on the
stage runtime: a sequence's state is a fixed-size recurrent state per linear-attention layer as
well as KV, which is fed in chunks like KV but cannot be trimmed back by position."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from exporter.verify import reference_greedy
from shard_runtime.chain import LocalChain
from tests.conftest import EXACT, ExportFn

pytestmark = pytest.mark.component

PROMPT = [5, 17, 33, 99, 100, 7, 42, 8, 61, 3, 200, 150]


def _chunked_greedy(
    chain: LocalChain, session: str, prompt: list[int], chunks: list[int], steps: int
) -> tuple[list[int], np.ndarray]:
    """Prefill ``prompt`` in chunks of the given sizes, then decode ``steps`` greedy tokens."""
    assert sum(chunks) == len(prompt)
    at = 0
    for size in chunks:
        logits = chain.forward(session, np.asarray(prompt[at : at + size]))[-1]
        at += size
    tokens: list[int] = []
    rows = []
    for step in range(steps):
        rows.append(logits)
        tokens.append(int(np.argmax(logits)))
        if step + 1 < steps:
            logits = chain.forward(session, np.asarray(tokens[-1:]))[-1]
    return tokens, np.stack(rows)


@pytest.mark.parametrize("stages", [1, 3])
def test_a_chunked_prefill_equals_transformers(
    tiny_export: ExportFn, tiny_model: Callable[..., Path], stages: int
) -> None:
    """A prompt fed in chunks (of 4, 1 and 7 positions; one at a time; chunks shorter than the
    convolution's kernel) carries the conv and recurrent states from chunk to chunk: the
    greedy tokens are transformers' for the whole prompt at once, token for token."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(tiny_model("qwen3_5"))).eval()
    expected, expected_logits = reference_greedy(reference, PROMPT, 24)
    chain = LocalChain(tiny_export("qwen3_5", stages), EXACT)
    for n, chunks in enumerate(([4, 1, 7], [1] * len(PROMPT), [2, 2, 8])):
        tokens, logits = _chunked_greedy(chain, f"s{n}", PROMPT, chunks, 24)
        chain.release(f"s{n}")
        assert tokens == expected, f"chunks {chunks}"
        assert np.abs(logits - expected_logits).max() < 1e-4
