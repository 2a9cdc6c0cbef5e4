"""A real Prometheus server scrapes the gateway and both stages with deploy/prometheus.yml.

The test rewrites only the targets of deploy/prometheus.yml (the compose service names) to the
loopback ports of the processes it started, and a 1 s scrape interval; then reads the gateway's
request counter and a stage's forward-latency histogram back through Prometheus's HTTP API.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.fleets import export_chat_model
from tests.processes import Proc, free_port, start_gateway, start_stages

pytestmark = pytest.mark.integration

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def prometheus_binary() -> str:
    path = shutil.which("prometheus") or (
        "/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None
    )
    if path is None:
        pytest.fail(
            "prometheus not found: install Debian's `prometheus` package "
            "(`deploy/bootstrap.sh --dev` does as root; else apt-get install prometheus)"
        )
    return path


def scrape_config(gateway: str, stages: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    for job in config["scrape_configs"]:
        if job["job_name"] == "pipeshard-gateway":
            job["static_configs"] = [{"targets": [gateway]}]
        elif job["job_name"] == "pipeshard-stage":
            assert len(job["static_configs"]) == len(stages)
            for static, target in zip(job["static_configs"], stages, strict=True):
                static["targets"] = [target]
    return config


def query(base: str, expr: str) -> list[dict[str, Any]]:
    reply = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert reply["status"] == "success", reply
    result: list[dict[str, Any]] = reply["data"]["result"]
    return result


def wait_for(base: str, expr: str, check: Any, timeout: float = 30.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        result = query(base, expr)
        if result and check(result):
            return result
        assert time.monotonic() < deadline, f"{expr}: {result}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    base = tmp_path_factory.mktemp("prometheus")
    _, export = export_chat_model(base)
    metrics = [free_port(), free_port()]
    procs = []
    for index, port in enumerate(metrics):
        started, _ = start_stages(export, base, stages=[index], extra=["--metrics-port", str(port)])
        procs += started
    addresses = [p.args[p.args.index("--listen") + 1] for p in procs]
    gateway, url = start_gateway(addresses, base / "gateway.log")
    config = base / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            scrape_config(url.removeprefix("http://"), [f"127.0.0.1:{p}" for p in metrics])
        )
    )
    web = free_port()
    prometheus = Proc(
        [
            prometheus_binary(),
            f"--config.file={config}",
            f"--storage.tsdb.path={base / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web}",
        ],
        base / "prometheus.log",
    ).start()
    try:
        # Prometheus answers 503 until its storage is open; /-/ready says when it is.
        if not prometheus.wait_http(f"http://127.0.0.1:{web}/-/ready", timeout=60):
            pytest.fail(f"prometheus not ready:\n{prometheus.log.read_text()[-3000:]}")
        yield url, f"http://127.0.0.1:{web}"
    finally:
        prometheus.stop()
        gateway.stop()
        for proc in procs:
            proc.stop()


def test_prometheus_scrapes_gateway_and_stages(fleet: tuple[str, str]) -> None:
    url, prometheus = fleet
    body = {"model": "chat-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    for _ in range(3):
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    # all three targets are up
    up = wait_for(prometheus, "up", lambda r: len(r) == 3 and all(x["value"][1] == "1" for x in r))
    assert {x["metric"]["job"] for x in up} == {"pipeshard-gateway", "pipeshard-stage"}
    # the gateway's request counter, as Prometheus stored it
    requests = wait_for(
        prometheus,
        'pipeshard_gateway_requests_total{endpoint="/v1/chat/completions",status="200"}',
        lambda r: float(r[0]["value"][1]) >= 3,
    )
    assert float(requests[0]["value"][1]) == 3
    # a stage's forward-latency histogram: decode steps were timed on stage 1
    forward = wait_for(
        prometheus,
        'pipeshard_stage_forward_seconds_count{stage="1",phase="decode"}',
        lambda r: float(r[0]["value"][1]) > 0,
    )
    assert forward[0]["metric"]["job"] == "pipeshard-stage"
    buckets = query(prometheus, 'pipeshard_stage_forward_seconds_bucket{stage="0"}')
    assert len(buckets) > 10 and any(b["metric"]["le"] == "+Inf" for b in buckets)
