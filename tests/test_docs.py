"""The README's configuration and metrics references match what the code defines."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from server.metrics import GatewayMetrics
from server.settings import GatewaySettings
from stage_node.metrics import StageMetrics
from stage_node.settings import StageSettings

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def exposed_names(registry: CollectorRegistry) -> set[str]:
    names = set()
    for metric in registry.collect():
        suffix = "_total" if metric.type == "counter" else ""
        names.add(metric.name + suffix)
    return names


def test_every_stage_setting_is_documented() -> None:
    for field in StageSettings.model_fields:
        env = f"PIPESHARD_STAGE_{field.upper()}"
        flag = "--" + field.replace("_", "-")
        assert f"`{flag}`" in README or env in README, field
        assert env in README or f"_{field.upper()}`" in README, env


def test_every_gateway_setting_is_documented() -> None:
    for field in GatewaySettings.model_fields:
        assert f"| `{field}`" in README, field


def test_every_metric_is_documented() -> None:
    names = exposed_names(GatewayMetrics().registry) | exposed_names(StageMetrics().registry)
    assert len(names) == 30
    for name in names:
        assert f"`{name}`" in README, name
