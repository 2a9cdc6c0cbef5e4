"""Stage processes over real gRPC on loopback: the ring equals the in-process chain."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from exporter.verify import reference_greedy
from protos import pipeshard_v1_pb2 as pb
from protos import pipeshard_v1_pb2_grpc as pb_grpc
from protos.codec import numpy_to_tensor
from protos.manifest import manifest_hash
from protos.step import StepRequest
from protos.transport import call_metadata
from server.ring import BadStep, RingRefused, SessionLost, StageUnavailable
from server.ring.grpc_client import PipelineClient
from shard_runtime.chain import LocalChain
from tests.clients import ring_greedy
from tests.conftest import EXACT, ExportFn, make_certificates
from tests.fleets import EIGHT_PROMPTS
from tests.processes import Proc, settled_async, start_stages

pytestmark = pytest.mark.integration

PROMPTS = EIGHT_PROMPTS
STEPS = 16


def stop_all(procs: list[Proc]) -> None:
    for proc in procs:
        proc.stop()


# The rings the tests start, each once per module: (architecture, stages, layers per stage)
RINGS: dict[str, tuple[str, int, tuple[float, ...] | None]] = {
    "qwen": ("qwen2", 2, None),
    "gemma": ("gemma3", 3, None),
    # every layer in a sliding window of 5, on the paged backend's block tables
    "mistral": ("mistral", 2, None),
    # fused projections read apart, half of each head rotating, every layer sliding
    "phi3": ("phi3", 2, None),
    # sparse experts (GatherMatmul) under the paged backend's transformation
    "moe": ("qwen3_moe", 2, None),
    # experts in every layer, sliding windows
    "mixtral": ("mixtral", 2, None),
    # GLM-4.5: a dense layer, then grouped sigmoid routing and a shared expert
    "glm": ("glm4_moe", 2, None),
    # gpt-oss: attention sinks, sliding and full layers, biased experts (2 GatherMatmul a layer)
    "gptoss": ("gpt_oss", 2, None),
    # boundaries inside MLPs: [tokens, 2 * hidden] on both hops
    "cut": ("llama", 3, (1.5, 3.25, 1.25)),
}
Ring = tuple[Path, list[str]]


@pytest.fixture(scope="module")
def ring_of(
    tiny_export: ExportFn, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], Ring]]:
    """``ring_of(name)``: the export and stage addresses of RINGS[name], started when first
    asked for; every ring stops at the end of the module."""
    started: dict[str, Ring] = {}
    procs: list[Proc] = []

    def get(name: str) -> Ring:
        if name not in started:
            arch, stages, split = RINGS[name]
            export = tiny_export(arch, stages, split=split)
            ring_procs, addresses = start_stages(export, tmp_path_factory.mktemp(f"{name}-ring"))
            procs.extend(ring_procs)
            started[name] = (export, addresses)
        return started[name]

    yield get
    stop_all(procs)


@pytest.fixture(scope="module")
def qwen_ring(ring_of: Callable[[str], Ring]) -> Ring:
    return ring_of("qwen")


@pytest.mark.parametrize("ring", list(RINGS))
def test_ring_equals_chain_and_transformers(
    ring: str, ring_of: Callable[[str], Ring], tiny_model: object
) -> None:
    from transformers import AutoModelForCausalLM

    export, addresses = ring_of(ring)
    arch = RINGS[ring][0]
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_model(arch))).eval()  # type: ignore[operator]
    chain = LocalChain(export, EXACT)

    async def run() -> list[list[int]]:
        client = PipelineClient(addresses)
        await client.start()
        try:
            return [await ring_greedy(client, f"p{i}", p, STEPS) for i, p in enumerate(PROMPTS[:3])]
        finally:
            await client.release(*(f"p{i}" for i in range(3)))
            await client.close()

    over_ring = asyncio.run(run())
    for prompt, tokens in zip(PROMPTS, over_ring, strict=False):
        in_process, _ = chain.greedy("local", prompt, STEPS)
        chain.release("local")
        expected, _ = reference_greedy(reference, prompt, STEPS)
        assert tokens == in_process == expected


@pytest.mark.parametrize("ring", ["qwen", "mistral", "phi3", "moe", "mixtral", "glm", "gptoss"])
def test_interleaved_sessions_equal_each_alone(ring: str, ring_of: Callable[[str], Ring]) -> None:
    """Eight sessions decoded together (one paged inference call per step) equal each decoded
    alone; for Mistral and Phi-3 every layer's sliding window is applied per row, for the MoE
    models (GLM's grouped sigmoid routing too) every row picks its own experts."""
    _, addresses = ring_of(ring)

    async def run() -> tuple[list[list[int]], list[list[int]], list[int]]:
        client = PipelineClient(addresses)
        await client.start()
        alone = []
        for i, prompt in enumerate(PROMPTS):
            alone.append(await ring_greedy(client, f"alone-{i}", prompt, STEPS))
            await client.release(f"alone-{i}")
        together = await asyncio.gather(
            *(ring_greedy(client, f"together-{i}", p, STEPS) for i, p in enumerate(PROMPTS))
        )
        in_use = [info.sessions_in_use for info in await client.stage_infos() if info]
        await client.release(*(f"together-{i}" for i in range(len(PROMPTS))))
        after = [info.sessions_in_use for info in await client.stage_infos() if info]
        await client.close()
        assert in_use == [len(PROMPTS)] * 2
        return alone, list(together), after

    alone, together, after = asyncio.run(run())
    assert together == alone
    assert len({tuple(t) for t in alone}) > 1  # the prompts do lead to different outputs
    assert after == [0, 0]


def test_rollback_over_the_ring(qwen_ring: tuple[Path, list[str]]) -> None:
    _, addresses = qwen_ring
    prompt = PROMPTS[0]

    async def run() -> tuple[list[int], list[int]]:
        client = PipelineClient(addresses)
        await client.start()
        clean = await ring_greedy(client, "clean", prompt, 8)
        # Feed the prompt, then 3 junk tokens, roll them back while feeding the real next token.
        first = await client.step("dirty", prompt, 0)
        junk = await client.step("dirty", [11, 12, 13], len(prompt), num_logits=3)
        assert len(junk.tokens) == 3 and junk.session_length == len(prompt) + 3
        tokens = [first.tokens[0].token_id]
        position = len(prompt)
        out = await client.step("dirty", tokens[-1:], position, rollback=3)
        tokens.append(out.tokens[0].token_id)
        position += 1
        while len(tokens) < 8:
            out = await client.step("dirty", tokens[-1:], position)
            tokens.append(out.tokens[0].token_id)
            position += 1
        await client.release("clean", "dirty")
        await client.close()
        return clean, tokens

    clean, dirty = asyncio.run(run())
    assert dirty == clean


def test_a_released_session_id_opens_again_with_the_whole_ring(
    qwen_ring: tuple[Path, list[str]],
) -> None:
    """Stages remember released ids, so that the ring's late steps of an ended request fail
    quietly; a request that opens the same id again (at position 0) still decodes on its own
    through the ring, token for token as the first time."""
    _, addresses = qwen_ring
    prompt = PROMPTS[1]

    async def run() -> list[list[int]]:
        client = PipelineClient(addresses, step_timeout=20)
        await client.start()
        runs = []
        for _ in range(2):
            first = await client.step("again", prompt, 0, solo=True)
            tokens = [first.tokens[0].token_id]
            follow = StepRequest("again", tuple(tokens), len(prompt), solo=True, follow=STEPS - 2)
            async for out in client.steps(follow):
                tokens.append(out.tokens[0].token_id)
            await client.release("again")
            runs.append(tokens)
        await client.close()
        return runs

    first, second = asyncio.run(run())
    assert len(first) == STEPS
    assert second == first


def test_bad_steps_get_status_codes_and_change_nothing(qwen_ring: tuple[Path, list[str]]) -> None:
    export, addresses = qwen_ring
    digest = manifest_hash(export)

    async def run() -> None:
        client = PipelineClient(addresses)
        await client.start()
        good = await client.step("good", PROMPTS[0], 0)
        cases = [
            (BadStep, client.step("good", [9999], len(PROMPTS[0]))),
            (BadStep, client.step("good", [1], len(PROMPTS[0]) + 5)),
            (BadStep, client.step("good", [1], 0, rollback=100)),
            (BadStep, client.step("good", [1], -1)),
            (SessionLost, client.step("nobody", [1], 4)),
            (BadStep, client.step("good", [], len(PROMPTS[0]))),
        ]
        for kind, call in cases:
            with pytest.raises(kind):
                await call
        with pytest.raises(ValueError):  # the wire cannot carry a negative rollback
            pb.Step(session_id="good", rollback=-1)

        # Malformed hidden states sent straight to stage 1: dtype, shape, byte length, and
        # rows that do not match the steps' token counts.
        async with grpc.aio.insecure_channel(addresses[1]) as channel:
            stub = pb_grpc.StageStub(channel)
            metadata = call_metadata(None, digest)
            results = stub.Results(pb.ResultsRequest(client_id="raw"), metadata=metadata)
            await results.initial_metadata()
            hidden = numpy_to_tensor(np.zeros((1, 64), np.float32))
            wrong_dtype = pb.Tensor(dtype=pb.DTYPE_UNSPECIFIED, shape=[1, 64], data=hidden.data)
            wrong_shape = numpy_to_tensor(np.zeros((1, 63), np.float32))
            short = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 64], data=hidden.data[:-4])
            cases = [(wrong_dtype, 1), (wrong_shape, 1), (short, 1), (hidden, 2)]
            steps = [
                pb.StepBatch(
                    steps=[
                        pb.Step(
                            session_id="good",
                            step_id=i + 1,
                            client_id="raw",
                            num_tokens=count,
                            start_position=len(PROMPTS[0]),
                            num_logits=1,
                        )
                    ],
                    hidden=t,
                )
                for i, (t, count) in enumerate(cases)
            ]

            async def feed() -> AsyncIterator[pb.StepBatch]:
                for step in steps:
                    yield step

            await stub.Push(feed(), metadata=metadata)
            for _ in steps:
                result = await results.read()
                assert result.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
                assert result.error.stage == 1
            results.cancel()

        # The session is intact: it continues exactly like a fresh one.
        nxt = good.tokens[0].token_id
        after = await client.step("good", [nxt], len(PROMPTS[0]))
        fresh = await ring_greedy(client, "fresh", PROMPTS[0], 2)
        assert [nxt, after.tokens[0].token_id] == fresh
        await client.release("good", "fresh")
        await client.close()

    asyncio.run(run())


