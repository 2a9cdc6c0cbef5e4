"""`pipeshard bench --quick` end to end on a tiny model: the report, the raw data and the plots
are written with the expected structure (the speeds are not checked).

The tiny target is exported to 2 stages with a draft (its own weights plus noise) and to the
two 1-stage variants of experiment 1. There is no openvino-genai baseline, so the report must
say what it left out.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from benchmarks.processes import PIPESHARD
from benchmarks.suite import latency, parity, speculation, ttft, users
from exporter.export import ExportOptions, export_model
from protos.manifest import WeightSpec
from testing_support.tiny_models import CHAT_TEMPLATE, make_draft, make_model

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ["parity", "microbatch", "speculative", "latency", "ttft"]
TITLES = [m.TITLE for m in (parity, users, speculation, latency, ttft)]
ROUNDS = 2  # --quick


def make_bench_exports(base: Path) -> tuple[Path, Path]:
    """(the 2-stage export with draft/, the variants folder holding s1/ and s1-nobeam/)."""
    target = make_model("qwen2", base / "target", chat_template=CHAT_TEMPLATE)
    draft = make_draft(target, base / "draft-model", noise=0.3)
    fp32 = WeightSpec(format="fp32")
    export = base / "export"
    export_model(
        ExportOptions(
            model=str(target), out=export, stages=2, weights=fp32, draft=str(draft), quiet=True
        )
    )
    variants = base / "variants"
    for name, beam_idx in (("s1", True), ("s1-nobeam", False)):
        export_model(
            ExportOptions(
                model=str(target),
                out=variants / name,
                stages=1,
                weights=fp32,
                beam_idx=beam_idx,
                quiet=True,
            )
        )
    return export, variants


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_bench_exports(tmp_path_factory.mktemp("bench"))


@pytest.fixture(scope="module")
def run(exports: tuple[Path, Path]) -> tuple[Path, subprocess.CompletedProcess[str]]:
    export, variants = exports
    base = export.parent
    out = base / "results"  # no --results: the report lands in the current directory
    out.mkdir(exist_ok=True)
    cmd = [
        PIPESHARD,
        "bench",
        "--quick",
        *("--export", str(export), "--variants", str(variants)),
        *("--ov-cache-dir", str(base / "ov-cache")),
        *("--delays", "0,20"),  # the quick default goes to 100 ms per hop: slow on any model
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=out)
    return out, done


def one(out: Path, pattern: str) -> Path:
    found = sorted(out.glob(pattern))
    assert len(found) == 1, (pattern, found)
    return found[0]


def test_bench_runs_every_experiment(run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    _, done = run
    assert done.returncode == 0, done.stderr[-5000:]


def test_report_has_every_table_beside_the_paper(
    run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, _ = run
    report = one(out, "bench-*.md").read_text()
    assert "## Processes: cores and threads" in report
    cores = sorted(os.sched_getaffinity(0))
    assert f"| stage 1 (`pipeshard stage`) | {cores[1 % len(cores)]} | 1 |" in report
    for title in TITLES:
        assert f"## {title}" in report
        section = report.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
        assert "|---|" in section and "**Failed**" not in section, section
    assert "| 24.54 |" in report  # the paper's monolithic figure beside ours
    # no --baseline: said, never silently left out
    assert report.count("no --baseline") >= 3
    assert "(c) 1-stage shard without beam_idx | 21.26 | 0.866 | " in report
    assert "(b) skipped" not in report and "(c) skipped" not in report


def test_json_has_every_raw_measurement(
    run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, _ = run
    data: dict[str, Any] = json.loads(one(out, "bench-*.json").read_text())
    assert {"cpu", "cores", "memory_gib", "openvino"} <= set(data["machine"])
    assert data["failures"] == {}
    assert set(data["experiments"]) == set(EXPERIMENTS)
    for name in EXPERIMENTS:
        assert len(data["experiments"][name]["rounds"]) == ROUNDS, name
    parity_round = data["experiments"]["parity"]["rounds"][0]
    assert set(parity_round) == {"s1", "s1-nobeam", "chain", "ring"}
    assert all(r["decode_tok_s"] > 0 for r in parity_round.values())
    fleet = data["experiments"]["microbatch"]["rounds"][0]
    assert set(fleet["fleet"]) == {"1", "2"} and fleet["spec"]["ttft_ms"]
    spec = data["experiments"]["speculative"]["rounds"][0]["0"]
    assert set(spec) == {"off", "adaptive", "K=3"}
    assert len(spec["K=3"]["prompt_seconds"]) == 4 and all(spec["K=3"]["identical"])
    wan = data["experiments"]["latency"]["rounds"][0]
    assert set(wan) == {"0", "20"} and set(wan["20"]) == {"naive", "full, 2 users"}
    ttft_round = data["experiments"]["ttft"]["rounds"][0]
    assert data["experiments"]["ttft"]["lengths"] == [128, 255]  # the tiny model's context: 256
    assert ttft_round["monolithic_ms"] is None and len(ttft_round["stages_ms"]) == 2


def test_plots_are_png_images(run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    import matplotlib.image

    out, _ = run
    for name in ("users", "speedup", "ttft"):
        path = one(out, f"bench-*-{name}.png")
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        height, width, _ = matplotlib.image.imread(path).shape
        assert height > 100 and width > 100


def test_variants_must_share_the_exports_weights(exports: tuple[Path, Path]) -> None:
    from benchmarks.suite.exports import find_variants
    from protos.manifest import SourceSpec, load_manifest

    export, variants = exports
    manifest = load_manifest(export)
    found, notes = find_variants(manifest, variants)
    assert set(found) == {"s1", "s1-nobeam"} and notes == []
    # other weights, whose source is not here to export from: both rows say why they are missing
    elsewhere = manifest.model_copy(
        update={"source": SourceSpec(kind="hf_dir", path=str(export.parent / "gone"))}
    )
    found, notes = find_variants(elsewhere, variants)
    assert found == {} and len(notes) == 2
    assert notes[0].startswith("(b) skipped:") and "is not on this machine" in notes[0]


def test_bench_lists_its_suites_and_each_suite_parses_its_own_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`pipeshard bench --help` lists every suite; `pipeshard bench SUITE --help` is that
    suite's own help; an unknown suite is refused; no suite at all is the paper run."""
    from benchmarks.suite.cli import SUITES, main

    assert main(["--help"]) == 0
    listing = capsys.readouterr().out
    assert all(f"    {name} " in listing or f"    {name}\n" in listing for name in SUITES)
    for name in SUITES:
        with pytest.raises(SystemExit) as done:
            main([name, "--help"])
        assert done.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: pipeshard bench {name} ")
    with pytest.raises(SystemExit) as done:
        main(["no-such-suite"])
    assert done.value.code == 2
    with pytest.raises(SystemExit) as done:
        main(["--experiments", "9"])  # the paper run's own check
    assert "--experiments takes numbers from 1 to 5" in str(done.value.code)


