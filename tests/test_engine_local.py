"""The engine and the HTTP layer on the in-process ring (server.ring.local): the same tokens as a
ring of stage processes, and the engine's handling of each kind of ring failure, without
processes (the failures are raised by a LocalRing that fails chosen steps)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from protos.sampling import SamplingParams
from protos.step import StepRequest
from server.api.app import create_app
from server.api.serving import generation_api_error
from server.engine.loop import Engine, GenerationRequest
from server.engine.scheduler import SchedulerConfig
from server.metrics import GatewayMetrics
from server.ring import (
    NoCapacity,
    Ring,
    RingError,
    SessionLost,
    StageUnavailable,
    StepOutput,
)
from server.ring.grpc_client import PipelineClient
from server.ring.local import LocalRing
from server.settings import GatewaySettings
from tests.conftest import EXACT, ExportFn
from tests.processes import start_stages

PROMPT = [(5 * i) % 150 + 3 for i in range(21)]
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=7)


class FailingRing(LocalRing):
    """The in-process ring, failing the decode steps it is told to with the error given."""

    def __init__(self, export: Path, failures: dict[int, RingError]) -> None:
        super().__init__(export, EXACT)
        self.failures = failures  # decode step number -> the error it fails with
        self.decode_steps = 0
        self.sent: list[StepRequest] = []

    async def steps(
        self, step: StepRequest, timeout: float | None = None
    ) -> AsyncGenerator[StepOutput, None]:
        self.sent.append(step)
        if step.start_position >= len(PROMPT):
            self.decode_steps += 1
            error = self.failures.pop(self.decode_steps, None)
            if error is not None:
                self.check_ready()
                await self.release(step.session_id)  # the stage lost or dropped it
                raise error
        async for out in super().steps(step, timeout):
            yield out


async def _generate(
    ring: Ring,
    max_tokens: int = 12,
    sampling: SamplingParams | None = None,
    config: SchedulerConfig | None = None,
) -> tuple[list[int], Engine]:
    engine = Engine(ring, frozenset(), 256, config or SchedulerConfig(), GatewayMetrics())
    request = GenerationRequest("r", PROMPT, max_tokens, sampling or SamplingParams())
    try:
        return [t.token_id async for t in engine.generate(request)], engine
    finally:
        await engine.close()


def _local(ring: LocalRing, **kw: object) -> tuple[list[int], Engine]:
    async def run() -> tuple[list[int], Engine]:
        try:
            return await _generate(ring, **kw)  # type: ignore[arg-type]
        finally:
            await ring.close()

    return asyncio.run(run())


@pytest.mark.integration
def test_the_in_process_ring_equals_stage_processes_token_for_token(
    tiny_export: ExportFn, tmp_path: Path
) -> None:
    """Greedy and sampled, with the ring decoding on its own or not: the engine gets the same
    tokens from the in-process ring as from a ring of stage processes (fp16 hops both)."""
    export = tiny_export("qwen2", 2)
    cases = [
        (SamplingParams(), SchedulerConfig()),
        (SAMPLED, SchedulerConfig()),
        (SAMPLED, SchedulerConfig(max_running=1, groups=1, solo=True, ring_decode=4)),
    ]
    local = [_local(LocalRing(export, EXACT), sampling=s, config=c)[0] for s, c in cases]
    procs, addresses = start_stages(export, tmp_path)
    try:

        async def over_processes() -> list[list[int]]:
            client = PipelineClient(addresses)
            await client.start()
            try:
                return [(await _generate(client, sampling=s, config=c))[0] for s, c in cases]
            finally:
                await client.close()

        remote = asyncio.run(over_processes())
    finally:
        for proc in procs:
            proc.stop()
    assert local == remote
    assert all(len(tokens) == 12 for tokens in local)
    assert local[0] != local[1]  # the sampled case is not greedy by accident


@pytest.mark.component
def test_a_lost_session_re_prefills_and_ends_with_the_same_tokens(tiny_export: ExportFn) -> None:
    export = tiny_export("qwen2", 2)
    plain, _ = _local(LocalRing(export, EXACT))
    ring = FailingRing(export, {3: SessionLost("stage 1 restarted", 1)})
    tokens, engine = _local(ring)
    assert tokens == plain
    assert engine.scheduler.resumes == 1
    # the re-prefill opened a fresh session at position 0 with the prompt and what was generated
    reopened = [s for s in ring.sent if s.start_position == 0]
    assert len(reopened) == 2 and reopened[1].session_id != reopened[0].session_id
    assert list(reopened[1].token_ids[: len(PROMPT)]) == PROMPT


@pytest.mark.component
def test_no_capacity_preempts_and_the_sequence_still_finishes(tiny_export: ExportFn) -> None:
    export = tiny_export("qwen2", 2)
    plain, _ = _local(LocalRing(export, EXACT))
    ring = FailingRing(export, {2: NoCapacity("no KV blocks left", 0)})
    tokens, engine = _local(ring)
    assert tokens == plain
    assert engine.scheduler.preemptions == 1


@pytest.mark.component
def test_a_stage_unavailable_ends_the_request_with_a_clean_error(tiny_export: ExportFn) -> None:
    """With no resume grace the request ends with the ring's error, which the HTTP layer
    turns into a 503 naming the stage."""
    ring = FailingRing(tiny_export("qwen2", 2), {1: StageUnavailable("stage 1 is down", 1)})
    with pytest.raises(StageUnavailable) as caught:
        _local(ring, config=SchedulerConfig(resume_grace=0))
    error = generation_api_error(caught.value)
    assert error is not None and error.status == 503 and error.code == "stage_unavailable"
    assert not any(r.has_session(s.session_id) for r in ring.chain.runners for s in ring.sent)


@pytest.mark.component
def test_a_consumer_that_stops_early_frees_its_session(tiny_export: ExportFn) -> None:
    ring = LocalRing(tiny_export("qwen2", 2), EXACT)

    async def run() -> list[int]:
        engine = Engine(ring, frozenset(), 256)
        taken = []
        stream = engine.generate(GenerationRequest("c", PROMPT, 50))
        async for token in stream:
            taken.append(token.token_id)
            if len(taken) == 3:
                break
        await stream.aclose()
        await engine.close()
        assert all(r.session_count == 0 for r in ring.chain.runners)
        await ring.close()
        return taken

    assert len(asyncio.run(run())) == 3


@pytest.mark.component
def test_the_http_api_serves_from_the_in_process_ring(tiny_export: ExportFn) -> None:
    export = tiny_export("qwen2", 2)
    plain, _ = _local(LocalRing(export, EXACT), max_tokens=6)
    ring = LocalRing(export, EXACT)
    # the ring given replaces the one the settings' stage addresses would make
    settings = GatewaySettings(stages=["127.0.0.1:9"], speculation="off")
    app = create_app(settings, ring)
    with TestClient(app) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        reply = client.post(
            "/v1/completions",
            json={"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0},
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["usage"]["completion_tokens"] <= 6
        assert client.get("/ready").json()["ready"] is True
    codec = app.state.gateway.service.codec
    expected = plain[: next((i + 1 for i, t in enumerate(plain) if t in codec.eos_ids), 6)]
    assert body["usage"]["completion_tokens"] == len(expected)
    text = "".join(codec.token_text(t) for t in expected if t not in codec.eos_ids)
    assert body["choices"][0]["text"] == text
