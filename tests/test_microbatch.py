"""Many users at once over HTTP: interleaved through the real stage ring, with admission control.

Stage 0 sits behind the latency-injecting proxy (25 ms each way), so every step takes a while
and requests really overlap, as they would across a network. A second gateway runs over the
same stages without batching (`pipeshard serve --no-batching`), where the ring decodes on its
own (the last stage feeds each token back to stage 0), and a third without batching that sends
every step itself (`--ring-decode 0`).
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.latency_proxy import start_in_thread
from tests.clients import request, stream_text
from tests.fleets import Fleet, export_chat_model, scrape
from tests.processes import PIPESHARD, free_port, settled, start_gateway, start_stages

pytestmark = pytest.mark.integration

EOS = 2
MAX_RUNNING = 8


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    base = tmp_path_factory.mktemp("microbatch")
    _, export = export_chat_model(base)
    procs, addresses, ports = [], [], []
    for index in (0, 1):
        ports.append(free_port())
        started, where = start_stages(
            export, base, ["--metrics-port", str(ports[-1])], stages=[index]
        )
        procs += started
        addresses += where
    host, port = addresses[0].rsplit(":", 1)
    proxy, stop_proxy = start_in_thread("127.0.0.1", 0, host, int(port), 0.025)
    ring = [f"127.0.0.1:{proxy.port}", *addresses[1:]]
    limits = ["--max-concurrent", str(MAX_RUNNING), "--max-queued", "1", "--prefill-chunk", "8"]
    gateway, url = start_gateway(ring, base / "gateway.log", limits)
    solo, solo_url = start_gateway(ring, base / "gateway-solo.log", [*limits, "--no-batching"])
    stepped, stepped_url = start_gateway(
        ring, base / "gateway-stepped.log", [*limits, "--no-batching", "--ring-decode", "0"]
    )
    batched_stepped, batched_stepped_url = start_gateway(
        ring, base / "gateway-batched-stepped.log", [*limits, "--ring-decode-batched", "0"]
    )
    uncached, uncached_url = start_gateway(
        ring,
        base / "gateway-uncached.log",
        [*limits[:-1], "48", "--no-prefix-cache"],  # chunks that cached prefixes end inside
    )
    try:
        yield Fleet(
            url,
            export=export,
            stages=addresses,
            stage_metrics=tuple(ports),
            gateways={
                "solo": solo_url,  # --no-batching: the ring decodes on its own
                "stepped": stepped_url,  # --no-batching --ring-decode 0: every step sent
                "batched-stepped": batched_stepped_url,  # batching, every step sent
                "uncached": uncached_url,  # no prefix cache, prompts prefilled whole
            },
        )
    finally:
        uncached.stop()
        gateway.stop()
        solo.stop()
        stepped.stop()
        batched_stepped.stop()
        stop_proxy()
        for proc in procs:
            proc.stop()


def test_concurrent_streams_equal_the_same_requests_one_by_one(fleet: Fleet) -> None:
    bodies = [request(i) for i in range(8)]
    alone = [stream_text(fleet, body) for body in bodies]
    assert len(set(alone)) > 4 and all(alone)  # different requests, real text
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda b: stream_text(fleet, b), bodies))
    assert together == alone
    # the prompts of 8+ tokens went through the ring in chunks of 8, and nothing is left
    fleet.wait_metric("pipeshard_gateway_requests_running", 0)
    assert fleet.metric("pipeshard_gateway_queue_seconds_count") >= 16


def stage_metric(port: int, name: str) -> float:
    return scrape(f"http://127.0.0.1:{port}", name)


def stage_calls(fleet: Fleet) -> list[tuple[float, float]]:
    """Each stage's inference calls so far and the sessions they held, from its metrics."""
    return [
        (
            stage_metric(port, "pipeshard_stage_batch_size_count"),
            stage_metric(port, "pipeshard_stage_batch_size_sum"),
        )
        for port in fleet.stage_metrics
    ]


