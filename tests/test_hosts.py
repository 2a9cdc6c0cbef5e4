"""Separate hosts on real links: the lab (network namespaces on a bridge, benchmarks/lab.py)
and a fleet across it, the gateway and each stage on a host of its own, listening on its own
address, with TLS on every hop (a certificate per host's address) and the shared secret.

One fleet for the module: the tiny chat model on 2 stages, a 5 ms latency proxy in front of each
stage (so a stream lasts long enough to cut a link in the middle of it), 100 Mbit links. Root
only: without root or `ip netns` every test here skips and says why.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from benchmarks.lab import Lab, LabError, LabFleet, free_subnet, netns, start_fleet, unavailable
from protos import pipeshard_v1_pb2 as pb
from protos import pipeshard_v1_pb2_grpc as pb_grpc
from protos.transport import SECRET_KEY
from tests.fleets import export_chat_model

pytestmark = pytest.mark.integration

REASON = unavailable()
needs_lab = pytest.mark.skipif(REASON is not None, reason=f"no lab of hosts here: {REASON}")

KEY, SECRET = "lab-key", "lab-secret"
GRACE = 5.0  # the gateway's resume grace
# A cut link stalls a step (no connection is refused): the gateway's probes see the stage (or
# its link) silent, and after the link-loss timeout the step is abandoned and the grace runs
# (docs/failures.md), long before the step deadline (the default 60 s).
LINK_LOSS = 2.0
STEP_TIMEOUT = 60.0
PROBE_ROUND = 1.5  # a probe's timeout and the interval: how late a silence may be seen
# greedy and long enough that a cut lands in the middle (ignore_eos: the length is fixed)
REQUEST: dict[str, Any] = {
    "model": "chat-model",
    "messages": [{"role": "user", "content": "the quick brown fox"}],
    "max_tokens": 200,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}


def lab_name() -> str:
    return f"pt{os.getpid() % 100000}"


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    if REASON is not None:
        pytest.skip(f"no lab of hosts here: {REASON}")
    with Lab(3, lab_name(), free_subnet(), rate="100mbit") as made:
        yield made


@pytest.fixture(scope="module")
def fleet(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> LabFleet:
    base = tmp_path_factory.mktemp("hosts")
    _, export = export_chat_model(base)
    return start_fleet(
        lab, export, base / "logs", delay_ms=5, tls=True, secret=SECRET, api_key=KEY,
        gateway_flags=["--resume-grace", str(GRACE), "--step-timeout", str(STEP_TIMEOUT),
                       "--link-loss-timeout", str(LINK_LOSS)],
    )  # fmt: skip


def stream(
    fleet: LabFleet, on_first: Any = None, arrivals: list[float] | None = None
) -> tuple[str, list[dict[str, Any]], float]:
    """A streamed chat completion: its text, every event, and when its last event came;
    ``on_first()`` runs when the first token has arrived; ``arrivals`` gets the time of
    each piece of text."""
    text, events = "", []
    headers = {"Authorization": f"Bearer {KEY}"}
    with (
        httpx.Client(verify=fleet.verify, timeout=120) as client,
        client.stream(
            "POST", f"{fleet.url}/v1/chat/completions", json=REQUEST, headers=headers
        ) as reply,
    ):
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            events.append(event)
            for choice in event.get("choices", []):
                piece = choice["delta"].get("content") or ""
                if piece and not text and on_first is not None:
                    on_first()
                if piece and arrivals is not None:
                    arrivals.append(time.monotonic())
                text += piece
    return text, events, time.monotonic()


def ready(fleet: LabFleet) -> tuple[int, dict[str, Any]]:
    reply = httpx.get(f"{fleet.url}/ready", verify=fleet.verify, timeout=10)
    return reply.status_code, reply.json()


def wait_ready(fleet: LabFleet, status: int, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        code, body = ready(fleet)
        if code == status:
            return body
        assert time.monotonic() < deadline, f"/ready stayed {code}: {body}"
        time.sleep(0.2)


def metric(url: str, verify: str | bool, name: str, **labels: str) -> float:
    text = httpx.get(url, verify=verify, timeout=10).text
    found = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{name}(?:\{{(.*)\}})? (\S+)$", line)
        if match is None:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            found += float(match.group(2))
    return found


def resumed(fleet: LabFleet) -> float:
    return metric(f"{fleet.url}/metrics", fleet.verify, "pipeshard_gateway_resumed_total")


@pytest.fixture(scope="module")
def reference(fleet: LabFleet) -> str:
    """The greedy text of REQUEST over the undisturbed lab."""
    text, events, _ = stream(fleet)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    return text


@needs_lab
def test_lab_shapes_cuts_partitions_and_removes_everything(tmp_path: Path) -> None:
    """Hosts on their own addresses reach each other; tbf holds a link to its rate; a cut host
    is unreachable until restored; a partition separates two hosts only; ``down`` (and a
    failed ``up``) leaves nothing behind."""
    name = f"{lab_name()}x"
    with pytest.raises(ValueError, match="100xbit"):
        Lab(2, name, free_subnet(), rate="100xbit").up()  # fails after the hosts exist
    assert netns(name) == []
    with Lab(3, name, free_subnet(), rate="20mbit") as lab:
        served = []
        for host in lab.hosts:
            log = tmp_path / f"http-{host.index}.log"
            served.append(lab.start(host.index, [*SINK, host.address], log))

        def reach(frm: int | None, to: int, size: int = 1, timeout: float = 20.0) -> float:
            """Seconds to send ``size`` bytes from host ``frm`` (None: this namespace) to
            host ``to``'s sink and read its count back; inf if it cannot within ``timeout``
            (generous where it must: a loaded machine is slow, not cut)."""
            address = lab.host(to).address
            if frm is None:
                return send(address, size, timeout)
            done = subprocess_send(lab, frm, address, size, timeout)
            return done

        def cut_off(frm: int | None, to: int) -> bool:
            return reach(frm, to, timeout=2.0) == INF  # (a slow link would pass it: no flake)

        for host in lab.hosts:  # the sinks are listening
            assert wait_reach(lambda to=host.index: reach(None, to))
        assert reach(None, 0) < INF and reach(1, 2) < INF and reach(2, 0) < INF
        # tbf holds the rate: 20 Mbit take about 1 s, an unshaped bridge milliseconds (a
        # lower bound: load only lengthens it)
        seconds = reach(None, 1, 2_500_000, timeout=60)
        assert seconds > 0.6, seconds
        lab.cut(1)
        assert cut_off(None, 1) and cut_off(0, 1)
        assert reach(0, 2) < INF
        lab.restore(1)
        assert wait_reach(lambda: reach(None, 1))
        lab.partition(1, 2)
        assert cut_off(1, 2) and cut_off(2, 1)
        assert reach(1, 0) < INF and reach(2, 0) < INF and reach(None, 1) < INF
        lab.heal(1, 2)
        assert wait_reach(lambda: reach(1, 2))
    assert netns(name) == []
    assert name not in os.popen("ip -o link show").read()


# A byte sink on a host: reads a connection to its end, answers with the count.
SINK = [
    "python3",
    "-c",
    "import socket,sys\n"
    "s=socket.create_server((sys.argv[1],7000))\n"
    "while True:\n"
    " c,_=s.accept(); n=0\n"
    " while (b:=c.recv(65536)): n+=len(b)\n"
    " c.sendall(str(n).encode()); c.close()\n",
]


def send(address: str, size: int, timeout: float) -> float:
    start = time.monotonic()
    try:
        with socket.create_connection((address, 7000), timeout=timeout) as sock:
            sock.sendall(b"x" * size)
            sock.shutdown(socket.SHUT_WR)
            assert int(sock.recv(64)) == size
    except OSError:
        return float("inf")
    return time.monotonic() - start


def subprocess_send(lab: Lab, frm: int, address: str, size: int, timeout: float) -> float:
    import subprocess

    code = (
        "import socket,sys,time\n"
        f"t=time.monotonic(); s=socket.create_connection(({address!r},7000),timeout={timeout})\n"
        f"s.sendall(b'x'*{size}); s.shutdown(socket.SHUT_WR)\n"
        f"assert int(s.recv(64))=={size}; print(time.monotonic()-t)\n"
    )
    done = subprocess.run(
        [*lab.host(frm).exec(), "python3", "-c", code], capture_output=True, text=True
    )
    return float(done.stdout) if done.returncode == 0 else float("inf")


INF = float("inf")


def wait_reach(probe: Any, timeout: float = 60.0) -> bool:
    """Until ``probe`` reaches its host (the timeout is a hang guard)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if probe() < float("inf"):
            return True
        time.sleep(0.2)
    return False


