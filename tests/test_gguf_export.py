"""Exports straight from GGUF files: the file's own blocks, token for token with transformers.

Tiny random models written as llama.cpp would (testing_support/tiny_gguf.py: Q4_K_M mixes of Q4_K,
Q6_K and F32) are exported with ``--weights gguf`` and compared with transformers loading the same
file (its de-quantization is gguf's, the reference): with f32 compute, an f32 KV cache and the CPU's
dynamic activation quantization off, the chained stages give the same greedy tokens and logits
within float rounding. Also: split == unsplit, one stage at a time on "different machines" == the
whole export, the paged backend, and the compressed weights in the compiled graph.
"""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import pytest

from exporter.errors import ExportError
from exporter.export import ExportOptions, export_model
from exporter.verify import verify_export
from pipeshard.cli import main
from protos.manifest import ShardManifest, WeightSpec, load_manifest, manifest_hash
from shard_runtime.chain import LocalChain
from shard_runtime.paged import PagedRunner
from shard_runtime.runner import RunnerOptions

pytestmark = pytest.mark.component

# f32 compute, f32 KV cache, no dynamic int8 activations: what transformers computes
EXACT_GGUF = RunnerOptions(
    kv_cache_precision="f32",
    inference_precision="f32",
    properties={"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"},
)
PROMPTS = [[1, 17, 42, 99, 7, 130, 64, 5, 200], [1, 3, 250, 11, 11, 90, 31, 140]]


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    from testing_support.tiny_gguf import make_gguf_model

    made: dict[tuple[str, str], Path] = {}

    def get(arch: str, types: str = "Q4_K_M") -> Path:
        if (arch, types) not in made:
            folder = tmp_path_factory.mktemp(f"gguf-{arch}-{types}")
            made[arch, types] = make_gguf_model(arch, folder, types=types)
        return made[arch, types]

    return get


@pytest.fixture(scope="session")
def gguf_export(
    tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Callable[..., Path]
) -> Callable[..., Path]:
    made: dict[tuple[str, int, str], Path] = {}

    def get(arch: str, stages: int, form: str = "split") -> Path:
        key = (arch, stages, form)
        if key not in made:
            out = tmp_path_factory.mktemp("gguf-exports") / f"{arch}-{stages}-{form}"
            export_model(
                ExportOptions(
                    model=str(tiny_gguf(arch)), out=out, stages=stages, gguf_form=form, quiet=True
                )
            )
            made[key] = out
        return made[key]

    return get


@pytest.mark.parametrize(
    ("arch", "stages", "form"),
    [
        ("llama", 1, "split"),
        ("llama", 3, "split"),
        ("qwen2", 2, "split"),
        ("qwen2", 2, "exact"),
        ("qwen3", 2, "split"),
        ("phi3", 2, "split"),  # llama.cpp's fused attn_qkv and ffn_up (gate and up)
        ("qwen3_moe", 2, "split"),  # 3-D Q4_K / Q6_K expert tensors, exact form
    ],
)
def test_gguf_stages_equal_transformers_on_the_same_file(
    gguf_export: Callable[..., Path], arch: str, stages: int, form: str
) -> None:
    export = gguf_export(arch, stages, form)
    manifest = load_manifest(export)
    assert manifest.weights.format == "gguf" and manifest.weights.gguf_form == form
    _check_type_summary(manifest, form)
    report = verify_export(export, prompt_ids=PROMPTS, steps=24, options=EXACT_GGUF, atol=1e-3)
    for result in report.results:
        comparison = result.reference
        assert comparison is not None and comparison.strict
        assert comparison.matched == 24, f"{arch}: tokens differ at {comparison.matched}"
        assert comparison.max_abs_diff < 1e-3
    assert report.failures() == []


def _check_type_summary(manifest: ShardManifest, form: str) -> None:
    """The manifest says, per tensor type of the file, what it became and how exact that is."""
    from gguf import GGUFReader

    counts = Counter(
        (t.tensor_type.name, len(t.shape) >= 2, len(t.shape) == 3)
        for t in GGUFReader(manifest.source.path).tensors
    )
    types = manifest.weights.gguf_types or []
    experts = "experts (GatherMatmul): "
    assert {(e.type, e.matrix, e.becomes.startswith(experts)): e.tensors for e in types} == counts
    exactness = {(e.type, e.matrix, e.becomes.startswith(experts)): e.exactness for e in types}
    assert exactness["Q6_K", True, False] == exactness["F32", False, False] == "bit-exact"
    q4k = {"split": "bit-exact", "exact": "within 1 f32 ulp"}[form]
    assert exactness["Q4_K", True, False] == q4k
    if ("Q4_K", True, True) in exactness:  # an MoE's experts always take the exact form
        assert exactness["Q4_K", True, True] == "within 1 f32 ulp"


def test_gguf_split_equals_unsplit_under_the_default_runtime(
    gguf_export: Callable[..., Path],
) -> None:
    """Dynamic int8 activations, u8... whatever the runtime does, it does it per layer the same
    way: 3 stages == 1 stage bit for bit."""
    report = verify_export(
        gguf_export("llama", 3),
        prompt_ids=PROMPTS,
        steps=24,
        against=gguf_export("llama", 1),
        reference=False,
        options=RunnerOptions(),
    )
    for result in report.results:
        assert result.against is not None and result.against.identical
        assert result.against.max_abs_diff == 0.0


