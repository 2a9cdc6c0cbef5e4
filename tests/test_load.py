"""Load on the real gateway and stage processes: 500 mixed requests at concurrency 32.

Non-streaming and streaming chat, text completions, n=2, logprobs, seeded sampling, greedy,
and about 15% of clients that go away early (a stream closed after its first events, a request
cancelled after a short delay, a connection closed in the middle of the request body).

Checked: no 5xx (nor 429: the queue is sized for 32 clients), every request that was not
cancelled completes with the right finish reasons and token counts (streams end with [DONE]),
every stage holds no session afterwards, the gateway's running and queued gauges are back to 0,
no process logged a traceback, greedy and seeded answers under load equal the same requests
served alone, and the resident memory of the gateway and of each stage after the load is within
10% of what it was after a warm-up.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest

from tests.fleets import Fleet, export_chat_model
from tests.processes import Proc, start_gateway, start_stages

pytestmark = pytest.mark.integration

KEY = "load-key"
CONCURRENCY = 32
REQUESTS = 500
WARMUP = 50
DISCONNECT_SHARE = 0.15
EOS = "2"  # the tiny model's end-of-sequence token id (logit_bias keys are token ids)
# 32 clients x n<=2 = 64 choices at most, and room (16+64 = 80) for a few choices whose client
# has just left and that the gateway is still tearing down: never a 429.
MAX_CONCURRENT, MAX_QUEUED = 16, 64
REQUEST_TIMEOUT_S = 60.0  # one request; a hang fails the test instead of blocking it
LOAD_TIMEOUT_S = 420.0  # the whole load
MEMORY_GROWTH = 0.10
# RSS moves by a few hundred KiB without any leak (allocator arenas, the interpreter's caches
# and OpenVINO's buffers settle at their own pace); the gateway here is about 310 MiB and each
# stage about 140 MiB, so 10% is already 14+ MiB and no absolute slack is added.
MEMORY_SLACK_KIB = 0

CHAT_PROMPTS = [
    "the quick brown fox",
    "once upon a time there was a small shard",
    "every stage keeps its own key value cache",
    "hello world, this is pipeshard",
    "speculative decoding proposes tokens with a draft",
]
TEXT_PROMPTS = [
    "once upon a time",
    "pipelines pass hidden states from stage to stage",
    "the lazy dog",
    "split models, serve them, measure them.",
]
PROBE_GREEDY = "pipelines pass hidden states over an ordinary network"
PROBE_SEEDED = "a small shard lived on a desktop computer"


Mode = Literal["greedy", "seeded", "free"]  # temperature 0 / 1 with a seed / 1 without
Leave = Literal["none", "stream", "cancel", "body"]


@dataclass(frozen=True)
class Spec:
    """One client request of the mix."""

    index: int
    chat: bool
    stream: bool
    n: int
    max_tokens: int
    mode: Mode
    no_eos: bool  # logit_bias keeps the end-of-sequence token out: exactly max_tokens each
    prompt: str
    logprobs: bool = False  # then each choice's tokens are counted, not just the sum
    # How the client leaves early: "stream" closes the stream after ``leave_after`` events,
    # "cancel" cancels the request after ``leave_after`` seconds, "body" closes the connection
    # in the middle of sending the request body.
    leave: Leave = "none"
    leave_after: float = 0.0
    probe: str = ""  # "greedy" / "seeded": compared with the same request served alone

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "n": self.n}
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if self.mode == "greedy":
            body["temperature"] = 0
        else:
            body["temperature"] = 1.0
            if self.mode == "seeded":
                body["seed"] = 1000 + self.index % 7
        if self.probe == "seeded":
            body["seed"] = 4242
        if self.no_eos:
            body["logit_bias"] = {EOS: -100}
        if self.logprobs and self.chat:
            body["logprobs"], body["top_logprobs"] = True, 2
        elif self.logprobs:
            body["logprobs"] = 2
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


@dataclass
class Outcome:
    spec: Spec
    status: int | None = None
    cancelled: bool = False
    texts: list[str] = field(default_factory=list)
    seconds: float = 0.0


def probe_spec(index: int, kind: str) -> Spec:
    if kind == "greedy":
        return Spec(index, True, False, 1, 12, "greedy", True, PROBE_GREEDY, probe="greedy")
    return Spec(index, True, False, 2, 10, "seeded", True, PROBE_SEEDED, probe="seeded")


def make_plan(count: int, seed: int) -> list[Spec]:
    """``count`` requests of the mix, reproducible from ``seed``; a few are probes."""
    rng = random.Random(seed)
    probes = {i: ("greedy" if k % 2 == 0 else "seeded") for k, i in enumerate(range(3, count, 40))}
    plan = []
    for i in range(count):
        if i in probes:
            plan.append(probe_spec(i, probes[i]))
            continue
        chat = rng.random() < 0.7
        stream = rng.random() < 0.5
        modes: list[Mode] = ["greedy", "greedy", "seeded", "free"]
        mode = rng.choice(modes)
        leave: Leave = "none"
        leave_after = 0.0
        if rng.random() < DISCONNECT_SHARE:
            # A stream is closed after its first 1-2 events or, like a non-streaming request,
            # cancelled after a short delay (then often before its first event: still queued
            # or in prefill); a few leave while sending the body.
            ways: list[Leave] = ["stream", "cancel", "body"] if stream else ["cancel", "body"]
            leave = rng.choices(ways, [0.55, 0.35, 0.1] if stream else [0.9, 0.1])[0]
            leave_after = rng.choice([1, 2]) if leave == "stream" else rng.uniform(0.02, 0.4)
        plan.append(
            Spec(
                index=i,
                chat=chat,
                stream=stream,
                n=2 if rng.random() < 0.2 else 1,
                # Long ones for those that leave, so they are still generating when they do.
                max_tokens=rng.randint(12, 16) if leave != "none" else rng.randint(4, 16),
                mode=mode,
                no_eos=rng.random() < 0.75,
                prompt=rng.choice(CHAT_PROMPTS if chat else TEXT_PROMPTS),
                logprobs=rng.random() < 0.15,
                leave=leave,
                leave_after=leave_after,
            )
        )
    return plan


def logprob_count(spec: Spec, choice: dict[str, Any]) -> int:
    """How many tokens' logprobs one choice (or one streamed chunk of it) carries."""
    logprobs = choice.get("logprobs")
    if not logprobs:
        return 0
    return len(logprobs["content"] or []) if spec.chat else len(logprobs["tokens"])


