"""Deployment files: systemd units, env examples, compose, Prometheus, Grafana, Dockerfile.

No Docker engine or systemd PID 1 is needed: units are checked with `systemd-analyze verify`
(offline), the rest is parsed and compared with what the code really reads and registers.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import shutil
import socket
import ssl
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from server.metrics import GatewayMetrics
from server.settings import GatewaySettings
from stage_node.metrics import StageMetrics
from stage_node.settings import StageSettings
from tests.conftest import make_certificates
from tests.processes import PIPESHARD

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SYSTEMD = DEPLOY / "systemd"
INSTALLED_BINARY = "/opt/pipeshard/.venv/bin/pipeshard"
STAGE_UNIT = SYSTEMD / "pipeshard-stage@.service"
GATEWAY_UNIT = SYSTEMD / "pipeshard-gateway.service"
STAGE_ENV = SYSTEMD / "stage.env.example"
GATEWAY_ENV = SYSTEMD / "gateway.env.example"

# unit file, instance file name to verify, env file the unit names, its example
UNITS = {
    "stage": (STAGE_UNIT, "pipeshard-stage@0.service", "/etc/pipeshard/stage-%i.env", STAGE_ENV),
    "gateway": (
        GATEWAY_UNIT,
        "pipeshard-gateway.service",
        "/etc/pipeshard/gateway.env",
        GATEWAY_ENV,
    ),
}


# --- helpers --------------------------------------------------------------------------------


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values in order]}} (keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None, f"key outside a section: {line}"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def env_file_values(path: Path) -> dict[str, str]:
    """The assignments of an env file that are in effect (uncommented lines)."""
    values = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: not KEY=VALUE: {raw!r}"
            values[key.strip()] = value.strip()
    return values


def env_names(settings: type[Any], prefix: str) -> set[str]:
    return {prefix + name.upper() for name in settings.model_fields}


STAGE_VARS = env_names(StageSettings, "PIPESHARD_STAGE_")
GATEWAY_VARS = env_names(GatewaySettings, "PIPESHARD_GATEWAY_")


def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None and Path("/usr/bin/systemd-analyze").exists():
        path = "/usr/bin/systemd-analyze"
    if path is None:
        pytest.fail(
            "systemd-analyze not found: install Debian's `systemd` package "
            "(apt-get install systemd) to verify the units in deploy/systemd/"
        )
    return path


def unit_for_tests(unit: Path, name: str, env_file: str, example: Path, tmp_path: Path) -> Path:
    """Copy a unit into tmp_path with what cannot exist on a test machine pointed at what does:
    the installed binary -> this venv's `pipeshard`, User/Group -> the current ones, the env
    file -> a copy of the example. Everything else is verified as written."""
    text = unit.read_text()
    binary = Path(sys.executable).parent / "pipeshard"
    assert binary.is_file(), f"{binary} missing: install the project (deploy/bootstrap.sh)"
    assert INSTALLED_BINARY in text
    assert f"EnvironmentFile={env_file}\n" in text
    assert "User=pipeshard\n" in text and "Group=pipeshard\n" in text
    env_copy = tmp_path / example.name
    shutil.copy(example, env_copy)
    text = text.replace(INSTALLED_BINARY, str(binary))
    text = text.replace(f"EnvironmentFile={env_file}\n", f"EnvironmentFile={env_copy}\n")
    text = text.replace("User=pipeshard\n", f"User={pwd.getpwuid(os.getuid()).pw_name}\n")
    text = text.replace("Group=pipeshard\n", f"Group={grp.getgrgid(os.getgid()).gr_name}\n")
    out = tmp_path / "units" / name
    out.parent.mkdir(exist_ok=True)
    out.write_text(text)
    return out


PROBLEM = re.compile(
    r"unknown|invalid|failed|ignoring|not executable|bad message|deprecated|missing", re.I
)


def verify_problems(unit: Path) -> list[str]:
    """`systemd-analyze verify` of one unit file: its non-zero exit status and every warning
    about this unit (systemd prints most mistakes, e.g. an unknown key, with status 0)."""
    proc = subprocess.run(
        [systemd_analyze(), "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    problems = [line for line in output.splitlines() if unit.name in line and PROBLEM.search(line)]
    if proc.returncode != 0:
        problems.append(f"exit status {proc.returncode}: {output.strip()}")
    return problems


def exposed_metric_names(registry: Any) -> set[str]:
    """Sample names prometheus_client exposes for a registry's metric families."""
    names: set[str] = set()
    for family in registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def service_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def load_compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def load_prometheus() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "prometheus.yml").read_text())


