"""exporter.gguf_quant: GGUF blocks -> OpenVINO decompression, checked against gguf-py.

The reference is ``gguf.quants.dequantize``. Each type gets random but valid raw blocks (gguf's own
quantizer where it has one, else random fields packed by hand, with the edge cases forced in),
then: numpy reference == gguf, the compiled OpenVINO graph == numpy reference bit for bit, and the
runtime graph keeps the weight compressed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from exporter.gguf_quant import (
    DenseWeight,
    PackedWeight,
    Q4KForm,
    Weight,
    dequantize_reference,
    describe,
    embedding,
    from_gguf,
    linear,
    weight_node,
)

pytestmark = pytest.mark.unit

ROWS, COLS = 16, 512  # two K-quant super-blocks per row
# Strict f32 with no dynamic activation quantization: the only way a matmul by the identity
# returns the decompressed weight bit for bit.
EXACT_CONFIG = {
    "INFERENCE_PRECISION_HINT": "f32",
    "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0",
    "INFERENCE_NUM_THREADS": "1",
}
IDS = np.array([ROWS - 1, 0, 3, 3], dtype=np.int64)
COMPRESSED = {ov.Type.u4, ov.Type.i4, ov.Type.u8, ov.Type.i8}

# (type, code type, group) of the types kept as integer codes
PACKED = {
    T.Q8_0: ("i8", 32),
    T.Q4_0: ("i4", 32),
    T.Q5_0: ("i8", 32),
    T.Q3_K: ("i4", 16),
    T.Q6_K: ("i8", 16),
    T.Q4_1: ("u4", 32),
    T.Q5_1: ("u8", 32),
    T.Q2_K: ("u4", 16),
    T.Q4_K: ("u4", 32),
    T.Q5_K: ("u8", 32),
    T.MXFP4: ("i8", 32),  # e2m1 codes as their doubled values, f32 scales 2^(E - 128)
}
AFFINE = [T.Q4_1, T.Q5_1, T.Q2_K, T.Q4_K, T.Q5_K]  # w = S*q - M: the forms apply
SYMMETRIC = [T.Q8_0, T.Q4_0, T.Q5_0, T.Q3_K, T.Q6_K, T.MXFP4]
DENSE = [T.F32, T.F16, T.BF16]
FORMS: list[Q4KForm] = ["exact", "split"]


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, np.float16).view(np.uint8).reshape(-1, 2)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per super-block -> ggml's 12-byte layout (Q4_K, Q5_K)."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return out


def _floats(rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    x[1, :32] = 0.75  # a constant block: Q4_1/Q5_1 give d = 0 with a nonzero minimum
    x[2, :32] = 0.0  # an all-zero block
    x[3, 32:64] = -np.abs(x[3, 32:64]) - 1.0  # an all-negative block
    return x


def make_raw(tensor_type: T, seed: int = 0) -> np.ndarray:
    """Valid random bytes of a [ROWS, COLS] tensor, shaped [ROWS, row bytes] like GGUFReader."""
    rng = np.random.default_rng(seed)
    if tensor_type in (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        return quants.quantize(_floats(rng), tensor_type).view(np.uint8).reshape(ROWS, -1)
    nb = ROWS * COLS // 256

    def small_f16() -> np.ndarray:
        return _f16_bytes(rng.uniform(1e-4, 1e-2, nb))

    def rand_bytes(n: int) -> np.ndarray:
        return rng.integers(0, 256, (nb, n), dtype=np.uint8)

    if tensor_type in (T.Q4_K, T.Q5_K):
        sc = rng.integers(0, 64, (nb, 8), dtype=np.uint8)
        mn = rng.integers(0, 64, (nb, 8), dtype=np.uint8)
        sc[0, :3], mn[0, :2] = 0, (0, 5)  # sc = 0 with m > 0 (constant -M) and with m = 0
        mn[1, 0], sc[1, 0] = 63, 1  # zero point dmin*m/(d*sc) far above 15
        parts = [small_f16(), small_f16(), _pack_k_scales(sc, mn)]
        parts += [rand_bytes(128)] if tensor_type == T.Q4_K else [rand_bytes(32), rand_bytes(128)]
    elif tensor_type == T.Q2_K:
        scales = rand_bytes(16)
        scales[0, :2] = (5 << 4, 0)  # sc = 0 with m = 5, and sc = m = 0
        parts = [scales, rand_bytes(64), small_f16(), small_f16()]
    elif tensor_type == T.Q3_K:
        parts = [rand_bytes(32), rand_bytes(64), rand_bytes(12), small_f16()]
    elif tensor_type == T.Q6_K:
        parts = [rand_bytes(128), rand_bytes(64), rand_bytes(16), small_f16()]
    elif tensor_type == T.MXFP4:  # 32-element blocks: e8m0 exponent + 16 bytes of e2m1 codes
        nb = ROWS * COLS // 32
        exponent = rng.integers(100, 150, (nb, 1), dtype=np.uint8)
        exponent[:4, 0] = (0, 1, 2, 127)  # f32 denormal scales 2^-128 and 2^-127, 2^-126, 1/2
        parts = [exponent, rand_bytes(16)]
    elif tensor_type == T.IQ4_NL:  # 32-element blocks: f16 d + 16 bytes of 4-bit grid indices
        nb = ROWS * COLS // 32
        parts = [small_f16(), rand_bytes(16)]
    else:
        raise AssertionError(tensor_type)
    return np.concatenate(parts, axis=1).reshape(ROWS, -1)


def gguf_dequant(raw: np.ndarray, tensor_type: T) -> np.ndarray:
    return quants.dequantize(raw, tensor_type).astype(np.float32)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit for bit, except that -0.0 == +0.0.

    A matmul by the identity accumulates from +0.0, so gguf's -0.0 (d < 0 times a zero code)
    comes back as +0.0; every other value must match exactly.
    """
    a32, b32 = np.asarray(a, np.float32) + np.float32(0), np.asarray(b, np.float32) + np.float32(0)
    return a32.shape == b32.shape and bool(np.array_equal(a32.view(np.uint32), b32.view(np.uint32)))