def check_choices(
    spec: Spec, reasons: list[str | None], usage: dict[str, Any], logprobs: list[int]
) -> None:
    """The finish reasons and token counts one answer must have; ``logprobs``: the number of
    tokens with logprobs in each choice (with ``spec.logprobs``: every token but an EOS)."""
    assert len(reasons) == spec.n, (spec, reasons)
    assert all(r in ("length", "stop") for r in reasons), (spec, reasons)
    completion = usage["completion_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + completion, (spec, usage)
    assert usage["prompt_tokens"] > 0 and usage["prompt_tokens"] % spec.n == 0, (spec, usage)
    if spec.no_eos:
        assert reasons == ["length"] * spec.n, (spec, reasons)
        assert completion == spec.n * spec.max_tokens, (spec, usage)
    else:
        # A choice that stopped at end-of-sequence has 1..max_tokens tokens (the EOS counts).
        stopped = reasons.count("stop")
        low = (spec.n - stopped) * spec.max_tokens + stopped
        assert low <= completion <= spec.n * spec.max_tokens, (spec, reasons, usage)
    if not spec.logprobs:
        assert logprobs == [0] * spec.n, (spec, logprobs)
        return
    # A choice that ends by length has max_tokens tokens; one that stops ends with an EOS
    # token, counted in usage but without logprobs (it has no text).
    for reason, count in zip(reasons, logprobs, strict=True):
        if reason == "length":
            assert count == spec.max_tokens, (spec, reasons, logprobs)
        else:
            assert count < spec.max_tokens, (spec, reasons, logprobs)
    assert completion == sum(logprobs) + reasons.count("stop"), (spec, reasons, logprobs, usage)


async def run_plain(client: httpx.AsyncClient, spec: Spec, model: str) -> Outcome:
    out = Outcome(spec)
    response = await client.post(spec.path, json=spec.body(model))
    out.status = response.status_code
    if response.status_code != 200:
        return out
    data = response.json()
    assert data["object"] == ("chat.completion" if spec.chat else "text_completion"), data
    choices = sorted(data["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == list(range(spec.n)), data
    reasons = [c["finish_reason"] for c in choices]
    check_choices(spec, reasons, data["usage"], [logprob_count(spec, c) for c in choices])
    out.texts = [c["message"]["content"] if spec.chat else c["text"] for c in choices]
    return out


async def run_stream(client: httpx.AsyncClient, spec: Spec, model: str) -> Outcome:
    out = Outcome(spec)
    async with client.stream("POST", spec.path, json=spec.body(model)) as response:
        out.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            return out
        assert response.headers["content-type"].startswith("text/event-stream")
        events: list[str] = []
        async for line in response.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), (spec, line)
            events.append(line.removeprefix("data: "))
            if spec.leave == "stream" and len(events) >= spec.leave_after:
                break  # leaving the block closes the connection mid-stream
            if events[-1] == "[DONE]":
                break
    if spec.leave == "stream" and events[-1] != "[DONE]":
        out.cancelled = True
        return out
    assert events[-1] == "[DONE]", (spec, events)
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), (spec, chunks)
    assert len({c["id"] for c in chunks}) == 1, spec
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage is not None, (spec, chunks[-1])
    # chat chunks carry "usage": null; completions chunks leave it out (an object in the schema)
    assert all(c.get("usage") is None for c in chunks[:-1]), spec
    texts = [""] * spec.n
    reasons: list[str | None] = [None] * spec.n
    logprobs = [0] * spec.n
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            i = choice["index"]
            assert reasons[i] is None, (spec, "a chunk after the finish reason", chunk)
            piece = choice["delta"].get("content") if spec.chat else choice["text"]
            texts[i] += piece or ""
            reasons[i] = choice["finish_reason"]
            logprobs[i] += logprob_count(spec, choice)
    check_choices(spec, reasons, usage, logprobs)
    out.texts = texts
    return out


async def leave_mid_body(client: httpx.AsyncClient, spec: Spec, model: str) -> Outcome:
    """Send the headers and half the body on a connection of its own, then close it."""
    body = json.dumps(spec.body(model)).encode()
    url = client.base_url
    _, writer = await asyncio.open_connection(url.host, url.port)
    head = (
        f"POST {spec.path} HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body[: len(body) // 2])
    await writer.drain()
    await asyncio.sleep(0.05)  # the gateway is reading the body now
    writer.close()
    await writer.wait_closed()
    return Outcome(spec, cancelled=True)


async def run_one(client: httpx.AsyncClient, spec: Spec, model: str) -> Outcome:
    started = time.perf_counter()
    run = run_stream if spec.stream else run_plain
    if spec.leave == "body":
        out = await leave_mid_body(client, spec, model)
    elif spec.leave == "cancel":
        try:
            out = await asyncio.wait_for(run(client, spec, model), spec.leave_after)
        except TimeoutError:  # the client went away: its connection is closed
            out = Outcome(spec, cancelled=True)
    else:
        out = await run(client, spec, model)
    out.seconds = time.perf_counter() - started
    return out


async def run_load(
    url: str, model: str, plan: list[Spec], peaks: dict[str, float] | None = None
) -> list[Outcome]:
    """Every request of ``plan``, at most CONCURRENCY at a time (a client that leaves closes
    its connection); ``peaks`` gets the highest running and queued gauges seen meanwhile."""
    peaks = {} if peaks is None else peaks
    gate = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(
        base_url=url,
        headers={"authorization": f"Bearer {KEY}"},
        timeout=REQUEST_TIMEOUT_S,
        limits=limits,
    ) as client:

        async def one(spec: Spec) -> Outcome:
            async with gate:
                return await run_one(client, spec, model)

        watcher = asyncio.create_task(watch(url, peaks))
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(one(s) for s in plan)), timeout=LOAD_TIMEOUT_S
            )
        finally:
            watcher.cancel()


