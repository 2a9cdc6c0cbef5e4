"""`pipeshard export` and `verify` from the command line: outputs, manifest, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openvino as ov
import pytest

from pipeshard.cli import main
from protos.manifest import load_manifest, manifest_hash, sha256_file
from tests.conftest import ExportFn


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.err.strip()


@pytest.mark.component
def test_manifest_describes_the_export(tiny_export: ExportFn) -> None:
    export_dir = tiny_export("gemma3", 3)
    m = load_manifest(export_dir)
    assert m.model.architecture == "gemma3_text" and m.model.num_layers == 6
    assert [(s.layer_start, s.layer_end) for s in m.stages] == [(0, 2), (2, 4), (4, 6)]
    assert m.model.sliding_window == 5 and "sliding_attention" in m.model.layer_types
    assert m.stages[0].inputs[0] == "input_ids" and m.stages[1].inputs[0] == "inputs_embeds"
    assert m.stages[-1].outputs == ["logits"] and m.stages[0].outputs == ["hidden_states"]
    for stage in m.stages:
        ports = ov.Core().read_model(export_dir / stage.model_xml)
        assert [p.get_any_name() for p in ports.inputs] == stage.inputs
        assert [p.get_any_name() for p in ports.outputs] == stage.outputs
    for entry in m.tokenizer.files:
        assert sha256_file(export_dir / entry.path) == entry.sha256
    assert m.tokenizer.eos_token_ids == [2]
    assert (export_dir / m.tokenizer.directory / "tokenizer.json").is_file()
    assert m.weights.format == "fp32" and m.draft is None
    assert len(manifest_hash(export_dir)) == 64


def _expect_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str, out: Path | None = None
) -> None:
    capsys.readouterr()
    code, err = run_cli(capsys, *argv, "--quiet")
    assert code != 0
    assert message in err, err
    assert len(err.splitlines()) == 1, err  # one-line reason
    if out is not None:
        leftovers = [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp")]
        assert leftovers == []


@pytest.mark.component
def test_bad_input_exits_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_model: Callable[..., Path]
) -> None:
    src = str(tiny_model("qwen2"))
    out = tmp_path / "out"
    _expect_error(capsys, ["export", str(tmp_path / "missing"), "--out", str(out)], "not found")
    _expect_error(
        capsys,
        ["export", src, "--out", str(out), "--stages", "7"],
        "cannot split 6 layers into 7 stages",
        out,
    )
    _expect_error(
        capsys,
        ["export", src, "--out", str(out), "--split", "2,2"],
        "adds up to 4, the model has 6 layers",
        out,
    )
    _expect_error(
        capsys,
        ["export", src, "--out", str(out), "--split", "3,3", "--stages", "3"],
        "disagrees",
        out,
    )
    _expect_error(
        capsys,
        ["export", src, "--out", str(out), "--node-memory", "1MB,1MB", "--weights", "fp32"],
        "does not fit",
        out,
    )
    _expect_error(
        capsys,
        ["export", src, "--out", str(out), "--weights", "int4", "--group-size", "128"],
        "--group-size 128 does not divide the input channels of this model's matrices "
        "(hidden_size 64, heads x head_dim 64): use --group-size 64 or --group-size -1",
        out,
    )
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _expect_error(capsys, ["export", src, "--out", str(out)], "not empty (use --force")
    assert (out / "keep.txt").read_text() == "mine"

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    _expect_error(
        capsys,
        ["export", str(gpt2), "--out", str(tmp_path / "o2")],
        "architecture 'gpt2' is not supported; "
        "supported: gemma3_text, glm4_moe, gpt_oss, llama, ministral, mistral, mixtral, phi3, "
        "qwen2, qwen3, qwen3_5_moe_text, qwen3_5_text, qwen3_moe, qwen3_next",
    )
    flash = tmp_path / "glm-4.7-flash"
    flash.mkdir()
    (flash / "config.json").write_text(json.dumps({"model_type": "glm4_moe_lite"}))
    _expect_error(
        capsys,
        ["export", str(flash), "--out", str(tmp_path / "o4")],
        "architecture 'glm4_moe_lite' is not supported (GLM-4.7-Flash's multi-head latent "
        "attention (DeepSeek's) is not built)",
    )
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"0")
    _expect_error(capsys, ["export", str(not_gguf), "--out", str(tmp_path / "o3")], "not a .gguf")


@pytest.mark.component
def test_int4_groups_fit_the_model_unless_asked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_model: Callable[..., Path]
) -> None:
    """int4 without --group-size: groups of 128, or (a warning and the plan say so) the
    largest power of two below that divides every matrix's input channels; the export is the
    one --group-size of that size makes (reused as it is). A --group-size that does not fit
    is an error (test_bad_input_exits_with_one_line)."""
    src = str(tiny_model("qwen2"))  # hidden 64: groups of 128 do not fit
    out = tmp_path / "int4"
    argv = ["export", src, "--out", str(out), "--stages", "2", "--weights", "int4"]
    capsys.readouterr()
    assert main(argv) == 0
    assert "(qwen2, 6 layers, int4 (groups of 64)):" in capsys.readouterr().out
    assert load_manifest(out).weights.group_size == 64
    built = (out / "stage-0" / "model.bin").stat().st_mtime_ns
    assert main([*argv, "--group-size", "64", "--reuse"]) == 0
    assert "already holds this export; reusing it" in capsys.readouterr().out
    assert (out / "stage-0" / "model.bin").stat().st_mtime_ns == built


@pytest.mark.component
def test_draft_with_other_vocabulary_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_model: Callable[..., Path]
) -> None:
    out = tmp_path / "out"
    _expect_error(
        capsys,
        [
            "export",
            str(tiny_model("qwen2")),
            "--out",
            str(out),
            "--draft",
            str(tiny_model("llama", vocab=300)),
            "--weights",
            "fp32",
            "--quiet",
        ],
        "draft vocabulary size 300 differs from the target's 256",
        out,
    )
    assert not out.exists()


@pytest.mark.component
def test_export_with_draft_and_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_model: Callable[..., Path]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old export")
    argv = [
        "export",
        str(tiny_model("qwen2")),
        "--out",
        str(out),
        "--split",
        "4,2",
        "--weights",
        "fp16",
        "--draft",
        str(tiny_model("llama", seed=1)),
        "--force",
    ]
    code, _ = run_cli(capsys, *argv)
    assert code == 0
    assert not (out / "old.txt").exists()
    m = load_manifest(out)
    assert [s.num_layers for s in m.stages] == [4, 2]
    assert m.draft is not None and m.draft.directory == "draft"
    draft = load_manifest(out / "draft")
    assert draft.num_stages == 1 and draft.model.architecture == "llama"
    assert m.draft.manifest_sha256 == manifest_hash(out / "draft")
    assert sorted(p.name for p in out.iterdir()) == [
        "draft",
        "manifest.json",
        "stage-0",
        "stage-1",
        "tokenizer",
    ]
    # --reuse: the same request does nothing; a different one re-exports.
    stamp = (out / "stage-0" / "model.xml").stat().st_mtime_ns
    reuse = [a for a in argv if a != "--force"] + ["--reuse", "--quiet"]
    assert run_cli(capsys, *reuse)[0] == 0
    assert (out / "stage-0" / "model.xml").stat().st_mtime_ns == stamp
    reuse[reuse.index("4,2")] = "3,3"
    assert run_cli(capsys, *reuse)[0] == 0
    assert [s.num_layers for s in load_manifest(out).stages] == [3, 3]


@pytest.mark.integration
def test_cli_end_to_end_in_a_subprocess(tmp_path: Path, tiny_model: Callable[..., Path]) -> None:
    """The installed console script: export, then verify (exit 0 and a PASS table)."""
    exe = Path(sys.executable).parent / "pipeshard"
    out = tmp_path / "e"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    subprocess.run(
        [
            str(exe),
            "export",
            str(tiny_model("llama")),
            "--out",
            str(out),
            "--stages",
            "2",
            "--weights",
            "fp32",
            "--quiet",
        ],
        check=True,
        env=env,
        timeout=300,
    )
    verify = subprocess.run(
        [
            str(exe),
            "verify",
            str(out),
            "--steps",
            "16",
            "--kv-cache-precision",
            "f32",
            "--inference-precision",
            "f32",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "16/16 tok" in verify.stdout and verify.stdout.strip().endswith("PASS")


@pytest.mark.component
def test_quiet_hides_the_gguf_reader_progress_bar() -> None:
    """transformers' GGUF reader calls tqdm directly: a quiet load switches that bar off, and
    puts the reader's tqdm back afterwards (also after a failed load)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from exporter.source import _gguf_progress

    original = gguf_utils.tqdm
    with _gguf_progress(False):
        assert gguf_utils.tqdm(range(2)).disable
    assert gguf_utils.tqdm is original
    with pytest.raises(RuntimeError), _gguf_progress(False):
        raise RuntimeError("load failed")
    assert gguf_utils.tqdm is original
    with _gguf_progress(True):
        assert gguf_utils.tqdm is original


