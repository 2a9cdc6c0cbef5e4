"""Small parsers shared by the command line and settings."""

from __future__ import annotations

import argparse
import math


def comma_list(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return items


def comma_numbers(text: str) -> list[float]:
    """``"16,12"`` -> [16, 12]; ``"15.7,12.3"`` -> [15.7, 12.3] (whole numbers stay ints)."""
    try:
        numbers = [int(item) if item.isdigit() else float(item) for item in comma_list(text)]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc
    if not all(math.isfinite(n) for n in numbers):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    return numbers


def parse_properties(items: list[str]) -> dict[str, str]:
    """``["KEY=VALUE", ...]`` -> dict; OpenVINO converts the string values itself."""
    properties = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        properties[key.strip()] = value.strip()
    return properties