def test_without_batching_concurrent_streams_equal_them_one_by_one_each_call_alone(
    fleet: Fleet,
) -> None:
    bodies = [request(i) for i in range(8)]
    alone = [stream_text(fleet, body, fleet.gateways["solo"]) for body in bodies]
    assert len(set(alone)) > 4 and all(alone)
    before = stage_calls(fleet)
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda b: stream_text(fleet, b, fleet.gateways["solo"]), bodies))
    assert together == alone
    # every inference call on both stages held one request's step, under load too
    for (calls, sessions), (calls0, sessions0) in zip(stage_calls(fleet), before, strict=True):
        assert calls - calls0 >= 8 * 24 and sessions - sessions0 == calls - calls0
    # the batching gateway over the same stages does put steps of requests together
    before = stage_calls(fleet)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda b: stream_text(fleet, b), bodies))
    grew = [(c - c0, s - s0) for (c, s), (c0, s0) in zip(stage_calls(fleet), before, strict=True)]
    assert all(sessions > calls for calls, sessions in grew)


def test_beyond_the_limit_requests_queue_then_get_429_and_cancelled_ones_leave(
    fleet: Fleet,
) -> None:
    holders_started = threading.Barrier(MAX_RUNNING + 1, timeout=60)
    hold = {
        "model": "chat-model",
        "messages": [{"role": "user", "content": "hold the line"}],
        "max_tokens": 200,
        "temperature": 0.0,
        "logit_bias": {str(EOS): -100},  # no early end: each holds its slot for 200 steps
        "stream": True,
    }

    def holder() -> int:
        tokens = 0
        started = False
        for chunk in fleet.client().chat.completions.create(
            **hold, stream_options={"include_usage": True}
        ):
            if not started:
                started = True
                holders_started.wait()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens

    with ThreadPoolExecutor(MAX_RUNNING) as pool:
        holders = [pool.submit(holder) for _ in range(MAX_RUNNING)]
        holders_started.wait()  # all 8 slots are generating
        assert fleet.metric("pipeshard_gateway_requests_running") == MAX_RUNNING

        body = {**hold, "max_tokens": 2}
        # A 9th request waits in the queue (here: until its client gives up after 1 s).
        waiter = threading.Thread(target=give_up_after, args=(fleet, body, 1.0))
        waiter.start()
        fleet.wait_metric("pipeshard_gateway_requests_queued", 1)
        # The queue holds 1: a 10th is refused at once with 429 and Retry-After.
        refused = httpx.post(f"{fleet.url}/v1/chat/completions", json=body, timeout=10)
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_exceeded"
        assert refused.json()["error"]["code"] == "queue_full"
        # The 9th's client goes away: its place in the queue is freed...
        waiter.join()
        fleet.wait_metric("pipeshard_gateway_requests_queued", 0)
        # ...so the next request is queued again rather than refused, and completes.
        late: list[httpx.Response] = []
        taker = threading.Thread(
            target=lambda: late.append(
                httpx.post(
                    f"{fleet.url}/v1/chat/completions", json={**body, "stream": False}, timeout=60
                )
            )
        )
        taker.start()
        fleet.wait_metric("pipeshard_gateway_requests_queued", 1)
        assert all(not h.done() for h in holders)  # the slots were full all along
        assert [h.result() for h in holders] == [hold["max_tokens"]] * MAX_RUNNING
        taker.join()
    assert late[0].status_code == 200
    assert late[0].json()["usage"]["completion_tokens"] == 2
    fleet.wait_metric("pipeshard_gateway_requests_running", 0)


def give_up_after(fleet: Fleet, body: dict[str, Any], seconds: float) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{fleet.url}/v1/chat/completions", json=body, timeout=seconds)