def test_gguf_stages_keep_compressed_weights_and_fuse_attention(
    gguf_export: Callable[..., Path], tiny_gguf: Callable[..., Path]
) -> None:
    """The IR holds the file's codes (u4 for Q4_K, i8 for Q6_K), no f32 weight matrices; the
    CPU plugin compiles them into compressed FullyConnected nodes and one fused attention node
    per layer (the beam_idx Gather kept)."""
    export = gguf_export("qwen2", 2)
    manifest = load_manifest(export)
    core = ov.Core()
    for stage in manifest.stages:
        model = core.read_model(export / stage.model_xml)
        constants = [op for op in model.get_ops() if op.get_type_name() == "Constant"]
        kinds = Counter(op.get_output_element_type(0).get_type_name() for op in constants)
        assert kinds["u4"] > 0 and kinds["i8"] > 0, kinds
        biggest_float = max(
            (
                int(np.prod(op.get_output_shape(0)))
                for op in constants
                if op.get_output_element_type(0) == ov.Type.f32
            ),
            default=0,
        )
        # scales, zero points, norms: at most a group's share of a matrix
        largest = manifest.model.hidden_size * (manifest.model.intermediate_size or 0)
        assert biggest_float <= largest // 16
        compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        runtime = compiled.get_runtime_model()
        types = Counter(op.get_rt_info()["layerType"].astype(str) for op in runtime.get_ops())
        assert types["ScaledDotProductAttention"] == stage.num_layers
        compressed = [
            op
            for op in runtime.get_ops()
            if op.get_rt_info()["layerType"].astype(str) == "FullyConnected"
            and any(
                op.input_value(i).get_element_type().get_type_name() in ("u4", "i8")
                for i in range(1, op.get_input_size())
            )
        ]
        assert compressed, f"stage {stage.index}: no compressed FullyConnected"


def test_gguf_experts_stay_compressed_and_sparse(gguf_export: Callable[..., Path]) -> None:
    """A GGUF's 3-D expert tensors become GatherMatmul nodes (3 an expert layer) over the
    file's own codes: the compiled stage holds no f32 matrix as large as an expert's."""
    export = gguf_export("qwen3_moe", 2)
    manifest = load_manifest(export)
    core = ov.Core()
    for stage in manifest.stages:
        compiled = core.compile_model(
            export / stage.model_xml, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
        )
        ops = compiled.get_runtime_model().get_ops()
        types = Counter(op.get_rt_info()["layerType"].astype(str) for op in ops)
        assert types["GatherMatmul"] == 3 * stage.num_layers, types
        gather = [op for op in ops if op.get_rt_info()["layerType"].astype(str) == "GatherMatmul"]
        weight_types = {op.input_value(1).get_element_type().get_type_name() for op in gather}
        assert weight_types == {"u4", "i8"}, weight_types  # Q4_K and Q6_K codes as stored


def test_a_gguf_whose_experts_transformers_cannot_read_is_refused(tmp_path: Path) -> None:
    """A file holding experts that transformers reads as a dense model (here a qwen2 file with
    an expert count): the export says so instead of failing on a missing tensor."""
    from testing_support.tiny_gguf import make_hf_model, write_gguf

    gguf = write_gguf(
        make_hf_model("qwen2", tmp_path / "hf", layers=2),
        tmp_path / "moe.gguf",
        "F32",
        extra={"qwen2.expert_count": 8},
    )
    out = tmp_path / "out"
    with pytest.raises(ExportError, match=r"holds 8 experts a layer .* not supported from a GGUF"):
        export_model(ExportOptions(model=str(gguf), out=out, stages=1, quiet=True))
    assert not out.exists()


def test_a_mixtral_gguf_is_read_as_mixtral(tmp_path: Path) -> None:
    """llama.cpp writes Mixtral as a llama file with experts (llama.expert_count), which
    transformers reads as a dense Llama; the export reads it as the Mixtral it is. Written in
    F32 from a Mixtral folder, its 2 stages give that model's greedy tokens."""
    from transformers import AutoModelForCausalLM

    from exporter.verify import reference_greedy
    from testing_support.tiny_gguf import make_hf_model, write_gguf

    hf = make_hf_model("mixtral", tmp_path / "hf", layers=3)
    gguf = write_gguf(hf, tmp_path / "mixtral.gguf", "F32")
    out = tmp_path / "out"
    export_model(ExportOptions(model=str(gguf), out=out, stages=2, quiet=True))
    manifest = load_manifest(out)
    assert manifest.model.architecture == "mixtral"
    reference = AutoModelForCausalLM.from_pretrained(str(hf)).eval()
    chain = LocalChain(out, EXACT_GGUF)
    for i, prompt in enumerate(PROMPTS):
        tokens, _ = chain.greedy(f"p{i}", prompt, 16)
        expected, _ = reference_greedy(reference, prompt, 16)
        assert tokens == expected


def test_paged_gguf_stages_equal_stateful(gguf_export: Callable[..., Path]) -> None:
    export = gguf_export("qwen3", 2)
    stateful = LocalChain(export, EXACT_GGUF)
    paged = LocalChain(export, EXACT_GGUF, kv_backend="paged")
    for i, prompt in enumerate(PROMPTS):
        assert paged.greedy(f"p{i}", prompt, 12)[0] == stateful.greedy(f"s{i}", prompt, 12)[0]


