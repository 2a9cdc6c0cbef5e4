"""The packages import each other only as the architecture says (every import, including the
lazy ones inside functions, read from the source with ast):

- ``protos`` (the wire contract) and ``common`` (helpers both services use) import nothing of
  the project but themselves;
- ``shard_runtime`` (the OpenVINO runtime of a shard, used by the stage, the gateway's draft
  and the exporter's checks) imports only ``protos`` and ``common``;
- the gateway (``server``) never imports a stage, the exporter, the benchmarks or the command
  line;
- a stage (``stage_node``) never imports the gateway, the exporter, the benchmarks or the
  command line; the exporter never imports the gateway, a stage or the command line;
- no module imports a private name (``_name``) from another package;
- only the command line (``pipeshard``, which wires every role together) and the benchmarks
  themselves import ``benchmarks``;
- no module imports itself back through others (no import circles);
- in the gateway only the ring transport (``server.ring.grpc_client``) speaks gRPC: the engine
  and the HTTP layer see the ring's typed errors (``server.ring``), never gRPC status codes;
- the gateway's three layers are folders: ``server.api`` (HTTP) may use the engine and the ring,
  ``server.engine`` only the ring (never HTTP), ``server.ring`` neither; what they share
  (settings, metrics, small parsers) sits beside them in ``server``.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "pipeshard",
    "common",
    "shard_runtime",
    "server",
    "stage_node",
    "protos",
    "exporter",
    "benchmarks",
    "testing_support",
)
# package -> project packages it must not import (the test fixtures, testing_support, are not
# installed: only the tests and the benchmarks that build a tiny model use them)
FORBIDDEN = {
    "protos": set(PACKAGES) - {"protos"},
    "common": set(PACKAGES) - {"common"},
    "shard_runtime": set(PACKAGES) - {"shard_runtime", "protos", "common"},
    "server": {"stage_node", "exporter", "benchmarks", "pipeshard", "testing_support"},
    "stage_node": {"server", "exporter", "benchmarks", "pipeshard", "testing_support"},
    "exporter": {"server", "stage_node", "benchmarks", "pipeshard", "testing_support"},
    "pipeshard": {"testing_support"},
    "testing_support": {"server", "stage_node", "benchmarks", "pipeshard"},
}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = modules()


def imported(name: str, path: Path) -> Iterator[tuple[str, int]]:
    """The project modules ``name`` imports, with the line of each import."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            # `from package import module` imports the module
            targets = [f"{base}.{alias.name}" for alias in node.names]
            targets = [t if t in MODULES else base for t in targets]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target, node.lineno


GRAPH = {name: sorted(set(imported(name, path))) for name, path in MODULES.items()}


def test_the_graph_sees_every_kind_of_import() -> None:
    """A guard for the reader above: top-level, lazy (inside a function) and ``from package
    import module`` imports are all seen."""
    targets = {name: {t for t, _ in found} for name, found in GRAPH.items()}
    assert "common.net" in targets["pipeshard.fleet"]  # top level
    assert "benchmarks.suite.cli" in targets["pipeshard.cli"]  # inside _run_bench
    assert "common.systemd" in targets["server.api.app"]  # from common import systemd


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_what_the_architecture_allows(package: str) -> None:
    broken = [
        f"{MODULES[name].relative_to(ROOT)}:{line} imports {target}"
        for name, targets in GRAPH.items()
        if name.split(".")[0] == package
        for target, line in targets
        if target.split(".")[0] in FORBIDDEN[package]
    ]
    assert broken == []


def test_the_test_fixtures_are_not_installed() -> None:
    """``pip install .`` installs the packages pyproject.toml's include patterns match: never
    testing_support (the tiny models and GGUF writer), and no fixture is left in the exporter."""
    from fnmatch import fnmatch

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    include = setup["packages"]["find"]["include"]
    assert not [p for p in include if fnmatch("testing_support", p)]
    assert sorted(p.name for p in (ROOT / "exporter").glob("tiny_*.py")) == []


