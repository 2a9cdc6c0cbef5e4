"""Stage failures seen from the client, over HTTP, with real processes: a stage killed, one
restarted mid-generation (the requests go on), one stalled (SIGSTOP)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from protos import pipeshard_v1_pb2 as pb
from protos import pipeshard_v1_pb2_grpc as pb_grpc
from protos.transport import call_metadata
from server.engine.sequence import Work
from tests.conftest import EXACT, ExportFn
from tests.fleets import MESSAGES, export_chat_model
from tests.processes import PIPESHARD, Proc, free_port, settled, start_gateway, start_stages

pytestmark = pytest.mark.integration

NO_EOS = {"2": -100}  # the tiny model's end-of-sequence token never comes
# The default gateway, and one without batching, where the ring decodes on its own (the last
# stage feeds each token back to stage 0): failures must end the same way on both.
MODES = pytest.mark.parametrize("mode", [[], ["--no-batching"]], ids=["batching", "ring-decode"])


@dataclass
class Ring:
    export: Path
    logs: Path
    procs: list[Proc]
    addresses: list[str]

    def restart(self, index: int) -> None:
        """Start stage ``index`` again on its address (its process was killed)."""
        port = int(self.addresses[index].rsplit(":", 1)[1])
        self.procs[index] = start_stages(self.export, self.logs, ports=[port], stages=[index])[0][0]

    def sessions(self, index: int) -> int:
        """Sessions in use on one stage, asked directly (the others may be down)."""

        async def ask() -> int:
            async with grpc.aio.insecure_channel(self.addresses[index]) as channel:
                info = await pb_grpc.StageStub(channel).Info(
                    pb.InfoRequest(), metadata=call_metadata(None, None), timeout=5
                )
                return int(info.sessions_in_use)

        return asyncio.run(ask())

    def release(self, index: int, session_id: str) -> int:
        """Free a session on one stage behind the gateway's back; returns how many it freed."""

        async def ask() -> int:
            async with grpc.aio.insecure_channel(self.addresses[index]) as channel:
                stub = pb_grpc.StageStub(channel)
                info = await stub.Info(
                    pb.InfoRequest(), metadata=call_metadata(None, None), timeout=5
                )
                reply = await stub.Release(
                    pb.ReleaseRequest(session_ids=[session_id]),
                    metadata=call_metadata(None, info.manifest_sha256),
                    timeout=5,
                )
                return int(reply.released)

        return asyncio.run(ask())

    def wait_sessions_freed(self, stages: int | None = None) -> list[int]:
        """Sessions in use on the first ``stages`` stages (all) once they reach 0 (or the hang
        guard runs out)."""
        count = stages or len(self.addresses)
        return settled(lambda: [self.sessions(i) for i in range(count)], lambda f: not any(f))

    def wait_sessions(self, index: int, count: int) -> None:
        """Until stage ``index`` holds ``count`` sessions: requests sent have reached it."""
        held = settled(lambda: self.sessions(index), lambda n: n >= count)
        assert held >= count, f"stage {index} holds {held} sessions, not {count}"

    def wait_ready(self, url: str, code: int, up: list[bool] | None = None) -> None:
        """Until the gateway's /ready answers ``code`` (and, given ``up``, names those stages
        up and down)."""

        def seen() -> tuple[int, list[bool]]:
            reply = httpx.get(f"{url}/ready")
            return reply.status_code, [s["up"] for s in reply.json()["stages"]]

        want = (code, up)
        found = settled(seen, lambda s: s[0] == code and (up is None or s[1] == up))
        assert found[0] == code and (up is None or found[1] == up), (found, want)


@pytest.fixture
def ring(tmp_path: Path) -> Iterator[Ring]:
    _, export = export_chat_model(tmp_path)
    procs, addresses = start_stages(export, tmp_path)
    ring = Ring(export, tmp_path, procs, addresses)
    try:
        yield ring
    finally:
        for proc in ring.procs:
            proc.stop()


def chat_body(max_tokens: int, stream: bool, **extra: object) -> dict[str, object]:
    return {
        "model": "chat-model",
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "stream": stream,
        "logit_bias": NO_EOS,
        "temperature": 0,
        **extra,
    }


