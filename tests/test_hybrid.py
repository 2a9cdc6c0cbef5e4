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


@pytest.mark.parametrize(
    ("arch", "stages"), [("qwen3_5", 1), ("qwen3_5", 3), ("qwen3_5_moe", 2), ("qwen3_next", 2)]
)
def test_a_chunked_prefill_equals_transformers(
    tiny_export: ExportFn, tiny_model: Callable[..., Path], arch: str, stages: int
) -> None:
    """A prompt fed in chunks (of 4, 1 and 7 positions; one at a time; chunks shorter than the
    convolution's kernel) carries the conv and recurrent states from chunk to chunk: the
    greedy tokens are transformers' for the whole prompt at once, token for token."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(tiny_model(arch))).eval()
    expected, expected_logits = reference_greedy(reference, PROMPT, 24)
    chain = LocalChain(tiny_export(arch, stages), EXACT)
    for n, chunks in enumerate(([4, 1, 7], [1] * len(PROMPT), [2, 2, 8])):
        tokens, logits = _chunked_greedy(chain, f"s{n}", PROMPT, chunks, 24)
        chain.release(f"s{n}")
        assert tokens == expected, f"chunks {chunks}"
        assert np.abs(logits - expected_logits).max() < 1e-4


def test_concurrent_sequences_each_equal_transformers(
    tiny_export: ExportFn, tiny_model: Callable[..., Path]
) -> None:
    """The engine over 2 stateful stages (in process, f32 hidden states between them): four
    greedy requests at once, each session with its own recurrent state, give transformers'
    tokens for each prompt alone."""
    import asyncio

    from transformers import AutoModelForCausalLM

    from protos.sampling import SamplingParams
    from server.engine.loop import Engine, GenerationRequest
    from server.engine.scheduler import SchedulerConfig
    from server.metrics import GatewayMetrics
    from server.ring.local import LocalRing

    reference = AutoModelForCausalLM.from_pretrained(str(tiny_model("qwen3_5"))).eval()
    prompts = [PROMPT, [200, 150, 100, 50, 25], [9] * 7, [3, 1, 4, 1, 5, 9, 2, 6]]
    ring = LocalRing(tiny_export("qwen3_5", 2), EXACT, "stateful", hidden_dtype="fp32")

    async def run() -> list[list[int]]:
        engine = Engine(ring, frozenset(), 256, SchedulerConfig(), GatewayMetrics())

        async def one(n: int, prompt: list[int]) -> list[int]:
            request = GenerationRequest(f"r{n}", prompt, 12, SamplingParams())
            return [t.token_id async for t in engine.generate(request)]

        try:
            return list(await asyncio.gather(*(one(n, p) for n, p in enumerate(prompts))))
        finally:
            await engine.close()
            await ring.close()

    got = asyncio.run(run())
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == reference_greedy(reference, prompt, 12)[0], f"prompt {prompt}"


def test_what_the_stack_cannot_do_for_hybrids_yet_is_refused(
    tiny_export: ExportFn,
) -> None:
    """Not supported yet, refused with the reason rather than computed wrong: the paged
    backend (and so its prefix cache) at stage start, a partial rollback (speculative
    decoding's rejected tokens) at the request, speculation at the gateway's start. A whole
    rollback (a fresh start of the session) stays exact."""
    from fastapi.testclient import TestClient

    from server.api.app import StartFailed, create_app
    from server.ring.local import LocalRing
    from server.settings import GatewaySettings
    from shard_runtime.paged import PagedRunner
    from shard_runtime.runner import InvalidStageInput, ShardRunner

    export = tiny_export("qwen3_5", 2)
    with pytest.raises(ValueError, match=r"linear-attention layers \[0, 1, 2\].*stateful"):
        PagedRunner(export, 0, EXACT, kv_cache_bytes=1 << 22)
    runner = ShardRunner(export, 1, EXACT)
    hidden = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    first = runner.forward("s", hidden)
    with pytest.raises(InvalidStageInput, match="recurrent state"):
        runner.rollback("s", 2)
    assert runner.session_length("s") == 6  # the session is left as it was
    runner.rollback("s", 6)
    assert np.array_equal(runner.forward("s", hidden), first)

    ring = LocalRing(export, EXACT, "stateful")
    app = create_app(GatewaySettings(stages=["127.0.0.1:9"], speculation="ngram"), ring)
    with (
        pytest.raises(StartFailed, match="speculative decoding is not supported"),
        TestClient(app),
    ):
        pass
