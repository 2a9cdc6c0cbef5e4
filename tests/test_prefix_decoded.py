"""The prefix cache keeps only blocks that prompt chunks filled: a block that decode steps
completed holds K/V from decode-time attention, close to what a prefill of the same tokens
computes but not equal, so a later prompt that took it could get other tokens (seen on the
default model). A conversation's next turn therefore re-prefills the last reply."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from server.engine.loop import Engine, GenerationRequest, GenerationStats
from server.ring.local import LocalRing
from server.settings import GatewaySettings
from tests.conftest import EXACT
from tests.fleets import export_chat_model
from tests.processes import settled_async

pytestmark = pytest.mark.component

PROMPT = [(7 * i) % 200 + 3 for i in range(40)]  # block 0 and 8 positions of block 1


def _run(
    ring: LocalRing, prompt: list[int], max_tokens: int, prefix_cache: bool
) -> tuple[list[int], int]:
    """One greedy request (no end-of-sequence stop), every decode step through the gateway
    (no ring decoding): its tokens and cached prompt positions."""

    async def run() -> tuple[list[int], int]:
        settings = GatewaySettings(
            stages=["127.0.0.1:9"], ring_decode_batched=0, prefix_cache=prefix_cache
        )
        config = settings.ring_scheduler_config(
            len(ring.stages), True, ring.kv_pools, ring.prefix_block_size
        )
        engine = Engine(ring, frozenset(), 1024, config)
        try:
            stats = GenerationStats()
            request = GenerationRequest(f"r{len(prompt)}{prefix_cache}", prompt, max_tokens)
            tokens = [t.token_id async for t in engine.generate(request, stats=stats)]

            async def held() -> int:
                return ring.chain.session_length(f"{request.request_id}-0")  # choice 0

            assert await settled_async(held, lambda n: n == 0) == 0  # the release went out
            return tokens, stats.cached_tokens
        finally:
            await engine.close()

    return asyncio.run(run())


def test_a_next_turn_reuses_the_prompt_blocks_but_not_the_decoded_ones(tmp_path: Path) -> None:
    """Turn 1: a 40-token prompt and a 70-token reply, every step through the gateway. Turn 2
    (prompt, reply and 3 more tokens) opens on the prompt's one full block only, although the
    reply's decode steps completed two more; its reply equals a gateway's without the prefix
    cache, token for token."""
    _, export = export_chat_model(tmp_path)
    ring = LocalRing(export, EXACT)  # the stages' prefix caches live as long as it does
    try:
        reply, cached = _run(ring, PROMPT, 70, prefix_cache=True)
        assert cached == 0 and len(reply) == 70
        turn = [*PROMPT, *reply, 5, 6, 7]
        second, cached = _run(ring, turn, 24, prefix_cache=True)
        assert cached == 32
        plain, uncached = _run(ring, turn, 24, prefix_cache=False)
        assert uncached == 0 and second == plain
    finally:
        asyncio.run(ring.close())