def stream_text(events: list[str]) -> str:
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e != "data: [DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def stream_with(
    url: str, body: dict[str, object], after: int, action: Callable[[], None]
) -> list[str]:
    """Stream a chat completion, run ``action`` once ``after`` events have arrived, and return
    every ``data:`` event up to the end of the stream."""
    events: list[str] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == after:
                    action()
    return events


class InBackground(threading.Thread):
    """A non-streaming request running while the test breaks the ring."""

    def __init__(self, url: str, body: dict[str, object]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.reply: httpx.Response | None = None

    def run(self) -> None:
        self.reply = httpx.post(f"{self.url}/v1/chat/completions", json=self.body, timeout=60)

    def result(self) -> httpx.Response:
        self.join(60)
        assert self.reply is not None
        return self.reply


class StreamInBackground(threading.Thread):
    """A streaming request read in a thread; ``started`` is set after its 4th event."""

    def __init__(self, url: str, body: dict[str, object]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list[str] = []
        self.started = threading.Event()

    def run(self) -> None:
        with httpx.stream(
            "POST", f"{self.url}/v1/chat/completions", json=self.body, timeout=60
        ) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line)
                    if len(self.events) == 4:
                        self.started.set()

    def result(self) -> str:
        if not self.is_alive() and not self.events:
            self.start()
        self.join(60)
        return stream_text(self.events)


@MODES
def test_killed_stage_without_grace_fails_fast_and_the_gateway_reconnects(
    ring: Ring, mode: list[str]
) -> None:
    gateway, url = start_gateway(
        ring.addresses, ring.logs / "gateway.log", ["--resume-grace", "0", *mode]
    )
    try:
        body = chat_body(200, stream=True)
        before = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False})
        assert before.status_code == 200
        # Stall stage 1 so both requests are surely mid-generation when it dies.
        waiting = InBackground(url, {**body, "stream": False})

        def kill_stage_1() -> None:
            ring.procs[1].signal(signal.SIGSTOP)
            waiting.start()
            ring.wait_sessions(0, 2)  # the waiting request got as far as the stalled stage
            ring.procs[1].kill()

        events = stream_with(url, body, 4, kill_stage_1)
        # Streaming: one error event, then [DONE]. Fast: the error is the kill itself
        # (stage_unavailable), not a step deadline waited out (stage_timeout).
        assert events[-1] == "data: [DONE]"
        errors = [e for e in events if '"error"' in e]
        assert len(errors) == 1 and errors[0] == events[-2]
        assert json.loads(errors[0].removeprefix("data: "))["error"]["code"] == "stage_unavailable"
        # Non-streaming: a 503 in the OpenAI envelope.
        failed = waiting.result()
        assert failed.status_code == 503
        envelope = failed.json()["error"]
        assert envelope["code"] == "stage_unavailable" and "stage 1" in envelope["message"]
        assert set(envelope) == {"message", "type", "param", "code"}
        # The gateway stays up, says which stage is down, and refuses new work with a 503 -
        # also once its probes have seen stage 0's link to the dead stage 1 broken (they
        # resume half a second after the last result): that is stage 1's failure.
        ring.wait_ready(url, 503, [True, False])
        assert httpx.get(f"{url}/health").status_code == 200
        # both count as choices ended by an error (the stream's 200 hid it from requests_total)
        assert (
            'pipeshard_gateway_choices_total{finish="error"} 2.0'
            in httpx.get(f"{url}/metrics").text
        )
        refused = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "stage_unavailable"
        assert ring.wait_sessions_freed(stages=1) == [0]  # the surviving stage is clean

        # The stage comes back on the same address: the gateway reconnects by itself.
        ring.restart(1)
        ring.wait_ready(url, 200)
        after = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False})
        assert after.status_code == 200
        assert after.json()["choices"][0]["message"] == before.json()["choices"][0]["message"]
        assert ring.wait_sessions_freed() == [0, 0]
    finally:
        gateway.stop()
    # the failed requests' steps (the ring's own ones too) were all taken care of
    assert "exception was never retrieved" not in (ring.logs / "gateway.log").read_text()


