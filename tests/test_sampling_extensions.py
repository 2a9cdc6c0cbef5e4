"""The sampling extensions clients of vLLM and llama.cpp send: ``ignore_eos``, ``min_tokens``,
``min_p`` and ``repetition_penalty``. Each has its effect (numpy references for the
arithmetic, the engine on the in-process ring for the rest), speculative decoding and batching
give the tokens of a plain run, and the HTTP API refuses bad values naming the field."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from protos.sampling import SamplingParams
from protos.step import StepRequest
from server.api.app import create_app
from server.engine.loop import Engine, GenerationRequest
from server.engine.scheduler import SchedulerConfig
from server.engine.speculative import NgramProposer
from server.metrics import GatewayMetrics
from server.ring import StepOutput
from server.ring.local import LocalRing
from server.settings import GatewaySettings
from shard_runtime.sampling import adjusted_logits, probabilities, sample, suppress
from shard_runtime.speculative import verify
from tests.conftest import EXACT
from tests.fleets import export_chat_model

PROMPT = [(7 * i) % 150 + 3 for i in range(19)]
ROW = np.array([2.0, -1.0, 0.5, 3.0, -0.25, 1.5, 0.0, -2.0], dtype=np.float32)


# --- the arithmetic (unit) ---------------------------------------------------------------------


def repetition_reference(row: np.ndarray, seen: set[int], penalty: float) -> np.ndarray:
    """Hugging Face's RepetitionPenaltyLogitsProcessor, written out."""
    out = row.astype(np.float32).copy()
    for t in seen:
        out[t] = out[t] / np.float32(penalty) if out[t] > 0 else out[t] * np.float32(penalty)
    return out


@pytest.mark.unit
@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_the_reference_on_the_logits(penalty: float) -> None:
    params = SamplingParams(repetition_penalty=penalty)
    prompt, history = [0, 1, 1], [3, 4]
    got = adjusted_logits(ROW, params, history, prompt)
    assert np.array_equal(got, repetition_reference(ROW, {0, 1, 3, 4}, penalty))
    # once per token, however often it was seen; then presence / frequency on the output only
    both = SamplingParams(repetition_penalty=penalty, presence_penalty=0.5, frequency_penalty=0.25)
    expected = repetition_reference(ROW, {0, 1, 3, 4}, penalty)
    expected[[3, 4]] -= np.float32(0.75)
    assert np.allclose(adjusted_logits(ROW, both, history, prompt), expected)
    # greedy follows it: token 3 (3.0) divided by 1.3 falls under token 0 only when seen
    assert sample(ROW, SamplingParams(), 5).token_id == 3
    assert sample(ROW, SamplingParams(repetition_penalty=2.0), 5, [3]).token_id == 0
    assert np.array_equal(adjusted_logits(ROW, SamplingParams(), [], prompt), ROW)


def min_p_reference(row: np.ndarray, temperature: float, min_p: float) -> dict[int, float]:
    probs = np.exp((row - row.max()) / temperature)
    probs = probs / probs.sum()
    kept = probs >= min_p * probs.max()
    return {
        int(i): float(p)
        for i, p in zip(np.flatnonzero(kept), probs[kept] / probs[kept].sum(), strict=True)
    }


@pytest.mark.unit
@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.6, 1.0])
@pytest.mark.parametrize("top", [{}, {"top_k": 3}, {"top_p": 0.9}], ids=["none", "top_k", "top_p"])
def test_min_p_drops_the_improbable_tokens_before_top_k_and_top_p(
    min_p: float, top: dict[str, Any]
) -> None:
    params = SamplingParams(temperature=0.8, min_p=min_p, **top)
    ids, probs = probabilities(ROW, params)
    reference = min_p_reference(ROW, 0.8, min_p)
    if not top:
        assert dict(zip(ids.tolist(), probs.tolist(), strict=True)) == pytest.approx(reference)
    assert set(ids.tolist()) <= set(reference)
    assert probs.sum() == pytest.approx(1.0)
    if min_p == 1.0:  # only the most probable token: sampling is greedy
        assert ids.tolist() == [3]
        for seed in range(20):
            assert (
                sample(ROW, SamplingParams(temperature=1.5, min_p=1.0, seed=seed), 4).token_id == 3
            )