def private_imports() -> Iterator[str]:
    """``from a.b import _name`` where ``a`` is another top-level package than the importer's."""
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            source = node.module.split(".")[0]
            if source not in PACKAGES or source == name.split(".")[0]:
                continue
            for alias in node.names:
                if alias.name.startswith("_"):
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    yield f"{where} imports {node.module}.{alias.name}"


def test_no_module_imports_another_packages_private_names() -> None:
    assert list(private_imports()) == []


def test_only_the_command_line_and_the_benchmarks_import_the_benchmarks() -> None:
    broken = [
        f"{MODULES[name].relative_to(ROOT)}:{line} imports {target}"
        for name, targets in GRAPH.items()
        if name.split(".")[0] not in {"pipeshard", "benchmarks"}
        for target, line in targets
        if target.split(".")[0] == "benchmarks"
    ]
    assert broken == []


def circles() -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target, _ in GRAPH[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    return groups


def test_no_import_circles() -> None:
    assert circles() == []


# the gateway modules that may use gRPC (grpc itself, the generated stubs, channel set-up)
GRPC_TRANSPORT = {"server.ring.grpc_client"}
GRPC_MODULES = ("grpc", "protos.pipeshard_v1_pb2_grpc", "protos.transport")


def grpc_imports(name: str, path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        for target in targets:
            if any(target == m or target.startswith(f"{m}.") for m in GRPC_MODULES):
                yield f"{path.relative_to(ROOT)}:{node.lineno} imports {target}"
                break


def test_only_the_ring_transport_speaks_grpc_in_the_gateway() -> None:
    broken = [
        found
        for name, path in MODULES.items()
        if name.split(".")[0] == "server" and name not in GRPC_TRANSPORT
        for found in grpc_imports(name, path)
    ]
    assert broken == []
    assert all(list(grpc_imports(n, MODULES[n])) for n in GRPC_TRANSPORT)  # the rule sees them


# gateway layer -> gateway layers it must not import
LAYERS = {
    "server.api": set(),
    "server.engine": {"server.api"},
    "server.ring": {"server.api", "server.engine"},
}


def layer(name: str) -> str | None:
    return next((lay for lay in LAYERS if name == lay or name.startswith(f"{lay}.")), None)


def test_the_gateways_layers_import_only_downwards() -> None:
    broken = [
        f"{MODULES[name].relative_to(ROOT)}:{line} imports {target}"
        for name, targets in GRAPH.items()
        if (own := layer(name)) is not None
        for target, line in targets
        if layer(target) in LAYERS[own]
    ]
    assert broken == []
    # every gateway module is in a layer or one of the shared ones beside them
    shared = {"server", "server.settings", "server.metrics", "server.options", "server.hosts"}
    assert {n for n in MODULES if n.split(".")[0] == "server" and layer(n) is None} == shared


# The packages a runtime install (gateway and stages: `pip install pipeshard`, the container
# image) imports; the exporter, the benchmarks and the build-time stub generator need extras.
RUNTIME_PACKAGES = ("pipeshard", "common", "shard_runtime", "server", "stage_node", "protos")
BUILD_TIME_MODULES = {"protos.codegen"}


def third_party_imports(path: Path) -> Iterator[tuple[str, int]]:
    """The top-level names of the absolute imports in ``path`` that are not the project's nor
    the standard library's, lazy ones included."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top not in PACKAGES and top not in sys.stdlib_module_names:
                yield top, node.lineno


def runtime_distributions() -> set[str]:
    """pyproject's runtime dependencies and, as installed here, everything they require
    (without extras): what `pip install pipeshard` brings."""
    pending = [
        Requirement(spec)
        for spec in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ]
    found: set[str] = set()
    while pending:
        req = pending.pop()
        name = canonicalize_name(req.name)
        if name in found or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        found.add(name)
        pending.extend(Requirement(spec) for spec in metadata.requires(req.name) or [])
    return found


def test_the_runtime_imports_only_its_declared_dependencies() -> None:
    """A module the gateway or a stage imports (even lazily) comes from a runtime dependency,
    or a runtime install (the container image) fails on it: the dev environment hides that,
    since the extras (torch, ...) bring much more."""
    allowed = runtime_distributions()
    provides = metadata.packages_distributions()
    broken = [
        f"{path.relative_to(ROOT)}:{line} imports {top} ({', '.join(provides.get(top, []))})"
        for name, path in MODULES.items()
        if name.split(".")[0] in RUNTIME_PACKAGES and name not in BUILD_TIME_MODULES
        for top, line in third_party_imports(path)
        if not {canonicalize_name(d) for d in provides.get(top, [])} & allowed
    ]
    assert broken == []


# request fields (of any dialect) that ask for a constraint: the engine reads none of them
CONSTRAINT_FIELDS = {"tool_choice", "parallel_tool_calls", "response_format", "json_schema"}


def request_reads(source: str, where: str) -> Iterator[str]:
    """``x.field`` or ``getattr(x, "field")`` of a constraint field in ``source``, and any
    import of pydantic (what the dialects' request models are made of)."""
    for node in ast.walk(ast.parse(source, where)):
        at = f"{where}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and node.attr in CONSTRAINT_FIELDS:
            yield f"{at} reads .{node.attr}"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in CONSTRAINT_FIELDS
        ):
            yield f"{at} reads getattr(..., {node.args[1].value!r})"
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names.append(node.module or "")
            if any(n.split(".")[0] == "pydantic" for n in names):
                yield f"{at} imports pydantic"


def test_the_engine_reads_no_http_request() -> None:
    """The engine never sees a dialect's request: it imports no HTTP module (the layers rule
    above), no pydantic model, and reads no field that asks for a constraint."""
    broken = [
        found
        for name, path in MODULES.items()
        if layer(name) == "server.engine"
        for found in request_reads(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert broken == []
    # the rule sees each kind of read (a guard for the reader)
    probe = "getattr(req, 'tool_choice')\nreq.response_format\nfrom pydantic import BaseModel\n"
    assert len(list(request_reads(probe, "probe"))) == 3


def _leaf_types(hint: object) -> Iterator[object]:
    """The types a field's annotation is made of (``Literal`` values left out)."""
    import typing

    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return
    if origin is None:
        yield hint
        return
    yield origin
    for arg in typing.get_args(hint):
        if arg is not Ellipsis:
            yield from _leaf_types(arg)


def test_grammars_are_built_from_the_neutral_constraint_spec_only() -> None:
    """``build_constraint`` takes a :class:`ConstraintSpec` (and the vocabulary), nothing a
    dialect defines; the spec is frozen and made of plain values and its own types."""
    import dataclasses
    import types
    import typing
    from collections.abc import Mapping

    from server.engine import constraint_spec, constraints

    assert not hasattr(constraints, "constraint_for")
    hints = typing.get_type_hints(constraints.build_constraint)
    assert hints == {
        "spec": constraint_spec.ConstraintSpec,
        "vocab": dict[str, int] | None,
        "return": constraints.Constraint,
    }
    own: set[type] = {
        obj
        for obj in vars(constraint_spec).values()
        if isinstance(obj, type)
        and dataclasses.is_dataclass(obj)
        and obj.__module__ == constraint_spec.__name__
    }
    assert constraint_spec.ConstraintSpec in own
    plain: set[object] = {str, bool, int, float, tuple, dict, Mapping, type(None)}
    plain |= {typing.Any, typing.Union, types.UnionType}
    for cls in own:
        assert cls.__dataclass_params__.frozen, cls  # type: ignore[attr-defined]
        for field, hint in typing.get_type_hints(cls).items():
            strange = [t for t in _leaf_types(hint) if t not in plain and t not in own]
            assert strange == [], f"{cls}.{field}: {strange}"
