"""Every setting has one source: its default is stated once, and the scheduler, the command
line's help and `pipeshard up` read it from there, so they cannot drift apart."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from common.net import split_listen
from pipeshard.arguments import show_default
from pipeshard.cli import build_parser
from pipeshard.fleet import FleetOptions
from server.engine.scheduler import SchedulerConfig
from server.settings import GatewaySettings
from stage_node.settings import StageSettings

pytestmark = pytest.mark.unit

# A number stated as a default in help text, e.g. "(64)", "(default 300)", "(1; ...)".
STATED_NUMBER = re.compile(r"\((?:default )?-?\d[\d.]*[;)]")


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_the_scheduler_defaults_are_the_served_ones() -> None:
    """The scheduler an engine builds without a config is the one `pipeshard serve` builds
    from its default settings, field for field."""
    served = GatewaySettings(stages=["127.0.0.1:1"]).scheduler_config()
    assert served == SchedulerConfig(), [
        (f.name, getattr(served, f.name), getattr(SchedulerConfig(), f.name))
        for f in dataclasses.fields(SchedulerConfig)
        if getattr(served, f.name) != getattr(SchedulerConfig(), f.name)
    ]


@pytest.mark.parametrize("command", ["stage", "serve", "up", "health"])
def test_help_takes_the_defaults_from_the_settings(command: str) -> None:
    """No flag's help states a number as its default; it names the setting's ({default}),
    which the help shows as the settings class holds it."""
    parser = _commands()[command]
    text = " ".join(parser.format_help().split())
    placeholders = 0
    for action in parser._actions:
        raw = action.help or ""
        assert not STATED_NUMBER.search(raw), (action.dest, raw)
        placeholders += "{default}" in raw
    assert placeholders
    assert not re.search(r"\{\w+\}", text)  # every one filled in


def test_serve_help_shows_the_served_defaults() -> None:
    text = " ".join(_commands()["serve"].format_help().split())
    settings = GatewaySettings(stages=["127.0.0.1:1"])
    assert f"beyond it 429 ({settings.max_queued})" in text
    assert f"may wait ({show_default(settings.queue_timeout)})" in text
    assert f"(default {settings.listen})" in text


def test_up_starts_the_services_with_their_own_defaults() -> None:
    """`pipeshard up` differs from `serve` and `stage` only where it says why (one
    micro-batch group on shared cores): the rest are the services' defaults."""
    fleet = FleetOptions()
    gateway = GatewaySettings(stages=["127.0.0.1:1"])
    stage = StageSettings(shards=".", stage=0)  # type: ignore[arg-type]
    assert (fleet.host, fleet.port) == split_listen(gateway.listen)
    assert fleet.stage_port == split_listen(stage.listen)[1]
    assert (fleet.threads, fleet.kv_backend) == (stage.threads, stage.kv_backend)
    assert (fleet.batching, fleet.speculation_max_users) == (
        gateway.batching,
        gateway.speculation_max_users,
    )


def test_runner_options_come_from_the_settings_of_each_role() -> None:
    """The stage, `pipeshard verify` and the gateway's draft build their RunnerOptions in one
    place (RunnerOptions.from_settings): the stage's and verify's defaults are its defaults."""
    from pipeshard.cli import _runner_options
    from shard_runtime.runner import RunnerOptions

    stage = StageSettings(shards=".", stage=0)  # type: ignore[arg-type]
    assert RunnerOptions.from_settings(stage) == RunnerOptions(cache_dir=stage.ov_cache_dir)
    pinned = StageSettings(
        shards=".",  # type: ignore[arg-type]
        stage=0,
        threads=2,
        max_sessions=3,
        streams=2,
        batch_invariant=False,
        kv_cache_precision="u8",
        ov_properties={"KEY": "1"},
    )
    assert RunnerOptions.from_settings(pinned) == RunnerOptions(
        threads=2,
        max_sessions=3,
        streams=2,
        batch_invariant=False,
        kv_cache_precision="u8",
        cache_dir=stage.ov_cache_dir,
        properties={"KEY": "1"},
    )
    verify = build_parser().parse_args(["verify", "export"])
    assert _runner_options(verify) == RunnerOptions()
    verify = build_parser().parse_args(
        ["verify", "export", "--device", "GPU", "--threads", "2", "--ov-property", "A=b"]
    )
    assert _runner_options(verify) == RunnerOptions(device="GPU", threads=2, properties={"A": "b"})
    gateway = GatewaySettings(
        stages=["127.0.0.1:1"], draft_device="GPU", draft_threads=3, max_concurrent=2
    )
    assert gateway.draft_runner_options() == RunnerOptions(
        device="GPU", threads=3, max_sessions=8, cache_dir=gateway.ov_cache_dir
    )


def test_the_python_floor_is_the_same_for_pip_ruff_and_mypy() -> None:
    """requires-python is what the code needs (3.11: builtin TimeoutError from asyncio), and
    the linters check the code for that version, not another."""
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    floor = pyproject["project"]["requires-python"]
    assert floor == ">=3.11"
    major, minor = floor.removeprefix(">=").split(".")
    assert pyproject["tool"]["ruff"]["target-version"] == f"py{major}{minor}"
    assert pyproject["tool"]["mypy"]["python_version"] == f"{major}.{minor}"


def test_the_version_is_stated_once() -> None:
    """pyproject.toml states the version; the package, the gateway's OpenAPI document and the
    stages' Info reply read it, and no source file repeats it."""
    import tomllib
    from pathlib import Path

    import pipeshard
    import stage_node.service
    from common.version import VERSION
    from server.api.app import create_app

    root = Path(__file__).parents[1]
    stated = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    assert VERSION == stated == pipeshard.__version__ == stage_node.service.VERSION
    assert create_app(GatewaySettings(stages=["127.0.0.1:1"])).version == VERSION
    repeated = [
        str(path.relative_to(root))
        for folder in ("pipeshard", "common", "server", "stage_node", "shard_runtime", "exporter")
        for path in (root / folder).rglob("*.py")
        if f'"{VERSION}"' in path.read_text()
    ]
    assert not repeated