@MODES
def test_requests_survive_a_stage_restart(ring: Ring, mode: list[str]) -> None:
    gateway, url = start_gateway(ring.addresses, ring.logs / "gateway.log", mode)  # default grace
    try:
        greedy = chat_body(120, stream=True)
        sampled = chat_body(120, stream=True, temperature=0.9, seed=7, frequency_penalty=0.5)
        plain = chat_body(60, stream=False)
        expected = {
            "greedy": StreamInBackground(url, greedy).result(),
            "sampled": StreamInBackground(url, sampled).result(),
        }
        expected_plain = httpx.post(f"{url}/v1/chat/completions", json=plain).json()
        assert all(expected.values())

        # Two streams mid-generation, then stage 1 freezes, a third request arrives, and stage
        # 1 is killed and restarted.
        streams = {
            "greedy": StreamInBackground(url, greedy),
            "sampled": StreamInBackground(url, sampled),
        }
        for stream in streams.values():
            stream.start()
        for stream in streams.values():
            assert stream.started.wait(30)
        ring.procs[1].signal(signal.SIGSTOP)
        waiting = InBackground(url, plain)
        waiting.start()
        ring.wait_sessions(0, 3)  # the third request got as far as the stalled stage
        ring.procs[1].kill()
        ring.restart(1)

        # At temperature 0 the text equals the uninterrupted run; seeded sampling with penalties
        # does too, because draws are keyed on (seed, position) and the history is kept.
        for name, stream in streams.items():
            assert stream.result() == expected[name], name
            assert not [e for e in stream.events if '"error"' in e]
            assert stream.events[-1] == "data: [DONE]"
        resumed = waiting.result()
        assert resumed.status_code == 200, resumed.text
        assert resumed.json()["choices"] == expected_plain["choices"]
        assert resumed.json()["usage"] == expected_plain["usage"]
        metrics = httpx.get(f"{url}/metrics").text
        assert "pipeshard_gateway_resumed_total 3.0" in metrics
        assert ring.wait_sessions_freed() == [0, 0]
    finally:
        gateway.stop()


def expected_and_streaming(url: str, body: dict[str, object]) -> tuple[str, StreamInBackground]:
    """The text ``body`` streams undisturbed, and the same request streaming again (started:
    4 events in)."""
    expected = StreamInBackground(url, body).result()
    stream = StreamInBackground(url, body)
    stream.start()
    assert stream.started.wait(30)
    return expected, stream


def test_a_stage_restarted_as_a_service_is_no_failure(ring: Ring) -> None:
    """`systemctl restart` of stage 0 mid-stream (SIGTERM, then a new process on the same
    address): the stream goes on with the uninterrupted text, and the stopped stage logged
    no error."""
    gateway, url = start_gateway(ring.addresses, ring.logs / "gateway.log")
    try:
        expected, stream = expected_and_streaming(url, chat_body(120, stream=True))
        stopped = ring.procs[0]
        stopped.stop()
        assert stopped.popen is not None and stopped.popen.returncode == 0
        ring.restart(0)
        assert stream.result() == expected
        assert not [e for e in stream.events if '"error"' in e]
        assert "pipeshard_gateway_resumed_total 1.0" in httpx.get(f"{url}/metrics").text
        assert ring.wait_sessions_freed() == [0, 0]
    finally:
        gateway.stop()
    log = stopped.log.read_text()
    assert "stage 0 stopping" in log and "Traceback" not in log and " ERROR " not in log


def test_a_stopped_gateway_lets_requests_finish(ring: Ring) -> None:
    """SIGTERM: a stream in flight still ends normally within the shutdown grace, and the
    gateway exits once it has."""
    gateway, url = start_gateway(
        ring.addresses, ring.logs / "gateway.log", ["--shutdown-grace", "30"]
    )
    try:
        expected, stream = expected_and_streaming(url, chat_body(200, stream=True))
        gateway.signal(signal.SIGTERM)
        assert stream.result() == expected
        assert stream.events[-1] == "data: [DONE]"
        assert not [e for e in stream.events if '"error"' in e]
        assert gateway.popen is not None
        gateway.popen.wait(20)
    finally:
        gateway.stop()
    assert ring.wait_sessions_freed() == [0, 0]