def test_microbatch_benchmark_compares_batched_and_unbatched_side_by_side(
    fleet: Fleet, tmp_path: Path
) -> None:
    """The benchmark script end to end on the tiny export (no genai baseline): every system
    at each user count, in its table, JSON and plot."""
    assert fleet.export is not None
    subprocess.run(
        [PIPESHARD, "bench", "users", "--export", str(fleet.export), "--no-baseline",
         "--users", "1,2", "--tokens", "6", "--rounds", "1", "--results", str(tmp_path),
         "--gateway-cores", "0"],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    (report,) = tmp_path.glob("microbatch-*.md")
    (data,) = tmp_path.glob("microbatch-*.json")
    assert list(tmp_path.glob("microbatch-*.png"))
    text = report.read_text()
    assert text.startswith("Command: `pipeshard bench users ") and "--no-batching" in text
    rows = json.loads(data.read_text())["rows"]
    assert "the stages' defaults (paged KV, batch invariance on" in text
    padding = json.loads(data.read_text())["stage_padding"]
    assert len(padding) == 2 and set(padding) <= {"pads one-row calls", "does not pad"}
    assert [(r["system"], r["users"]) for r in rows] == [
        ("batched", 1), ("batched", 2), ("unbatched", 1), ("unbatched", 2),
        ("stepped", 1), ("stepped", 2),
    ]  # fmt: skip
    assert all(r["e2e_tok_s"] > 0 and len(r["stage_busy"]) == 2 for r in rows)
    # (with 2 users of 6 tiny tokens, one may be done before the other's first token: no
    # window where both decode, so only one user's decode rate is sure to be measured)
    assert all(r["decode_tok_s"] > 0 for r in rows if r["users"] == 1)
    assert "--ring-decode 0" in text
    assert "Gateways and HTTP clients pinned to core(s) 0 (taskset)" in text
    # the stages' own bound, from their decode calls, for the systems without batching: each
    # user's token waits for every stage in turn, so one user cannot beat the sum of the calls
    assert "| decode call ms per stage | bound tok/s |" in text
    bounded = [r for r in rows if r["system"] in ("unbatched", "stepped")]
    assert all("bound_tok_s" not in r for r in rows if r["system"] == "batched")
    for r in bounded:
        assert len(r["decode_call_ms"]) == 2 and all(c > 0 for c in r["decode_call_ms"])
        assert r["bound_tok_s"] == min(r["users"] / sum(r["decode_call_ms"]),
                                       1 / max(r["decode_call_ms"])) * 1000  # fmt: skip
        if r["users"] == 1:
            assert 0 < r["decode_tok_s"] <= r["bound_tok_s"] * 1.1
    # without a baseline the ratio columns say so instead of showing numbers
    assert "| vs two copies [min, max] |" in text and "| n/a |" in text
    assert all(r["vs_monolithic"] != r["vs_monolithic"] for r in rows)  # NaN: no baseline


def test_microbatch_benchmark_passes_stage_flags_and_states_them(
    fleet: Fleet, tmp_path: Path
) -> None:
    """``--stage-flags`` reaches both stage processes (their logs show the stateful backend,
    without the paged block pool) and the report says which flags the stages ran with."""
    assert fleet.export is not None
    subprocess.run(
        [PIPESHARD, "bench", "users", "--export", str(fleet.export), "--no-baseline",
         "--users", "1", "--tokens", "4", "--rounds", "1", "--results", str(tmp_path),
         "--systems", "unbatched", "--stage-flags=--kv-backend stateful"],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    text = next(tmp_path.glob("microbatch-*.md")).read_text()
    data = json.loads(next(tmp_path.glob("microbatch-*.json")).read_text())
    assert "1 inference thread each, flags `--kv-backend stateful`, otherwise" in text
    assert "paged KV" not in text
    assert data["stage_padding"] == ["stateful KV", "stateful KV"]
    assert data["options"]["stage_flags"] == "--kv-backend stateful"
    assert [(r["system"], r["users"]) for r in data["rows"]] == [("unbatched", 1)]


def completion(url: str, body: dict[str, Any]) -> tuple[str, list[Any], int]:
    """Text, logprobs (token, logprob, top 2) and completion tokens of a non-streaming call."""
    reply = httpx.post(
        f"{url}/v1/chat/completions",
        json={**body, "logprobs": True, "top_logprobs": 2},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    probs = [
        (t["token"], t["logprob"], [(o["token"], o["logprob"]) for o in t["top_logprobs"]])
        for t in choice["logprobs"]["content"]
    ]
    return choice["message"]["content"], probs, reply.json()["usage"]["completion_tokens"]


def test_the_ring_decoding_on_its_own_equals_every_step_through_the_gateway(fleet: Fleet) -> None:
    """Without batching the last stage feeds each sampled token straight back to stage 0: the
    tokens and logprobs are those of the gateway sending every step, under load too, and the
    ring makes every step after a request's first token itself."""
    penalised = {**request(3), "presence_penalty": 0.8, "frequency_penalty": 0.6, "max_tokens": 40}
    long = {**request(5), "max_tokens": 80, "logit_bias": {str(EOS): -100}}  # > --ring-decode
    bodies = [*(request(i) for i in range(7)), penalised, long]  # 8 running, 1 queued
    last = fleet.stage_metrics[-1]
    loops = stage_metric(last, "pipeshard_stage_loop_steps_total")
    stepped = [completion(fleet.gateways["stepped"], body) for body in bodies]
    assert stage_metric(last, "pipeshard_stage_loop_steps_total") == loops  # none without it
    assert len({text for text, _, _ in stepped}) > 5 and stepped[-1][2] == 80
    with ThreadPoolExecutor(len(bodies)) as pool:
        looped = list(pool.map(lambda b: completion(fleet.gateways["solo"], b), bodies))
    assert looped == stepped
    # the gateway sent the step of a request's first token and of every 33rd after it (once
    # a run of --ring-decode 32 tokens ended); the ring made the others itself
    made = stage_metric(last, "pipeshard_stage_loop_steps_total") - loops
    assert made == sum(ring_made(tokens) for _, _, tokens in stepped)


def ring_made(tokens: int, ring_decode: int = 32) -> int:
    return tokens - -(-tokens // (ring_decode + 1))


def test_batched_groups_decoding_on_the_ring_equal_every_step_through_the_gateway(
    fleet: Fleet,
) -> None:
    """With batching, a group runs on the ring by itself (--ring-decode-batched, default 8)
    while no request waits to join one: tokens and logprobs are those of the batching gateway
    sending every step, alone and under load (8 running, 1 queued, joining groups mid-run),
    and a request alone has every token but each 9th after its first made by the ring."""
    long = {**request(5), "max_tokens": 80, "logit_bias": {str(EOS): -100}}
    bodies = [*(request(i) for i in range(7)), {**request(7), "max_tokens": 40}, long]
    last = fleet.stage_metrics[-1]
    loops = stage_metric(last, "pipeshard_stage_loop_steps_total")
    stepped = [completion(fleet.gateways["batched-stepped"], body) for body in bodies]
    assert stage_metric(last, "pipeshard_stage_loop_steps_total") == loops  # none without it
    assert len({text for text, _, _ in stepped}) > 5 and stepped[-1][2] == 80
    assert completion(fleet.url, long) == stepped[-1]
    made = stage_metric(last, "pipeshard_stage_loop_steps_total") - loops
    assert made == ring_made(80, 8)
    with ThreadPoolExecutor(len(bodies)) as pool:
        looped = list(pool.map(lambda b: completion(fleet.url, b), bodies))
    assert looped == stepped
    assert stage_metric(last, "pipeshard_stage_loop_steps_total") - loops > made  # runs again


def test_a_client_leaving_while_the_ring_decodes_frees_its_sessions(fleet: Fleet) -> None:
    body = {**request(2), "max_tokens": 200, "logit_bias": {str(EOS): -100}, "stream": True}
    last = fleet.stage_metrics[-1]
    loops = stage_metric(last, "pipeshard_stage_loop_steps_total")
    with httpx.stream(
        "POST", f"{fleet.gateways['solo']}/v1/chat/completions", json=body, timeout=60
    ) as reply:
        seen = 0
        for line in reply.iter_lines():
            seen += line.startswith("data: ")
            if seen == 6:
                break  # the client goes away mid-stream
        assert seen == 6 and reply.status_code == 200
    held = settled(
        lambda: [stage_metric(p, "pipeshard_stage_sessions") for p in fleet.stage_metrics],
        lambda found: not any(found),
    )
    assert not any(held), "the stages still hold the session"
    made = stage_metric(last, "pipeshard_stage_loop_steps_total") - loops
    # a whole request after it through the gateway that steps every token (no loop steps):
    # the freed session's ring made no step meanwhile either, it had stopped
    solo, stepped = fleet.gateways["solo"], fleet.gateways["stepped"]
    alone = completion(stepped, request(2))
    assert stage_metric(last, "pipeshard_stage_loop_steps_total") - loops == made  # stopped
    assert 4 <= made < 80  # the ring stopped within a run of 32, far before 200 tokens
    # late steps of the freed session fail quietly: not counted as the stages' errors
    for port in fleet.stage_metrics:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'pipeshard_stage_errors_total{code="NOT_FOUND"}' not in text
    assert completion(solo, request(2)) == alone


def test_a_ring_of_one_stage_decodes_on_its_own(tmp_path: Path) -> None:
    """A one-stage ring feeds its tokens back into itself."""
    _, export = export_chat_model(tmp_path, stages=1)
    port = free_port()
    procs, addresses = start_stages(export, tmp_path, ["--metrics-port", str(port)])
    solo, solo_url = start_gateway(addresses, tmp_path / "solo.log", ["--no-batching"])
    stepped, stepped_url = start_gateway(
        addresses, tmp_path / "stepped.log", ["--no-batching", "--ring-decode", "0"]
    )
    try:
        bodies = [request(i) for i in range(4)]
        expected = [completion(stepped_url, body) for body in bodies]
        loops = stage_metric(port, "pipeshard_stage_loop_steps_total")
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda b: completion(solo_url, b), bodies)) == expected
        made = stage_metric(port, "pipeshard_stage_loop_steps_total") - loops
        assert made == sum(ring_made(tokens) for _, _, tokens in expected)
    finally:
        solo.stop()
        stepped.stop()
        for proc in procs:
            proc.stop()


def _chat(fleet: Fleet, url: str, messages: list[dict[str, str]], i: int) -> tuple[str, int]:
    """One reply (greedy, or seeded sampling for odd ``i``) and its cached prompt tokens."""
    body = {**request(i), "messages": messages, "max_tokens": 16}
    reply = fleet.client(url).chat.completions.create(**body)
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return reply.choices[0].message.content or "", usage.prompt_tokens_details.cached_tokens or 0


def test_prefix_cache_reuses_earlier_turns_and_shared_prompts_without_changing_a_token(
    fleet: Fleet,
) -> None:
    """A conversation's later turns and requests sharing a long system prompt open their
    sessions on the stages' cached KV blocks (usage.prompt_tokens_details.cached_tokens), and
    every reply, greedy and sampled, equals the one of a gateway without the prefix cache that
    prefills every prompt whole in chunks of 48 (which the cached prefixes, whole blocks of
    32, end inside; the cached blocks were computed in chunks of 8)."""
    system = {"role": "system", "content": " ".join(["owl fox dog cat"] * 12)}
    before = fleet.metric("pipeshard_gateway_prompt_cached_tokens_total")
    for i in (0, 1):  # greedy, then seeded sampling
        history: list[dict[str, str]] = [system]
        for turn in range(3):
            history.append({"role": "user", "content": f"turn {turn} {i} fox owl"})
            expected, uncached = _chat(fleet, fleet.gateways["uncached"], history, i)
            text, cached = _chat(fleet, fleet.url, history, i)
            assert text == expected, (i, turn)
            assert uncached == 0
            assert cached >= 32 or (i == 0 and turn == 0), (i, turn, cached)
            history.append({"role": "assistant", "content": text})
    # four questions at once under the shared system prompt, each from the cache
    questions = [[system, {"role": "user", "content": f"question {q}"}] for q in range(4)]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda m: _chat(fleet, fleet.url, m, 2), questions))
    assert [t for t, _ in together] == [
        _chat(fleet, fleet.gateways["uncached"], m, 2)[0] for m in questions
    ]
    assert all(cached >= 32 for _, cached in together)
    assert fleet.metric("pipeshard_gateway_prompt_cached_tokens_total") > before
    hits = sum(
        scrape(f"http://127.0.0.1:{port}", "pipeshard_stage_prefix_cache_hit_blocks_total")
        for port in fleet.stage_metrics
    )
    assert hits > 0