async def watch(url: str, peaks: dict[str, float]) -> None:
    """Record the highest running and queued gauges seen while the load runs."""
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        while True:
            metrics = (await client.get("/metrics")).text
            for name in ("running", "queued"):
                value = gauge(metrics, f"pipeshard_gateway_requests_{name}")
                peaks[name] = max(peaks.get(name, 0.0), value)
            await asyncio.sleep(0.05)


def rss_kib(proc: Proc) -> int:
    """The resident set of the process itself (its popen pid: `pipeshard` execs no wrapper)."""
    assert proc.popen is not None and proc.popen.poll() is None, proc.args
    command = Path(f"/proc/{proc.popen.pid}/cmdline").read_bytes().split(b"\0")
    assert command[1].endswith(b"/pipeshard"), command  # python running the script, no shell
    status = Path(f"/proc/{proc.popen.pid}/status").read_text()
    found = re.search(r"^VmRSS:\s+(\d+) kB$", status, re.MULTILINE)
    assert found is not None, status
    return int(found.group(1))


def gauge(metrics: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", metrics, re.MULTILINE)
    assert found is not None, name
    return float(found.group(1))


def statuses(metrics: str) -> dict[str, float]:
    """Request counts by HTTP status, over all endpoints."""
    counts: dict[str, float] = {}
    pattern = r'^pipeshard_gateway_requests_total\{endpoint="[^"]*",status="(\d+)"\} (\S+)$'
    for status, value in re.findall(pattern, metrics, re.MULTILINE):
        counts[status] = counts.get(status, 0.0) + float(value)
    return counts


def first_traceback(log: str) -> str:
    """The log line before the first traceback, the traceback, and the exception it ends with."""
    lines = log.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Traceback"))
    end = next(
        (i for i in range(start + 1, len(lines)) if not lines[i].startswith((" ", "\t"))),
        len(lines) - 1,
    )
    return "\n".join(lines[max(0, start - 1) : end + 1])


@dataclass
class LoadFleet(Fleet):
    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics").text

    def memory(self) -> dict[str, int]:
        assert self.gateway is not None
        found = {"gateway": rss_kib(self.gateway)}
        for i, proc in enumerate(self.stage_procs):
            found[f"stage {i}"] = rss_kib(proc)
        return found

    def settle(self, timeout: float = 60.0) -> tuple[list[int], float, float]:
        """Wait until no stage holds a session and nothing runs or waits in the gateway (the
        timeout is a hang guard)."""
        deadline = time.monotonic() + timeout
        while True:
            sessions = self.stage_sessions()
            metrics = self.metrics()
            running = gauge(metrics, "pipeshard_gateway_requests_running")
            queued = gauge(metrics, "pipeshard_gateway_requests_queued")
            idle = not any(sessions) and running == 0 and queued == 0
            if idle or time.monotonic() > deadline:
                return sessions, running, queued
            time.sleep(0.1)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoadFleet]:
    base = tmp_path_factory.mktemp("load")
    source, export = export_chat_model(base)
    procs, addresses = start_stages(export, base)
    gateway_log = base / "gateway.log"
    gateway, url = start_gateway(
        addresses,
        gateway_log,
        [
            "--api-key",
            KEY,
            "--max-concurrent",
            str(MAX_CONCURRENT),
            "--max-queued",
            str(MAX_QUEUED),
        ],
    )
    try:
        yield LoadFleet(
            url=url,
            model="chat-model",
            source=source,
            export=export,
            stages=addresses,
            gateway=gateway,
            stage_procs=procs,
            logs=[gateway_log, *(p.log for p in procs)],
        )
    finally:
        gateway.stop()
        for proc in procs:
            proc.stop()


