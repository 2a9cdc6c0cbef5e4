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


@pytest.mark.parametrize("stage", [0, 1])
def test_a_rollback_within_the_last_chunk_equals_never_feeding_its_tail(
    tiny_export: ExportFn, stage: int
) -> None:
    """A hybrid's stage rolls back into its last chunk of several positions (a speculative
    verification's rejected tokens): back to the states before it, its accepted part fed again.
    The session then computes what a session never fed the rolled-back positions computes,
    also when the chunk was the session's first."""
    from shard_runtime.runner import ShardRunner

    runner = ShardRunner(tiny_export("qwen3_5", 2), stage, EXACT)
    rng = np.random.default_rng(1)
    if stage == 0:
        data = rng.integers(3, 250, 12)
    else:
        data = rng.standard_normal((12, 64)).astype(np.float32)

    def run(session: str, chunks: list[tuple[int, int]], rollback: int = 0) -> np.ndarray:
        for lo, hi in chunks:
            runner.forward(session, data[lo:hi])
        if rollback:
            runner.rollback(session, rollback)
        return runner.forward(session, data[9:12])

    plain = run("plain", [(0, 4), (4, 5)])
    assert np.array_equal(run("rolled", [(0, 4), (4, 9)], rollback=4), plain)
    assert runner.session_length("rolled") == 8
    assert np.array_equal(run("first", [(0, 7)], rollback=2), run("alone", [(0, 5)]))


def test_speculation_equals_plain_decoding(tiny_export: ExportFn) -> None:
    """Prompt-lookup speculation on 2 stateful stages of a hybrid: the verifications' rejected
    tokens are rolled back out of the recurrent states; greedy output equals decoding without
    speculation token for token, with tokens both accepted and rejected."""
    import asyncio

    from protos.sampling import SamplingParams
    from server.engine.loop import Engine, GenerationRequest
    from server.engine.scheduler import SchedulerConfig
    from server.engine.speculative import NgramProposer
    from server.metrics import GatewayMetrics
    from server.ring.local import LocalRing

    export = tiny_export("qwen3_5", 2)
    prompts = [PROMPT + PROMPT[:6], [9, 8, 7, 9, 8, 7, 9, 8], [3, 1, 4, 1, 5, 9, 2, 6] * 2]

    def generate(speculate: bool, metrics: GatewayMetrics) -> list[list[int]]:
        ring = LocalRing(export, EXACT, "stateful", hidden_dtype="fp32")

        async def run() -> list[list[int]]:
            engine = Engine(
                ring,
                frozenset(),
                256,
                SchedulerConfig(),
                metrics,
                proposer=NgramProposer() if speculate else None,
                spec_k=4 if speculate else 0,
            )
            try:
                out = []
                for n, prompt in enumerate(prompts):
                    request = GenerationRequest(f"r{n}", prompt, 32, SamplingParams())
                    out.append([t.token_id async for t in engine.generate(request)])
                return out
            finally:
                await engine.close()
                await ring.close()

        return asyncio.run(run())

    metrics = GatewayMetrics()
    assert generate(True, metrics) == generate(False, GatewayMetrics())
    proposed = metrics.registry.get_sample_value("pipeshard_gateway_spec_proposed_tokens_total")
    accepted = metrics.registry.get_sample_value("pipeshard_gateway_spec_accepted_tokens_total")
    assert proposed and accepted is not None
    assert 0 < accepted < proposed


def test_what_the_stack_cannot_do_for_hybrids_yet_is_refused(
    tiny_export: ExportFn,
) -> None:
    """Not supported, refused with the reason rather than computed wrong: a stateful rollback
    past the last chunk of several positions at the request (paged stages: see
    test_hybrid_paged.py). A whole rollback (a fresh start of the session) stays exact."""
    from shard_runtime.runner import InvalidStageInput, ShardRunner

    export = tiny_export("qwen3_5", 2)
    runner = ShardRunner(export, 1, EXACT)
    hidden = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    first = runner.forward("s", hidden[:6])
    runner.forward("s", hidden[6:7])
    with pytest.raises(InvalidStageInput, match="recurrent state"):
        runner.rollback("s", 2)  # past the last chunk of several positions
    assert runner.session_length("s") == 7  # the session is left as it was
    runner.rollback("s", 7)
    assert np.array_equal(runner.forward("s", hidden[:6]), first)