def scrape_targets(config: dict[str, Any], job: str) -> set[str]:
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert job in jobs, f"no scrape job {job!r} in prometheus.yml"
    assert jobs[job].get("metrics_path", "/metrics") == "/metrics"
    return {t for sc in jobs[job]["static_configs"] for t in sc["targets"]}


def dockerfile_stages() -> list[dict[str, Any]]:
    """The Dockerfile as stages: {name, base, instructions: [(KEYWORD, arguments)]}."""
    text = (ROOT / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    logical = re.sub(r"\\\n\s*", " ", "\n".join(lines)).splitlines()
    stages: list[dict[str, Any]] = []
    for line in logical:
        if not line.strip():
            continue
        keyword, _, args = line.strip().partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            stages.append({"name": name, "base": parts[0], "instructions": []})
        else:
            assert stages, f"instruction before FROM: {line}"
            stages[-1]["instructions"].append((keyword, args.strip()))
    return stages


def stage_chain(stages: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The stage `name` and the stages it is built FROM, down to the external image."""
    by_name = {s["name"]: s for s in stages}
    chain = [by_name[name]]
    while chain[-1]["base"] in by_name:
        chain.append(by_name[chain[-1]["base"]])
    return chain


# --- (a) systemd units ----------------------------------------------------------------------


@pytest.mark.component
@pytest.mark.parametrize("role", sorted(UNITS))
def test_unit_passes_systemd_analyze_verify(role: str, tmp_path: Path) -> None:
    unit, name, env_file, example = UNITS[role]
    assert verify_problems(unit_for_tests(unit, name, env_file, example, tmp_path)) == []


@pytest.mark.component
@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("Restart=on-failure", "Restart=sometimes"),  # bad value: status 0, a warning
        ("NoNewPrivileges=yes", "NoNewPrivilege=yes"),  # unknown key: status 0, a warning
        ("[Service]", "[Service"),  # syntax error: non-zero status
    ],
)
def test_verify_catches_a_broken_unit(old: str, new: str, tmp_path: Path) -> None:
    unit, name, env_file, example = UNITS["stage"]
    good = unit_for_tests(unit, name, env_file, example, tmp_path)
    assert old in good.read_text()
    good.write_text(good.read_text().replace(old, new, 1))
    assert verify_problems(good), f"systemd-analyze verify did not notice {old!r} -> {new!r}"


@pytest.mark.unit
@pytest.mark.parametrize("role", sorted(UNITS))
def test_unit_settings(role: str) -> None:
    unit, _, env_file, _ = UNITS[role]
    sections = parse_unit(unit.read_text())
    u, s = sections["Unit"], sections["Service"]
    assert "network-online.target" in " ".join(u["After"])
    assert "network-online.target" in " ".join(u["Wants"])
    assert sections["Install"]["WantedBy"] == ["multi-user.target"]
    assert s["User"] == ["pipeshard"] and s["Group"] == ["pipeshard"]
    assert s["EnvironmentFile"] == [env_file]
    command = "stage" if role == "stage" else "serve"
    # No flags: every setting comes from the environment.
    assert s["ExecStart"] == [f"{INSTALLED_BINARY} {command}"]
    assert s["Restart"] == ["on-failure"] and s["RestartSec"]
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
    }.items():
        assert s[key] == [value], key
    assert "/var/cache/pipeshard" in s["ReadWritePaths"]
    assert s["LimitNOFILE"] and s["TasksMax"]


@pytest.mark.unit
def test_stage_unit_points_the_openvino_cache_at_var_cache() -> None:
    service = parse_unit(STAGE_UNIT.read_text())["Service"]
    env = dict(v.partition("=")[::2] for v in service["Environment"])
    assert env["PIPESHARD_STAGE_OV_CACHE_DIR"] == "/var/cache/pipeshard/ov-cache"
    assert env["PIPESHARD_STAGE_STAGE"] == "%i"


# --- (e) env examples -----------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    ("example", "names", "prefix"),
    [
        (STAGE_ENV, STAGE_VARS, "PIPESHARD_STAGE_"),
        (GATEWAY_ENV, GATEWAY_VARS, "PIPESHARD_GATEWAY_"),
    ],
)
def test_env_example_lists_every_setting(example: Path, names: set[str], prefix: str) -> None:
    text = example.read_text()
    assigned = set(re.findall(rf"^#?({prefix}[A-Z0-9_]+)=", text, re.M))
    assert names - assigned == set(), f"{example.name} misses settings"
    assert assigned - names == set(), f"{example.name} sets variables no setting reads"


def _clean_env(monkeypatch: pytest.MonkeyPatch, values: dict[str, str]) -> None:
    for key in list(os.environ):
        if key.startswith("PIPESHARD_"):
            monkeypatch.delenv(key)
    for key, value in values.items():
        monkeypatch.setenv(key, value)


@pytest.mark.unit
def test_stage_unit_environment_makes_valid_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the stage unit hands `pipeshard stage` (its Environment= for instance 1, then the
    example env file) validates, and the instance name is the stage index."""
    service = parse_unit(STAGE_UNIT.read_text())["Service"]
    env = dict(v.replace("%i", "1").partition("=")[::2] for v in service["Environment"])
    env.update(env_file_values(STAGE_ENV))
    _clean_env(monkeypatch, env)
    settings = StageSettings()  # type: ignore[call-arg]
    assert settings.stage == 1
    assert settings.ov_cache_dir == Path("/var/cache/pipeshard/ov-cache")
    assert settings.listen.startswith("0.0.0.0:")


@pytest.mark.unit
def test_gateway_env_example_makes_valid_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_env(monkeypatch, env_file_values(GATEWAY_ENV))
    settings = GatewaySettings.load()
    assert len(settings.stages) >= 2


@pytest.mark.unit
def test_commands_without_flags_parse() -> None:
    from pipeshard.cli import build_parser

    for command in ("stage", "serve"):
        assert build_parser().parse_args([command]).command == command


# --- (b) compose and (c) Prometheus ---------------------------------------------------------


@pytest.mark.component
def test_compose_file_passes_docker_compose_config(tmp_path: Path) -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail(
            "docker-compose not found: install Debian's `docker-compose` package "
            "(`deploy/bootstrap.sh --dev` does as root); `config` needs no Docker engine"
        )
    env = {**os.environ, "PIPESHARD_EXPORT": str(tmp_path)}

    def config(path: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [binary, "-f", str(path), "config"], env=env, capture_output=True, text=True
        )

    done = config(DEPLOY / "compose.yaml")
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)
    assert set(resolved["services"]) == {"stage0", "stage1", "gateway", "prometheus"}
    mounts = resolved["services"]["gateway"]["volumes"]
    assert any(m.get("source") == str(tmp_path) and m.get("read_only") for m in mounts)
    # and it does reject a broken file
    broken = tmp_path / "compose.yaml"
    text = (DEPLOY / "compose.yaml").read_text()
    broken.write_text(text.replace("    restart: unless-stopped\n", "    restart: [1, 2]\n", 1))
    (tmp_path / "prometheus.yml").write_text("")
    assert config(broken).returncode != 0


@pytest.mark.unit
def test_compose_services() -> None:
    services = load_compose()["services"]
    assert set(services) == {"stage0", "stage1", "gateway", "prometheus"}
    for name, index in (("stage0", 0), ("stage1", 1)):
        stage = services[name]
        assert stage["command"] in (["stage"], "stage")
        env = service_env(stage)
        assert set(env) <= STAGE_VARS, f"{name}: unknown variables {set(env) - STAGE_VARS}"
        assert env["PIPESHARD_STAGE_STAGE"] == str(index)
        assert env["PIPESHARD_STAGE_LISTEN"] == "0.0.0.0:50051"
        assert env["PIPESHARD_STAGE_METRICS_PORT"].isdigit()
        targets = [
            v["target"] if isinstance(v, dict) else v.split(":")[1] for v in stage["volumes"]
        ]
        assert env["PIPESHARD_STAGE_SHARDS"] == "/models/export"
        assert "/models/export" in targets, f"{name}: the export folder is not mounted"
        assert "healthcheck" in stage and "test" not in stage["healthcheck"]  # the image's
    gateway = services["gateway"]
    assert gateway["command"] in (["serve"], "serve")
    env = service_env(gateway)
    assert set(env) <= GATEWAY_VARS, f"gateway: unknown variables {set(env) - GATEWAY_VARS}"
    assert env["PIPESHARD_GATEWAY_STAGES"] == "stage0:50051,stage1:50051"
    for address in env["PIPESHARD_GATEWAY_STAGES"].split(","):
        host, _, port = address.partition(":")
        assert port_of(service_env(services[host])["PIPESHARD_STAGE_LISTEN"]) == int(port)
    assert "${PIPESHARD_PORT:-8000}:8000" in [str(p) for p in gateway["ports"]]
    assert port_of(env["PIPESHARD_GATEWAY_LISTEN"]) == 8000
    # the image's HEALTHCHECK (test_dockerfile_healthcheck_works_for_both_roles), which
    # follows the listen port and TLS; compose sets only its timing
    assert "healthcheck" in gateway and "test" not in gateway["healthcheck"]
    prometheus = services["prometheus"]
    assert prometheus["image"].startswith("docker.io/prom/prometheus")  # podman: no short names
    mounts = [v for v in prometheus["volumes"] if str(v).startswith("./prometheus.yml:")]
    assert mounts, "prometheus does not mount ./prometheus.yml"
    assert (DEPLOY / "prometheus.yml").is_file()


@pytest.mark.unit
def test_prometheus_scrapes_the_gateway_and_both_stages() -> None:
    config = load_prometheus()
    services = load_compose()["services"]
    gateway_port = port_of(service_env(services["gateway"])["PIPESHARD_GATEWAY_LISTEN"])
    assert scrape_targets(config, "pipeshard-gateway") == {f"gateway:{gateway_port}"}
    stage_targets = {
        f"{name}:{service_env(services[name])['PIPESHARD_STAGE_METRICS_PORT']}"
        for name in ("stage0", "stage1")
    }
    assert scrape_targets(config, "pipeshard-stage") == stage_targets


# --- (d) Grafana ----------------------------------------------------------------------------


def _exprs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for v in node.values() for e in _exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in _exprs(v)]
    return []


