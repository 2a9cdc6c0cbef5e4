"""Shared fixtures: tiny random models and their exports, built once per test session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from stage_node.runner import RunnerOptions

# Compile options for exactness tests: f32 compute and an f32 KV cache (the CPU default u8
# cache and dynamic activation quantization would add noise the comparison is not about).
EXACT = RunnerOptions(kv_cache_precision="f32", inference_precision="f32")

ExportFn = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    from tests.tiny_models import make_model

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
