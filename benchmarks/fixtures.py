"""The test suite's tiny models, for the benchmarks that build their own model.

They live in ``testing_support/`` beside the tests, which ``pip install .`` does not install:
these benchmarks run from a pipeshard checkout, whose root this puts on the import path when
the command was started elsewhere (``pipeshard bench`` from an editable install).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]


def use_testing_support() -> None:
    """Make ``testing_support`` importable, or stop with what to do instead."""
    if importlib.util.find_spec("testing_support") is not None:
        return
    if not (CHECKOUT / "testing_support" / "__init__.py").is_file():
        raise SystemExit(
            "this benchmark builds the test suite's tiny model (testing_support/, which is not "
            "installed): run it from a pipeshard checkout"
        )
    sys.path.insert(0, str(CHECKOUT))
