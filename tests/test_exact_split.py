"""The README's "bit for bit" claim for float weights: an fp32 export (no quantization) split
at 2 and 3 stages computes exactly what the unsplit export does, with f32 compute, an f32 KV
cache and the hidden states handed over in fp32 (`--hidden-dtype fp32`). Logits and logprobs
are compared with ==, not within a tolerance."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from exporter.verify import verify_export
from protos.sampling import SamplingParams
from protos.step import StepRequest
from server.ring.grpc_client import PipelineClient
from shard_runtime.chain import LocalChain
from tests.conftest import EXACT, ExportFn
from tests.processes import start_stages

PROMPTS = [[5, 9, 13, 40, 7, 21, 3], [17, 4, 4, 88, 60, 2, 31, 11, 9]]


@pytest.mark.component
@pytest.mark.parametrize(
    ("arch", "stages"),
    [("llama", 2), ("llama", 3), ("qwen3_moe", 3), ("qwen3_5", 3)],
    ids=["llama-2", "llama-3", "qwen3_moe-3", "qwen3_5-3"],
)
def test_fp32_split_logits_equal_the_unsplit_export_bit_for_bit(
    tiny_export: ExportFn, arch: str, stages: int
) -> None:
    """The chained stages' logits, every step of 32 greedy ones, == the 1-stage export's (a
    dense model, experts, and the hybrid whose recurrent state crosses no boundary)."""
    report = verify_export(
        tiny_export(arch, stages, "fp32"),
        steps=32,
        against=tiny_export(arch, 1, "fp32"),
        reference=False,
        options=EXACT,
        atol=0.0,
    )
    assert report.manifest.num_stages == stages
    for result in report.results:
        assert result.against is not None
        assert result.against.identical, result.prompt
        assert result.against.max_abs_diff == 0.0, result.prompt
    assert report.failures() == []


Decoded = list[tuple[int, float | None, list[tuple[int, float]]]]
SAMPLING = SamplingParams(logprobs=True, top_logprobs=5)
STEPS = 16


@pytest.mark.component
def test_fp32_hand_over_between_stages_changes_nothing(tiny_export: ExportFn) -> None:
    """Hidden states cast to fp32 between stages (what each stage sends with
    `--hidden-dtype fp32`): every greedy token of the 3-stage chain, its logprob and its top-5
    logprobs equal the unsplit export's exactly."""

    def decode(chain: LocalChain, prompt: list[int], session: str) -> Decoded:
        seen: Decoded = []
        step = StepRequest(session, tuple(prompt), 0, sampling=SAMPLING)
        position = len(prompt)
        while len(seen) < STEPS:
            (token,) = chain.step(step, np.dtype(np.float32))
            seen.append((token.token_id, token.logprob, list(token.top)))
            step = StepRequest(session, (token.token_id,), position, sampling=SAMPLING)
            position += 1
        chain.release(session)
        return seen

    split = LocalChain(tiny_export("llama", 3, "fp32"), EXACT)
    whole = LocalChain(tiny_export("llama", 1, "fp32"), EXACT)
    for n, prompt in enumerate(PROMPTS):
        expected = decode(whole, prompt, f"whole-{n}")
        assert expected[0][1] is not None and len(expected[0][2]) == 5
        assert decode(split, prompt, f"split-{n}") == expected


@pytest.mark.integration
@pytest.mark.parametrize("stages", [2, 3])
def test_stage_processes_with_fp32_hidden_states_equal_one_stage_bit_for_bit(
    tiny_export: ExportFn, tmp_path: Path, stages: int
) -> None:
    """Real stage processes over gRPC with `--hidden-dtype fp32`: every greedy token and its
    logprob and top-5 logprobs (log-softmax of the last stage's logits, sent as float32) are
    the unsplit export's exactly."""

    def run(export: Path, logs: Path) -> list[Decoded]:
        procs, addresses = start_stages(export, logs, ["--hidden-dtype", "fp32"])
        try:

            async def decode() -> list[Decoded]:
                client = PipelineClient(addresses)
                await client.start()
                runs: list[Decoded] = []
                for n, prompt in enumerate(PROMPTS):
                    session = f"s{n}"
                    seen: Decoded = []
                    out = await client.step(session, prompt, 0, sampling=SAMPLING)
                    position = len(prompt)
                    while True:
                        token = out.tokens[0]
                        seen.append((token.token_id, token.logprob, list(token.top)))
                        if len(seen) == STEPS:
                            break
                        out = await client.step(
                            session, [token.token_id], position, sampling=SAMPLING
                        )
                        position += 1
                    await client.release(session)
                    runs.append(seen)
                await client.close()
                return runs

            return asyncio.run(decode())
        finally:
            for proc in procs:
                proc.stop()

    split_dir, whole_dir = tmp_path / "split", tmp_path / "whole"
    split_dir.mkdir()
    whole_dir.mkdir()
    split = run(tiny_export("llama", stages, "fp32"), split_dir)
    whole = run(tiny_export("llama", 1, "fp32"), whole_dir)
    assert all(len(r) == STEPS and r[0][1] is not None for r in whole)
    assert split == whole
