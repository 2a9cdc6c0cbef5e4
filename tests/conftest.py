"""Shared fixtures: tiny random models and their exports, built once per test session."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from common.telemetry import keep_telemetry_off

keep_telemetry_off()  # as every pipeshard process does, before openvino is imported

from shard_runtime.runner import RunnerOptions  # noqa: E402

# Compile options for exactness tests: f32 compute and an f32 KV cache (the CPU default u8
# cache and dynamic activation quantization would add noise the comparison is not about).
EXACT = RunnerOptions(kv_cache_precision="f32", inference_precision="f32")

ExportFn = Callable[..., Path]

TIERS = ("unit", "component", "integration")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test is in exactly one tier (a ``pytestmark`` of its module, or a mark of its own):
    ``pytest -m unit`` is then the quick loop and no test falls outside every tier."""
    wrong = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            wrong.append(f"{item.nodeid}: {', '.join(tiers) or 'no tier'}")
    if wrong:
        raise pytest.UsageError(
            f"tests need exactly one of the marks {', '.join(TIERS)}:\n" + "\n".join(wrong)
        )


# Tests that skip where the machine lacks root or tools, and that CI (CI=true, as root, after
# `deploy/bootstrap.sh --dev` installed the tools) must run: a skip there fails the run.
MUST_RUN_IN_CI = ("tests/test_hosts.py", "tests/test_image.py")
_must_run_skipped: list[str] = []


def _note_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    if report.skipped and report.nodeid.startswith(MUST_RUN_IN_CI):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        _must_run_skipped.append(f"{report.nodeid}: {reason}")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _note_skip(report)  # a module that skips as a whole (tests/test_image.py without podman)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _note_skip(report)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under CI as root a skipped lab or image test fails the run: it would hide that the
    link-cut or container tests never ran. Elsewhere they skip and say why (`-rs`)."""
    if not _must_run_skipped or os.environ.get("CI") != "true" or os.geteuid() != 0:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", "skipped under CI as root, where they must run", red=True)
        for line in _must_run_skipped:
            reporter.write_line(line)
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    from testing_support.tiny_models import make_model

    made: dict[tuple[str, int, int], Path] = {}

    def get(arch: str, seed: int = 0, vocab: int = 256) -> Path:
        key = (arch, seed, vocab)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"{arch}-{seed}-{vocab}")
            made[key] = make_model(arch, folder, seed=seed, vocab=vocab)
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny_export(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Callable[..., Path]
) -> ExportFn:
    """Export a tiny model once per (arch, stages, weights, beam_idx, split) and reuse it
    (``split``: layers per stage, fractions cutting inside an MLP; ``stages`` must agree)."""
    from exporter.export import ExportOptions, export_model
    from protos.manifest import WeightSpec

    made: dict[tuple[str, int, str, bool, tuple[float, ...] | None], Path] = {}

    def get(
        arch: str,
        stages: int,
        weights: str = "fp32",
        beam_idx: bool = True,
        split: tuple[float, ...] | None = None,
    ) -> Path:
        key = (arch, stages, weights, beam_idx, split)
        if key not in made:
            name = f"{arch}-{stages}-{weights}-{beam_idx}" + ("-cut" if split else "")
            out = tmp_path_factory.mktemp("exports") / name
            spec = WeightSpec(
                format=weights,  # type: ignore[arg-type]
                group_size=32 if weights == "int4" else None,
                symmetric=False if weights == "int4" else None,
            )
            export_model(
                ExportOptions(
                    model=str(tiny_model(arch)),
                    out=out,
                    stages=stages,
                    split=list(split) if split else None,
                    weights=spec,
                    beam_idx=beam_idx,
                    quiet=True,
                )
            )
            made[key] = out
        return made[key]

    return get


def make_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A throw-away CA and a server certificate for 127.0.0.1/localhost, made with openssl:
    (CA bundle, certificate, key)."""
    ca_key, ca, key, csr, cert = (
        folder / n for n in ("ca.key", "ca.pem", "s.key", "s.csr", "s.pem")
    )
    folder.mkdir(parents=True, exist_ok=True)
    ext = folder / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run = lambda *args: subprocess.run(["openssl", *args], check=True, capture_output=True)  # noqa: E731
    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
        "-days",
        "1",
        "-subj",
        "/CN=pipeshard test CA",
    )
    run(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(key),
        "-out",
        str(csr),
        "-subj",
        "/CN=localhost",
    )
    run(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-out",
        str(cert),
        "-days",
        "1",
        "-extfile",
        str(ext),
    )
    return ca, cert, key