def operand_ulp_bound(raw: np.ndarray, tensor_type: T) -> np.ndarray:
    """One f32 ulp of the larger of gguf's operands |S*q| and |M| (w = S*q - M), per element.

    The fractional zero point form computes (q - M/S) * S: its error is one rounding of the
    operands' size, which is more than one ulp of w only where S*q and M nearly cancel.
    """
    split = from_gguf(tensor_type, raw, (ROWS, COLS), "split")
    assert isinstance(split, PackedWeight) and split.correction is not None
    sq = np.abs(split.codes.astype(np.float32) * np.repeat(split.scale, split.group, axis=1))
    m = np.abs(np.repeat(dequantize_reference(split.correction), split.group, axis=1))
    return np.spacing(np.maximum(sq, m))


def compile_lin_emb(weight: Weight, cols: int, bias: Weight | None = None) -> Any:
    x = ops.parameter([-1, -1, cols], ov.Type.f32, name="x")  # rank 3 like the builder's
    ids = ops.parameter([-1], ov.Type.i64, name="ids")
    outs = [linear(x, weight, "proj", bias), embedding(ids, weight, "embed")]
    return ov.Core().compile_model(ov.Model(outs, [x, ids]), "CPU", EXACT_CONFIG)


def run_identity(compiled: Any, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(W as computed by linear(), the IDS rows as computed by embedding())."""
    res = compiled([np.eye(cols, dtype=np.float32)[None], IDS])
    return res[0][0].T, res[1]


class Layer(NamedTuple):
    kind: str  # the runtime graph's layerType: "FullyConnected", "Gather", "Const", ...
    inputs: list[ov.Type]
    output: ov.Type
    size: int  # elements of the first output (0 if dynamic)


def runtime_layers(compiled: Any) -> list[Layer]:
    layers = []
    for op in compiled.get_runtime_model().get_ordered_ops():
        shape = op.output(0).get_partial_shape()
        layers.append(
            Layer(
                op.get_rt_info()["layerType"].astype(str),
                [op.input(i).get_element_type() for i in range(op.get_input_size())],
                op.output(0).get_element_type(),
                int(np.prod(list(shape.to_shape()))) if shape.is_static else 0,
            )
        )
    return layers


def assert_compressed(compiled: Any, weight: PackedWeight) -> None:
    """The CPU plugin fused the decompression into FullyConnected and Gather.

    Two facts of the runtime graph, robust to node naming: a FullyConnected and a Gather read
    their weight input as integer codes (u4/i4/u8/i8), and no f32 constant of rows*cols elements
    is left, i.e. the decompression was not constant-folded into a dense copy of the weight.
    """
    layers = runtime_layers(compiled)
    assert any(la.kind == "FullyConnected" and la.inputs[1] in COMPRESSED for la in layers), layers
    assert any(la.kind == "Gather" and la.inputs[0] in COMPRESSED for la in layers), layers
    dense = [
        la
        for la in layers
        if la.kind == "Const" and la.output == ov.Type.f32 and la.size >= weight.rows * weight.cols
    ]
    assert not dense, dense


# ---------------------------------------------------------------------------------------------
# 1 + 2 + 3: reference, OpenVINO, fusion


@pytest.mark.parametrize("tensor_type", SYMMETRIC, ids=lambda t: t.name)
def test_symmetric_types_are_bit_exact(tensor_type: T) -> None:
    raw = make_raw(tensor_type)
    weight = from_gguf(tensor_type, raw, (ROWS, COLS))
    assert isinstance(weight, PackedWeight)
    assert (weight.code_type, weight.group) == PACKED[tensor_type]
    assert weight.zero_point is None and weight.source_type == tensor_type.name
    ref = gguf_dequant(raw, tensor_type)
    assert same_bits(dequantize_reference(weight), ref)
    assert describe(tensor_type, "split", True)[1] == "bit-exact"  # what the manifest says
    compiled = compile_lin_emb(weight, COLS)
    lin, emb = run_identity(compiled, COLS)
    if tensor_type == T.MXFP4:
        # MXFP4's scales reach below f32's normal range (E 0, 1: 2^-128, 2^-127): the decoded
        # weight above is bit-exact, but the CPU plugin's kernels may flush values under
        # 2^-122 to zero (the blocks of a real file whose every value is that small are zeros)
        tiny = np.abs(ref) < 2.0**-122
        assert tiny.any() and not np.all(tiny)
        assert np.all((lin[tiny] == 0) | (lin[tiny] == ref[tiny]))
        assert np.all((emb[tiny[IDS]] == 0) | (emb[tiny[IDS]] == ref[IDS][tiny[IDS]]))
        lin, emb = np.where(tiny, ref, lin), np.where(tiny[IDS], ref[IDS], emb)
    assert same_bits(lin, ref)
    assert same_bits(emb, ref[IDS])
    assert_compressed(compiled, weight)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("tensor_type", AFFINE, ids=lambda t: t.name)
def test_scale_min_types(tensor_type: T, form: Q4KForm) -> None:
    raw = make_raw(tensor_type)
    weight = from_gguf(tensor_type, raw, (ROWS, COLS), form)
    assert isinstance(weight, PackedWeight)
    assert (weight.code_type, weight.group) == PACKED[tensor_type]
    ref = gguf_dequant(raw, tensor_type)
    mine = dequantize_reference(weight)
    assert np.isfinite(mine).all()
    # what the manifest says of the type, checked below
    said = {"split": "bit-exact", "exact": "within 1 f32 ulp"}[form]
    assert describe(tensor_type, form, True)[1] == said
    if form == "split":
        # codes*S - M is gguf's own arithmetic: bit for bit
        assert weight.zero_point is None and weight.correction is not None
        assert same_bits(mine, ref)
        fix = weight.correction
        if tensor_type in (T.Q4_1, T.Q5_1):
            # one f16 minimum per block, kept as stored
            assert isinstance(fix, DenseWeight) and fix.array.dtype == np.float16
        else:
            # the K-quants' minimums stay compressed: u8 codes times the super-block's dmin
            assert isinstance(fix, PackedWeight) and fix.code_type == "u8"
            assert (fix.rows, fix.cols, fix.group) == (ROWS, weight.groups, 256 // weight.group)
            assert fix.codes.max() < (16 if tensor_type == T.Q2_K else 64)
    else:
        # (q - Z) * S with f32 Z = M/S: within one ulp of gguf's operands (see the bound)
        assert weight.correction is None and weight.zero_point is not None
        assert (np.abs(mine - ref) <= operand_ulp_bound(raw, tensor_type)).all()
        assert not same_bits(mine, ref)  # the bound is tight, not vacuous
        if tensor_type == T.Q4_K:
            assert weight.zero_point.max() > 15  # kept in f32, not clipped to u4
    compiled = compile_lin_emb(weight, COLS)
    lin, emb = run_identity(compiled, COLS)
    # what OpenVINO computes is exactly the numpy reference of the same encoding
    assert same_bits(lin, mine)
    assert same_bits(emb, mine[IDS])
    assert_compressed(compiled, weight)
    if isinstance(weight.correction, PackedWeight):
        # the correction's matmul is a compressed FullyConnected of its own
        fc = [la for la in runtime_layers(compiled) if la.kind == "FullyConnected"]
        assert sum(la.inputs[1] in COMPRESSED for la in fc) == 2, fc


def test_scale_zero_sub_blocks_decode_to_minus_m() -> None:
    raw = make_raw(T.Q4_K)
    ref = gguf_dequant(raw, T.Q4_K)
    # row 0, super-block 0: sub-blocks 0 and 1 have sc = 0, m = 0 and m = 5
    assert (ref[0, :32] == 0).all()
    assert (ref[0, 32:64] < 0).all() and np.unique(ref[0, 32:64]).size == 1
    for form in FORMS:
        assert same_bits(
            dequantize_reference(from_gguf(T.Q4_K, raw, (ROWS, COLS), form))[0, :64], ref[0, :64]
        )


@pytest.mark.parametrize("tensor_type", DENSE, ids=lambda t: t.name)
def test_dense_types(tensor_type: T) -> None:
    raw = make_raw(tensor_type)
    weight = from_gguf(tensor_type, raw, (ROWS, COLS))
    assert isinstance(weight, DenseWeight)
    want = np.float16 if tensor_type == T.F16 else np.float32
    assert weight.array.dtype == want and weight.array.shape == (ROWS, COLS)
    ref = gguf_dequant(raw, tensor_type)
    assert same_bits(dequantize_reference(weight), ref)
    bias = DenseWeight(np.arange(ROWS, dtype=np.float32))
    lin, emb = run_identity(compile_lin_emb(weight, COLS, bias), COLS)
    assert same_bits(lin, ref + np.arange(ROWS, dtype=np.float32)[:, None])
    assert same_bits(emb, ref[IDS])


def test_fallback_is_f16_with_a_note() -> None:
    raw = make_raw(T.IQ4_NL)
    weight = from_gguf(T.IQ4_NL, raw, (ROWS, COLS))
    assert isinstance(weight, DenseWeight) and weight.array.dtype == np.float16
    assert weight.note == "IQ4_NL dequantized to f16 (inexact)"
    assert describe(T.IQ4_NL, "split", True)[1] == "rounded to f16"
    assert np.array_equal(weight.array, gguf_dequant(raw, T.IQ4_NL).astype(np.float16))


def test_one_dimensional_quantized_tensor_is_dense_f32() -> None:
    raw = make_raw(T.Q8_0)[0]
    weight = from_gguf(T.Q8_0, raw, (COLS,))
    assert isinstance(weight, DenseWeight) and "exact" in weight.note
    assert same_bits(weight.array, gguf_dequant(raw, T.Q8_0))
    assert describe(T.Q8_0, "split", False) == ("de-quantized to f32", "bit-exact")


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        from_gguf(T.Q4_K, make_raw(T.Q4_K), (ROWS, COLS * 2))
    with pytest.raises(ValueError):
        from_gguf(T.Q4_K, make_raw(T.Q4_K), (2, ROWS, COLS // 2))


# ---------------------------------------------------------------------------------------------
# 4: slicing and permuting


@pytest.mark.parametrize(
    ("tensor_type", "form"),
    [(T.Q4_K, "exact"), (T.Q4_K, "split"), (T.Q6_K, "exact"), (T.Q4_0, "exact"), (T.F16, "exact")],
)
def test_take_and_permute_agree_with_the_matrix(tensor_type: T, form: Q4KForm) -> None:
    weight = from_gguf(tensor_type, make_raw(tensor_type), (ROWS, COLS), form)
    full = dequantize_reference(weight)
    order = np.random.default_rng(1).permutation(ROWS)
    assert same_bits(dequantize_reference(weight.take_rows(3, 11)), full[3:11])
    assert same_bits(dequantize_reference(weight.take_cols(64, 320)), full[:, 64:320])
    assert same_bits(dequantize_reference(weight.permute_rows(order)), full[order])
    part = weight.permute_rows(order).take_rows(2, 10).take_cols(128, 384)
    lin, _ = run_identity(compile_lin_emb(part, 256), 256)  # sliced views build constants too
    assert same_bits(lin, full[order][2:10, 128:384])
    if isinstance(weight, PackedWeight):
        with pytest.raises(ValueError):
            weight.take_cols(8, 64)
    with pytest.raises(ValueError):
        weight.permute_rows(np.zeros(ROWS, np.int64))


# ---------------------------------------------------------------------------------------------
# 5: the split form on real activations


def test_split_form_matmul_is_tight() -> None:
    raw = make_raw(T.Q5_K, seed=3)
    weight = from_gguf(T.Q5_K, raw, (ROWS, COLS), "split")
    x = np.random.default_rng(4).standard_normal((2, 5, COLS)).astype(np.float32)
    param = ops.parameter([-1, -1, COLS], ov.Type.f32)
    compiled = ov.Core().compile_model(
        ov.Model([linear(param, weight, "proj")], [param]), "CPU", EXACT_CONFIG
    )
    out = compiled([x])[0]
    want = x.astype(np.float64) @ gguf_dequant(raw, T.Q5_K).astype(np.float64).T
    assert np.abs(out - want).max() <= 1e-5 * np.abs(want).max()


def test_weight_node_of_split_is_the_full_matrix() -> None:
    raw = make_raw(T.Q4_K)
    weight = from_gguf(T.Q4_K, raw, (ROWS, COLS), "split")
    model = ov.Model([weight_node(weight, "w")], [])
    out = ov.Core().compile_model(model, "CPU", EXACT_CONFIG)({})[0]
    assert same_bits(out, gguf_dequant(raw, T.Q4_K))


@pytest.mark.parametrize("zp", [128.0, 2.5])
def test_uniform_zero_point_becomes_a_scalar(zp: float) -> None:
    """A zero point equal everywhere is one scalar (u8 when integral, else f32), still exact."""
    rng = np.random.default_rng(5)
    groups = COLS // 32
    weight = PackedWeight(
        rows=ROWS,
        cols=COLS,
        group=32,
        code_type="u8",
        codes=rng.integers(0, 256, (ROWS, COLS), dtype=np.uint8),
        scale=rng.uniform(0.01, 0.1, (ROWS, groups)).astype(np.float32),
        zero_point=np.broadcast_to(np.float32(zp), (ROWS, groups)),
    )
    compiled = compile_lin_emb(weight, COLS)
    lin, emb = run_identity(compiled, COLS)
    want = dequantize_reference(weight)
    assert same_bits(lin, want) and same_bits(emb, want[IDS])
    assert_compressed(compiled, weight)
    consts = [la.output for la in runtime_layers(compiled) if la.kind == "Const" and la.size == 1]
    assert (ov.Type.u8 if zp == 128.0 else ov.Type.f32) in consts


def test_fast_form_regroups_q6_k_to_32_within_its_bound() -> None:
    """--gguf-form fast: Q6_K's pairs of 16-column sub-blocks share the larger one's scale / 4.
    That one's values are exact; the other's are off by at most an eighth of the larger step;
    the graph keeps the i8 codes compressed with one scale per 32, and the types with a
    minimum take the (exact) split form."""
    raw = make_raw(T.Q6_K)
    # force the edge cases: a pair with equal and opposite scales (sub-blocks 0 and 1 of the
    # first super-block: int8 scales at byte 192 of each 210-byte block) and an all-zero pair
    blocks = raw.reshape(-1, 210).copy()
    blocks[0, 192:196] = np.array([5, -5, 0, 0], np.int8).view(np.uint8)
    raw = blocks.reshape(raw.shape)
    exact = from_gguf(T.Q6_K, raw, (ROWS, COLS), "split")
    fast = from_gguf(T.Q6_K, raw, (ROWS, COLS), "fast")
    assert isinstance(exact, PackedWeight) and isinstance(fast, PackedWeight)
    assert (fast.code_type, fast.group, fast.zero_point) == ("i8", 32, None)
    assert describe(T.Q6_K, "fast", True)[1] == "inexact"
    ref = gguf_dequant(raw, T.Q6_K)
    mine = dequantize_reference(fast)
    pair_scale = np.abs(exact.scale.reshape(ROWS, -1, 2))  # [rows, pairs, 2]
    larger = pair_scale.argmax(axis=2)
    big = np.abs(pair_scale).max(axis=2)  # the larger sub-block's step
    err = np.abs(mine - ref).reshape(ROWS, -1, 2, 16)
    for j in (0, 1):
        lead = larger == j  # [rows, pairs]: sub-block j holds the pair's scale
        assert np.all(err[:, :, j][lead] == 0)
        # the other one: half a step of the new grid (scale / 4), one step where clipped
        bound = np.broadcast_to((big / 4)[:, :, None], err[:, :, 1 - j].shape)[lead]
        assert np.all(err[:, :, 1 - j][lead] <= bound * (1 + 1e-6))
    assert np.all(err[0, 1] == 0)  # the all-zero pair
    compiled = compile_lin_emb(fast, COLS)
    lin, emb = run_identity(compiled, COLS)
    assert same_bits(lin, mine) and same_bits(emb, mine[IDS])
    assert_compressed(compiled, fast)
    q4 = from_gguf(T.Q4_K, make_raw(T.Q4_K), (ROWS, COLS), "fast")
    assert isinstance(q4, PackedWeight) and q4.correction is not None  # the split form
    assert same_bits(dequantize_reference(q4), gguf_dequant(make_raw(T.Q4_K), T.Q4_K))