def test_mixed_load_keeps_the_fleet_clean(fleet: LoadFleet) -> None:
    # The probes served alone first: what the same requests must give under load.
    alone = asyncio.run(run_load(fleet.url, fleet.model, [probe_spec(0, "greedy")]))
    alone += asyncio.run(run_load(fleet.url, fleet.model, [probe_spec(1, "seeded")]))
    assert [o.status for o in alone] == [200, 200]
    expected = {"greedy": alone[0].texts, "seeded": alone[1].texts}
    assert all(expected["greedy"]) and len(set(expected["seeded"])) == 2, expected

    warmup = asyncio.run(run_load(fleet.url, fleet.model, make_plan(WARMUP, seed=1)))
    assert all(o.cancelled or o.status == 200 for o in warmup)
    assert fleet.settle() == ([0, 0], 0, 0)
    before = fleet.memory()

    started = time.perf_counter()
    peaks: dict[str, float] = {}
    outcomes = asyncio.run(run_load(fleet.url, fleet.model, make_plan(REQUESTS, seed=2), peaks))
    elapsed = time.perf_counter() - started

    sessions, running, queued = fleet.settle()
    after = fleet.memory()
    cancelled = [o for o in outcomes if o.cancelled]
    served = [o for o in outcomes if not o.cancelled]
    slowest = max(o.seconds for o in outcomes)
    print(
        f"\nload: {REQUESTS} requests in {elapsed:.1f} s ({len(cancelled)} left early, "
        f"slowest {slowest:.1f} s, peak gauges {peaks}); RSS KiB after warm-up {before}, "
        f"after the load {after}"
    )

    bad = [(o.spec, o.status) for o in served if o.status != 200]
    assert not bad, bad  # no 5xx, no 429, no 4xx
    assert len(cancelled) >= REQUESTS * DISCONNECT_SHARE / 3  # the mix did disconnect
    # It was loaded: every running slot taken and choices waiting for one.
    assert peaks.get("running") == MAX_CONCURRENT and peaks.get("queued", 0) > 0, peaks
    for outcome in served:
        if outcome.spec.probe:
            assert outcome.texts == expected[outcome.spec.probe], outcome.spec
    assert sum(1 for o in served if o.spec.probe) >= 8

    assert sessions == [0, 0] and running == 0 and queued == 0, (sessions, running, queued)
    counts = statuses(fleet.metrics())
    assert not [s for s in counts if s.startswith("5") or s == "429"], counts
    assert fleet.gateway is not None and fleet.gateway.popen is not None
    for proc in [fleet.gateway, *fleet.stage_procs]:
        assert proc.popen is not None and proc.popen.poll() is None, proc.args
    assert httpx.get(f"{fleet.url}/ready").status_code == 200
    for log in fleet.logs:
        text = log.read_text(errors="replace")
        failed = "Traceback" in text
        assert not failed, f"{log}:\n{first_traceback(text)}"

    for name, kib in after.items():
        limit = before[name] * (1 + MEMORY_GROWTH) + MEMORY_SLACK_KIB
        assert kib <= limit, (name, before[name], kib)