def test_ring_refuses_mismatched_missing_and_misordered_stages(
    tiny_export: ExportFn, qwen_ring: tuple[Path, list[str]], tmp_path: Path
) -> None:
    export, addresses = qwen_ring
    other = tiny_export("qwen2", 2, "fp16")
    procs, other_addresses = start_stages(other, tmp_path, stages=[1])
    try:

        async def refused(ring: list[str]) -> str:
            client = PipelineClient(ring)
            with pytest.raises(RingRefused) as caught:
                await client.start(timeout=5)
            await client.close()
            return str(caught.value)

        message = asyncio.run(refused([addresses[0], other_addresses[0]]))
        assert manifest_hash(export) in message and manifest_hash(other) in message
        assert "stage 1 is missing" in asyncio.run(refused(addresses[:1]))
        assert "serves stage 1 but is listed as stage 0" in asyncio.run(refused(addresses[::-1]))
    finally:
        stop_all(procs)


def test_a_step_reaching_an_unlinked_stage_is_dropped_by_its_kind(
    tiny_export: ExportFn, tmp_path: Path
) -> None:
    """A restarted stage 0 can get the last stage's ring step of a session lost with the old
    process before the gateway links it: that failed step is dropped with a warning, not
    logged as an error (a computed step with nowhere to go still is one)."""
    export = tiny_export("qwen2", 2)
    procs, addresses = start_stages(export, tmp_path, stages=[0])
    try:

        async def push(*steps: pb.Step) -> None:
            async with grpc.aio.insecure_channel(addresses[0]) as channel:
                stub = pb_grpc.StageStub(channel)
                metadata = call_metadata(None, manifest_hash(export))

                async def feed() -> AsyncIterator[pb.StepBatch]:
                    yield pb.StepBatch(steps=list(steps))

                await stub.Push(feed(), metadata=metadata)

        def wait_log(text: str) -> str:
            deadline = time.monotonic() + 10
            while text not in (log := procs[0].log.read_text()) and time.monotonic() < deadline:
                time.sleep(0.05)
            return log

        ring_step = pb.Step(
            session_id="lost", step_id=7, token_ids=[5], num_tokens=1, start_position=4
        )
        asyncio.run(push(ring_step))
        log = wait_log("dropping a failed step of session lost")
        assert "not linked to a next stage yet; dropping a failed step of session lost" in log
        assert " ERROR " not in log, log
        computed = pb.Step(session_id="new", step_id=8, token_ids=[5, 6], num_tokens=2)
        asyncio.run(push(computed))
        assert "ERROR stage_node.service: stage 0 is not linked" in wait_log(" ERROR ")
    finally:
        stop_all(procs)