@needs_lab
def test_chat_ready_and_metrics_across_hosts(lab: Lab, fleet: LabFleet, reference: str) -> None:
    """Each process on its own host and address, TLS on every hop: the gateway is ready with
    both stages up, streams the same greedy text twice, and its metrics and the stages' are
    scraped over HTTPS across the bridge, bytes on every link counted."""
    assert fleet.url.startswith(f"https://{lab.host(0).address}:")
    code, body = ready(fleet)
    assert code == 200 and [s["up"] for s in body["stages"]] == [True, True]
    assert [s["address"] for s in body["stages"]] == fleet.stages
    text, _, _ = stream(fleet)
    assert text == reference and text
    gateway = f"{fleet.url}/metrics"
    # the gateway sends steps to stage 0 and gets results from the last stage
    assert metric(gateway, fleet.verify, "pipeshard_gateway_link_bytes_total",
                  direction="out", peer=fleet.stages[0]) > 0  # fmt: skip
    assert metric(gateway, fleet.verify, "pipeshard_gateway_link_bytes_total",
                  direction="in", peer=fleet.stages[1]) > 0  # fmt: skip
    first, last = fleet.metrics
    assert metric(first, fleet.verify, "pipeshard_stage_link_bytes_total",
                  direction="out", peer=fleet.stages[1]) > 0  # fmt: skip
    for url in fleet.metrics:
        assert metric(url, fleet.verify, "pipeshard_stage_link_bytes_total", direction="in") > 0
    assert metric(last, fleet.verify, "pipeshard_stage_tokens_total", phase="decode") > 0
    # gRPC over TLS verified against the lab's CA; a caller without the secret is refused
    assert fleet.ca is not None
    credentials = grpc.ssl_channel_credentials(fleet.ca.read_bytes())
    with grpc.secure_channel(fleet.stages[0], credentials) as channel:
        stub = pb_grpc.StageStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Health(pb.HealthRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Health(pb.HealthRequest(), metadata=((SECRET_KEY, SECRET),), timeout=10).serving


@needs_lab
def test_a_cut_shorter_than_the_grace_finishes_with_identical_text(
    lab: Lab, fleet: LabFleet, reference: str
) -> None:
    """Stage 1's host loses its link for 1.5 s in the middle of a stream: the stream waits,
    resumes once the link is back and ends with the same text as without the cut."""
    before = resumed(fleet)
    cutter: list[threading.Thread] = []

    def cut() -> None:
        def run() -> None:
            lab.cut(2)
            time.sleep(1.5)
            lab.restore(2)

        cutter.append(threading.Thread(target=run))
        cutter[0].start()

    try:
        text, events, _ = stream(fleet, on_first=cut)
    finally:
        for thread in cutter:
            thread.join()
        lab.restore(2)
    assert cutter, "no token came"
    assert text == reference
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert resumed(fleet) > before  # the cut did land in the middle of the stream
    wait_ready(fleet, 200)


CUTS = {
    "stage 0's host": (lambda lab: lab.cut(1), lambda lab: lab.restore(1)),
    "stage 1's host": (lambda lab: lab.cut(2), lambda lab: lab.restore(2)),
    "between the stages": (lambda lab: lab.partition(1, 2), lambda lab: lab.heal(1, 2)),
}


@needs_lab
@pytest.mark.parametrize("where", list(CUTS))
def test_a_cut_longer_than_the_link_loss_timeout_resumes_as_soon_as_the_link_is_back(
    lab: Lab, fleet: LabFleet, reference: str, where: str
) -> None:
    """A link cut mid-stream for longer than the link-loss timeout, back within the grace: the
    stalled step is abandoned, and once the link is back the stream re-prefills and goes on
    with the same text before the step deadline (60 s) would have ended it: the gateway's and
    the stages' connections that went through the cut are made afresh."""
    cut, restore = CUTS[where]
    down_s = LINK_LOSS + PROBE_ROUND + 0.5  # abandoned while cut; back well within the grace
    wait_ready(fleet, 200)
    before = resumed(fleet)
    times: dict[str, float] = {}
    cutter: list[threading.Thread] = []

    def start() -> None:
        def run() -> None:
            cut(lab)
            times["cut"] = time.monotonic()
            time.sleep(down_s)
            restore(lab)
            times["back"] = time.monotonic()

        cutter.append(threading.Thread(target=run))
        cutter[0].start()

    arrivals: list[float] = []
    try:
        text, events, ended = stream(fleet, on_first=start, arrivals=arrivals)
    finally:
        for thread in cutter:
            thread.join()
        restore(lab)
    assert cutter, "no token came"
    assert text == reference
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert resumed(fleet) > before  # abandoned and resumed
    # text came again after the link's return (the probes see it, the ring is linked
    # afresh, the prompt and the tokens so far are prefilled again), and the stream ended,
    # before the step deadline would have ended the stalled step: the link-loss timeout
    # abandoned it, not the deadline (an order of events, not a measure of seconds)
    again = min(t for t in arrivals if t > times["back"])
    assert again <= ended < times["cut"] + STEP_TIMEOUT, (again, ended, times)
    wait_ready(fleet, 200)
    # the abandoned session is freed on every stage (where the cut kept the gateway from it,
    # once the stage is back), and no abandoned step's failure went unhandled
    deadline = time.monotonic() + 60  # a hang guard
    while any(metric(url, fleet.verify, "pipeshard_stage_sessions") for url in fleet.metrics):
        assert time.monotonic() < deadline, "sessions left on the stages"
        time.sleep(0.2)
    assert "never retrieved" not in fleet.gateway.log.read_text()


@needs_lab
def test_a_cut_longer_than_the_grace_ends_the_stream_cleanly_and_the_fleet_serves_again(
    lab: Lab, fleet: LabFleet, reference: str
) -> None:
    """Stage 1's host loses its link for longer than the grace: after the link-loss timeout the
    stalled step is abandoned (not after the step deadline), the grace runs out, and the
    stream ends with one error event, code stage_unavailable, within the link-loss timeout, a
    probe round and the grace (and a margin); /ready names the stage meanwhile; once the link
    is back the fleet is ready again and serves the same text."""
    cut_at: list[float] = []

    def cut() -> None:
        lab.cut(2)
        cut_at.append(time.monotonic())

    try:
        _, events, ended = stream(fleet, on_first=cut)
        code, body = ready(fleet)
    finally:
        lab.restore(2)
    assert cut_at
    errors = [e for e in events if "error" in e]
    assert len(errors) == 1 and errors[0] is events[-1], events[-3:]
    assert errors[0]["error"]["code"] == "stage_unavailable", errors
    # ended by the link-loss timeout, not by the step deadline (an order of events)
    assert ended < cut_at[0] + STEP_TIMEOUT, ended - cut_at[0]
    assert code == 503 and body["stages"][1]["up"] is False
    wait_ready(fleet, 200, timeout=90)
    text, _, _ = stream(fleet)
    assert text == reference


@needs_lab
def test_a_partition_between_the_stages_is_reported_by_ready(
    lab: Lab, fleet: LabFleet, reference: str
) -> None:
    """Stages 0 and 1 cannot reach each other while the gateway reaches both: /ready turns 503
    and names stage 0's link to stage 1 (stage 1 itself is up); healed, it is ready again and
    serves the same text."""
    wait_ready(fleet, 200)
    lab.partition(1, 2)
    try:
        body = wait_ready(fleet, 503)
        first, second = body["stages"]
        assert first["up"] is False and f"its link to {fleet.stages[1]} is down" in first["state"]
        assert second["up"] is True
    finally:
        lab.heal(1, 2)
    wait_ready(fleet, 200, timeout=60)
    text, _, _ = stream(fleet)
    assert text == reference


def test_lab_refuses_bad_settings() -> None:
    """Names, subnets and host counts are checked before anything is made (any machine)."""
    with pytest.raises(ValueError, match="1 to 200 hosts"):
        Lab(0)
    with pytest.raises(ValueError, match="lower-case"):
        Lab(2, name="Bad-Name")
    with pytest.raises(ValueError, match="private /24"):
        Lab(2, subnet="8.8.8")
    assert isinstance(LabError("x"), RuntimeError)


@needs_lab
def test_links_benchmark_reports_every_network(tmp_path: Path) -> None:
    """`pipeshard bench links` on the tiny export, loopback against one shaped network: a row
    per prompt length and user count for both, and bytes per prompt token that are the hidden
    state's (64 values in fp16 on the one stage-to-stage hop) plus the little else a step
    carries; on the lab's links the interfaces saw more than the payload."""
    import subprocess

    from tests.processes import PIPESHARD

    _, export = export_chat_model(tmp_path / "model")
    cmd = [
        PIPESHARD, "bench", "links", "--export", str(export), "--networks",
        "loopback,100mbit:2", "--users", "1,2", "--prompts", "20,60", "--quick",
        "--lab-name", f"{lab_name()}b", "--results", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    (report,) = tmp_path.glob("links-*.md")
    text = report.read_text()
    assert "| 20 | " in text and "| 60 | " in text and "| 2 | " in text
    data = json.loads(next(tmp_path.glob("links-*.json")).read_text())["results"]
    assert set(data) == {"loopback", "100mbit + 2 ms"}
    for name, result in data.items():
        per_prompt = result["bytes_per_prompt_token"]
        assert 128 <= per_prompt["payload"] < 128 + 64, (name, per_prompt)
        assert result["decode"]["2"]["tokens_per_s"] > 0
    shaped = data["100mbit + 2 ms"]
    assert shaped["bytes_per_prompt_token"]["wire"] > shaped["bytes_per_prompt_token"]["payload"]
    assert data["loopback"]["bytes_per_prompt_token"]["wire"] is None
    assert netns(f"{lab_name()}b") == []


@needs_lab
def test_lab_script_brings_a_lab_up_changes_it_and_takes_it_down() -> None:
    """deploy/lab.sh: up prints every host with its address and rate, cut and partition show in
    status, down removes it all; a command on no lab is a one-line error."""
    import subprocess
    import sys

    script = str(Path(__file__).resolve().parents[1] / "deploy" / "lab.sh")
    name = f"{lab_name()}s"
    env = {**os.environ, "PYTHON": sys.executable, "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}

    def lab_sh(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [script, "--name", name, *args], capture_output=True, text=True, env=env, timeout=60
        )

    subnet = free_subnet()
    try:
        up = lab_sh("up", "--hosts", "3", "--rate", "100mbit", "--subnet", subnet)
        assert up.returncode == 0, up.stderr
        assert f"{name}-2  {subnet}.4/24  rate 100Mbit" in up.stdout
        assert lab_sh("cut", "1").returncode == 0
        assert lab_sh("partition", "0", "2").returncode == 0
        status = lab_sh("status").stdout
        assert f"{name}-1  {subnet}.3/24  rate 100Mbit  CUT" in status
        assert f"{name}-0  {subnet}.2/24  rate 100Mbit  partitioned from {subnet}.4" in status
        assert lab_sh("heal", "0", "2").returncode == 0
        assert "partitioned" not in lab_sh("status").stdout
    finally:
        down = lab_sh("down")
    assert down.returncode == 0 and down.stdout.startswith("removed ")
    assert netns(name) == []
    missing = lab_sh("cut", "1")
    assert missing.returncode == 2 and f"no lab named {name!r}" in missing.stderr
