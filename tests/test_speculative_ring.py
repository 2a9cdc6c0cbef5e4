"""Speculative decoding over real stage processes: output identical to decoding without it.

The draft is the tiny target with noise added to its weights (same vocabulary, different
weights), so it is often but not always right: steps accept some tokens and roll back others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from exporter.export import ExportOptions, export_model
from protos.manifest import WeightSpec, load_manifest
from protos.sampling import SamplingParams
from server.engine.loop import Engine, GenerationRequest
from server.engine.scheduler import SchedulerConfig
from server.engine.sequence import Phase
from server.engine.speculative import DRAFT_CHUNK, DraftProposer, NgramProposer, Proposal, Proposer
from server.metrics import GatewayMetrics
from server.ring.grpc_client import PipelineClient
from shard_runtime.chain import LocalChain
from testing_support.tiny_models import CHAT_TEMPLATE, make_draft, make_model
from tests.conftest import EXACT
from tests.processes import start_gateway, start_stages

pytestmark = pytest.mark.integration

PROMPTS = [[5, 9, 13, 2 + i, 40, 41, 42, 7 * i + 3, 12, 13, 14] for i in range(4)]
TOKENS = 40
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    base = tmp_path_factory.mktemp("spec")
    target = make_model("qwen2", base / "target", chat_template=CHAT_TEMPLATE)
    draft = make_draft(target, base / "draft-model", noise=0.6)
    out = {}
    for stages in (1, 2, 3):
        out[stages] = base / f"export-{stages}"
        export_model(
            ExportOptions(
                model=str(target),
                out=out[stages],
                stages=stages,
                weights=WeightSpec(format="fp32"),
                draft=str(draft) if stages == 2 else None,
                quiet=True,
            )
        )
    return out


def draft_dir(exports: dict[int, Path]) -> Path:
    return exports[2] / "draft"


def make_draft_proposer(exports: dict[int, Path], chunk: int = DRAFT_CHUNK) -> DraftProposer:
    vocab = load_manifest(exports[2]).model.vocab_size
    return DraftProposer(draft_dir(exports), EXACT, vocab, chunk)


def plain_greedy(export: Path) -> list[list[int]]:
    chain = LocalChain(export, EXACT)
    return [chain.greedy(f"p{i}", prompt, TOKENS)[0] for i, prompt in enumerate(PROMPTS)]


def generate(
    addresses: list[str],
    proposer: Proposer | None,
    spec_k: int,
    sampling: SamplingParams = GREEDY,
    concurrent: bool = False,
    metrics: GatewayMetrics | None = None,
    lengths: list[int] | None = None,  # max_tokens of each prompt (TOKENS)
    spec_max_users: int = 0,
    on_engine: Callable[[Engine], None] | None = None,
) -> list[list[int]]:
    async def run() -> list[list[int]]:
        client = PipelineClient(addresses)
        await client.start()
        engine = Engine(
            client,
            frozenset(),
            256,
            SchedulerConfig(prefill_chunk=4, max_prefill_in_flight=4),
            metrics,
            proposer=proposer,
            spec_k=spec_k,
            spec_max_users=spec_max_users,
        )
        if on_engine is not None:
            on_engine(engine)

        async def one(i: int, prompt: list[int]) -> list[int]:
            tokens = lengths[i] if lengths else TOKENS
            request = GenerationRequest(f"r{i}-{spec_k}", prompt, tokens, sampling)
            return [t.token_id async for t in engine.generate(request)]

        try:
            if concurrent:
                return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))
            return [await one(i, p) for i, p in enumerate(PROMPTS)]
        finally:
            await engine.close()
            infos = await client.stage_infos()
            await client.close()
            assert [i.sessions_in_use for i in infos if i] == [0] * len(addresses)

    return asyncio.run(run())


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_greedy_with_the_draft_equals_greedy_without(
    exports: dict[int, Path], stages: int, tmp_path: Path
) -> None:
    expected = plain_greedy(exports[stages])
    procs, addresses = start_stages(exports[stages], tmp_path)
    try:
        proposer = make_draft_proposer(exports)
        for k in (0, 1, 4):  # adaptive, then fixed
            metrics = GatewayMetrics()
            assert generate(addresses, proposer, k, metrics=metrics) == expected, k
            proposed = metrics.registry.get_sample_value(
                "pipeshard_gateway_spec_proposed_tokens_total"
            )
            accepted = metrics.registry.get_sample_value(
                "pipeshard_gateway_spec_accepted_tokens_total"
            )
            assert proposed and accepted is not None
            assert 0 < accepted < proposed  # steps both accepted and rolled back tokens
        assert proposer.runner.session_count == 0  # draft sessions released
        # prompt lookup instead of a draft model: the same output
        assert generate(addresses, NgramProposer(), 0) == expected
        # 4 concurrent requests with speculation: each as alone without it
        assert generate(addresses, proposer, 0, concurrent=True) == expected
    finally:
        for proc in procs:
            proc.stop()


def test_speculation_on_paged_stages_equals_plain_decoding(
    exports: dict[int, Path], tmp_path: Path
) -> None:
    """Rollback of rejected draft tokens is bookkeeping on paged stages; output is unchanged."""
    expected = plain_greedy(exports[2])
    procs, addresses = start_stages(exports[2], tmp_path, ["--kv-backend", "paged"])
    try:
        proposer = make_draft_proposer(exports)
        metrics = GatewayMetrics()
        assert generate(addresses, proposer, 4, metrics=metrics) == expected
        accepted = metrics.registry.get_sample_value("pipeshard_gateway_spec_accepted_tokens_total")
        proposed = metrics.registry.get_sample_value("pipeshard_gateway_spec_proposed_tokens_total")
        assert proposed and accepted is not None and 0 < accepted < proposed  # rollbacks too
        assert generate(addresses, proposer, 0, concurrent=True) == expected
        seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
        (tmp_path / "stateful").mkdir()
        stateful_procs, stateful = start_stages(
            exports[2], tmp_path / "stateful", ["--kv-backend", "stateful"]
        )
        try:
            assert generate(addresses, proposer, 0, seeded) == generate(
                stateful, proposer, 0, seeded
            )
        finally:
            for proc in stateful_procs:
                proc.stop()
    finally:
        for proc in procs:
            proc.stop()


def test_seeded_sampling_with_the_draft_is_plain_sampling(
    exports: dict[int, Path], tmp_path: Path
) -> None:
    """Coupled verification: seeded sampling (a frequency penalty too) with a draft gives the
    tokens of the same requests without speculation, whatever K, and 4 requests at once give
    each one's tokens alone: every emitted token is plain sampling's at its position. Two
    drafts: the noisy one (many of its proposals are rejected: corrections) and the target itself,
    run as a draft without batch invariance (its proposals are accepted, but where its
    numbers differ). The former acceptance rule, min(1, p/q) and a draw from the residual,
    emits other tokens."""
    procs, addresses = start_stages(exports[2], tmp_path)
    try:
        sampling = SamplingParams(temperature=0.9, seed=11, frequency_penalty=0.7)
        plain = generate(addresses, None, 0, sampling)
        # the same seed's noise on the tiny model's near-alike rows can give two prompts one
        # text; the others differ, so rows swapped between requests would show
        assert len({tuple(t) for t in plain}) >= len(PROMPTS) - 1
        vocab = load_manifest(exports[2]).model.vocab_size
        rates = []
        for proposer in (
            make_draft_proposer(exports),
            DraftProposer(exports[1], EXACT, vocab),  # the target as its own draft
        ):
            metrics = GatewayMetrics()
            assert generate(addresses, proposer, 0, sampling, metrics=metrics) == plain
            assert generate(addresses, proposer, 1, sampling) == plain
            assert generate(addresses, proposer, 5, sampling) == plain
            assert generate(addresses, proposer, 0, sampling, concurrent=True) == plain
            assert generate(addresses, proposer, 3, sampling, concurrent=True) == plain
            registry = metrics.registry
            proposed = registry.get_sample_value("pipeshard_gateway_spec_proposed_tokens_total")
            accepted = registry.get_sample_value("pipeshard_gateway_spec_accepted_tokens_total")
            assert proposed
            rates.append((accepted or 0.0) / proposed)
        # the noisy draft is often rejected (corrections); the target as a draft, picking with
        # the same noise and penalties, is accepted (but where its numbers differ)
        assert rates[0] < 0.9 < rates[1], rates
    finally:
        for proc in procs:
            proc.stop()


def test_gateway_with_draft_serves_the_same_text(exports: dict[int, Path], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    export = exports[2]
    procs, addresses = start_stages(export, tmp_path)
    gateway, url = start_gateway(
        addresses, tmp_path / "gateway.log", ["--draft", str(draft_dir(exports))]
    )
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120.0)
        tokenizer = AutoTokenizer.from_pretrained(str(export / "tokenizer"))
        chain = LocalChain(export, EXACT)
        for i, prompt in enumerate(PROMPTS[:2]):
            text = tokenizer.decode(prompt)
            reply = client.completions.create(
                model="target", prompt=text, max_tokens=24, temperature=0
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
            tokens, _ = chain.greedy(f"h{i}", ids, 24)
            eos = 2
            expected = tokens[: tokens.index(eos)] if eos in tokens else tokens
            assert reply.choices[0].text == tokenizer.decode(expected)
        metrics = httpx.get(f"{url}/metrics").text
        assert "pipeshard_gateway_spec_proposed_tokens_total" in metrics
        steps = "pipeshard_gateway_spec_k_count"
        proposed = [line for line in metrics.splitlines() if line.startswith(steps)]
        assert proposed and float(proposed[0].split()[1]) > 0
        # the stages run on this machine: speculation pauses once two requests decode
        log = (tmp_path / "gateway.log").read_text()
        assert "speculation only while at most 1 request(s) decode at once (auto: stage 0" in log
    finally:
        gateway.stop()
        for proc in procs:
            proc.stop()


class _Watched:
    """The draft, noting how many requests were decoding at each proposal."""

    def __init__(self, proposer: DraftProposer) -> None:
        self.proposer = proposer
        self.engine: Engine | None = None
        self.decoding: list[int] = []

    def propose(
        self,
        seq_id: str,
        context: list[int],
        k: int,
        params: SamplingParams,
        prompt_len: int | None = None,
    ) -> Proposal:
        assert self.engine is not None
        sequences = self.engine.scheduler.sequences.values()
        self.decoding.append(sum(1 for s in sequences if s.phase is Phase.DECODE))
        return self.proposer.propose(seq_id, context, k, params, prompt_len)

    def warm(self, seq_id: str, prompt: list[int]) -> bool:
        return self.proposer.warm(seq_id, prompt)

    def release(self, seq_id: str) -> None:
        self.proposer.release(seq_id)


def test_speculation_pauses_above_its_user_limit_and_output_is_unchanged(
    exports: dict[int, Path], tmp_path: Path
) -> None:
    """speculation_max_users = 1: while several requests decode every step is plain; the one
    that goes on alone speculates again (its draft catching up on the plain tokens)."""
    expected = plain_greedy(exports[2])
    lengths = [TOKENS, 8, 8, 8]  # the first decodes alone after the others end
    procs, addresses = start_stages(exports[2], tmp_path, ["--kv-backend", "paged"])
    watched = _Watched(make_draft_proposer(exports, chunk=3))  # catch-ups in several calls
    metrics = GatewayMetrics()
    try:
        got = generate(
            addresses,
            watched,
            0,
            concurrent=True,
            metrics=metrics,
            lengths=lengths,
            spec_max_users=1,
            on_engine=lambda engine: setattr(watched, "engine", engine),
        )
    finally:
        for proc in procs:
            proc.stop()
    assert got == [tokens[:n] for tokens, n in zip(expected, lengths, strict=True)]
    assert watched.decoding, "the request left alone speculated"
    assert max(watched.decoding) == 1, watched.decoding
    steps = {
        mode: metrics.registry.get_sample_value(
            "pipeshard_gateway_spec_steps_total", {"mode": mode}
        )
        or 0
        for mode in ("speculative", "paused", "plain")
    }
    # paused while several decoded; alone, each call of the draft either proposed
    # (speculative) or caught up a chunk (plain, as a step where K was 0; with chunks of 3
    # the lone request may finish before its draft has caught up)
    assert steps["paused"] > 0, steps
    assert steps["speculative"] <= len(watched.decoding) <= steps["speculative"] + steps["plain"]
    assert watched.proposer.runner.session_count == 0


def test_the_draft_takes_in_long_prompts_and_catch_ups_a_chunk_at_a_time(
    exports: dict[int, Path],
) -> None:
    """A chunk per call, so that other requests' proposals run in between; what it then
    proposes is what a draft that took everything in at once proposes."""
    whole, chunked = make_draft_proposer(exports), make_draft_proposer(exports, chunk=4)
    prompt = [5, 9, 13, 2, 40, 41, 42, 3, 12, 13, 14, 7, 8]  # 12 to take in: 3 calls
    assert [chunked.warm("a", prompt) for _ in range(3)] == [False, False, True]
    assert chunked.warm("a", prompt)  # nothing left
    assert whole.warm("a", prompt)  # one call
    proposed = chunked.propose("a", prompt, 3, GREEDY).tokens
    assert len(proposed) == 3 and proposed == whole.propose("a", prompt, 3, GREEDY).tokens
    # 9 tokens decoded without the draft (plain steps): caught up in chunks of 4, then it proposes
    longer = [*prompt, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    first = chunked.propose("a", longer, 3, GREEDY)
    assert first.tokens == []  # took in 4 of the 9
    second = chunked.propose("a", longer, 3, GREEDY)  # 5 left: within a chunk and one
    assert second.tokens and second.tokens == whole.propose("a", longer, 3, GREEDY).tokens
    for proposer in (whole, chunked):
        proposer.release("a")
        assert proposer.runner.session_count == 0


def test_a_draft_of_another_vocabulary_is_refused(exports: dict[int, Path]) -> None:
    """Checked at construction, or (the gateway, which compiles the draft while the stages
    start) once the target's vocabulary is known."""
    vocab = load_manifest(exports[2]).model.vocab_size
    with pytest.raises(ValueError, match=rf"draft's vocabulary \({vocab}\) differs"):
        DraftProposer(draft_dir(exports), EXACT, vocab + 1)
    later = DraftProposer(draft_dir(exports), EXACT, None)
    later.check_target(vocab)
    with pytest.raises(ValueError, match=rf"differs from the target's \({vocab + 44}\)"):
        later.check_target(vocab + 44)