@pytest.mark.unit
def test_suppress_masks_only_the_rows_before_the_position() -> None:
    rows = np.tile(ROW, (3, 1))
    out = suppress(rows, [3, 5], first_position=10, before=12)
    assert np.isneginf(out[:2, [3, 5]]).all() and np.array_equal(out[2], ROW)
    assert np.array_equal(rows[0], ROW)  # a copy
    assert np.array_equal(suppress(rows, [3], 12, 12), rows)


@pytest.mark.unit
def test_greedy_verification_applies_repetition_with_the_accepted_tokens() -> None:
    rows = np.tile(ROW, (3, 1))
    params = SamplingParams(repetition_penalty=3.0)
    plain: list[int] = []
    for i in range(3):
        plain.append(sample(rows[i], params, 20 + i, plain, [7]).token_id)
    assert len(set(plain)) == 3  # each token, once taken, is pushed down
    out = verify(rows, plain, params, 20, [], [7])
    assert [t.token_id for t in out] == plain


@pytest.mark.unit
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=0.9, repetition_penalty=1.8),
    ],
    ids=["min_p", "repetition"],
)
def test_speculative_sampling_emits_the_plain_tokens_after_the_extensions(
    params: SamplingParams,
) -> None:
    """Draft tokens from a wrong distribution, verified: the emitted token is the one plain
    sampling picks after min_p / the repetition penalty, and a proposal is accepted exactly
    when it is that token."""
    vocab = ROW.size
    rng = np.random.default_rng(3)
    seen = [3, 5]
    accepted = 0
    for seed in range(600):
        proposed = int(rng.integers(vocab))
        seeded = SamplingParams(**{**params.__dict__, "seed": seed})
        out = verify(ROW[None, :], [proposed], seeded, 9, [], seen)
        plain = sample(ROW, seeded, 9, [], seen).token_id
        assert [t.token_id for t in out] == [plain]
        accepted += proposed == plain
    assert accepted > 0