def test_secret_idle_timeout_and_metrics(tiny_export: ExportFn, tmp_path: Path) -> None:
    import urllib.request

    from tests.processes import free_port

    export = tiny_export("qwen2", 1)
    metrics_port = free_port()
    procs, addresses = start_stages(
        export,
        tmp_path,
        extra=[
            "--secret",
            "s3cret",
            "--session-idle-timeout",
            "1",
            "--metrics-port",
            str(metrics_port),
        ],
    )
    try:

        async def run() -> None:
            for secret in ("guess", None):
                wrong = PipelineClient(addresses, secret=secret)
                with pytest.raises(RingRefused) as caught:
                    await wrong.start(timeout=5)
                assert "secret" in str(caught.value)
                await wrong.close()

            # The right secret but another export's manifest hash: the data path refuses it.
            async with grpc.aio.insecure_channel(addresses[0]) as channel:
                stub = pb_grpc.StageStub(channel)
                for digest in ("0" * 64, None):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await stub.Release(
                            pb.ReleaseRequest(session_ids=["x"]),
                            metadata=call_metadata("s3cret", digest),
                        )
                    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                    assert "differs from this stage's" in (refused.value.details() or "")

            client = PipelineClient(addresses, secret="s3cret")
            await client.start()
            await ring_greedy(client, "abandoned", PROMPTS[1], 3)
            infos = await client.stage_infos()
            assert infos[0] is not None and infos[0].sessions_in_use == 1
            # idle timeout 1 s, reaper every 0.5 s: nothing but the reaper frees it
            assert await settled_async(lambda: first_sessions(client), lambda n: n == 0) == 0
            await client.close()

        asyncio.run(run())
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
        assert 'pipeshard_stage_forward_seconds_count{phase="decode"} 2.0' in text
        assert 'pipeshard_stage_tokens_total{phase="prefill"} 12.0' in text
        assert "pipeshard_stage_sessions 0.0" in text
    finally:
        stop_all(procs)


