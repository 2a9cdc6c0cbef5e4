"""The documentation matches the code: settings, command-line flags, metrics and links.

docs/configuration.md is generated from the settings classes by docs/generate_configuration.py
and must be what it writes now; docs/metrics.md lists every metric the gateway and the stages
register; every relative link of README.md and docs/*.md points to a file (and heading) that
exists; the README links to every page under docs/ and holds CI's test command.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
from prometheus_client import CollectorRegistry

from server.metrics import GatewayMetrics
from server.settings import GatewaySettings
from stage_node.metrics import StageMetrics
from stage_node.settings import StageSettings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
CONFIGURATION = DOCS / "configuration.md"
METRICS = DOCS / "metrics.md"
# Written by someone else; the README and the index link to it before it exists.
MAY_BE_MISSING = {DOCS / "benchmarks.md"}

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "generate_configuration", DOCS / "generate_configuration.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exposed_names(registry: CollectorRegistry) -> set[str]:
    names = set()
    for metric in registry.collect():
        suffix = "_total" if metric.type == "counter" else ""
        names.add(metric.name + suffix)
    return names


def pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [README, *sorted(DOCS.glob("*.md"))]


def without_code(text: str) -> str:
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to -."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for heading in HEADING.findall(without_code(path.read_text())):
        base = slug(heading)
        name, n = base, 0
        while name in found:  # GitHub numbers repeated headings: x, x-1, x-2
            n += 1
            name = f"{base}-{n}"
        found.add(name)
    return found


def cli_subcommands() -> dict[str, argparse.ArgumentParser]:
    """The `pipeshard` subcommands' parsers."""
    from pipeshard.cli import build_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("`pipeshard` has no subcommands")


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings} - {"-h", "--help"}


def config_sections() -> dict[str, str]:
    """docs/configuration.md's stage and gateway sections."""
    text = CONFIGURATION.read_text()
    stage_at = text.index("## `pipeshard stage`")
    gateway_at = text.index("## `pipeshard serve`")
    return {"stage": text[stage_at:gateway_at], "gateway": text[gateway_at:]}


# --- configuration ---------------------------------------------------------------------------


def test_configuration_page_is_generated_from_the_code() -> None:
    assert CONFIGURATION.read_text() == generator().render(), (
        "docs/configuration.md is out of date: run .venv/bin/python docs/generate_configuration.py"
    )


def test_every_stage_setting_is_documented() -> None:
    section = config_sections()["stage"]
    flag = generator().flag
    for field in StageSettings.model_fields:
        assert f"| `{field}` | `{flag('stage', field)}` |" in section, field
        assert f"`PIPESHARD_STAGE_{field.upper()}`" in section, field


def test_every_gateway_setting_is_documented() -> None:
    section = config_sections()["gateway"]
    flag = generator().flag
    for field in GatewaySettings.model_fields:
        assert f"| `{field}` | `{flag('gateway', field)}` |" in section, field
        assert f"`PIPESHARD_GATEWAY_{field.upper()}`" in section, field


def test_documented_flags_are_the_command_lines() -> None:
    """Every flag the page gives a setting exists, and every flag of `pipeshard stage` and
    `pipeshard serve` is on the page."""
    commands = cli_subcommands()
    gen = generator()
    text = CONFIGURATION.read_text()
    for role, command, settings in (
        ("stage", "stage", StageSettings),
        ("gateway", "serve", GatewaySettings),
    ):
        options = option_strings(commands[command])
        for field in settings.model_fields:
            for name in gen.flag_names(role, field):
                assert name in options, f"{field}: `pipeshard {command}` has no {name}"
        for name in options:
            assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), (
                f"`pipeshard {command} {name}` is not in docs/configuration.md"
            )


# --- metrics ---------------------------------------------------------------------------------


def test_every_metric_is_documented() -> None:
    names = exposed_names(GatewayMetrics().registry) | exposed_names(StageMetrics().registry)
    assert len(names) == 36
    text = METRICS.read_text()
    for name in names:
        assert f"| `{name}` |" in text, name
    documented = set(re.findall(r"^\| `(pipeshard_\w+)` \|", text, re.MULTILINE))
    assert documented == names, f"documented but not registered: {documented - names}"


# --- links -----------------------------------------------------------------------------------


def test_readme_links_every_docs_page() -> None:
    targets = {
        (README.parent / t.split("#")[0]).resolve() for t in LINK.findall(README.read_text())
    }
    for page in sorted(DOCS.glob("*.md")):
        assert page.resolve() in targets, f"README.md does not link {page.relative_to(ROOT)}"


def test_relative_links_point_to_existing_files() -> None:
    problems = []
    for page in pages():
        for target in LINK.findall(without_code(page.read_text())):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            path_part, _, anchor = target.partition("#")
            path = (page.parent / path_part).resolve() if path_part else page.resolve()
            where = f"{page.relative_to(ROOT)}: {target}"
            if not path.exists():
                if path not in MAY_BE_MISSING:
                    problems.append(f"{where}: no such file")
                continue
            if anchor and path.suffix == ".md" and anchor not in anchors(path):
                problems.append(f"{where}: no such heading")
    assert not problems, "\n".join(problems)


def test_readme_holds_the_ci_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = next(line for line in ci if line.startswith("bash deploy/bootstrap.sh"))
    assert command in README.read_text().splitlines()