def test_a_published_vision_language_folder_exports_its_text_model(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """Qwen3.5 as published: a vision-language config (model_type qwen3_5, the text model's
    config under text_config), the text weights under model.language_model., a vision tower and
    MTP weights beside them (never read): 2 stages give transformers' greedy tokens."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5Config

    from exporter.export import ExportOptions, export_model
    from exporter.verify import verify_export
    from protos.manifest import WeightSpec, load_manifest

    folder = tmp_path / "qwen3_5-vl"
    shutil.copytree(tiny_model("qwen3_5"), folder)
    text = json.loads((folder / "config.json").read_text())
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}
    Qwen3_5Config(
        text_config=text, vision_config={**vision, "out_hidden_size": 64}
    ).save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen3_5"
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.visual.patch_embed.proj.weight"] = torch.randn(32, 3, 2, 16, 16)
    weights["mtp.fc.weight"] = torch.randn(64, 128)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})

    out = tmp_path / "out"
    export_model(
        ExportOptions(
            model=str(folder), out=out, stages=2, weights=WeightSpec(format="fp32"), quiet=True
        )
    )
    assert load_manifest(out).model.architecture == "qwen3_5_text"
    report = verify_export(out, steps=16, options=EXACT, atol=1e-4)
    assert report.failures() == []
    assert all(r.reference is not None and r.reference.matched == 16 for r in report.results)


def test_stage_processes_pick_the_paged_backend_and_serve_stateful_too(
    tiny_export: ExportFn, tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """`pipeshard stage` on a hybrid's stages: --kv-backend auto serves them paged (several
    sessions in one inference call, as for every other model), and --kv-backend stateful
    still serves them; a ring of either gives transformers' greedy tokens."""
    import asyncio

    from transformers import AutoModelForCausalLM

    from protos.sampling import SamplingParams
    from server.engine.loop import Engine, GenerationRequest
    from server.engine.scheduler import SchedulerConfig
    from server.metrics import GatewayMetrics
    from server.ring.grpc_client import PipelineClient
    from tests.processes import start_stages

    export = tiny_export("qwen3_5", 2)
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_model("qwen3_5"))).eval()
    expected = reference_greedy(reference, PROMPT, 12)[0]
    for backend, want_paged in (("auto", True), ("stateful", False)):
        procs, addresses = start_stages(
            export, tmp_path, extra=["--hidden-dtype", "fp32", "--kv-backend", backend]
        )
        try:

            async def generate(addresses: list[str]) -> tuple[list[int], bool]:
                client = PipelineClient(addresses)
                await client.start()
                engine = Engine(client, frozenset(), 256, SchedulerConfig(), GatewayMetrics())
                try:
                    request = GenerationRequest("r", PROMPT, 12, SamplingParams())
                    return [t.token_id async for t in engine.generate(request)], client.paged
                finally:
                    await engine.close()
                    await client.close()

            tokens, paged = asyncio.run(generate(addresses))
        finally:
            for proc in procs:
                proc.stop()
        assert paged == want_paged, backend
        assert tokens == expected, backend


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_split_int4_equals_unsplit_int4(tiny_export: ExportFn, arch: str) -> None:
    """NNCF's int4 compresses a hybrid's layers (the Gated DeltaNet projections, the experts)
    the same whatever the split: 3 stages give the 1-stage export's logits exactly."""
    from exporter.verify import verify_export

    report = verify_export(
        tiny_export(arch, 3, "int4"),
        steps=24,
        against=tiny_export(arch, 1, "int4"),
        reference=False,
        options=EXACT,
    )
    for result in report.results:
        assert result.against is not None
        assert result.against.identical
        assert result.against.max_abs_diff == 0.0


def test_a_lost_session_re_prefills_and_ends_with_the_same_tokens(tiny_export: ExportFn) -> None:
    """A stage loses a hybrid's session mid-stream (as a restart does): the engine re-prefills
    it on a fresh session (fresh recurrent states from position 0, the prompt and what was
    generated) and ends with the tokens of an uninterrupted run."""
    import asyncio
    from collections.abc import AsyncGenerator

    from protos.sampling import SamplingParams
    from protos.step import StepRequest
    from server.engine.loop import Engine, GenerationRequest
    from server.engine.scheduler import SchedulerConfig
    from server.metrics import GatewayMetrics
    from server.ring import SessionLost, StepOutput
    from server.ring.local import LocalRing

    export = tiny_export("qwen3_5", 2)

    class LosingRing(LocalRing):
        """Drops the session at its 4th decode step, failing that step."""

        decode_steps = 0

        async def steps(
            self, step: StepRequest, timeout: float | None = None
        ) -> AsyncGenerator[StepOutput, None]:
            if step.start_position >= len(PROMPT):
                self.decode_steps += 1
                if self.decode_steps == 4:
                    await self.release(step.session_id)
                    raise SessionLost("stage 1 restarted", 1)
            async for out in super().steps(step, timeout):
                yield out

    def generate(ring: LocalRing) -> tuple[list[int], int]:
        async def run() -> tuple[list[int], int]:
            engine = Engine(ring, frozenset(), 256, SchedulerConfig(), GatewayMetrics())
            try:
                request = GenerationRequest("r", PROMPT, 16, SamplingParams())
                tokens = [t.token_id async for t in engine.generate(request)]
                return tokens, engine.scheduler.resumes
            finally:
                await engine.close()
                await ring.close()

        return asyncio.run(run())

    plain, _ = generate(LocalRing(export, EXACT, "stateful", hidden_dtype="fp32"))
    resumed, resumes = generate(LosingRing(export, EXACT, "stateful", hidden_dtype="fp32"))
    assert resumes == 1
    assert resumed == plain
