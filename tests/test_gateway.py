"""The real gateway process over HTTP, on real stage processes: the openai client, curl, errors."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from exporter.verify import reference_greedy
from server.ring.grpc_client import PipelineClient
from shard_runtime.chain import LocalChain
from tests.clients import ring_greedy
from tests.conftest import EXACT, make_certificates
from tests.fleets import KEY, MESSAGES, Fleet, export_chat_model
from tests.processes import free_port, settled, start_gateway, start_stages

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    base = tmp_path_factory.mktemp("fleet")
    source, export = export_chat_model(base)
    procs, addresses = start_stages(export, base)
    gateway, url = start_gateway(
        addresses,
        base / "gateway.log",
        ["--api-key", KEY, "--api-key", "second-key", "--max-body-bytes", "65536"],
    )
    try:
        yield Fleet(url, "chat-model", source, export, addresses, gateway, procs)
    finally:
        gateway.stop()
        for proc in procs:
            proc.stop()


def test_greedy_text_equals_pipeline_and_unsplit_model(fleet: Fleet) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reply = fleet.client().chat.completions.create(
        model=fleet.model,
        messages=MESSAGES,
        max_tokens=20,
        temperature=0,  # type: ignore[arg-type]
    )
    tokenizer = AutoTokenizer.from_pretrained(str(fleet.source))
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)
    chain_tokens, _ = LocalChain(fleet.export, EXACT).greedy("g", prompt, 20)
    model = AutoModelForCausalLM.from_pretrained(str(fleet.source)).eval()
    reference, _ = reference_greedy(model, prompt, 20)

    async def over_ring() -> list[int]:
        client = PipelineClient(fleet.stages)
        await client.start()
        tokens = await ring_greedy(client, "direct", prompt, 20)
        await client.release("direct")
        await client.close()
        return tokens

    assert asyncio.run(over_ring()) == chain_tokens == reference
    eos = 2
    expected = reference[: reference.index(eos)] if eos in reference else reference
    assert reply.choices[0].message.content == tokenizer.decode(expected)
    assert reply.usage.completion_tokens == (len(expected) + 1 if eos in reference else 20)
    assert reply.choices[0].finish_reason == ("stop" if eos in reference else "length")
    assert len(expected) >= 8  # the comparison is about real text


def test_the_gateway_and_the_stages_run_without_torch(fleet: Fleet) -> None:
    """Only the exporter needs torch. It is installed here (the export extra), and
    transformers imports it wherever it finds it, unless the gateway keeps it out."""
    fleet.client().chat.completions.create(model=fleet.model, messages=MESSAGES, max_tokens=2)
    assert len(fleet.pids) == 3
    for pid in fleet.pids:
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "libtorch" not in maps and "libopenvino" in maps, pid


def test_streaming_matches_non_streaming_and_usage(fleet: Fleet) -> None:
    client = fleet.client()
    full = client.chat.completions.create(
        model=fleet.model,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,  # type: ignore[arg-type]
    )
    chunks = list(
        client.chat.completions.create(
            model=fleet.model,
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(
        client.chat.completions.create(
            model=fleet.model,
            messages=MESSAGES,
            max_tokens=4,
            stream=True,  # type: ignore[arg-type]
        )
    )
    assert all(c.usage is None for c in plain) and all(c.choices for c in plain)


def test_max_tokens_gives_length_with_exact_counts(fleet: Fleet) -> None:
    reply = fleet.client().chat.completions.create(
        model=fleet.model,
        messages=MESSAGES,
        max_tokens=3,
        temperature=0,  # type: ignore[arg-type]
        logit_bias={"2": -100},  # never end early
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 3


def test_stop_sequence_from_the_models_own_output(fleet: Fleet) -> None:
    client = fleet.client()
    text = (
        client.chat.completions.create(
            model=fleet.model,
            messages=MESSAGES,
            max_tokens=24,
            temperature=0,  # type: ignore[arg-type]
            logit_bias={"2": -100},
        )
        .choices[0]
        .message.content
    )
    assert text is not None and len(text) > 12
    stop = text[8:11]
    cut = text.index(stop)
    for stream in (False, True):
        if stream:
            chunks = list(
                client.chat.completions.create(
                    model=fleet.model,
                    messages=MESSAGES,
                    max_tokens=24,
                    temperature=0,  # type: ignore[arg-type]
                    logit_bias={"2": -100},
                    stop=[stop, "never-said"],
                    stream=True,
                )
            )
            got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            reply = client.chat.completions.create(
                model=fleet.model,
                messages=MESSAGES,
                max_tokens=24,
                temperature=0,  # type: ignore[arg-type]
                logit_bias={"2": -100},
                stop=stop,
            )
            got, reason = reply.choices[0].message.content or "", reply.choices[0].finish_reason
        assert got == text[:cut] and reason == "stop", (stream, stop, got)


def test_n_seeded_sampling_and_logprobs(fleet: Fleet) -> None:
    client = fleet.client()

    def sample() -> list[str]:
        reply = client.chat.completions.create(
            model=fleet.model,
            messages=MESSAGES,
            max_tokens=10,
            temperature=1.0,
            seed=1234,  # type: ignore[arg-type]
            n=2,
            logit_bias={"2": -100},
        )
        assert [c.index for c in reply.choices] == [0, 1]
        assert reply.usage is not None and reply.usage.completion_tokens == 20
        return [c.message.content or "" for c in reply.choices]

    first, second = sample(), sample()
    assert first == second  # reproducible with a seed
    assert first[0] != first[1]  # the two choices draw differently

    reply = client.chat.completions.create(
        model=fleet.model,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,  # type: ignore[arg-type]
        logprobs=True,
        top_logprobs=3,
        logit_bias={"2": -100},
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert (
            entry.logprob <= 0 and entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        )
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the top one
    assert "".join(e.token for e in content) == reply.choices[0].message.content


def test_text_completions(fleet: Fleet) -> None:
    client = fleet.client()
    reply = client.completions.create(
        model=fleet.model,
        prompt="once upon a time",
        max_tokens=6,
        temperature=0,
        logit_bias={"2": -100},
    )
    assert reply.object == "text_completion" and reply.choices[0].finish_reason == "length"
    streamed = list(
        client.completions.create(
            model=fleet.model,
            prompt="once upon a time",
            max_tokens=6,
            temperature=0,
            logit_bias={"2": -100},
            stream=True,
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == reply.choices[0].text


def _post(
    fleet: Fleet, body: object, key: str | None = KEY, raw: bytes | None = None
) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{fleet.url}/v1/chat/completions", content=content, headers=headers)


@pytest.mark.parametrize("stream", [False, True])
def test_errors_in_the_openai_envelope(fleet: Fleet, stream: bool) -> None:
    good = {"model": fleet.model, "messages": MESSAGES, "stream": stream, "max_tokens": 2}
    cases: list[tuple[int, dict[str, object] | None, bytes | None, str | None]] = [
        (400, None, b"{not json", None),
        (400, {**good, "messages": []}, None, "messages"),
        (400, {**good, "messages": [{"role": "wizard", "content": "hi"}]}, None, "messages"),
        (400, {**good, "temperature": 3}, None, "temperature"),
        (400, {**good, "top_p": 1.5}, None, "top_p"),
        (400, {**good, "n": 0}, None, "n"),
        (400, {**good, "max_tokens": 10**6}, None, "max_tokens"),
        (400, {**good, "messages": [{"role": "user", "content": "fox " * 400}]}, None, None),
        (404, {**good, "model": "no-such-model"}, None, "model"),
        (413, None, b"{" + b" " * 70000 + b"}", None),
    ]
    for status, body, raw, param in cases:
        response = _post(fleet, body, raw=raw)
        assert response.status_code == status, (body, response.text)
        assert response.headers["content-type"].startswith("application/json")
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        if param is not None:
            assert error["param"] is not None and error["param"].startswith(param), error
    assert _post(fleet, good).status_code == 200
    for key in (None, "wrong-key"):
        response = _post(fleet, good, key=key)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert _post(fleet, good, key="second-key").status_code == 200
    with pytest.raises(openai.NotFoundError):
        fleet.client().models.retrieve("no-such-model")
    assert fleet.client().models.retrieve(fleet.model).id == fleet.model


def test_curl_streams_sse_until_done(fleet: Fleet) -> None:
    body = json.dumps({"model": fleet.model, "messages": MESSAGES, "max_tokens": 4, "stream": True})
    out = subprocess.run(
        [
            "curl",
            "-sN",
            f"{fleet.url}/v1/chat/completions",
            "-H",
            f"Authorization: Bearer {KEY}",
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    events = [e for e in out.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for event in events[:-1]:
        json.loads(event.removeprefix("data: "))


def test_disconnect_releases_sessions_on_every_stage(fleet: Fleet) -> None:
    body = {
        "model": fleet.model,
        "messages": MESSAGES,
        "max_tokens": 200,
        "stream": True,
        "logit_bias": {"2": -100},
    }
    cancelled, errors, lengths = (fleet.choices(f) for f in ("cancelled", "error", "length"))
    with httpx.stream(
        "POST",
        f"{fleet.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {KEY}"},
        timeout=30,
    ) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in received)
        assert max(fleet.stage_sessions()) == 1  # generating now
    # counted as cancelled (the client left), not as an error or a finished choice: it ended
    # when the client left, not at max_tokens, and its session is freed on every stage
    assert settled(lambda: fleet.choices("cancelled"), lambda n: n > cancelled) == cancelled + 1
    assert fleet.choices("error") == errors and fleet.choices("length") == lengths
    assert settled(fleet.stage_sessions, lambda held: held == [0, 0]) == [0, 0]


def test_operations_endpoints(fleet: Fleet) -> None:
    assert httpx.get(f"{fleet.url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{fleet.url}/ready").json()
    assert ready["ready"] and [s["index"] for s in ready["stages"]] == [0, 1]
    response = httpx.get(f"{fleet.url}/v1/models", headers={"authorization": f"Bearer {KEY}"})
    assert response.headers["x-request-id"]
    assert (
        httpx.get(f"{fleet.url}/health", headers={"x-request-id": "abc-123"}).headers[
            "x-request-id"
        ]
        == "abc-123"
    )
    metrics = httpx.get(f"{fleet.url}/metrics").text
    for name in (
        'pipeshard_gateway_requests_total{endpoint="/v1/chat/completions",status="200"}',
        "pipeshard_gateway_time_to_first_token_seconds_count",
        "pipeshard_gateway_inter_token_latency_seconds_count",
        "pipeshard_gateway_prompt_tokens_total",
        "pipeshard_gateway_generated_tokens_total",
        "pipeshard_gateway_requests_running",
        "pipeshard_gateway_requests_queued",
    ):
        assert name in metrics, name


def test_end_of_sequence_stops_and_is_counted(fleet: Fleet) -> None:
    stops, lengths = fleet.choices("stop"), fleet.choices("length")
    for stream in (False, True):
        if stream:
            chunks = list(
                fleet.client().chat.completions.create(
                    model=fleet.model,
                    messages=MESSAGES,  # type: ignore[arg-type]
                    max_tokens=8,
                    logit_bias={"2": 100},  # the end-of-sequence token comes first
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            reply = fleet.client().chat.completions.create(
                model=fleet.model,
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=8,
                logit_bias={"2": 100},
            )
            text, reason = reply.choices[0].message.content, reply.choices[0].finish_reason
            usage = reply.usage
        assert text == "" and reason == "stop"
        assert usage is not None and usage.completion_tokens == 1
    assert fleet.choices("stop") == stops + 2
    assert fleet.choices("length") == lengths


def test_servers_benchmark_compares_running_servers(fleet: Fleet, tmp_path: Path) -> None:
    """benchmarks/servers.py against real servers (here the one gateway under two names)."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.servers",  # from the checkout: pip does not install benchmarks
            "--server", f"a={fleet.url}",
            "--server", f"b={fleet.url}/",
            "--users", "1,2",
            "--rounds", "2",
            "--tokens", "4",
            "--ttft-tokens", "0",  # its prompt (~300 tokens a copy) outgrows the 256 positions
            "--api-key", KEY,
            "--results", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=120, cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    [md] = tmp_path.glob("servers-*.md")
    [raw] = tmp_path.glob("servers-*.json")
    table = md.read_text()
    assert "| 1 | " in table and "| 2 | " in table and "identical on every server" in table
    data = json.loads(raw.read_text())
    assert data["model"] == fleet.model
    assert [len(v) for v in data["rates"]["b"].values()] == [2, 2]
    assert all(rate > 0 for runs in data["rates"]["a"].values() for rate in runs)


