"""A stage that stops answering (its link cut, its process suspended) loses the steps in flight
after the gateway's link_loss_timeout, not the step deadline; a stage busy with a long step
answers its probes meanwhile and keeps its step; idle streams keep their gRPC keepalive pings
(no GOAWAY "too_many_pings") and a peer that stops answering them is dropped. Real stage
processes on loopback; real network cuts are in tests/test_hosts.py (root only)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from protos import pipeshard_v1_pb2 as pb
from protos import pipeshard_v1_pb2_grpc as pb_grpc
from protos.transport import MIN_PING_INTERVAL_MS, call_metadata, open_channel
from tests.fleets import MESSAGES, export_chat_model
from tests.processes import PIPESHARD, Proc, free_port, start_gateway, start_stages

pytestmark = pytest.mark.integration

LINK_LOSS_S = 1.5  # (longer than a probe's timeout, 1 s, as it must be)
SLOW_PREFILL_S = 5.0  # several link-loss timeouts

# Makes a stage's inference calls on a prompt's first chunk that much slower, the way a slow
# device would: the sleep releases the GIL as an OpenVINO call does.
SLOW_STAGE = """
import os, time
import stage_node.backend as backend

_SECONDS = float(os.environ["PIPESHARD_TEST_SLOW_PREFILL_S"])

def _slowed(compute):
    def slow(self, batch):
        if any(item.request.start_position == 0 and len(item.data) > 1 for item in batch):
            time.sleep(_SECONDS)
        return compute(self, batch)
    return slow

for _cls in (backend.PagedBackend, backend.StatefulBackend):
    _cls.compute = _slowed(_cls.compute)