def test_a_stopped_gateway_ends_what_the_grace_cannot_finish(ring: Ring) -> None:
    """SIGTERM while stage 1 is stalled: after the shutdown grace the stream in flight ends
    with an error event and [DONE], the request waiting for its reply gets a 503 (code
    server_shutting_down, which the openai client retries), and the gateway exits instead
    of waiting for them; nothing is logged as an unexpected error."""
    gateway, url = start_gateway(
        ring.addresses, ring.logs / "gateway.log", ["--shutdown-grace", "1"]
    )
    try:
        stream = StreamInBackground(url, chat_body(200, stream=True))
        stream.start()
        assert stream.started.wait(30)
        ring.procs[1].signal(signal.SIGSTOP)
        waiting = InBackground(url, chat_body(20, stream=False))
        waiting.start()
        ring.wait_sessions(0, 2)  # the request waits for its reply (from the stalled stage)
        gateway.signal(signal.SIGTERM)
        # the stream ends while stage 1 is still stalled: the gateway did not wait for it
        # (30 s is a hang guard, not a measure of the 1 s grace)
        stream.join(30)
        assert not stream.is_alive()
        assert stream.events[-1] == "data: [DONE]"
        error = json.loads(stream.events[-2].removeprefix("data: "))["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "service_unavailable"
        refused = waiting.result()
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "server_shutting_down"
        assert gateway.popen is not None
        gateway.popen.wait(10)
    finally:
        ring.procs[1].signal(signal.SIGCONT)
        gateway.stop()
    assert ring.wait_sessions_freed(stages=1) == [0]  # stage 0 was told
    log = (ring.logs / "gateway.log").read_text()
    assert "shutting down: 2 request(s) ended unfinished" in log
    assert "unexpected error" not in log and "Traceback" not in log


@MODES
def test_a_session_a_stage_no_longer_holds_is_prefilled_again(ring: Ring, mode: list[str]) -> None:
    """Stage 0 frees a session mid-stream (as after a restart the health checks missed): its
    next step there fails with NOT_FOUND, and the gateway re-prefills the request on a fresh
    session instead of failing it; the text equals the uninterrupted run."""
    gateway, url = start_gateway(ring.addresses, ring.logs / "gateway.log", mode)
    try:
        body = chat_body(80, stream=True)
        expected = StreamInBackground(url, body).result()
        freed: list[int] = []

        def free_on_stage_0(events: list[str]) -> None:
            seq_id = json.loads(events[0].removeprefix("data: "))["id"] + "-0"
            ring.procs[1].signal(signal.SIGSTOP)  # hold the stream between two steps
            try:
                freed.append(ring.release(0, seq_id))
            finally:
                ring.procs[1].signal(signal.SIGCONT)

        events: list[str] = []
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 4:
                        free_on_stage_0(events)
        assert freed == [1]
        assert not [e for e in events if '"error"' in e]
        assert stream_text(events) == expected and events[-1] == "data: [DONE]"
        metrics = httpx.get(f"{url}/metrics").text
        assert "pipeshard_gateway_resumed_total 1.0" in metrics
        assert ring.wait_sessions_freed() == [0, 0]  # the session stage 1 still held too
    finally:
        gateway.stop()


@MODES
def test_a_stalled_stage_times_out_and_the_gateway_keeps_answering(
    ring: Ring, mode: list[str]
) -> None:
    gateway, url = start_gateway(
        ring.addresses,
        ring.logs / "gateway.log",
        ["--step-timeout", "2", "--resume-grace", "0", *mode],
    )
    try:
        body = chat_body(200, stream=True)

        def stall_stage_1() -> None:
            ring.procs[1].signal(signal.SIGSTOP)
            # While the stage is stalled, the gateway's other endpoints answer at once.
            with httpx.Client(base_url=url, timeout=1.0) as other:
                for path in ("/health", "/v1/models", "/metrics"):
                    assert other.get(path).status_code == 200, path
                assert other.get("/ready").status_code in (200, 503)

        # the stream ends while stage 1 is still stalled, by the step deadline (stage_timeout),
        # not a hang
        events = stream_with(url, body, 2, stall_stage_1)
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == "stage_timeout" and events[-1] == "data: [DONE]"
        ready = httpx.get(f"{url}/ready").json()
        assert [s["up"] for s in ready["stages"]] == [True, False]

        # The stage wakes up: the ring heals, and the session it kept is freed.
        ring.procs[1].signal(signal.SIGCONT)
        ring.wait_ready(url, 200)
        again = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 8})
        assert again.status_code == 200
        assert ring.wait_sessions_freed() == [0, 0]
    finally:
        gateway.stop()