def test_prefix_suite_compares_the_cache_on_and_off_side_by_side(
    exports: tuple[Path, Path], tmp_path: Path
) -> None:
    """`pipeshard bench prefix --quick` on the tiny export, both gateways with its draft: every
    turn and every user on both gateways, the same replies, cached tokens only with the cache,
    the stages' cached blocks, and a verdict per target (the speeds are not checked)."""
    export, _ = exports
    cmd = [
        PIPESHARD, "bench", "prefix", "--quick", "--draft", "--export", str(export),
        "--results", str(tmp_path), "--ov-cache-dir", str(export.parent / "ov-cache"),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-5000:]
    report = one(tmp_path, "prefix-cache-*.md").read_text()
    data: dict[str, Any] = json.loads(one(tmp_path, "prefix-cache-*.json").read_text())
    assert report.startswith("Command: `pipeshard bench prefix --quick --draft ")
    assert "## Processes: cores and threads" in report and "| draft 1 |" in report
    assert "\nMachine: " in report and len(data["stage_cache_at_end"]) == 2
    assert "`pipeshard serve --no-prefix-cache --draft EXPORT/draft`" in report
    turns = data["multi_turn"]
    assert [t["turn"] for t in turns] == [1, 2, 3] and [t["first"] for t in turns] == [
        "cached", "uncached", "cached",
    ]  # fmt: skip
    assert all(t["same_reply"] and t["full_length"] for t in turns)
    assert all(t["uncached"]["cached_tokens"] == 0 for t in turns)
    # each later turn opens on the blocks (32 positions) of the turns before it
    assert turns[0]["cached"]["cached_tokens"] == 0
    assert all(t["cached"]["cached_tokens"] >= 96 for t in turns[1:])
    assert all(len(t["stage_cache"]) == 2 for t in turns)
    shared = data["shared"]
    assert all(shared["same_replies"]) and len(shared["same_replies"]) == 2
    assert all(r["cached_tokens"] >= 64 for r in shared["cached"]["requests"])
    assert all(r["cached_tokens"] == 0 for r in shared["uncached"]["requests"])
    assert all(s["cached_blocks"] > 0 for s in shared["stage_cache_after_warm_up"])
    assert data["gateway_tokens"]["uncached"]["prompt_cached_tokens"] == 0
    for target in (
        "TTFT of turns 2-3 with the cache <= 0.2x",
        "decode tok/s of turns 2-3",
        "TTFT p50 with the cache <= 0.3x",
        "aggregate tok/s (end to end)",
    ):
        line = next(x for x in report.splitlines() if target in x)
        assert line.endswith((": PASS", ": FAIL")), line
    assert set(data["targets"]) == {"multi_turn", "shared"}


