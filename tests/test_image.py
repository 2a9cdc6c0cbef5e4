"""The container image built and run, with podman: the Dockerfile built on a local stand-in for
its base (deploy/base-image.sh), stage and gateway containers serving a chat completion with a
tiny model and passing the image's HEALTHCHECK, deploy/compose.yaml up and down with
podman-compose, and the systemd units under systemd as PID 1 of a container
(deploy/systemd/Containerfile): Type=notify readiness and the watchdog.

Root only, with podman, runc, podman-compose and debootstrap (Debian packages), a Debian mirror
and PyPI; skipped with the reason elsewhere. The podman settings are this module's own
(``CONTAINERS_CONF``): runc, no default ulimits, no pids limit, which also work on hosts where
podman's default runtime does not (a cgroup v1 hybrid). docs/deployment.md has the commands.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.fleets import KEY, MESSAGES, export_chat_model, local_gateway
from tests.processes import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "localhost/pipeshard:test"
SYSTEMD_IMAGE = "localhost/pipeshard-systemd:test"
BASE = "python:3.11-slim"  # the Dockerfile's FROM
MAX_IMAGE_BYTES = 1_200_000_000
CONTAINERS_CONF = """\
[containers]
default_ulimits = []
pids_limit = 0
log_driver = "k8s-file"

