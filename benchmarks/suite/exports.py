"""Which exports a run measures: the N-stage export (default: the one `pipeshard up` makes) and,
for experiment 1, 1-stage exports of the same weights with and without ``beam_idx``.

The 1-stage exports are looked for in the variants folder and made there from the export's own
source when missing (`pipeshard export`, which needs the export extra and the source weights);
when neither works, experiment 1 says so and measures the rest.
"""

from __future__ import annotations

import importlib.util
import logging
import subprocess
from pathlib import Path

from protos.manifest import ShardManifest, load_manifest

log = logging.getLogger(__name__)
# name -> (beam_idx, the row of experiment 1 it serves)
VARIANTS = {"s1": (True, "(b)"), "s1-nobeam": (False, "(c)")}


def default_export() -> Path:
    """The default model's export as `pipeshard up` caches it."""
    from exporter.default_models import resolve_builtin
    from pipeshard.fleet import FleetOptions, export_path

    builtin = resolve_builtin("default")
    assert builtin is not None
    return export_path(FleetOptions(), builtin.name)


def resolve_export(export: Path | None) -> Path:
    """``export``, or the default model's export, made the way `pipeshard up` makes it."""
    if export is not None:
        return export
    path = default_export()
    if (path / "manifest.json").is_file():
        return path
    if importlib.util.find_spec("torch") is None:
        raise SystemExit(
            f"no export at {path}: run `pipeshard up` once (it exports the default model there), "
            "or give --export DIR"
        )
    from pipeshard.fleet import FleetOptions, ensure_export

    log.info("exporting the default model to %s, as `pipeshard up` does (once)", path)
    return ensure_export(FleetOptions())


def default_variants(manifest: ShardManifest) -> Path:
    from common.net import default_ov_cache

    key = (manifest.source.sha256 or manifest.model.model_id)[:16]
    return default_ov_cache().parent / "bench" / f"{key}-{manifest.weights.format}"


def find_variants(manifest: ShardManifest, folder: Path) -> tuple[dict[str, Path], list[str]]:
    """The 1-stage exports found or made in ``folder``, and a line for each one missing."""
    found: dict[str, Path] = {}
    notes: list[str] = []
    for name, (beam_idx, row) in VARIANTS.items():
        path = folder / name
        reason = None if matches(path, manifest, beam_idx) else derive(manifest, path, beam_idx)
        if reason is None:
            found[name] = path
        else:
            notes.append(f"{row} skipped: {reason}")
    return found, notes


def matches(path: Path, manifest: ShardManifest, beam_idx: bool) -> bool:
    """Is ``path`` a 1-stage export of the same weights, with or without ``beam_idx``?"""
    try:
        other = load_manifest(path)
    except (ValueError, OSError):
        return False
    same_source = (
        other.source.sha256 == manifest.source.sha256
        if manifest.source.sha256
        else other.source.path == manifest.source.path
    )
    return (
        same_source
        and other.num_stages == 1
        and all(s.beam_idx == beam_idx for s in other.stages)
        and other.weights == manifest.weights
        and other.model.model_id == manifest.model.model_id
    )


def derive(manifest: ShardManifest, out: Path, beam_idx: bool) -> str | None:
    """Export the 1-stage variant into ``out``; None when done, else why it could not be."""
    from benchmarks.processes import PIPESHARD

    source = Path(manifest.source.path)
    if importlib.util.find_spec("torch") is None:
        return (
            f"no 1-stage export of the same weights in {out.parent}, and the export extra "
            "(torch) is not installed to make one"
        )
    if not source.exists():
        return (
            f"no 1-stage export of the same weights in {out.parent}, and the export's source "
            f"({source}) is not on this machine to make one; give --variants DIR holding "
            "s1/ and s1-nobeam/"
        )
    weights = manifest.weights
    cmd = [PIPESHARD, "export", str(source), "--stages", "1", "--weights", weights.format]
    if weights.group_size is not None:
        cmd += ["--group-size", str(weights.group_size)]
    if weights.symmetric:
        cmd.append("--sym")
    if not beam_idx:
        cmd.append("--no-beam-idx")
    cmd += ["--max-context", str(manifest.model.max_context), "--out", str(out)]
    log.info("+ %s", " ".join(cmd))
    done = subprocess.run([*cmd, "--force", "--quiet"], capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return f"`{' '.join(cmd)}` failed: {last}"
    return None