def test_long_prompt_benchmark_measures_a_streaming_users_pauses(fleet: Fleet) -> None:
    """benchmarks/long_prompt.py against the real gateway: B's long prompt is counted, and A's
    gaps while B was in flight are measured."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.long_prompt",  # from the checkout: pip does not install benchmarks
            "--url", fleet.url,
            "--prompt-tokens", "128",  # the tiny model holds 256 positions
            "--tokens", "48",
            "--delay", "0.2",
            "--api-key", KEY,
        ],
        capture_output=True, text=True, timeout=120, cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["b_prompt_tokens"] > 100 and result["b_seconds"] > 0
    assert result["a_median_gap_ms"] is not None and result["a_median_gap_ms"] >= 0


def test_tls_everywhere_https_gateway_over_tls_stages(fleet: Fleet, tmp_path: Path) -> None:
    """Stages serving gRPC and /metrics over TLS, a gateway verifying them and serving HTTPS:
    the openai client and curl trust the CA and get the same greedy text as plain HTTP; a
    client without the CA is refused; plain HTTP to the HTTPS port gets no answer."""
    ca, cert, key = make_certificates(tmp_path)
    pair = ["--tls-cert", str(cert), "--tls-key", str(key)]
    tls = [*pair, "--tls-ca", str(ca)]
    metrics_port = free_port()
    stage_procs, addresses = start_stages(fleet.export, tmp_path, tls, stages=[0])
    last, [last_address] = start_stages(
        fleet.export, tmp_path, [*tls, "--metrics-port", str(metrics_port)], stages=[1]
    )
    stage_procs += last
    gateway, url = start_gateway(
        [*addresses, last_address],
        tmp_path / "gateway.log",
        [*tls, "--api-key", KEY],
        https_ca=ca,
    )
    try:
        assert url.startswith("https://")
        with httpx.Client(verify=str(ca)) as https:
            client = openai.OpenAI(
                base_url=f"{url}/v1", api_key=KEY, max_retries=0, http_client=https
            )
            reply = client.chat.completions.create(
                model=fleet.model, messages=MESSAGES, max_tokens=8, temperature=0
            )
            scraped = https.get(f"https://127.0.0.1:{metrics_port}/metrics").text
        plain = fleet.client().chat.completions.create(
            model=fleet.model, messages=MESSAGES, max_tokens=8, temperature=0
        )
        assert reply.choices[0].message.content == plain.choices[0].message.content
        assert "pipeshard_stage_" in scraped

        body = json.dumps(
            {"model": fleet.model, "messages": MESSAGES, "max_tokens": 8, "stream": True}
        )
        curl = [
            "curl",
            "-sN",
            "-H",
            f"Authorization: Bearer {KEY}",
            "-H",
            "Content-Type: application/json",
        ]
        curl += ["-d", body]
        out = subprocess.run(
            [*curl, "--cacert", str(ca), f"{url}/v1/chat/completions"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        assert out.endswith("data: [DONE]\n\n")
        untrusted = subprocess.run(
            [*curl, f"{url}/v1/chat/completions"], capture_output=True, timeout=60
        )
        assert untrusted.returncode == 60  # curl: peer certificate cannot be authenticated
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url.replace('https', 'http')}/health", timeout=5)
    finally:
        gateway.stop()
        for proc in stage_procs:
            proc.stop()
    assert "Traceback" not in (tmp_path / "gateway.log").read_text()
