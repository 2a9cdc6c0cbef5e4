"""Every figure of the report: a median over rounds with its [min, max]; ratios pair by pair."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

Spread = dict[str, Any]


def spread(values: Iterable[float | None]) -> Spread | None:
    """Median, min, max and the values themselves; None when there is nothing to summarise."""
    kept = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not kept:
        return None
    return {
        "median": statistics.median(kept),
        "min": min(kept),
        "max": max(kept),
        "n": len(kept),
        "values": kept,
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def ratios(
    numerators: Sequence[float | None], denominators: Sequence[float | None]
) -> Spread | None:
    """Round-by-round ratios (the i-th numerator over the i-th denominator), summarised."""
    return spread(ratio(n, d) for n, d in zip(numerators, denominators, strict=True))


def fmt(value: Spread | None, digits: int = 2, suffix: str = "") -> str:
    """``median [min, max]`` (just the median when every round gave the same), or n/a."""
    if value is None:
        return "n/a"
    median = f"{value['median']:.{digits}f}{suffix}"
    if value["n"] < 2:
        return median
    return f"{median} [{value['min']:.{digits}f}, {value['max']:.{digits}f}]"


def ref(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"