def test_a_gateway_that_cannot_start_says_why_in_one_line(tmp_path: Path) -> None:
    """A stage that is not there after start_timeout, and a draft folder that is no export
    (found while the stages are still awaited, so at once): one log line each, no traceback,
    uvicorn's exit status for a failed start."""

    def serve(*extra: str) -> tuple[str, int]:
        stages, listen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        done = subprocess.run(
            [PIPESHARD, "serve", "--stages", stages, "--listen", listen, *extra],
            capture_output=True,
            text=True,
            timeout=300,  # a hang guard
        )
        return done.stdout + done.stderr, done.returncode

    out, code = serve("--start-timeout", "2")
    assert code == 3 and "Traceback" not in out, out
    assert re.search(r"ERROR server\.api\.app: cannot start: stage 0 at \S+ is missing", out), out
    not_an_export = tmp_path / "not-an-export"
    not_an_export.mkdir()
    # the stages would be awaited for an hour, longer than the hang guard: it exits on the
    # draft at once, and never says the stage is missing
    out, code = serve("--start-timeout", "3600", "--draft", str(not_an_export))
    assert code == 3 and "Traceback" not in out, out
    assert "cannot start: " in out and "not a pipeshard export folder" in out, out
    assert "is missing" not in out, out


def test_a_fault_in_the_scheduler_ends_the_requests_and_the_gateway_goes_on(
    tiny_export: ExportFn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the scheduler (here: next_work raising once, mid-generation) ends the three
    requests in progress with SchedulingFailed at once instead of leaving them waiting
    forever; their sessions are freed on the stages, and the next request is served with the
    tokens it gets alone."""
    from server.engine.loop import Engine, GenerationRequest, SchedulingFailed
    from server.engine.scheduler import SchedulerConfig
    from server.metrics import GatewayMetrics
    from server.ring.grpc_client import PipelineClient
    from shard_runtime.chain import LocalChain

    export = tiny_export("qwen2", 2)
    expected = LocalChain(export, EXACT).greedy("alone", [5, 9, 13, 40], 12)[0]
    procs, addresses = start_stages(export, tmp_path)

    async def run() -> None:
        client = PipelineClient(addresses)
        await client.start()
        engine = Engine(client, frozenset(), 256, SchedulerConfig(groups=2), GatewayMetrics())
        real, turns = engine.scheduler.next_work, 0

        def faulty(now: float, ring_ready: bool = True) -> list[Work]:
            nonlocal turns
            turns += 1
            if turns == 12:  # the three have prefilled and decode
                raise RuntimeError("injected fault")
            return real(now, ring_ready)

        monkeypatch.setattr(engine.scheduler, "next_work", faulty)

        async def one(name: str, prompt: list[int]) -> list[int]:
            request = GenerationRequest(name, prompt, 12)
            return [t.token_id async for t in engine.generate(request)]

        try:
            outcomes = await asyncio.wait_for(
                asyncio.gather(
                    *(one(f"r{i}", [7, 8 + i, 9]) for i in range(3)), return_exceptions=True
                ),
                60,
            )
            assert all(isinstance(o, SchedulingFailed) for o in outcomes), outcomes
            assert "injected fault" in str(outcomes[0])
            assert await asyncio.wait_for(one("next", [5, 9, 13, 40]), 60) == expected
            for _ in range(1200):  # releases go out after the requests end (a hang guard)
                if all(
                    i is not None and i.sessions_in_use == 0 for i in await client.stage_infos()
                ):
                    break
                await asyncio.sleep(0.05)
            assert [i.sessions_in_use for i in await client.stage_infos() if i] == [0, 0]
        finally:
            await engine.close()
            await client.close()

    try:
        asyncio.run(run())
    finally:
        for proc in procs:
            proc.stop()
