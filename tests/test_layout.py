"""The test suite's own layout: shared fixtures and helpers live in ``conftest.py`` and helper
modules (``fleets``, ``clients``, ``processes``), never in a test module that others import;
the shipped packages never import the test suite."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
SHIPPED = ("pipeshard", "common", "shard_runtime", "server", "stage_node", "protos", "exporter")


def imports(path: Path) -> Iterator[tuple[str, int]]:
    """Every module ``path`` imports (lazy ones inside functions too), with its line."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, node.lineno
            yield from ((f"{node.module}.{alias.name}", node.lineno) for alias in node.names)


def test_no_test_module_imports_another() -> None:
    broken = [
        f"tests/{path.name}:{line} imports {name}"
        for path in sorted(TESTS.glob("test_*.py"))
        for name, line in imports(path)
        if name.split(".")[0] == "tests" and any(p.startswith("test_") for p in name.split("."))
    ]
    assert broken == []


def test_the_shipped_packages_and_the_benchmarks_never_import_the_tests() -> None:
    broken = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for package in (*SHIPPED, "benchmarks")
        for path in sorted((ROOT / package).rglob("*.py"))
        for name, line in imports(path)
        if name.split(".")[0] == "tests"
    ]
    assert broken == []


def test_the_checks_above_see_an_import_of_a_test_module(tmp_path: Path) -> None:
    """A guard for the reader: top-level and lazy imports of a test module are both seen."""
    module = tmp_path / "test_x.py"
    module.write_text("from tests.test_y import a\n\ndef f():\n    import tests.test_z\n")
    seen = [name for name, _ in imports(module)]
    assert seen == ["tests.test_y", "tests.test_y.a", "tests.test_z"]


def test_pip_install_ships_the_runtime_and_the_exporter_but_no_benchmarks_or_tests() -> None:
    """The packages `pip install .` installs (pyproject's find rule, as setuptools applies it):
    every shipped package, and neither the benchmarks (`pipeshard bench` loads them from a
    checkout) nor the tests."""
    import tomllib

    from setuptools import find_packages

    rule = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    installed = find_packages(where=str(ROOT), include=rule["packages"]["find"]["include"])
    tops = {name.split(".")[0] for name in installed}
    assert tops == set(SHIPPED)