@pytest.mark.unit
def test_grafana_dashboard_uses_only_registered_metrics() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "pipeshard-dashboard.json").read_text())
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["panels"]
    registered = exposed_metric_names(GatewayMetrics().registry) | exposed_metric_names(
        StageMetrics().registry
    )
    exprs = _exprs(dashboard)
    used = {name for expr in exprs for name in re.findall(r"\bpipeshard_[a-z0-9_]+", expr)}
    assert used - registered == set(), "the dashboard queries metrics nobody registers"
    for wanted in (
        "pipeshard_gateway_generated_tokens_total",
        "pipeshard_gateway_time_to_first_token_seconds_bucket",
        "pipeshard_gateway_inter_token_latency_seconds_bucket",
        "pipeshard_gateway_requests_running",
        "pipeshard_gateway_requests_queued",
        "pipeshard_stage_forward_seconds_bucket",
        "pipeshard_stage_sessions",
    ):
        assert wanted in used, f"no panel shows {wanted}"
    quantiles = " ".join(e for e in exprs if "histogram_quantile" in e)
    assert "histogram_quantile(0.5," in quantiles and "histogram_quantile(0.95," in quantiles
    assert "phase" in " ".join(e for e in exprs if "pipeshard_stage_forward_seconds" in e)


# --- (f) Dockerfile -------------------------------------------------------------------------