def test_each_stage_exported_alone_on_its_own_machine_forms_the_same_ring(
    tmp_path: Path,
    tiny_gguf: Callable[..., Path],
    gguf_export: Callable[..., Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Three "machines", each with its own copy of the file in another folder, export their own
    stage (`--stage K`): the manifests, and so the export's identity, are the same; the stages
    gathered in one folder compute exactly what the whole export does."""
    whole = gguf_export("llama", 3)
    gathered = tmp_path / "ring"
    hashes = set()
    for k in range(3):
        machine = tmp_path / f"pc{k}"
        copy = machine / "models" / tiny_gguf("llama").name
        copy.parent.mkdir(parents=True)
        shutil.copy(tiny_gguf("llama"), copy)
        out = machine / "export"
        code = main(
            ["export", str(copy), "--stages", "3", "--stage", str(k), "--out", str(out), "--quiet"]
        )
        assert code == 0
        assert sorted(p.name for p in out.iterdir()) == ["manifest.json", f"stage-{k}", "tokenizer"]
        hashes.add(manifest_hash(out))
        if k == 0:
            shutil.copytree(out, gathered)
        else:
            shutil.copytree(out / f"stage-{k}", gathered / f"stage-{k}")
    assert hashes == {manifest_hash(whole)}
    # one machine adds another stage to its folder: allowed, the same export
    assert (
        main(
            [
                "export",
                str(tiny_gguf("llama")),
                "--stages",
                "3",
                "--stage",
                "2",
                "--out",
                str(tmp_path / "pc0" / "export"),
                "--quiet",
            ]
        )
        == 0
    )
    report = verify_export(
        gathered,
        prompt_ids=PROMPTS,
        steps=16,
        against=whole,
        reference=False,
        options=EXACT_GGUF,
    )
    assert all(r.against is not None and r.against.max_abs_diff == 0.0 for r in report.results)

    capsys.readouterr()
    # another export's stage into that folder, a stage outside the plan, abbreviations
    for argv, message in [
        (["--stages", "2", "--stage", "1", "--out", str(gathered)], "holds another export"),
        (["--stages", "3", "--stage", "3", "--out", str(tmp_path / "x")], "stages 0-2"),
        (["--stages", "3", "--stag", "1", "--out", str(tmp_path / "x")], "unrecognized"),
        (
            [
                "--stages",
                "3",
                "--stage",
                "1",
                "--draft",
                str(tiny_gguf("llama")),
                "--out",
                str(tmp_path / "x"),
            ],
            "export the draft on the gateway's PC",
        ),
    ]:
        with pytest.raises(SystemExit) if "unrecognized" in message else _no_raise():
            code = main(["export", str(tiny_gguf("llama")), *argv, "--quiet"])
            assert code != 0
        assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert manifest_hash(gathered) == manifest_hash(whole)


class _no_raise:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


def test_gguf_weights_need_a_gguf_file(
    tmp_path: Path, tiny_model: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "export",
            str(tiny_model("qwen2")),
            "--weights",
            "gguf",
            "--out",
            str(tmp_path / "o"),
            "--quiet",
        ]
    )
    assert code != 0 and "is not a GGUF file" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_gguf_tokenizer_is_read_once_then_cached(
    tmp_path: Path, tiny_gguf: Callable[..., Path]
) -> None:
    """transformers builds a GGUF's tokenizer from the whole metadata (seconds for a real
    vocabulary, at every export): the first export caches it by the file's sha256, and an
    export from the cache writes the same tokenizer files and the same manifest."""
    from exporter.source import TOKENIZER_CACHE

    gguf = tiny_gguf("qwen2")
    cache = tmp_path / "cache"

    def export(name: str) -> Path:
        out = tmp_path / name
        export_model(ExportOptions(model=str(gguf), out=out, stages=1, quiet=True, cache_dir=cache))
        return out

    first = export("first")
    [cached] = (cache / TOKENIZER_CACHE).iterdir()
    assert (cached / "tokenizer.json").is_file()
    assert not [p for p in cached.parent.iterdir() if p.name.startswith(".")]  # no leftovers
    second = export("second")
    files = sorted(p.name for p in (first / "tokenizer").iterdir())
    assert files == sorted(p.name for p in (second / "tokenizer").iterdir())
    for name in files:
        assert (first / "tokenizer" / name).read_bytes() == (
            second / "tokenizer" / name
        ).read_bytes()
    assert manifest_hash(first) == manifest_hash(second)
    # the second export did read the cache: an edit there shows in the next export
    config = cached / "tokenizer_config.json"
    mark = '"x_cache_mark": 1, "model_max_length"'
    config.write_text(config.read_text().replace('"model_max_length"', mark))
    assert "x_cache_mark" in (export("third") / "tokenizer" / "tokenizer_config.json").read_text()


def test_header_reader_steps_over_arrays_to_the_same_tensors(
    tiny_gguf: Callable[..., Path],
) -> None:
    """The export's header reader skips decoding the vocabulary's arrays and must still land on
    the same tensor index (names, types, shapes, offsets) and scalar fields as gguf's reader."""
    from gguf import GGUFReader, GGUFValueType

    from exporter.weights import read_gguf_header

    path = tiny_gguf("qwen2")
    fast, full = read_gguf_header(path), GGUFReader(str(path))
    assert read_gguf_header(path) is fast  # parsed once per process

    def index(reader: Any) -> list[tuple[object, ...]]:
        return [
            (t.name, t.tensor_type, t.shape.tolist(), t.data_offset, t.n_bytes, bytes(t.data))
            for t in reader.tensors
        ]

    assert index(fast) == index(full)
    assert fast.data_offset == full.data_offset
    assert list(fast.fields) == list(full.fields)
    arrays = [k for k, f in full.fields.items() if f.types[0] == GGUFValueType.ARRAY]
    assert "tokenizer.ggml.tokens" in arrays and "tokenizer.ggml.token_type" in arrays
    for key, field in full.fields.items():
        if key in arrays:
            assert fast.fields[key].types == field.types[:2]
            assert fast.fields[key].data == []  # not decoded
        else:
            assert [bytes(p) for p in fast.fields[key].parts] == [bytes(p) for p in field.parts]


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_a_glm4moe_gguf_equals_the_hugging_face_model_it_was_written_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], stages: int
) -> None:
    """GLM-4.5 from GGUF (llama.cpp's glm4moe: post_attention_norm before the MLP, stacked
    experts, ffn_*_shexp, exp_probs_b, a NextN block after the last layer), which transformers
    cannot read: its config and tokenizer come from exporter.gguf_reader. The Hugging Face
    weights are first rounded to what Q8_0 holds, so that the Q8_0 file and the folder hold the
    same values: 1, 2 and 3 stages of the file (i8 codes, every expert layer as GatherMatmul on
    both KV backends) give the folder's greedy tokens in transformers, stateful and paged; the
    NextN block is skipped and the plan says so."""
    import torch
    from gguf import GGUFReader
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from exporter.verify import reference_greedy
    from testing_support.tiny_gguf import dequantize, make_hf_model, quantize, write_gguf

    hf = make_hf_model("glm4_moe", tmp_path / "hf", layers=4)
    state = load_file(str(hf / "model.safetensors"))
    for name, tensor in state.items():
        if tensor.dim() >= 2 and not name.endswith("mlp.gate.weight"):  # routers stay F32
            rows = tensor.float().numpy().reshape(-1, tensor.shape[-1])
            exact = dequantize(quantize(rows, "Q8_0"), "Q8_0").reshape(tensor.shape)
            state[name] = torch.from_numpy(np.ascontiguousarray(exact))
    save_file(state, str(hf / "model.safetensors"), metadata={"format": "pt"})
    gguf = write_gguf(hf, tmp_path / "glm.gguf", "Q8_0")
    names = {t.name for t in GGUFReader(gguf).tensors}
    assert {"blk.1.post_attention_norm.weight", "blk.1.exp_probs_b.bias"} <= names
    assert {"blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_shexp.weight"} <= names
    assert "blk.4.nextn.eh_proj.weight" in names  # the NextN block after layers 0-3

    out = tmp_path / "out"
    export_model(ExportOptions(model=str(gguf), out=out, stages=stages))
    printed = capsys.readouterr().out
    assert "skipped: 1 NextN/MTP layer(s) stored after layer 3" in printed
    manifest = load_manifest(out)
    assert manifest.model.architecture == "glm4_moe" and manifest.model.num_layers == 4
    assert manifest.num_stages == stages
    core = ov.Core()
    for stage in manifest.stages:
        compiled = core.compile_model(
            out / stage.model_xml, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
        )
        paged = PagedRunner(out, stage.index, EXACT_GGUF, kv_cache_bytes=1 << 22)
        experts = len(set(range(1, 4)) & set(range(stage.layer_start, stage.layer_end)))
        for ops in (
            compiled.get_runtime_model().get_ops(),
            paged.compiled.get_runtime_model().get_ops(),
        ):
            kinds = [str(op.get_rt_info()["layerType"].astype(str)) for op in ops]
            assert Counter(kinds)["GatherMatmul"] == 3 * experts, Counter(kinds)  # layer 0 dense
            gather = [op for op, kind in zip(ops, kinds, strict=True) if kind == "GatherMatmul"]
            codes = {op.input_value(1).get_element_type().get_type_name() for op in gather}
            assert codes == ({"i8"} if experts else set())
    reference = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    for backend in ("stateful", "paged"):
        chain = LocalChain(out, EXACT_GGUF, kv_backend=backend)
        for i, prompt in enumerate(PROMPTS):
            tokens, _ = chain.greedy(f"p{i}", prompt, 16)
            expected, _ = reference_greedy(reference, prompt, 16)
            assert tokens == expected, f"{backend}: {tokens} != {expected}"


