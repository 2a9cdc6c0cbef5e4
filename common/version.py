"""pipeshard's version, stated once: pyproject.toml's ``version``. An installed pipeshard
reads it from its package metadata; a checkout run without installing, from pyproject.toml."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _version() -> str:
    try:
        return metadata.version("pipeshard")
    except metadata.PackageNotFoundError:
        with PYPROJECT.open("rb") as file:
            version: str = tomllib.load(file)["project"]["version"]
        return version


VERSION = _version()