@pytest.mark.unit
def test_dockerfile_runtime_target() -> None:
    stages = dockerfile_stages()
    assert stages[-1]["name"] == "runtime", "runtime must be the last (default) target"
    chain = stage_chain(stages, "runtime")
    assert chain[-1]["base"].startswith("python:3.11-slim")
    instructions = [i for stage in reversed(chain) for i in stage["instructions"]]
    runs = " ".join(args for keyword, args in instructions if keyword in ("RUN", "ENV", "ARG"))
    assert "pip install" in runs and "/wheels/" in runs
    assert "torch" not in runs.lower() and "[export]" not in runs, "runtime installs torch"
    users = [args for keyword, args in instructions if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "runtime runs as root"
    assert any(keyword == "HEALTHCHECK" for keyword, _ in instructions)
    entrypoint = [json.loads(a) for k, a in instructions if k == "ENTRYPOINT"]
    assert entrypoint and entrypoint[-1] == ["pipeshard"]
    by_name = {s["name"]: s for s in stages}
    builder_runs = " ".join(a for k, a in by_name["builder"]["instructions"] if k == "RUN")
    assert "pip wheel" in builder_runs and "--no-deps" in builder_runs


@pytest.mark.unit
def test_dockerfile_builds_every_runtime_package() -> None:
    """The wheel the image installs holds every package pyproject ships but the benchmarks
    (the command line `pipeshard` is one of them)."""
    import tomllib

    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {p.rstrip("*") for p in found["packages"]["find"]["include"]} - {"benchmarks"}
    by_name = {s["name"]: s for s in dockerfile_stages()}
    copied = {
        args.split()[0] for keyword, args in by_name["builder"]["instructions"] if keyword == "COPY"
    }
    assert packages and packages <= copied, f"the image's wheel lacks {packages - copied}"


@pytest.mark.unit
def test_dockerfile_export_target() -> None:
    stages = dockerfile_stages()
    chain = stage_chain(stages, "export")
    runs = " ".join(a for s in chain for k, a in s["instructions"] if k == "RUN")
    assert "[export]" in runs and "pip uninstall -y torchvision" in runs
    assert chain[-1]["base"].startswith("python:3.11-slim")


@pytest.mark.unit
def test_dockerignore() -> None:
    entries = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "exports", "benchmarks/out"} <= entries


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}')

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.integration
def test_dockerfile_healthcheck_works_for_both_roles(tmp_path: Path) -> None:
    """Run the HEALTHCHECK command (`pipeshard health`), with PID 1's command line taken from a
    file. A stage must answer its gRPC Health call: a bare TCP listener on its port is not
    healthy (tests/test_health.py checks real stages, secrets, TLS and a stopped stage)."""
    stages = dockerfile_stages()
    instructions = [i for s in stage_chain(stages, "runtime") for i in s["instructions"]]
    check = next(args for keyword, args in instructions if keyword == "HEALTHCHECK")
    argv = json.loads(check[check.index("CMD") + 3 :])
    assert argv == ["pipeshard", "health"]
    cmdline = tmp_path / "cmdline"

    def healthy(role: str, env: dict[str, str]) -> bool:
        cmdline.write_text(f"/opt/pipeshard/.venv/bin/pipeshard\0{role}\0--log-level\0INFO\0")
        clean = {k: v for k, v in os.environ.items() if not k.startswith("PIPESHARD_")}
        proc = subprocess.run(
            [PIPESHARD, *argv[1:], "--cmdline", str(cmdline), "--timeout", "2"],
            env=clean | env,
            capture_output=True,
            timeout=30,
        )
        return proc.returncode == 0

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        stage_env = {"PIPESHARD_STAGE_LISTEN": f"0.0.0.0:{port}"}
        assert not healthy("stage", stage_env)  # accepts TCP, answers no gRPC

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        gateway_env = {
            "PIPESHARD_GATEWAY_LISTEN": f"0.0.0.0:{server.server_address[1]}",
            "PIPESHARD_STAGE_LISTEN": f"0.0.0.0:{port}",
        }
        assert healthy("serve", gateway_env)
        assert not healthy("stage", gateway_env)  # same env, stage role: checks the stage port
        # a gateway serving HTTPS (its certificate in the environment) is checked over HTTPS
        assert not healthy("serve", gateway_env | {"PIPESHARD_GATEWAY_TLS_CERT": "/x.pem"})
    finally:
        server.shutdown()
        server.server_close()

    _, cert, key = make_certificates(tmp_path / "tls")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        https_env = {
            "PIPESHARD_GATEWAY_LISTEN": f"0.0.0.0:{server.server_address[1]}",
            "PIPESHARD_GATEWAY_TLS_CERT": str(cert),
        }
        assert healthy("serve", https_env)
        assert not healthy(
            "serve", {"PIPESHARD_GATEWAY_LISTEN": https_env["PIPESHARD_GATEWAY_LISTEN"]}
        )
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.component
def test_a_skipped_image_test_fails_the_run_under_ci_as_root() -> None:
    """tests/conftest.py: the container-image tests skip, saying why, where podman is missing
    (here: a PATH without it); under CI=true as root that skip fails the run, elsewhere the
    run only reports it (pytest's status for nothing run, 5)."""

    def run(**env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
             "tests/test_image.py"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PATH": str(Path(sys.executable).parent), **env},
            timeout=300,
        )  # fmt: skip

    ci = run(CI="true")
    assert "SKIPPED [1] tests/test_image.py" in ci.stdout and "needs " in ci.stdout, ci.stdout
    if os.geteuid() == 0:
        assert ci.returncode == 1, ci.stdout
        assert "skipped under CI as root, where they must run" in ci.stdout
    else:  # not root: the image tests cannot run here, CI or not
        assert ci.returncode == 5, ci.stdout
    plain = run(CI="")
    assert plain.returncode == 5, plain.stdout
    assert "must run" not in plain.stdout
