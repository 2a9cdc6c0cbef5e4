"""The prefix cache keeps what a sequence decoded, not only its prompt: a conversation's next
turn opens on the blocks of the reply too, even where the ring decoded it on its own (no
gateway step named those blocks: the gateway names them when it frees the session)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from server.engine import Engine, GenerationRequest, GenerationStats
from server.pipeline import PipelineClient
from server.settings import GatewaySettings
from tests.processes import start_stages
from tests.test_gateway import export_chat_model

PROMPT = [(7 * i) % 200 + 3 for i in range(40)]  # block 0 and 8 positions of block 1


def _run(
    addresses: list[str], prompts: list[list[int]], max_tokens: int, prefix_cache: bool
) -> list[tuple[list[int], int]]:
    """Each prompt in turn, greedy (no end-of-sequence stop), with the ring decoding every
    token after the prompt on its own: (tokens, cached prompt positions) of each."""

    async def run() -> list[tuple[list[int], int]]:
        client = PipelineClient(addresses)
        await client.start()
        settings = GatewaySettings(
            stages=addresses, ring_decode_batched=256, prefix_cache=prefix_cache
        )
        config = settings.ring_scheduler_config(
            len(addresses), True, client.kv_pools, client.prefix_block_size
        )
        engine = Engine(client, frozenset(), 1024, config)
        out = []
        try:
            for i, prompt in enumerate(prompts):
                stats = GenerationStats()
                request = GenerationRequest(f"p{prefix_cache}{i}", prompt, max_tokens)
                tokens = [t.token_id async for t in engine.generate(request, stats=stats)]
                out.append((tokens, stats.cached_tokens))
                await asyncio.sleep(0.2)  # the session's release (and its blocks) goes out
        finally:
            await engine.close()
            await client.close()
        return out

    return asyncio.run(run())


def test_a_next_turn_opens_on_the_blocks_of_a_ring_decoded_reply(tmp_path: Path) -> None:
    """Turn 1: a 40-token prompt and a 70-token reply, decoded on the ring. Turn 2: prompt,
    reply and 3 more tokens: it opens on 3 blocks of 32 (the prompt's and the reply's: all but
    the reply's last token were fed), where the prompt's blocks alone are 1, and its reply
    equals the one of a gateway without the prefix cache, token for token."""
    _, export = export_chat_model(tmp_path)
    procs, addresses = start_stages(export, tmp_path)
    try:
        [(reply, cached)] = _run(addresses, [PROMPT], 70, prefix_cache=True)
        assert cached == 0 and len(reply) == 70
        turn = [*PROMPT, *reply, 5, 6, 7]
        [(second, cached)] = _run(addresses, [turn], 24, prefix_cache=True)
        assert cached == 96
        [(plain, uncached)] = _run(addresses, [turn], 24, prefix_cache=False)
        assert uncached == 0 and second == plain
    finally:
        for proc in procs:
            proc.stop()