# gpt-oss as llama.cpp's gpt-oss files hold it: MXFP4 experts, Q8_0 elsewhere
GPT_OSS_TYPES = {"": "Q8_0", "_exps": "MXFP4"}


@pytest.mark.parametrize("fused", [False, True])
def test_a_gpt_oss_gguf_equals_the_hugging_face_model_it_was_written_from(
    tmp_path: Path, fused: bool
) -> None:
    """gpt-oss from GGUF (llama.cpp's gpt-oss: attn_sinks, post_attention_norm before the MLP,
    the router's bias, MXFP4 experts with F32 biases, gate and up apart as the converter writes
    them, or fused gate rows then up rows), which transformers cannot read: its config and
    tokenizer come from exporter.gguf_reader. The Hugging Face weights are first rounded to
    what the file holds (Q8_0, MXFP4), so transformers on the folder is the file's reference:
    1 and 2 stages, stateful and paged, give its greedy tokens; every expert layer compiles to
    2 GatherMatmul reading the MXFP4 codes as i8."""
    import torch
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
    from transformers import AutoModelForCausalLM

    from exporter.verify import reference_greedy
    from testing_support.tiny_gguf import make_hf_model, round_weights, write_gguf

    hf = make_hf_model("gpt_oss", tmp_path / "hf", layers=4)
    round_weights(hf, GPT_OSS_TYPES)
    gguf = write_gguf(hf, tmp_path / "oss.gguf", GPT_OSS_TYPES)
    reader = GGUFReader(gguf)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.1.ffn_gate_exps.weight"] == GGMLQuantizationType.MXFP4
    assert types["blk.1.ffn_down_exps.weight"] == GGMLQuantizationType.MXFP4
    assert types["blk.1.attn_q.weight"] == GGMLQuantizationType.Q8_0
    assert {"blk.1.attn_sinks.weight", "blk.1.post_attention_norm.weight"} <= set(types)
    assert {"blk.1.ffn_gate_inp.bias", "blk.1.ffn_up_exps.bias"} <= set(types)
    if fused:  # the converter's fuse_gate_up_exps: one tensor, each expert's gate then up rows
        fused_path = tmp_path / "oss-fused.gguf"
        arch = reader.fields["general.architecture"].contents()
        writer = GGUFWriter(fused_path, arch)
        for field in reader.fields.values():
            if not field.name.startswith(("GGUF.", "general.architecture")):
                writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1])
        tensors = {t.name: t for t in reader.tensors}
        for name, t in tensors.items():
            if ".ffn_up_exps." in name:
                continue
            if ".ffn_gate_exps." in name:
                up = tensors[name.replace("gate", "up")]
                gate_data, up_data = np.asarray(t.data), np.asarray(up.data)
                # weights [E, rows, row bytes] stack their rows, biases [E, rows] their values
                axis = -1 if gate_data.ndim == 2 else -2
                data = np.concatenate([gate_data, up_data], axis=axis)
                name = name.replace("ffn_gate_exps", "ffn_gate_up_exps")
            else:
                data = np.asarray(t.data)
            writer.add_tensor(name, data, raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        gguf = fused_path
        assert "blk.1.ffn_gate_up_exps.weight" in {t.name for t in GGUFReader(gguf).tensors}
    reference = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    expected = [reference_greedy(reference, prompt, 16)[0] for prompt in PROMPTS]
    core = ov.Core()
    for stages in (1, 2):
        out = tmp_path / f"out-{stages}"
        export_model(ExportOptions(model=str(gguf), out=out, stages=stages, quiet=True))
        manifest = load_manifest(out)
        assert manifest.model.architecture == "gpt_oss" and manifest.model.num_layers == 4
        summary = {e.type: e for e in manifest.weights.gguf_types if e.matrix}
        assert summary["MXFP4"].exactness == "bit-exact"
        for stage in manifest.stages:
            compiled = core.compile_model(
                out / stage.model_xml, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
            )
            ops = compiled.get_runtime_model().get_ops()
            gather = [o for o in ops if o.get_rt_info()["layerType"].astype(str) == "GatherMatmul"]
            assert len(gather) == 2 * stage.num_layers
            assert {o.input_value(1).get_element_type().get_type_name() for o in gather} == {"i8"}
        for backend in ("stateful", "paged"):
            chain = LocalChain(out, EXACT_GGUF, kv_backend=backend)
            for i, prompt in enumerate(PROMPTS):
                tokens, _ = chain.greedy(f"p{i}", prompt, 16)
                assert tokens == expected[i], f"{stages} stages, {backend}"


def test_gpt_oss_mxfp4_checkpoint_equals_its_dense_folder(tmp_path: Path) -> None:
    """OpenAI's gpt-oss checkpoints store the experts as MXFP4 ``*_blocks`` (two e2m1 codes a
    byte, the even element low) and ``*_scales`` (e8m0): a folder written that way from a tiny
    model whose experts hold MXFP4 values exports to the same graph values as the dense folder:
    the same greedy tokens and logits within float rounding, which the dense folder's test
    ties to transformers."""
    import torch
    from gguf import GGMLQuantizationType
    from gguf import quants as gguf_quants
    from safetensors.torch import load_file, save_file

    from testing_support.tiny_gguf import make_hf_model, round_weights

    dense = make_hf_model("gpt_oss", tmp_path / "dense", layers=2)
    round_weights(dense, {"_exps": "MXFP4"})  # experts only; the rest stays F32
    packed = tmp_path / "mxfp4"
    shutil.copytree(dense, packed)
    state = load_file(str(dense / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name] = tensor
            continue
        rows = tensor.transpose(-1, -2).float().numpy()  # [E, out, in], as the blocks are
        experts, width, cols = rows.shape
        blocks = gguf_quants.quantize(rows.reshape(-1, cols), GGMLQuantizationType.MXFP4)
        blocks = blocks.reshape(experts, width, cols // 32, 17)
        codes = np.concatenate([blocks[..., 1:] & 0x0F, blocks[..., 1:] >> 4], axis=-1)
        hf_blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # the even element low
        out[f"{name}_blocks"] = torch.from_numpy(np.ascontiguousarray(hf_blocks))
        out[f"{name}_scales"] = torch.from_numpy(np.ascontiguousarray(blocks[..., 0]))
    save_file(out, str(packed / "model.safetensors"), metadata={"format": "pt"})
    exports = []
    for folder in (dense, packed):
        export_dir = tmp_path / f"export-{folder.name}"
        export_model(
            ExportOptions(
                model=str(folder),
                out=export_dir,
                stages=2,
                weights=WeightSpec(format="fp32"),
                quiet=True,
            )
        )
        exports.append(export_dir)
    report = verify_export(
        exports[1], prompt_ids=PROMPTS, steps=16, against=exports[0], reference=False,
        options=EXACT_GGUF, atol=1e-5,
    )  # fmt: skip
    assert report.failures() == []
    assert all(r.against is not None and r.against.identical for r in report.results)


@pytest.mark.parametrize(
    ("arch", "types"), [("gpt_oss", GPT_OSS_TYPES), ("glm4_moe", {"": "Q8_0", "_exps": "Q4_K"})]
)
def test_verify_a_gguf_transformers_cannot_read(
    tmp_path: Path, arch: str, types: dict[str, str]
) -> None:
    """`pipeshard verify` of an export from a gpt-oss or GLM-4.5 GGUF, whose weights
    transformers' GGUF loader refuses: the reference is transformers' model of the file's
    config holding the file's weights as gguf-py de-quantizes them (the same as an export from
    the Hugging Face folder would be compared with); strict under the exact runtime."""
    from testing_support.tiny_gguf import make_gguf_model

    gguf = make_gguf_model(arch, tmp_path / "gguf", types=types)
    out = tmp_path / "out"
    export_model(ExportOptions(model=str(gguf), out=out, stages=2, quiet=True))
    report = verify_export(out, prompt_ids=PROMPTS, steps=16, options=EXACT_GGUF)
    for result in report.results:
        assert result.reference is not None and result.reference.strict
        assert result.reference.matched == 16, result
    assert report.failures() == []


def test_pipeshard_plans_tensors_are_a_glm4moe_gguf_s(tmp_path: Path) -> None:
    """`pipeshard plan`'s GLM tensors, names and shapes, are those of a glm4moe GGUF written as
    llama.cpp writes one (testing_support/tiny_gguf.py), given the tiny model's shape: the NextN
    block after the last layer aside."""
    import dataclasses
    import json

    from gguf import GGUFReader

    from exporter.presets import PRESETS, tensors
    from testing_support.tiny_gguf import make_hf_model, write_gguf

    hf = make_hf_model("glm4_moe", tmp_path / "hf", layers=4)
    path = write_gguf(hf, tmp_path / "glm.gguf", "Q8_0")
    stored = {
        t.name: tuple(int(d) for d in reversed(t.shape.tolist()))
        for t in GGUFReader(path).tensors
        if not t.name.startswith("blk.4.")  # the NextN block
    }
    config = json.loads((hf / "config.json").read_text())
    tiny = dataclasses.replace(
        PRESETS["glm-4.7"],
        layers=config["num_hidden_layers"],
        hidden=config["hidden_size"],
        heads=config["num_attention_heads"],
        kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        vocab=config["vocab_size"],
        intermediate=config["intermediate_size"],
        experts=config["n_routed_experts"],
        experts_per_token=config["num_experts_per_tok"],
        expert_intermediate=config["moe_intermediate_size"],
        shared_expert_intermediate=config["moe_intermediate_size"],
        first_dense=config["first_k_dense_replace"],
    )
    planned = {t.name: t.shape for t in tensors(tiny)}
    assert planned == stored


@pytest.mark.parametrize(
    ("arch", "gguf_arch"),
    [("qwen3_5", "qwen35"), ("qwen3_5_moe", "qwen35moe"), ("qwen3_next", "qwen3next")],
)
def test_a_hybrid_gguf_equals_the_hugging_face_model_it_was_written_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], arch: str, gguf_arch: str
) -> None:
    """Qwen3.5 / Qwen3.5-MoE / Qwen3-Next from GGUF, written as llama.cpp's converter does:
    A stored as -exp(A_log), dt_bias as ssm_dt.bias, norms plus one (not ssm_norm), value heads
    tiled for Qwen3.5 (the graph repeats the key heads tiled to match), Qwen3-Next's qkvz
    regrouped and its b/a fused in ssm_ba, an MTP block after Qwen3.5's last layer (skipped).
    The Hugging Face weights are first rounded to what Q8_0 holds: 1, 2 (L L | L F) and 3
    stages of the file give the folder's greedy tokens in transformers on both KV backends, also
    after a chunked prefill; every linear-attention layer is one GatedDeltaNet node, every expert
    layer 3 GatherMatmul on i8 codes."""
    import torch
    from gguf import GGUFReader
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from exporter.verify import reference_greedy
    from testing_support.tiny_gguf import dequantize, make_hf_model, quantize, write_gguf

    hf = make_hf_model(arch, tmp_path / "hf", layers=4)
    state = load_file(str(hf / "model.safetensors"))
    kept = ("mlp.gate.weight", "shared_expert_gate.weight", "conv1d.weight")  # F32 in the file
    for name, tensor in state.items():
        if tensor.dim() >= 2 and not name.endswith(kept):
            rows = tensor.float().numpy().reshape(-1, tensor.shape[-1])
            exact = dequantize(quantize(rows, "Q8_0"), "Q8_0").reshape(tensor.shape)
            state[name] = torch.from_numpy(np.ascontiguousarray(exact))
    save_file(state, str(hf / "model.safetensors"), metadata={"format": "pt"})
    gguf = write_gguf(hf, tmp_path / f"{gguf_arch}.gguf", "Q8_0")
    names = {t.name for t in GGUFReader(gguf).tensors}
    assert {"blk.0.ssm_a", "blk.0.ssm_dt.bias", "blk.0.attn_qkv.weight"} <= names
    assert ("blk.0.ssm_ba.weight" in names) == (gguf_arch == "qwen3next")
    assert ("blk.4.attn_q.weight" in names) == (gguf_arch != "qwen3next")  # the MTP block

    reference = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    expected = [reference_greedy(reference, prompt, 12)[0] for prompt in PROMPTS]
    for stages in (1, 2, 3):
        out = tmp_path / f"out-{stages}"
        export_model(ExportOptions(model=str(gguf), out=out, stages=stages))
        printed = capsys.readouterr().out
        mtp = "skipped: 1 NextN/MTP layer(s) stored after layer 3" in printed
        assert mtp == (gguf_arch != "qwen3next")
        manifest = load_manifest(out)
        assert manifest.model.architecture == f"{arch}_text".replace("next_text", "next")
        assert manifest.model.layer_types == ["linear_attention"] * 3 + ["full_attention"]
        core = ov.Core()
        for stage in manifest.stages:
            compiled = core.compile_model(
                out / stage.model_xml, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
            )
            ops = compiled.get_runtime_model().get_ops()
            types = Counter(op.get_rt_info()["layerType"].astype(str) for op in ops)
            local = range(stage.layer_start, stage.layer_end)
            assert types["GatedDeltaNet"] == len(set(local) - {3}), types
            experts = 0 if arch == "qwen3_5" else len(local)
            assert types["GatherMatmul"] == 3 * experts, types
        for backend in ("stateful", "paged"):
            chain = LocalChain(out, EXACT_GGUF, kv_backend=backend, kv_cache_bytes=1 << 22)
            for i, prompt in enumerate(PROMPTS):
                tokens, _ = chain.greedy(f"p{i}", prompt, 12)
                assert tokens == expected[i], f"{stages} {backend} stages: {tokens}"
                # a chunked prefill: 3 positions, 1, then the rest
                session = f"c{i}"
                for lo, hi in ((0, 3), (3, 4), (4, len(prompt))):
                    logits = chain.forward(session, np.asarray(prompt[lo:hi]))[-1]
                chunked = [int(np.argmax(logits))]
                for _ in range(11):
                    step = chain.forward(session, np.asarray(chunked[-1:]))
                    chunked.append(int(np.argmax(step[-1])))
                assert chunked == expected[i], f"{stages} {backend} stages, chunked"


def test_the_benchmarks_glm_stand_in_is_a_glm_4_5_air_shaped_glm4moe_file(tmp_path: Path) -> None:
    """``pipeshard bench gguf-export write --model glm-4.5-air`` (the stand-in the MoE speed
    reports time), at a tiny shape: exactly the tensors, shapes and llama-quantize Q4_K_M types
    of `pipeshard plan`'s GLM-4.5-Air table cut to these layers (an expert's 160 channels are
    no K-quant row: its ffn_down falls back to Q5_0 / Q8_0), metadata the GGUF reader maps to
    GLM-4.5-Air's routing (the first layer dense, sigmoid, one shared expert, half of each head
    rotating, biases, no QK-norm); its 2 stages run every expert layer as GatherMatmul."""
    import dataclasses

    from gguf import GGUFReader

    from benchmarks.gguf_export import main as gguf_export_main
    from exporter.gguf_reader import read_config
    from exporter.presets import PRESETS, typed_tensors

    path = tmp_path / "glm.gguf"
    tiny = dict(hidden=256, intermediate=352, heads=4, kv_heads=2, head_dim=64, vocab=512)
    moe = dict(experts=8, experts_per_token=2, expert_intermediate=160)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**tiny, **moe}.items()]
    gguf_export_main(["write", str(path), "--model", "glm-4.5-air", "--layers", "3", *flags])

    preset = dataclasses.replace(
        PRESETS["glm-4.5-air"], layers=3, **tiny, **moe, shared_expert_intermediate=160
    )
    planned = {t.tensor.name: (t.tensor.shape, t.type) for t in typed_tensors(preset, "Q4_K_M")}
    stored = {
        t.name: (tuple(int(d) for d in reversed(t.shape.tolist())), t.tensor_type.name)
        for t in GGUFReader(path).tensors
    }
    assert stored == planned
    assert stored["blk.1.ffn_down_exps.weight"] == ((8, 256, 160), "Q5_0")
    assert stored["blk.2.ffn_down_exps.weight"] == ((8, 256, 160), "Q8_0")  # use_more_bits
    assert stored["blk.1.ffn_gate_exps.weight"] == ((8, 160, 256), "Q4_K")
    assert stored["blk.0.ffn_down.weight"] == ((256, 352), "Q5_0")
    assert "blk.0.ffn_gate_exps.weight" not in stored and "blk.0.attn_q_norm.weight" not in stored

    config = read_config(path)
    assert config["model_type"] == "glm4_moe"
    expected = {
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 160,
        "intermediate_size": 352,
        "head_dim": 64,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "attention_bias": True,
        "use_qk_norm": False,
        "vocab_size": 512,
    }
    assert {k: config[k] for k in expected} == expected
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.5

    out = tmp_path / "out"
    export_model(ExportOptions(model=str(path), out=out, stages=2, quiet=True))
    manifest = load_manifest(out)
    assert manifest.model.architecture == "glm4_moe" and manifest.num_stages == 2
    core = ov.Core()
    for stage in manifest.stages:
        compiled = core.compile_model(out / stage.model_xml, "CPU")
        kinds = Counter(
            str(op.get_rt_info()["layerType"].astype(str))
            for op in compiled.get_runtime_model().get_ops()
        )
        experts = len(set(range(1, 3)) & set(range(stage.layer_start, stage.layer_end)))
        assert kinds["GatherMatmul"] == 3 * experts, kinds
    tokens, _ = LocalChain(out, RunnerOptions()).greedy("s", PROMPTS[0], 8)
    assert len(tokens) == 8