@pytest.mark.unit
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 0.001),
        ("repetition_penalty", -1.0),
    ],
)
def test_sampling_params_refuse_bad_values(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate(10)


# --- the engine on the in-process ring (component) ----------------------------------------------


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 with a chat template, on 2 stages."""
    return export_chat_model(tmp_path_factory.mktemp("extensions"))[1]


class RecordingRing(LocalRing):
    """The in-process ring, keeping every step it was sent."""

    def __init__(self, export: Path) -> None:
        super().__init__(export, EXACT)
        self.sent: list[StepRequest] = []

    async def steps(
        self, step: StepRequest, timeout: float | None = None
    ) -> AsyncGenerator[StepOutput, None]:
        self.sent.append(step)
        async for out in super().steps(step, timeout):
            yield out


def run(
    export: Path,
    requests: list[GenerationRequest],
    speculate: bool = False,
    concurrent: bool = False,
    ring: LocalRing | None = None,
) -> list[list[int]]:
    async def go() -> list[list[int]]:
        local = ring or LocalRing(export, EXACT)
        eos = frozenset(local.manifest.tokenizer.eos_token_ids)
        engine = Engine(
            local, eos, 256, SchedulerConfig(), GatewayMetrics(),
            proposer=NgramProposer() if speculate else None, spec_k=3 if speculate else 0,
        )  # fmt: skip

        async def one(request: GenerationRequest) -> list[int]:
            return [t.token_id async for t in engine.generate(request)]

        try:
            if concurrent:
                return list(await asyncio.gather(*(one(r) for r in requests)))
            return [await one(r) for r in requests]
        finally:
            await engine.close()
            await local.close()

    return asyncio.run(go())


def eos_of(export: Path) -> int:
    from protos.manifest import load_manifest

    return load_manifest(export).tokenizer.eos_token_ids[0]


def request(name: str, max_tokens: int = 16, **kw: Any) -> GenerationRequest:
    sampling = kw.pop("sampling", SamplingParams())
    return GenerationRequest(name, PROMPT, max_tokens, sampling, **kw)


@pytest.mark.component
def test_ignore_eos_goes_on_past_the_end_and_min_tokens_masks_it(export: Path) -> None:
    eos = eos_of(export)
    to_eos = SamplingParams(logit_bias={eos: 100.0})  # the first greedy token is EOS
    plain, ignored, held = run(
        export,
        [
            request("a", sampling=to_eos),
            request("b", sampling=to_eos, ignore_eos=True),
            request("c", sampling=to_eos, min_tokens=5),
        ],
    )
    assert plain == [eos]
    assert ignored == [eos] * 16  # max_tokens, EOS and all
    assert len(held) == 6 and eos not in held[:5] and held[5] == eos
    # the ring decoding on its own (no batching) stops at EOS only where it ends the output
    solo = SchedulerConfig(max_running=1, groups=1, solo=True, ring_decode=8)

    async def on_the_ring() -> list[list[int]]:
        ring = LocalRing(export, EXACT)
        engine = Engine(ring, frozenset({eos}), 256, solo, GatewayMetrics())
        try:
            found = []
            for r in (request("d", sampling=to_eos, ignore_eos=True),
                      request("e", sampling=to_eos, min_tokens=5)):  # fmt: skip
                found.append([t.token_id async for t in engine.generate(r)])
            return found
        finally:
            await engine.close()
            await ring.close()

    ring_ignored, ring_held = asyncio.run(on_the_ring())
    assert ring_ignored == [eos] * 16
    assert len(ring_held) == 6 and eos not in ring_held[:5] and ring_held[5] == eos


@pytest.mark.component
def test_min_p_one_is_greedy_and_repetition_penalty_changes_greedy(export: Path) -> None:
    greedy, top_only, penalised = run(
        export,
        [
            request("g", 24, ignore_eos=True),
            request("m", 24, sampling=SamplingParams(temperature=1.2, seed=3, min_p=1.0),
                    ignore_eos=True),
            request("r", 24, sampling=SamplingParams(repetition_penalty=1.5), ignore_eos=True),
        ],
    )  # fmt: skip
    assert top_only == greedy
    assert penalised != greedy


@pytest.mark.component
def test_the_stage_gets_the_prompt_and_the_output_for_the_repetition_penalty(
    export: Path,
) -> None:
    ring = RecordingRing(export)
    (tokens,) = run(
        export, [request("r", 10, sampling=SamplingParams(repetition_penalty=1.3))], ring=ring
    )
    sampling_steps = [s for s in ring.sent if s.start_position + len(s.token_ids) >= len(PROMPT)]
    assert len(sampling_steps) == len(tokens)
    for i, step in enumerate(sampling_steps):
        assert step.prompt_ids_seen == tuple(sorted(set(PROMPT)))
        assert list(step.history) == tokens[:i]


CASES = [
    SamplingParams(repetition_penalty=1.4),
    SamplingParams(temperature=0.9, seed=5, min_p=0.1, repetition_penalty=1.2),
    SamplingParams(temperature=1.1, seed=9, top_p=0.9, min_p=0.05),
]


@pytest.mark.component
def test_speculation_and_batching_give_the_tokens_of_a_plain_run(export: Path) -> None:
    """Greedy with speculation equals greedy without; seeded sampling gives the same tokens
    alone and batched, and with speculation whatever k it proposes; min_tokens and ignore_eos
    along with them."""
    eos = eos_of(export)
    reqs = [request(f"c{i}", 20, sampling=s, min_tokens=6) for i, s in enumerate(CASES)]
    biased = SamplingParams(logit_bias={eos: 3.0}, repetition_penalty=1.3)
    reqs.append(request("e", 20, sampling=biased, ignore_eos=True))
    alone = run(export, reqs)
    assert run(export, reqs, concurrent=True) == alone
    greedy = [0, 3]
    spec = run(export, reqs, speculate=True)
    assert [spec[i] for i in greedy] == [alone[i] for i in greedy]
    assert run(export, reqs, speculate=True, concurrent=True) == spec
    assert all(len(t) >= 6 and eos not in t[:6] for t in alone[:3])  # min_tokens
    assert len(alone[3]) == len(spec[3]) == 20 and eos in alone[3]  # ignore_eos


@pytest.mark.integration
def test_the_extensions_cross_the_wire_to_stage_processes(export: Path, tmp_path: Path) -> None:
    """The same tokens from a ring of stage processes as from the in-process ring: the new
    step and sampling fields survive gRPC."""
    from server.ring.grpc_client import PipelineClient
    from tests.processes import start_stages

    eos = eos_of(export)
    reqs = [request(f"c{i}", 12, sampling=s, min_tokens=6) for i, s in enumerate(CASES)]
    reqs.append(request("e", 12, sampling=SamplingParams(logit_bias={eos: 100.0}), ignore_eos=True))
    local = run(export, reqs)
    procs, addresses = start_stages(export, tmp_path)
    try:

        async def remote() -> list[list[int]]:
            client = PipelineClient(addresses)
            await client.start()
            engine = Engine(client, frozenset({eos}), 256, SchedulerConfig(), GatewayMetrics())
            try:
                return [[t.token_id async for t in engine.generate(r)] for r in reqs]
            finally:
                await engine.close()
                await client.close()

        assert asyncio.run(remote()) == local
    finally:
        for proc in procs:
            proc.stop()
    assert local[3] == [eos] * 12


# --- the HTTP API (component) -----------------------------------------------------------------


@dataclass
class App:
    client: TestClient
    model: str
    eos: int


@pytest.fixture(scope="module")
def app(export: Path) -> Iterator[App]:
    ring = LocalRing(export, EXACT)
    settings = GatewaySettings(stages=["127.0.0.1:9"], speculation="off")
    with TestClient(create_app(settings, ring)) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        yield App(client, model, eos_of(export))


def post(app: App, path: str, **body: Any) -> Any:
    base: dict[str, Any] = {"model": app.model, "max_tokens": 8}
    if path.endswith("chat/completions"):
        base["messages"] = [{"role": "user", "content": "the fox"}]
    else:
        base["prompt"] = PROMPT
    return app.client.post(path, json={**base, **body})


@pytest.mark.component
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_the_extensions_through_http(app: App, path: str) -> None:
    bias = {str(app.eos): 100}
    stopped = post(app, path, logit_bias=bias, temperature=0)
    assert stopped.json()["usage"]["completion_tokens"] == 1
    full = post(app, path, logit_bias=bias, temperature=0, ignore_eos=True)
    assert full.status_code == 200, full.text
    assert full.json()["usage"]["completion_tokens"] == 8
    assert full.json()["choices"][0]["finish_reason"] == "length"
    held = post(app, path, logit_bias=bias, temperature=0, min_tokens=3)
    assert held.json()["usage"]["completion_tokens"] == 4
    assert held.json()["choices"][0]["finish_reason"] == "stop"
    plain = post(app, path, temperature=0, max_tokens=12, ignore_eos=True)
    top = post(app, path, temperature=1, seed=4, min_p=1.0, max_tokens=12, ignore_eos=True)
    assert text_of(top) == text_of(plain)
    penalised = post(app, path, temperature=0, repetition_penalty=50.0, max_tokens=12)
    assert penalised.status_code == 200 and text_of(penalised) != text_of(plain)


def text_of(reply: Any) -> str:
    choice = reply.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


BAD = [
    ("ignore_eos", "yes"),
    ("ignore_eos", 1),
    ("min_tokens", -1),
    ("min_tokens", 2.5),
    ("min_tokens", 9),  # more than max_tokens
    ("min_p", 1.5),
    ("min_p", -0.01),
    ("min_p", "0.1"),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", 1e-30),  # dividing by it could overflow
    ("repetition_penalty", 101.0),
]


@pytest.mark.component
@pytest.mark.parametrize(("field", "value"), BAD)
def test_bad_values_are_a_400_naming_the_field(app: App, field: str, value: Any) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        reply = post(app, path, **{field: value})
        assert reply.status_code == 400, (path, reply.text)
        assert reply.json()["error"]["param"] == field


@pytest.mark.component
@pytest.mark.parametrize("field", ["ignore_eos", "min_tokens"])
def test_stop_extensions_with_constrained_output_are_refused(app: App, field: str) -> None:
    value: Any = True if field == "ignore_eos" else 2
    reply = post(
        app, "/v1/chat/completions", response_format={"type": "json_object"}, **{field: value}
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == field