@pytest.mark.parametrize(
    ("arch", "backend"),
    [
        ("mistral", "paged"),
        ("phi3", "paged"),
        ("qwen3_moe", "paged"),
        ("mixtral", "paged"),
        ("glm4_moe", "paged"),
        ("glm4_moe", "stateful"),
        ("gpt_oss", "paged"),
        ("gpt_oss", "stateful"),
    ],
)
def test_speculation_with_a_draft_of_the_same_architecture(
    arch: str, backend: str, tmp_path: Path
) -> None:
    """The newer architectures (every layer sliding, fused projections, sparse experts) on 2
    paged stages, GLM's also on 2 stateful ones: greedy with a draft of the same vocabulary
    (its weights plus noise) equals plain greedy decoding, alone and 4 requests at once."""
    target = make_model(arch, tmp_path / "target", chat_template=CHAT_TEMPLATE)
    draft = make_draft(target, tmp_path / "draft-model", noise=0.3)
    export = tmp_path / "export"
    export_model(
        ExportOptions(
            model=str(target),
            out=export,
            stages=2,
            weights=WeightSpec(format="fp32"),
            draft=str(draft),
            quiet=True,
        )
    )
    expected = plain_greedy(export)
    procs, addresses = start_stages(export, tmp_path, ["--kv-backend", backend])
    try:
        vocab = load_manifest(export).model.vocab_size
        proposer = DraftProposer(export / "draft", EXACT, vocab, DRAFT_CHUNK)
        metrics = GatewayMetrics()
        assert generate(addresses, proposer, 4, metrics=metrics) == expected
        accepted = metrics.registry.get_sample_value("pipeshard_gateway_spec_accepted_tokens_total")
        assert accepted  # the draft was used, not just asked
        assert generate(addresses, proposer, 0, concurrent=True) == expected
    finally:
        for proc in procs:
            proc.stop()