def test_the_benchmarks_qwen3_6_stand_in_is_a_qwen3_6_35b_a3b_shaped_qwen35moe_file(
    tmp_path: Path,
) -> None:
    """``pipeshard bench gguf-export write --model qwen3.6-35b-a3b`` at a tiny shape: exactly
    the tensors, shapes and llama-quantize Q4_K_M types of `pipeshard plan`'s Qwen3.6-35B-A3B
    table cut to these layers (3 Gated DeltaNet layers then a gated full-attention one, attn_qkv
    in Q5_K, Q6_K ffn_down on the use_more_bits layers and attn_v on the last full-attention
    layer, a gated shared expert, conv kernels and routers F32), metadata the GGUF reader maps
    to Qwen3.5-MoE's config (no MTP layer); its 2 stages run every linear-attention layer as one
    GatedDeltaNet node and every expert layer as GatherMatmul, and decode."""
    import dataclasses

    from gguf import GGUFReader

    from benchmarks.gguf_export import main as gguf_export_main
    from exporter.gguf_reader import read_config
    from exporter.presets import PRESETS, typed_tensors

    path = tmp_path / "qwen36.gguf"
    tiny = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=512)
    moe = dict(experts=8, experts_per_token=2, expert_intermediate=256)
    linear = dict(linear_key_heads=2, linear_value_heads=4, linear_head_dim=64)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**tiny, **moe, **linear}.items()]
    gguf_export_main(["write", str(path), "--model", "qwen3.6-35b-a3b", "--layers", "8", *flags])

    preset = dataclasses.replace(
        PRESETS["qwen3.6-35b-a3b"],
        layers=8,
        **tiny,
        **moe,
        shared_expert_intermediate=256,
        linear_key_heads=2,
        linear_value_heads=4,
        linear_key_dim=64,
        linear_value_dim=64,
    )
    planned = {t.tensor.name: (t.tensor.shape, t.type) for t in typed_tensors(preset, "Q4_K_M")}
    stored = {
        t.name: (tuple(int(d) for d in reversed(t.shape.tolist())), t.tensor_type.name)
        for t in GGUFReader(path).tensors
    }
    assert stored == planned
    assert stored["blk.0.attn_qkv.weight"] == ((512, 256), "Q5_K")
    assert stored["blk.0.ssm_conv1d.weight"] == ((512, 4), "F32")
    assert stored["blk.0.ffn_down_exps.weight"] == ((8, 256, 256), "Q6_K")  # use_more_bits
    assert stored["blk.1.ffn_down_exps.weight"] == ((8, 256, 256), "Q4_K")
    assert stored["blk.3.attn_q.weight"] == ((512, 256), "Q4_K")  # the query and its gate
    assert stored["blk.3.attn_v.weight"][1] == "Q4_K" and stored["blk.7.attn_v.weight"][1] == "Q6_K"
    assert stored["blk.3.ffn_gate_inp_shexp.weight"] == ((1, 256), "F32")
    assert "blk.0.attn_q.weight" not in stored and "blk.3.attn_qkv.weight" not in stored
    assert "blk.8.attn_norm.weight" not in stored  # no MTP block

    config = read_config(path)
    assert config["model_type"] == "qwen3_5_moe_text"
    expected = {
        "num_hidden_layers": 8,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 256,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "head_dim": 64,
        "vocab_size": 512,
    }
    assert {k: config[k] for k in expected} == expected
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert "mtp_num_hidden_layers" not in config

    out = tmp_path / "out"
    export_model(ExportOptions(model=str(path), out=out, stages=2, quiet=True))
    manifest = load_manifest(out)
    assert manifest.model.architecture == "qwen3_5_moe_text" and manifest.num_stages == 2
    core = ov.Core()
    for stage in manifest.stages:
        compiled = core.compile_model(out / stage.model_xml, "CPU")
        kinds = Counter(
            str(op.get_rt_info()["layerType"].astype(str))
            for op in compiled.get_runtime_model().get_ops()
        )
        local = range(stage.layer_start, stage.layer_end)
        assert kinds["GatedDeltaNet"] == sum(1 for i in local if i % 4 != 3), kinds
        assert kinds["GatherMatmul"] == 3 * len(local), kinds
    tokens, _ = LocalChain(out, RunnerOptions()).greedy("s", PROMPTS[0], 8)
    assert len(tokens) == 8