async def first_sessions(client: PipelineClient) -> int:
    infos = await client.stage_infos()
    assert infos[0] is not None
    return infos[0].sessions_in_use


def test_results_stand_in_for_health_probes_while_they_flow(
    qwen_ring: tuple[Path, list[str]],
) -> None:
    """Every stage is probed each interval while the ring is idle, and not while results keep
    coming (each went through every stage); the probes resume when they stop.

    Order and outcome, not a window of time: a probe round may go out only where the last
    result is an interval old, so the probes sent while busy are bounded by the gaps of at
    least an interval the test itself saw between results (on a loaded machine there are more
    such gaps, and more probes are allowed); with a gap-free run there is at most the one round
    as the load starts."""
    _, addresses = qwen_ring
    interval = 0.3

    async def run() -> tuple[int, int, int, int]:
        client = PipelineClient(addresses, health_interval=interval)
        await client.start()
        idle = await settled_async(lambda: probes(client), lambda n: n >= 2 * 3)
        await ring_greedy(client, "warm", PROMPTS[0], 2)
        before = client.probes_sent
        gaps, last = 0, time.monotonic()
        for request in range(40):
            # one step at a time, so that the test sees every gap between two results
            prompt = PROMPTS[request % len(PROMPTS)]
            out = await client.step(f"busy-{request}", prompt, 0)
            position = len(prompt)
            for _ in range(8):
                now = time.monotonic()
                # half an interval: the result reaches the client a little before the test
                gaps += now - last >= interval / 2
                last = now
                out = await client.step(f"busy-{request}", [out.tokens[0].token_id], position)
                position += 1
            await client.release(f"busy-{request}")  # at once: more requests than sessions
        busy = client.probes_sent - before
        after = await settled_async(lambda: probes(client), lambda n: n >= before + busy + 2 * 3)
        await client.release("warm")
        await client.close()
        return idle, busy, gaps, after - before - busy

    idle, busy, gaps, after = asyncio.run(run())
    assert idle >= 2 * 3  # 2 stages, 3 rounds while idle
    assert busy <= 2 * (1 + gaps), (busy, gaps)  # one round as the load starts, one a gap
    assert after >= 2 * 3  # the probes resume once the results stop


async def probes(client: PipelineClient) -> int:
    return client.probes_sent