def test_attention_cost_times_a_hybrid_s_two_attention_layers(tmp_path: Path) -> None:
    """`pipeshard bench attention-cost` on a tiny Qwen3.6-shaped stand-in GGUF: the linear layer
    runs as one fused GatedDeltaNet node and the full one as SDPA, both decode at each context
    and prefill, and the report and JSON hold both with their ratio; the full layer's KV cache
    grows with the context while the linear layer's state does not."""
    from benchmarks.attention_cost import main as attention_main
    from benchmarks.gguf_export import main as gguf_export_main

    path = tmp_path / "qwen36.gguf"
    tiny = ["--hidden=256", "--heads=4", "--kv-heads=2", "--head-dim=64", "--vocab=512"]
    tiny += ["--experts=4", "--experts-per-token=2", "--expert-intermediate=256"]
    tiny += ["--linear-key-heads=2", "--linear-value-heads=4", "--linear-head-dim=64"]
    gguf_export_main(["write", str(path), "--model", "qwen3.6-35b-a3b", "--layers", "4", *tiny])
    results = tmp_path / "results"
    args = [str(path), "--contexts", "8,40", "--chunk", "16", "--steps", "2", "--rounds", "2"]
    assert attention_main([*args, "--results", str(results), "--name", "cost"]) == 0

    data = json.loads(next(results.glob("cost-*.json")).read_text())
    assert data["layers"] == {"linear_attention": 0, "full_attention": 3}
    assert data["fused_ops"]["linear_attention"]["GatedDeltaNet"] == 1
    assert data["fused_ops"]["full_attention"]["ScaledDotProductAttention"] == 1
    assert len(data["rounds"]) == 2
    decode = data["summary"]["decode"]
    assert [row["context"] for row in decode] == [8, 40]
    for row in decode:
        assert row["linear_attention"] > 0 and row["full_attention"] > 0
        assert row["ratio"] == pytest.approx(sum(row["ratio_rounds"]) / 2)  # their median
    # KV: k and v, 2 heads of 64, f16, for every position so far (8 + 2 decoded, then 40 + 2)
    assert decode[0]["full_attention_state_bytes"] == 2 * 2 * 64 * 10 * 2
    assert decode[1]["full_attention_state_bytes"] == 2 * 2 * 64 * 42 * 2
    # conv [2 * 2 * 64 + 4 * 64, 4] and recurrent [4, 64, 64] in f32, whatever the context
    fixed = (512 * 4 + 4 * 64 * 64) * 4
    assert (
        decode[0]["linear_attention_state_bytes"]
        == decode[1]["linear_attention_state_bytes"]
        == fixed
    )
    first = data["summary"]["prefill_first"]
    assert first["tokens"] == 8 and first["ratio"] > 0
    assert [last["context"] for last in data["summary"]["prefill_last"]] == [8, 40]
    report = next(results.glob("cost-*.md")).read_text()
    assert "## Decode: one token after the context" in report
    assert "| 40 |" in report and "the last 14 before 40" in report  # 10 -> 26 -> 40