def test_the_benchmarks_gpt_oss_stand_in_is_a_gpt_oss_20b_shaped_mxfp4_file(
    tmp_path: Path,
) -> None:
    """``pipeshard bench gguf-export write --model gpt-oss-20b`` at a tiny shape: exactly the
    tensors, shapes and types of `pipeshard plan`'s gpt-oss-20b MXFP4 table cut to these layers
    (experts MXFP4 with F32 biases [E, rows], attention sinks, q/k/v/o biases, a biased router,
    every other matrix Q8_0, file type MOSTLY_MXFP4_MOE), metadata the GGUF reader maps to
    gpt-oss's config (sliding window on every other layer, the first sliding; YaRN factor 32
    over 4096 positions); its 2 stages read the MXFP4 codes bit-exactly, run every expert
    layer as 2 GatherMatmul, and decode."""
    import dataclasses

    from gguf import GGUFReader, LlamaFileType

    from benchmarks.gguf_export import main as gguf_export_main
    from exporter.gguf_reader import read_config
    from exporter.presets import PRESETS, typed_tensors

    path = tmp_path / "oss.gguf"
    tiny = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=512)
    moe = dict(experts=8, experts_per_token=2, expert_intermediate=128)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**tiny, **moe}.items()]
    gguf_export_main(["write", str(path), "--model", "gpt-oss-20b", "--layers", "4", *flags])

    preset = dataclasses.replace(PRESETS["gpt-oss-20b"], layers=4, **tiny, **moe)
    planned = {t.tensor.name: (t.tensor.shape, t.type) for t in typed_tensors(preset, "MXFP4")}
    reader = GGUFReader(path)
    stored = {
        t.name: (tuple(int(d) for d in reversed(t.shape.tolist())), t.tensor_type.name)
        for t in reader.tensors
    }
    assert stored == planned
    assert stored["blk.0.ffn_gate_exps.weight"] == ((8, 128, 256), "MXFP4")
    assert stored["blk.3.ffn_down_exps.weight"] == ((8, 256, 128), "MXFP4")
    assert stored["blk.0.ffn_up_exps.bias"] == ((8, 128), "F32")
    assert stored["blk.0.attn_q.weight"] == ((256, 256), "Q8_0")
    assert stored["blk.0.attn_sinks.weight"] == ((4,), "F32")
    assert stored["output.weight"] == ((512, 256), "Q8_0")
    file_type = int(reader.fields["general.file_type"].parts[-1][0])
    assert file_type == LlamaFileType.MOSTLY_MXFP4_MOE

    config = read_config(path)
    assert config["model_type"] == "gpt_oss"
    expected = {
        "num_hidden_layers": 4,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 128,
        "head_dim": 64,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "attention_bias": True,
        "vocab_size": 512,
    }
    assert {k: config[k] for k in expected} == expected
    rope = config["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == (
        "yarn",
        32.0,
        4096,
    )

    out = tmp_path / "out"
    export_model(ExportOptions(model=str(path), out=out, stages=2, quiet=True))
    manifest = load_manifest(out)
    assert manifest.model.architecture == "gpt_oss" and manifest.num_stages == 2
    summary = {e.type: e for e in manifest.weights.gguf_types if e.matrix}
    assert summary["MXFP4"].exactness == "bit-exact"
    core = ov.Core()
    for stage in manifest.stages:
        compiled = core.compile_model(out / stage.model_xml, "CPU")
        kinds = Counter(
            str(op.get_rt_info()["layerType"].astype(str))
            for op in compiled.get_runtime_model().get_ops()
        )
        assert kinds["GatherMatmul"] == 2 * stage.num_layers, kinds
    tokens, _ = LocalChain(out, RunnerOptions()).greedy("s", PROMPTS[0], 8)
    assert len(tokens) == 8