def test_killed_stage_fails_fast_and_the_ring_recovers(
    tiny_export: ExportFn, tmp_path: Path
) -> None:
    export = tiny_export("qwen2", 2)
    procs, addresses = start_stages(export, tmp_path)
    try:

        async def run() -> None:
            client = PipelineClient(addresses, health_interval=0.25)
            await client.start()
            await ring_greedy(client, "before", PROMPTS[0], 4)
            await client.release("before")
            # a session between steps when the ring breaks: no step of it is in flight
            idle = await ring_greedy(client, "idle", PROMPTS[0], 2)

            decoded = [0]

            async def generate_forever() -> None:
                position = 0
                prompt = PROMPTS[1]
                out = await client.step("victim", prompt, position)
                position = len(prompt)
                while True:
                    out = await client.step("victim", [out.tokens[0].token_id], position)
                    position += 1
                    decoded[0] += 1

            task = asyncio.create_task(generate_forever())

            async def steps_decoded() -> int:
                return decoded[0]

            await settled_async(steps_decoded, lambda n: n >= 2)  # mid-generation now
            procs[1].kill()
            # fails fast: the kill itself is the error (the stage unavailable, not a step
            # timeout); the wait is only a hang guard
            with pytest.raises(StageUnavailable) as caught:
                await asyncio.wait_for(task, timeout=60)
            assert caught.value.stage == 1
            assert not client.ready
            # The idle session's next step is refused at once, and it is freed too: its KV
            # on the killed stage is gone, so what stage 0 holds of it is of no use.
            with pytest.raises(StageUnavailable):
                await client.step("idle", idle[-1:], len(PROMPTS[0]) + 1)
            # Sessions on the surviving stage are released.
            assert await settled_async(lambda: first_sessions(client), lambda n: n == 0) == 0

            # The stage comes back on the same address: the client reconnects by itself.
            port = int(addresses[1].rsplit(":", 1)[1])
            restarted, _ = start_stages(export, tmp_path, ports=[port], stages=[1])
            procs[1] = restarted[0]

            async def ready() -> bool:
                return client.ready

            assert await settled_async(ready, bool)
            assert await ring_greedy(client, "after", PROMPTS[0], 4) == await ring_greedy(
                client, "again", PROMPTS[0], 4
            )
            await client.close()

        asyncio.run(run())
    finally:
        stop_all(procs)


def test_stopped_stages_end_their_streams_cleanly(tiny_export: ExportFn, tmp_path: Path) -> None:
    """SIGTERM with a gateway attached: each stage ends the long-lived streams itself (the
    senders learn it is stopping) and exits at once, with no error or traceback logged."""
    export = tiny_export("qwen2", 2)
    procs, addresses = start_stages(export, tmp_path)
    try:

        async def run() -> None:
            client = PipelineClient(addresses, health_interval=0.25)
            await client.start()
            await ring_greedy(client, "s", PROMPTS[0], 4)  # every stream is open now
            for proc in reversed(procs):
                proc.stop()
                # exited by itself within the hang guard of stop() (no SIGKILL); that no
                # grace period was waited out shows in the logs below: no stream cancelled
                assert proc.popen is not None and proc.popen.returncode == 0
                await asyncio.sleep(0.5)
            with pytest.raises(StageUnavailable):
                await client.step("s", [1], len(PROMPTS[0]) + 3)
            await client.close()

        asyncio.run(run())
    finally:
        stop_all(procs)
    logs = [p.log.read_text() for p in procs]
    for log in logs:
        assert "Traceback" not in log and " ERROR " not in log, log
    # stage 0's link to stage 1 was told why its stream ended
    assert "stage 1 is stopping" in logs[0]


def test_tls_on_every_hop(tiny_export: ExportFn, tmp_path: Path) -> None:
    ca, cert, key = make_certificates(tmp_path)
    export = tiny_export("qwen2", 2)
    tls = ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca)]
    procs, addresses = start_stages(export, tmp_path, extra=tls)
    try:

        async def run() -> list[int]:
            plain = PipelineClient(addresses)
            with pytest.raises(StageUnavailable):
                await plain.start(timeout=2)
            await plain.close()

            client = PipelineClient(addresses, tls_ca=ca)
            await client.start()
            tokens = await ring_greedy(client, "tls", PROMPTS[0], 6)
            await client.release("tls")
            await client.close()
            return tokens

        chain = LocalChain(export, EXACT)
        assert asyncio.run(run()) == chain.greedy("x", PROMPTS[0], 6)[0]
    finally:
        stop_all(procs)