"""


def chat(max_tokens: int, stream: bool) -> dict[str, object]:
    return {
        "model": "chat-model",
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def resumed(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    found = re.search(r"^pipeshard_gateway_resumed_total (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def health(address: str) -> pb.HealthReply:
    with grpc.insecure_channel(address) as channel:
        reply: pb.HealthReply = pb_grpc.StageStub(channel).Health(
            pb.HealthRequest(), metadata=call_metadata(None, None), timeout=5
        )
        return reply


def test_a_long_step_on_a_stage_that_answers_is_not_taken_for_a_lost_link(
    tmp_path: Path,
) -> None:
    """Stage 1 computes a prompt for several link-loss timeouts (no result meanwhile, so the
    gateway probes): it answers its probes during the call, so the step is kept, /ready stays
    200 and the request ends normally, without a resume."""
    _, export = export_chat_model(tmp_path)
    [first], addresses = start_stages(export, tmp_path, stages=[0])
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SLOW_STAGE)
    port = free_port()
    env = {
        "PYTHONPATH": os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]),
        "PIPESHARD_TEST_SLOW_PREFILL_S": str(SLOW_PREFILL_S),
    }
    slow = Proc(
        [
            PIPESHARD, "stage", "--shards", str(export), "--stage", "1",
            "--listen", f"127.0.0.1:{port}", "--threads", "1",
            "--ov-cache-dir", str(tmp_path / "ov-cache"),
        ],
        tmp_path / "stage-1-slow.log",
        env=env,
    ).start()  # fmt: skip
    gateway = None
    try:
        slow.wait_ready()
        addresses.append(f"127.0.0.1:{port}")
        flags = ["--link-loss-timeout", str(LINK_LOSS_S), "--step-timeout", "60"]
        gateway, url = start_gateway(addresses, tmp_path / "gateway.log", flags)
        seen: dict[str, list[float]] = {"ready": [], "computing": []}
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                seen["ready"].append(httpx.get(f"{url}/ready").status_code)
                seen["computing"].append(health(addresses[1]).compute_seconds)
                time.sleep(0.2)

        watcher = threading.Thread(target=watch)
        started = time.monotonic()
        watcher.start()
        try:
            reply = httpx.post(f"{url}/v1/chat/completions", json=chat(8, False), timeout=120)
        finally:
            done.set()
            watcher.join()
        elapsed = time.monotonic() - started
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 8
        assert elapsed >= SLOW_PREFILL_S
        # stage 1 answered probes while its call ran for longer than the link-loss timeout
        assert max(seen["computing"]) > 2 * LINK_LOSS_S, seen
        assert set(seen["ready"]) == {200}, seen
        assert resumed(url) == 0
        assert "link lost" not in (tmp_path / "gateway.log").read_text()
    finally:
        if gateway is not None:
            gateway.stop()
        for proc in (first, slow):
            proc.stop()


# the default gateway, and one without batching, where the ring decodes on its own
@pytest.mark.parametrize("mode", [[], ["--no-batching"]], ids=["batching", "ring-decode"])
def test_a_stage_that_stops_answering_loses_its_steps_after_the_link_loss_timeout(
    tmp_path: Path, mode: list[str]
) -> None:
    """Stage 1 suspended mid-stream (it answers nothing, as behind a cut cable): with a step
    deadline of 60 s the stream still ends within the link-loss timeout, the probes' period
    and the grace (0 here), with code stage_unavailable; resumed, the fleet serves again."""
    _, export = export_chat_model(tmp_path)
    procs, addresses = start_stages(export, tmp_path)
    flags = ["--link-loss-timeout", str(LINK_LOSS_S), "--step-timeout", "60", *mode]
    gateway, url = start_gateway(
        addresses, tmp_path / "gateway.log", [*flags, "--resume-grace", "0"]
    )
    try:
        events: list[dict[str, object]] = []
        stopped_at = 0.0
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", f"{url}/v1/chat/completions", json=chat(200, True)) as reply,
        ):
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line.removeprefix("data: ")))
                if len(events) == 3:
                    procs[1].signal(signal.SIGSTOP)
                    stopped_at = time.monotonic()
        ended = time.monotonic() - stopped_at
        assert stopped_at, "the stream ended before the stage was stopped"
        error = events[-1].get("error")
        assert isinstance(error, dict) and error["code"] == "stage_unavailable", events[-3:]
        assert "has not answered" in str(error["message"])
        # ended by the link-loss timeout (its message), not by the 60 s step deadline: an
        # order of events, not a measure of the link-loss timeout
        assert ended < 60, ended
        assert "link lost" in (tmp_path / "gateway.log").read_text()
        procs[1].signal(signal.SIGCONT)
        deadline = time.monotonic() + 20
        while httpx.get(f"{url}/ready").status_code != 200:
            assert time.monotonic() < deadline, httpx.get(f"{url}/ready").json()
            time.sleep(0.1)
        again = httpx.post(f"{url}/v1/chat/completions", json=chat(8, False), timeout=60)
        assert again.status_code == 200, again.text
    finally:
        procs[1].signal(signal.SIGCONT)
        gateway.stop()
        for proc in procs:
            proc.stop()


def test_idle_streams_keep_their_keepalive_pings_and_a_silent_stage_is_dropped(
    tmp_path: Path,
) -> None:
    """A stage accepts keepalive pings on idle streams as often as MIN_PING_INTERVAL_MS (no
    GOAWAY "too_many_pings", which ends a stream's calls); a stage that stops answering the
    pings has its connection closed and its streams fail with UNAVAILABLE."""
    _, export = export_chat_model(tmp_path, stages=1)
    [proc], [address] = start_stages(export, tmp_path)
    every = MIN_PING_INTERVAL_MS * 3 // 2  # (not at the very limit: timers are not exact)

    async def run() -> tuple[bool, grpc.StatusCode]:
        options: list[tuple[str, int | str]] = [
            ("grpc.keepalive_time_ms", every),
            ("grpc.keepalive_timeout_ms", 1000),
            ("grpc.http2.ping_timeout_ms", 1000),
        ]
        async with open_channel(address, options=options) as channel:
            stub = pb_grpc.StageStub(channel)
            info = await stub.Info(pb.InfoRequest(), metadata=call_metadata(None, None))
            metadata = call_metadata(None, info.manifest_sha256)
            results = stub.Results(pb.ResultsRequest(client_id="idle"), metadata=metadata)
            await results.initial_metadata()
            push = stub.Push(metadata=metadata)
            await push.wait_for_connection()
            # more pings than the server's allowance of strikes (max_ping_strikes 2)
            await asyncio.sleep(5 * every / 1000)
            alive = not results.done() and not push.done()
            await stub.Health(pb.HealthRequest(), metadata=metadata, timeout=5)
            proc.signal(signal.SIGSTOP)

            async def drain() -> None:
                async for _ in results:
                    pass

            # Without keepalive the stream would wait on the silent stage for good (TCP alone
            # gives up after many minutes): that it ends at all, while the stage is still
            # stopped, is the keepalive's doing. 120 s is a hang guard, not a measure.
            try:
                await asyncio.wait_for(drain(), 120)
            except grpc.aio.AioRpcError as exc:
                return alive, exc.code()
            return alive, grpc.StatusCode.OK

    try:
        alive, code = asyncio.run(run())
    finally:
        proc.signal(signal.SIGCONT)
        proc.stop()
    assert alive, "an idle stream ended while pinged at the allowed rate"
    assert code == grpc.StatusCode.UNAVAILABLE