def test_the_benchmarks_dense_active_stand_in_of_glm_s_shape(tmp_path: Path) -> None:
    """The dense model a GLM-4.5-Air cut is timed against: its active width (9 x 1408 = 12672
    channels, no multiple of 256) takes Q5_0 for ffn_down, or Q8_0 where Q4_K_M gives Q6_K, as
    llama-quantize falls back; its 96 heads of 128 over hidden 4096 are no Llama for
    transformers, so ``--qwen3`` writes a Qwen3 (here 4 heads of 128 over 256), which exports
    and decodes."""
    from gguf import GGUFReader

    from benchmarks.gguf_export import main as gguf_export_main

    path = tmp_path / "dense.gguf"
    shape = ["--hidden", "256", "--intermediate", "352", "--heads", "4", "--kv-heads", "2"]
    gguf_export_main(["write", str(path), "--qwen3", "--layers", "9", *shape, "--head-dim", "128"])
    reader = GGUFReader(path)
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "qwen3"
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    downs = [types[f"blk.{i}.ffn_down.weight"] for i in range(9)]
    # Q6_K on llama-quantize's use_more_bits layers (0, 3, 6 and the last eighth: 7, 8)
    assert downs == ["Q8_0", "Q5_0", "Q5_0", "Q8_0", "Q5_0", "Q5_0", "Q8_0", "Q8_0", "Q8_0"]
    assert types["blk.0.ffn_gate.weight"] == types["blk.0.ffn_up.weight"] == "Q4_K"
    assert types["blk.0.attn_q_norm.weight"] == "F32"
    out = tmp_path / "out"
    export_model(ExportOptions(model=str(path), out=out, stages=1, quiet=True))
    manifest = load_manifest(out)
    assert manifest.model.architecture == "qwen3" and manifest.model.head_dim == 128
    assert len(LocalChain(out, RunnerOptions()).greedy("s", PROMPTS[0], 4)[0]) == 4