[engine]
runtime = "runc"
events_logger = "file"
"""
# The name of this run's containers, networks and compose project.
PREFIX = f"pipeshard-test-{os.getpid()}"


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root: podman builds and runs the containers as root here"
    missing = [
        tool
        for tool in ("podman", "runc", "podman-compose", "debootstrap")
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists()
    ]
    if missing:
        return f"needs {', '.join(missing)}: apt-get install podman runc podman-compose debootstrap"
    return None


if (_reason := _unavailable()) is not None:
    pytest.skip(_reason, allow_module_level=True)


def tool(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    conf = tmp_path_factory.mktemp("podman") / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


@pytest.fixture(scope="module")
def podman(env: dict[str, str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    def run(
        *args: str, check: bool = True, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [tool("podman"), *args], env=env, capture_output=True, text=True, timeout=timeout
        )
        if check:
            assert done.returncode == 0, f"podman {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        return done

    return run


def build_args() -> list[str]:
    """A build that reaches PyPI from the host's network with the host's CA certificates (a
    TLS-inspecting proxy's CA among them), neither of them kept in the image."""
    bundle = Path(os.environ.get("SSL_CERT_FILE", "/etc/ssl/certs/ca-certificates.crt"))
    mounts = ["-v", f"{bundle}:/etc/ssl/certs/ca-certificates.crt:ro"] if bundle.is_file() else []
    return ["build", "--format", "docker", "--network", "host", *mounts]


@pytest.fixture(scope="module")
def image(podman: Callable[..., subprocess.CompletedProcess[str]], env: dict[str, str]) -> str:
    if podman("image", "exists", BASE, check=False).returncode != 0:
        done = subprocess.run(
            ["bash", str(ROOT / "deploy" / "base-image.sh")],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, f"deploy/base-image.sh:\n{done.stderr}"
    podman(*build_args(), "--pull=never", "-t", IMAGE, str(ROOT))
    return IMAGE


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A tiny chat model exported to 2 stages with a draft (compose runs the draft), and the
    greedy answer to MESSAGES of the same export served on this host, in process."""
    _, export = export_chat_model(tmp_path_factory.mktemp("image-model"), draft=True)
    with local_gateway(export, "chat-model") as fleet:
        reply = fleet.client().chat.completions.create(
            model="chat-model",
            messages=MESSAGES,
            max_tokens=16,
            temperature=0,  # type: ignore[arg-type]
        )
    return export, reply.choices[0].message.content or ""


def wait_ready(url: str, logs: Callable[[], str], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} not ready:\n{logs()}"
        time.sleep(0.5)


def greedy(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="chat-model",
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,  # type: ignore[arg-type]
    )
    return reply.choices[0].message.content or ""


def test_the_image_holds_no_torch_and_fits(
    image: str, podman: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    size = int(podman("image", "inspect", image, "--format", "{{.Size}}").stdout)
    assert size <= MAX_IMAGE_BYTES, f"the runtime image is {size / 1e9:.2f} GB"
    probe = (
        "import importlib.util as u; "
        "print([m for m in ('torch', 'optimum', 'nncf', 'torchvision') if u.find_spec(m)])"
    )
    found = podman("run", "--rm", "--entrypoint", "python", image, "-c", probe).stdout
    assert found.strip() == "[]"
    # every installed distribution's requirements are met (a runtime-only install)
    podman("run", "--rm", "--entrypoint", "python", image, "-m", "pip", "check")
    inspected = json.loads(podman("image", "inspect", image).stdout)[0]
    assert inspected["Config"]["User"] == "pipeshard"
    # kept only in the docker image format (`podman build --format docker`)
    assert inspected["Healthcheck"]["Test"] == ["CMD", "pipeshard", "health"]


@pytest.fixture
def network(podman: Callable[..., subprocess.CompletedProcess[str]]) -> Iterator[str]:
    name = f"{PREFIX}-net"
    podman("network", "create", name)
    containers: list[str] = []
    yield name
    for found in podman("ps", "-aq", "--filter", f"network={name}").stdout.split():
        containers.append(found)
    if containers:
        podman("rm", "-f", "-t", "2", *containers, check=False)
    podman("network", "rm", "-f", name, check=False)


def test_stage_and_gateway_containers_serve_and_pass_the_healthcheck(
    image: str,
    tiny: tuple[Path, str],
    network: str,
    podman: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    export, expected = tiny
    mount = ["-v", f"{export}:/models/export:ro"]
    stages = [f"{PREFIX}-stage{k}" for k in (0, 1)]
    for k, name in enumerate(stages):
        podman(
            "run", "-d", "--name", name, "--network", network, *mount,
            "-e", "PIPESHARD_STAGE_SHARDS=/models/export", "-e", f"PIPESHARD_STAGE_STAGE={k}",
            image, "stage",
        )  # fmt: skip
    gateway = f"{PREFIX}-gateway"
    port = free_port()
    podman(
        "run", "-d", "--name", gateway, "--network", network, "-p", f"127.0.0.1:{port}:8000",
        *mount, "-e", f"PIPESHARD_GATEWAY_STAGES={stages[0]}:50051,{stages[1]}:50051",
        "-e", "PIPESHARD_GATEWAY_DRAFT=/models/export/draft",
        "-e", f"PIPESHARD_GATEWAY_API_KEYS={KEY}",
        image, "serve",
    )  # fmt: skip

    def logs() -> str:
        return "\n".join(podman("logs", c, check=False).stderr for c in (*stages, gateway))

    url = f"http://127.0.0.1:{port}"
    wait_ready(url, logs)
    # the same tokens as the export served on this host
    assert greedy(url) == expected
    for container in (*stages, gateway):
        assert podman("healthcheck", "run", container, check=False).returncode == 0, logs()
    # and the check can fail: a stage that does not answer (its process stopped)
    pid = podman("inspect", "--format", "{{.State.Pid}}", stages[1]).stdout.strip()
    os.kill(int(pid), signal.SIGSTOP)
    try:
        assert podman("healthcheck", "run", stages[1], check=False).returncode != 0
    finally:
        os.kill(int(pid), signal.SIGCONT)
    assert podman("healthcheck", "run", stages[1], check=False).returncode == 0


def test_compose_fleet_serves_and_comes_down(
    image: str,
    tiny: tuple[Path, str],
    env: dict[str, str],
    podman: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    """deploy/compose.yaml as shipped, Prometheus included (a local stand-in for its image,
    deploy/prometheus-image.sh, where no registry gives the real one): the fleet serves, every
    container passes its healthcheck, Prometheus scrapes the gateway and both stages, and
    `down` leaves no container and, with -v, no volume."""
    prometheus = str(yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())["services"]
                     ["prometheus"]["image"])  # fmt: skip
    if podman("image", "exists", prometheus, check=False).returncode != 0:
        done = subprocess.run(
            ["bash", str(ROOT / "deploy" / "prometheus-image.sh")],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, f"deploy/prometheus-image.sh:\n{done.stderr}"
    export, expected = tiny
    port, prometheus_port = free_port(), free_port()
    compose_env = {
        **env,
        "PIPESHARD_IMAGE": image,
        "PIPESHARD_EXPORT": str(export),
        "PIPESHARD_PORT": str(port),
        "PROMETHEUS_PORT": str(prometheus_port),
    }
    base = [tool("podman-compose"), "-p", PREFIX, "-f", str(ROOT / "deploy" / "compose.yaml")]

    def compose(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*base, *args], env=compose_env, capture_output=True, text=True, timeout=300
        )

    def project(kind: str) -> list[str]:
        label = f"label=io.podman.compose.project={PREFIX}"
        command = ("ps", "-aq") if kind == "container" else (kind, "ls", "-q")
        return podman(*command, "--filter", label).stdout.split()

    def logs() -> str:
        return "\n".join(podman("logs", c, check=False).stderr for c in project("container"))

    try:
        up = compose("up", "-d")
        # podman-compose 1.0 exits 0 even where a `podman run` failed: count the containers
        assert up.returncode == 0 and len(project("container")) == 4, up.stdout + up.stderr
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, logs)
        assert greedy(url) == expected
        states = {c: podman("healthcheck", "run", c, check=False).returncode
                  for c in project("container")}  # fmt: skip
        assert set(states.values()) == {0}, f"{states}\n{logs()}"
        targets: dict[str, str] = {}
        deadline = time.monotonic() + 90
        while set(targets.values()) != {"up"} or len(targets) != 3:
            assert time.monotonic() < deadline, f"Prometheus's targets: {targets}"
            time.sleep(1)
            with contextlib.suppress(httpx.HTTPError):  # until it listens
                answer = httpx.get(f"http://127.0.0.1:{prometheus_port}/api/v1/targets")
                found = answer.json()["data"]["activeTargets"]
                targets = {t["scrapeUrl"]: t["health"] for t in found}
        assert set(targets) == {
            "http://gateway:8000/metrics",
            "http://stage0:9100/metrics",
            "http://stage1:9100/metrics",
        }
    finally:
        down = compose("down", "-t", "20", "-v")
        # podman-compose 1.0 leaves the project's network behind
        podman("network", "rm", "-f", f"{PREFIX}_default", check=False)
    assert down.returncode == 0, down.stdout + down.stderr
    assert project("container") == []
    assert project("volume") == []


def test_units_under_systemd_as_pid_1(
    image: str,
    tiny: tuple[Path, str],
    tmp_path: Path,
    podman: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    """The units of deploy/systemd, as shipped but for a shorter watchdog, started by systemd
    as PID 1 of a container: `systemctl start` returns once the service is ready (Type=notify),
    the watchdog is fed, and a service that stops feeding it is killed and restarted."""
    export, expected = tiny
    podman(
        *build_args(), "--build-arg", f"IMAGE={image}", "-t", SYSTEMD_IMAGE,
        "-f", str(ROOT / "deploy" / "systemd" / "Containerfile"), str(ROOT / "deploy" / "systemd"),
    )  # fmt: skip
    etc = tmp_path / "etc"
    etc.mkdir()
    for k in (0, 1):
        (etc / f"stage-{k}.env").write_text(
            "PIPESHARD_STAGE_SHARDS=/opt/pipeshard/export\n"
            f"PIPESHARD_STAGE_LISTEN=127.0.0.1:{50051 + k}\n"
            f"PIPESHARD_STAGE_METRICS_PORT={9100 + k}\n"
        )
    (etc / "gateway.env").write_text(
        "PIPESHARD_GATEWAY_STAGES=127.0.0.1:50051,127.0.0.1:50052\n"
        "PIPESHARD_GATEWAY_LISTEN=0.0.0.0:8000\n"  # reached through the published port
        "PIPESHARD_GATEWAY_DRAFT=/opt/pipeshard/export/draft\n"
        f"PIPESHARD_GATEWAY_API_KEYS={KEY}\n"
    )
    for path in etc.iterdir():
        path.chmod(0o644)
    etc.chmod(0o755)
    name = f"{PREFIX}-systemd"
    port = free_port()
    # CAP_SYS_ADMIN: systemd can then build the units' sandbox (ProtectSystem=strict, ...),
    # which it skips silently without it.
    podman(
        "run", "-d", "--name", name, "--systemd=always", "--cap-add", "SYS_ADMIN",
        "-p", f"127.0.0.1:{port}:8000",
        "-v", f"{export}:/opt/pipeshard/export:ro", "-v", f"{etc}:/etc/pipeshard:ro",
        SYSTEMD_IMAGE,
    )  # fmt: skip

    def sh(script: str, check: bool = True) -> str:
        return podman("exec", name, "bash", "-c", script, check=check).stdout

    def show(unit: str, *props: str) -> dict[str, str]:
        lines = sh(f"systemctl show {unit} " + " ".join(f"-p {p}" for p in props)).splitlines()
        return dict(line.split("=", 1) for line in lines)

    try:
        deadline = time.monotonic() + 60
        while sh("systemctl is-system-running", check=False).strip() not in ("running", "degraded"):
            assert time.monotonic() < deadline, sh("systemctl --failed", check=False)
            time.sleep(0.5)
        assert sh("cat /proc/1/comm").strip() == "systemd"
        # a watchdog of 4 s (the units' 60 s would make the test wait minutes)
        sh(
            "for u in pipeshard-stage@.service pipeshard-gateway.service; do "
            "mkdir -p /run/systemd/system/$u.d; "
            "printf '[Service]\\nWatchdogSec=4s\\n' > /run/systemd/system/$u.d/watchdog.conf; "
            "done; systemctl daemon-reload"
        )
        units = ["pipeshard-stage@0", "pipeshard-stage@1", "pipeshard-gateway"]
        for unit in units:
            # Type=notify: start returns once the service said READY=1, with its status line
            started = podman("exec", name, "systemctl", "start", unit, check=False)
            journal = sh(f"journalctl --no-pager -u {unit}", check=False)
            assert started.returncode == 0, started.stderr + journal
            state = show(unit, "ActiveState", "SubState", "StatusText", "Type", "WatchdogUSec")
            assert state["ActiveState"] == "active" and state["SubState"] == "running", state
            assert state["Type"] == "notify" and state["WatchdogUSec"] == "4s"
            assert "serving on " in state["StatusText"], state
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/ready").status_code == 200
        assert greedy(url) == expected
        # the units' sandbox is in place: the system read-only, the cache writable
        pid = show("pipeshard-stage@0", "MainPID")["MainPID"]
        mounts = {
            fields[4]: fields[5].split(",")
            for fields in (line.split() for line in sh(f"cat /proc/{pid}/mountinfo").splitlines())
        }
        assert "ro" in mounts["/"] and "rw" in mounts["/var/cache/pipeshard"], mounts
        # the watchdog is fed: its timestamp moves
        before = show("pipeshard-gateway", "WatchdogTimestampMonotonic")
        deadline = time.monotonic() + 60  # a hang guard: it is fed every 2 s
        while show("pipeshard-gateway", "WatchdogTimestampMonotonic") == before:
            assert time.monotonic() < deadline, "the watchdog was not fed"
            time.sleep(0.5)
        # a gateway that stops feeding it (its process stopped) is killed and restarted
        gateway_pid = show("pipeshard-gateway", "MainPID")["MainPID"]
        sh(f"kill -STOP {gateway_pid}")
        deadline = time.monotonic() + 60
        while show("pipeshard-gateway", "NRestarts")["NRestarts"] == "0":
            assert time.monotonic() < deadline, sh("journalctl --no-pager -u pipeshard-gateway")
            time.sleep(0.5)
        journal = sh("journalctl --no-pager -u pipeshard-gateway")
        assert "Watchdog timeout (limit 4s)!" in journal
        assert "Failed with result 'watchdog'" in journal
        wait_ready(url, lambda: sh("journalctl --no-pager", check=False), timeout=60)
        assert show("pipeshard-gateway", "MainPID")["MainPID"] != gateway_pid
        assert greedy(url) == expected
    finally:
        podman("rm", "-f", "-t", "5", name, check=False)