def _tiny_gguf(path: Path, layers: int) -> Path:
    """A GGUF file holding a Qwen2 config (and one tensor): enough to read its config."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(128)
    writer.add_embedding_length(32)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(16)
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.component
def test_a_gguf_config_is_read_once_then_cached_until_the_file_changes(tmp_path: Path) -> None:
    from exporter.source import CONFIG_CACHE, resolve_source

    gguf_path = _tiny_gguf(tmp_path / "tiny.gguf", layers=2)
    cache = tmp_path / "cache"

    def read() -> Any:
        return resolve_source(str(gguf_path), cache, progress=False).load_config()

    config = read()
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("qwen2", 2, 32)
    [cached] = (cache / CONFIG_CACHE).iterdir()
    # The next read comes from the cache (an edit there shows), with the same name as before.
    edited = json.loads(cached.read_text())
    cached.write_text(json.dumps({**edited, "rms_norm_eps": 0.5}))
    again = read()
    assert again.rms_norm_eps == 0.5 and again._name_or_path == config._name_or_path
    # A file that changes is read again; an unreadable cache entry is read around.
    _tiny_gguf(gguf_path, layers=3)
    os.utime(gguf_path, ns=(1, 1))
    assert read().num_hidden_layers == 3
    for entry in (cache / CONFIG_CACHE).iterdir():
        entry.write_text("{not json")
    assert read().num_hidden_layers == 3


@pytest.mark.component
def test_an_int4_export_without_nncf_names_the_extra_in_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    tiny_model: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run command installs pipeshard[gguf] (no NNCF): an export that needs NNCF ends with
    one line naming the export extra, not a traceback, and writes no export."""
    monkeypatch.setitem(sys.modules, "nncf", None)  # `import nncf` fails as where it is absent
    out = tmp_path / "out"
    code, err = run_cli(
        capsys, "export", str(tiny_model("qwen2")), "--out", str(out), "--weights", "int4"
    )
    assert code == 2 and "Traceback" not in err, err
    last = err.splitlines()[-1]  # (after the progress bars)
    assert last.startswith("pipeshard export: error: nncf is not installed"), err
    assert "pipeshard[export]" in last
    assert not (out / "manifest.json").exists()
