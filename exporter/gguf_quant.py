"""A GGUF tensor's own quantized blocks -> OpenVINO nodes that decompress to exactly the reference.

``GGUF bytes -> from_gguf() -> DenseWeight | PackedWeight -> weight_node | linear | embedding``

The reference is gguf-py's ``gguf.quants.dequantize`` (what llama.cpp and transformers agree on).
Block types are not requantized: their integer codes are kept as stored (u4/i4/u8/i8) with f32
per-group scales and, for the scale+min types, an f32 zero point, laid out as the CPU plugin's
compressed FullyConnected pattern ``Constant(codes) -> Convert -> [Subtract zp] -> Multiply scale
-> Reshape -> MatMul``. Why f32 and not f16 scales: ``d*sc`` needs up to 18 significant bits,
more than f16's 11. Types without an exact form become dense f16 with a note saying so.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from protos.manifest import GGUFExactness

log = logging.getLogger(__name__)

# "fast": split for the types with a minimum, and Q6_K regrouped to 32 (see regroup_q6_k)
Q4KForm = Literal["exact", "split", "fast"]
CodeType = Literal["u4", "i4", "u8", "i8"]

_OV_CODE_TYPES: dict[str, ov.Type] = {
    "u4": ov.Type.u4,
    "i4": ov.Type.i4,
    "u8": ov.Type.u8,
    "i8": ov.Type.i8,
}
_CODE_RANGES: dict[str, tuple[int, int]] = {
    "u4": (0, 15),
    "i4": (-8, 7),
    "u8": (0, 255),
    "i8": (-128, 127),
}
# Elements decoded per chunk: bounds the decoders' temporaries on huge tensors.
_CHUNK_ELEMENTS = 1 << 22


def _check_span(lo: int, hi: int, size: int, what: str) -> None:
    if not 0 <= lo < hi <= size:
        raise ValueError(f"{what} [{lo}, {hi}) is not a non-empty range inside [0, {size})")


def _check_permutation(order: np.ndarray, rows: int) -> np.ndarray:
    order = np.asarray(order)
    if order.shape != (rows,) or not np.array_equal(np.sort(order), np.arange(rows)):
        raise ValueError(f"order must be a permutation of range({rows})")
    return order


@dataclass(frozen=True)
class DenseWeight:
    """A plain float tensor: [rows, cols] (or 1-D for norms and biases), f32 or f16 as stored."""

    array: np.ndarray
    note: str = ""  # e.g. "Q2_K dequantized to f16 (inexact)" when it is a fallback

    def take_rows(self, lo: int, hi: int) -> DenseWeight:
        _check_span(lo, hi, self.array.shape[0], "rows")
        return replace(self, array=self.array[lo:hi])

    def take_cols(self, lo: int, hi: int) -> DenseWeight:
        if self.array.ndim != 2:
            raise ValueError("take_cols needs a 2-D weight")
        _check_span(lo, hi, self.array.shape[1], "cols")
        return replace(self, array=self.array[:, lo:hi])

    def permute_rows(self, order: np.ndarray) -> DenseWeight:
        return replace(self, array=self.array[_check_permutation(order, self.array.shape[0])])


@dataclass(frozen=True)
class PackedWeight:
    """Integer codes + f32 per-group scale (+ zero point), decompressing to (codes - zp) * scale.

    The "split" form has no zero point but a ``correction`` M: it decompresses to
    ``codes * scale - M`` (the reference's own arithmetic, so bit-exact), and ``linear`` applies M
    as a second small MatMul over the group sums of x, keeping the big one zero-point free. M is
    itself a weight of [rows, groups]: for the K-quants it is compressed too (the 6- or 4-bit
    block minimums as u8 codes times the super-block's f16 ``dmin``, exact in f32: a quarter of
    an f32 M's bytes, and faster), for Q4_1/Q5_1 the f16 minimums as stored (the numbers:
    docs/benchmarks.md, "GGUF weight forms").
    """

    rows: int
    cols: int
    group: int  # input columns per scale group
    code_type: str  # "u4" | "i4" | "u8" | "i8"
    codes: np.ndarray  # [rows, cols] int8 (i4/i8) or uint8 (u4/u8), one code per element
    scale: np.ndarray  # float32 [rows, cols // group]
    zero_point: np.ndarray | None  # float32 [rows, cols // group] (fractional allowed) or None
    correction: Weight | None = None  # "split" form only: [rows, cols // group]
    source_type: str = ""  # GGML type name it came from, e.g. "Q4_K"

    def __post_init__(self) -> None:
        groups = self.cols // self.group if self.group else 0
        if self.group <= 0 or self.cols % self.group:
            raise ValueError(f"cols {self.cols} is not a multiple of group {self.group}")
        if self.code_type not in _OV_CODE_TYPES:
            raise ValueError(f"unknown code type {self.code_type!r}")
        if self.codes.shape != (self.rows, self.cols):
            raise ValueError(f"codes shape {self.codes.shape} != {(self.rows, self.cols)}")
        want = np.int8 if self.code_type[0] == "i" else np.uint8
        if self.codes.dtype != want:
            raise ValueError(f"{self.code_type} codes must be {np.dtype(want)}")
        for field in ("scale", "zero_point"):
            value = getattr(self, field)
            if value is not None and value.shape != (self.rows, groups):
                raise ValueError(f"{field} shape {value.shape} != {(self.rows, groups)}")
        if self.correction is not None:
            if self.zero_point is not None:
                raise ValueError("the split form (correction) takes no zero point")
            shape = weight_shape(self.correction)
            if shape != (self.rows, groups):
                raise ValueError(f"correction shape {shape} != {(self.rows, groups)}")
            if isinstance(self.correction, PackedWeight) and self.correction.correction is not None:
                raise ValueError("a correction has no correction of its own")

    @property
    def groups(self) -> int:
        return self.cols // self.group

    def _map(
        self,
        codes: Callable[[np.ndarray], np.ndarray],
        groups: Callable[[np.ndarray], np.ndarray],
        fix: Callable[[Weight], Weight],
    ) -> PackedWeight:
        new_codes = codes(self.codes)
        return replace(
            self,
            rows=new_codes.shape[0],
            cols=new_codes.shape[1],
            codes=new_codes,
            scale=groups(self.scale),
            zero_point=None if self.zero_point is None else groups(self.zero_point),
            correction=None if self.correction is None else fix(self.correction),
        )

    def take_rows(self, lo: int, hi: int) -> PackedWeight:
        _check_span(lo, hi, self.rows, "rows")
        return self._map(lambda a: a[lo:hi], lambda a: a[lo:hi], lambda w: w.take_rows(lo, hi))

    def regroup(self, group: int) -> PackedWeight:
        """The same weight with smaller groups (each scale repeated): exact, only bigger."""
        if group <= 0 or self.group % group:
            raise ValueError(f"group {group} does not divide {self.group}")
        if group == self.group:
            return self
        k = self.group // group
        zp = self.zero_point
        return replace(
            self,
            group=group,
            scale=np.repeat(self.scale, k, axis=1),
            zero_point=None if zp is None else np.repeat(zp, k, axis=1),
        )

    def take_cols(self, lo: int, hi: int) -> PackedWeight:
        _check_span(lo, hi, self.cols, "cols")
        if lo % self.group or hi % self.group:
            raise ValueError(f"cols [{lo}, {hi}) must fall on group boundaries ({self.group})")
        g_lo, g_hi = lo // self.group, hi // self.group

        def cut(fix: Weight) -> Weight:
            # a K-quant's minimums have one scale per super-block: a cut at a sub-block edge
            # splits that scale's group
            if isinstance(fix, PackedWeight):
                fix = fix.regroup(math.gcd(fix.group, g_lo, g_hi))
            return fix.take_cols(g_lo, g_hi)

        return self._map(lambda a: a[:, lo:hi], lambda a: a[:, g_lo:g_hi], cut)

    def permute_rows(self, order: np.ndarray) -> PackedWeight:
        idx = _check_permutation(order, self.rows)
        return self._map(lambda a: a[idx], lambda a: a[idx], lambda w: w.permute_rows(idx))


Weight = DenseWeight | PackedWeight


def weight_shape(weight: Weight) -> tuple[int, ...]:
    if isinstance(weight, DenseWeight):
        return tuple(weight.array.shape)
    return (weight.rows, weight.cols)


# ---------------------------------------------------------------------------------------------
# Block decoders: bytes [n_blocks, type_size] -> codes, scale, minimum with
# w = scale * codes - minimum per sub-block, mirroring gguf-py's quants.py bit layouts.


class _Fields(NamedTuple):
    codes: np.ndarray  # [n_blocks, block_size] int8/uint8
    scale: np.ndarray  # [n_blocks, subs] f32
    minimum: np.ndarray | None  # [n_blocks, subs] f32, or None for symmetric types
    # the K-quants' minimum = min_scale * min_codes (what the split form keeps compressed)
    min_codes: np.ndarray | None = None  # [n_blocks, subs] uint8
    min_scale: np.ndarray | None = None  # [n_blocks, 1] f32 (the block's f16 dmin)


def _f16(b: np.ndarray) -> np.ndarray:
    """[n, 2] bytes -> [n, 1] f32 from the little-endian f16 they hold."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, k] bytes -> [n, 2k]: the k low nibbles, then the k high nibbles (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes -> [n, 32] of bit i of the little-endian u32 (the 5th bit of element i)."""
    word = np.ascontiguousarray(qh).view("<u4")
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of packed 6-bit scales and mins -> two [n, 8] uint8."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc, mn


def _q8_0(b: np.ndarray) -> _Fields:
    return _Fields(np.ascontiguousarray(b[:, 2:]).view(np.int8), _f16(b[:, :2]), None)


def _q4_0(b: np.ndarray) -> _Fields:
    # i4 (q - 8) with no zero point: exact, and the simplest pattern to fuse
    codes = _nibbles(b[:, 2:18]).astype(np.int8) - np.int8(8)
    return _Fields(codes, _f16(b[:, :2]), None)


def _q4_1(b: np.ndarray) -> _Fields:
    # w = d*q + m, i.e. minimum = -m
    return _Fields(_nibbles(b[:, 4:20]), _f16(b[:, :2]), -_f16(b[:, 2:4]))


def _q5_0(b: np.ndarray) -> _Fields:
    q = _nibbles(b[:, 6:22]) | (_bits32(b[:, 2:6]) << 4)
    return _Fields(q.astype(np.int8) - np.int8(16), _f16(b[:, :2]), None)


def _q5_1(b: np.ndarray) -> _Fields:
    q = _nibbles(b[:, 8:24]) | (_bits32(b[:, 4:8]) << 4)
    return _Fields(q, _f16(b[:, :2]), -_f16(b[:, 2:4]))


def _q2_k(b: np.ndarray) -> _Fields:
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    shift = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = ((qs.reshape(n, 2, 1, 32) >> shift) & 3).reshape(n, 256)
    sc, mn = scales & 0x0F, scales >> 4
    return _Fields(q, d * sc.astype(np.float32), dmin * mn.astype(np.float32), mn, dmin)


def _q3_k(b: np.ndarray) -> _Fields:
    n = b.shape[0]
    hmask, qs, scales, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    lo = scales[:, :8].reshape(n, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)
    hi = scales[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)
    sc = (lo.reshape(n, 16) & 0x0F) | ((hi.reshape(n, 16) & 0x03) << 4)
    ql = qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    qh = hmask.reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    # the high bit *clear* means -4 (ggml's convention): q in [-4, 3] fits i4
    q = (ql.reshape(n, 256) & 3).astype(np.int8) - (((qh.reshape(n, 256) & 1) ^ 1) << 2).astype(
        np.int8
    )
    return _Fields(q, d * (sc.astype(np.int8) - np.int8(32)).astype(np.float32), None)


def _q4_k(b: np.ndarray) -> _Fields:
    sc, mn = _k_scale_min(b[:, 4:16])
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    n = b.shape[0]
    q = _nibbles(b[:, 16:144].reshape(n * 4, 32)).reshape(n, 256)
    return _Fields(q, d * sc.astype(np.float32), dmin * mn.astype(np.float32), mn, dmin)


def _q5_k(b: np.ndarray) -> _Fields:
    sc, mn = _k_scale_min(b[:, 4:16])
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    n = b.shape[0]
    ql = _nibbles(b[:, 48:176].reshape(n * 4, 32)).reshape(n, 8, 32)
    qh = (b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = (ql | (qh << 4)).reshape(n, 256)
    return _Fields(q, d * sc.astype(np.float32), dmin * mn.astype(np.float32), mn, dmin)


def _q6_k(b: np.ndarray) -> _Fields:
    n = b.shape[0]
    ql = _nibbles(b[:, :128].reshape(n * 2, 64)).reshape(n, 8, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = (ql | ((qh.reshape(n, 8, 32) & 3) << 4)).astype(np.int8) - np.int8(32)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return _Fields(q.reshape(n, 256), _f16(b[:, 208:210]) * sc, None)


def regroup_q6_k(weight: PackedWeight) -> PackedWeight:
    """Q6_K's i8 codes with a scale per 16 -> i8 codes with a scale per 32, the group the CPU
    plugin's compressed matmul (and its int8 quantization of the input) runs fast.

    Each pair of sub-blocks shares the scale S = a/4 of the one whose scale a is larger in
    magnitude: its codes become 4q, exactly (q in [-32, 31], so 4q in [-128, 124]); the other
    one's become round(4q * b / a), each value off by at most |a|/8, an eighth of the larger
    sub-block's step (clipped to i8 only where b = -a and q = -32). Not exact: an export in
    ``--gguf-form fast`` says so in its manifest.
    """
    if weight.source_type != "Q6_K" or weight.group != 16 or weight.code_type != "i8":
        raise ValueError("regroup_q6_k takes a Q6_K weight as from_gguf makes it")
    rows, pairs = weight.rows, weight.groups // 2
    scale = weight.scale.reshape(rows, pairs, 2)
    big = np.argmax(np.abs(scale), axis=2)  # the first on a tie
    lead = np.take_along_axis(scale, big[..., None], axis=2)  # [rows, pairs, 1]
    out_scale = lead[..., 0] / np.float32(4)
    codes = np.empty((rows, weight.cols), np.int8)
    step = max(1, _CHUNK_ELEMENTS // weight.cols)
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        q = weight.codes[lo:hi].reshape(hi - lo, pairs, 2, 16).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(lead[lo:hi] == 0, np.float32(0), scale[lo:hi] / lead[lo:hi])
        c = np.rint(q * (np.float32(4) * ratio)[..., None])
        codes[lo:hi] = np.clip(c, -128, 127).astype(np.int8).reshape(hi - lo, weight.cols)
    return replace(weight, group=32, codes=codes, scale=out_scale.astype(np.float32))


# MXFP4's 16 codes (e2m1) as the doubled values gguf-py's MXFP4.kvalues lists: integers, so
# that an i8 code times the block's scale 2^(E - 128) is the value, exactly
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def e8m0_half(exponents: np.ndarray) -> np.ndarray:
    """An e8m0 exponent byte E -> 2^(E - 128) as f32 (ggml_e8m0_to_fp32_half: E 0 and 1 give
    the f32 denormals 2^-128 and 2^-127; E 255 is finite)."""
    e = np.asarray(exponents).astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _mxfp4(b: np.ndarray) -> _Fields:
    # byte 0: the e8m0 exponent; 16 bytes: elements 0-15 in the low nibbles, 16-31 high
    return _Fields(MXFP4_VALUES[_nibbles(b[:, 1:17])], e8m0_half(b[:, :1]), None)


def mxfp4_weight(codes: np.ndarray, exponents: np.ndarray) -> PackedWeight:
    """MXFP4 given as 4-bit codes [rows, cols] (uint8, one a byte, element order) and e8m0
    exponents [rows, cols // 32] (a Hugging Face checkpoint's ``*_blocks``/``*_scales``
    unpacked): i8 codes (the doubled e2m1 values) with an f32 scale per 32, exactly the
    values transformers' and gguf-py's de-quantization give."""
    rows, cols = codes.shape
    return PackedWeight(
        rows=rows,
        cols=cols,
        group=32,
        code_type="i8",
        codes=MXFP4_VALUES[codes & 0x0F],
        scale=e8m0_half(exponents).reshape(rows, cols // 32),
        zero_point=None,
        source_type="MXFP4",
    )


def stack_rows(first: Weight, second: Weight) -> Weight:
    """``first``'s rows, then ``second``'s (two weights of the same form): exact."""
    if isinstance(first, DenseWeight) and isinstance(second, DenseWeight):
        return DenseWeight(np.concatenate([first.array, second.array]), first.note)
    if not (isinstance(first, PackedWeight) and isinstance(second, PackedWeight)):
        raise ValueError("stack_rows needs two weights of the same kind")
    if (first.cols, first.group, first.code_type) != (second.cols, second.group, second.code_type):
        raise ValueError("stack_rows needs the same columns, groups and codes")
    if first.correction is not None or second.correction is not None:
        raise ValueError("stack_rows takes the exact form, not split")
    if (first.zero_point is None) != (second.zero_point is None):
        raise ValueError("stack_rows: one weight has a zero point, the other none")
    zp = None
    if first.zero_point is not None and second.zero_point is not None:
        zp = np.concatenate([first.zero_point, second.zero_point])
    return replace(
        first,
        rows=first.rows + second.rows,
        codes=np.concatenate([first.codes, second.codes]),
        scale=np.concatenate([first.scale, second.scale]),
        zero_point=zp,
    )


class _Spec(NamedTuple):
    group: int  # elements per scale
    code_type: CodeType
    decode: Callable[[np.ndarray], _Fields]


_SPECS: dict[GGMLQuantizationType, _Spec] = {
    GGMLQuantizationType.Q8_0: _Spec(32, "i8", _q8_0),
    GGMLQuantizationType.Q4_0: _Spec(32, "i4", _q4_0),
    GGMLQuantizationType.Q4_1: _Spec(32, "u4", _q4_1),
    GGMLQuantizationType.Q5_0: _Spec(32, "i8", _q5_0),
    GGMLQuantizationType.Q5_1: _Spec(32, "u8", _q5_1),
    GGMLQuantizationType.Q2_K: _Spec(16, "u4", _q2_k),
    GGMLQuantizationType.Q3_K: _Spec(16, "i4", _q3_k),
    GGMLQuantizationType.Q4_K: _Spec(32, "u4", _q4_k),
    GGMLQuantizationType.Q5_K: _Spec(32, "u8", _q5_k),
    GGMLQuantizationType.Q6_K: _Spec(16, "i8", _q6_k),
    # gpt-oss's experts: the smallest exact form GatherMatmul keeps compressed (it unpacks
    # f4e2m1 codes to f32; e8m0 scales save nothing at run time: docs/export.md, "gpt-oss")
    GGMLQuantizationType.MXFP4: _Spec(32, "i8", _mxfp4),
}


def _encode_affine(
    codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w = scale*codes - minimum -> codes, scale, zero point with w = (codes - zp) * scale.

    codes [n, subs, group] is edited in place; scale [n, subs] too.
    """
    zero_scale = scale == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(zero_scale, np.float32(0), minimum / np.where(zero_scale, 1, scale))
    # (An integer zero point, round(M/S) as openvino.genai's GGUF reader makes, is inexact and
    # no faster than the split form: docs/benchmarks.md, "GGUF weight forms".)
    zp = ratio.astype(np.float32)
    # A sub-block with scale 0 but a minimum decodes to the constant -minimum, which
    # (q - zp) * 0 cannot say: re-encode it as (0 - 1) * minimum.
    const = zero_scale & (minimum != 0)
    if const.any():
        codes[const] = 0
        scale[const] = minimum[const]
        zp[const] = 1
    return codes, scale, zp


def _decode_packed(
    tensor_type: GGMLQuantizationType, raw: np.ndarray, rows: int, cols: int, form: Q4KForm
) -> PackedWeight:
    spec = _SPECS[tensor_type]
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    groups = cols // spec.group
    row_bytes = cols // block_size * type_size
    blocks = raw.reshape(rows, row_bytes)
    codes = np.empty((rows, cols), np.int8 if spec.code_type[0] == "i" else np.uint8)
    scale = np.empty((rows, groups), np.float32)
    affine = tensor_type in (
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q2_K,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
    )
    split = affine and form in ("split", "fast")
    # the split form's minimums, kept compressed where the type factors them (K-quants)
    factored = split and tensor_type not in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_1)
    subs = block_size // spec.group  # minimums per super-block (= per dmin)
    extra = np.empty((rows, groups), np.uint8 if factored else np.float32) if affine else None
    min_scale = np.empty((rows, cols // block_size), np.float32) if factored else None
    step = max(1, _CHUNK_ELEMENTS // cols)
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        f = spec.decode(blocks[lo:hi].reshape(-1, type_size))
        c = f.codes.reshape(hi - lo, groups, spec.group)
        s = f.scale.reshape(hi - lo, groups)
        if extra is not None:
            assert f.minimum is not None
            if factored:
                assert f.min_codes is not None and f.min_scale is not None and min_scale is not None
                extra[lo:hi] = f.min_codes.reshape(hi - lo, groups)
                min_scale[lo:hi] = f.min_scale.reshape(hi - lo, -1)
            elif split:
                extra[lo:hi] = f.minimum.reshape(hi - lo, groups)
            else:
                m = f.minimum.reshape(hi - lo, groups)
                c, s, extra[lo:hi] = _encode_affine(c, s, m)
        codes[lo:hi] = c.reshape(hi - lo, cols)
        scale[lo:hi] = s
    correction: Weight | None = None
    if split and extra is not None:
        if min_scale is not None:
            correction = PackedWeight(
                rows=rows,
                cols=groups,
                group=subs,
                code_type="u8",
                codes=extra,
                scale=min_scale,
                zero_point=None,
                source_type=f"{tensor_type.name} minimums",
            )
        else:
            # Q4_1/Q5_1: one f16 minimum per block, as stored (so f16 holds it exactly)
            correction = DenseWeight(extra.astype(np.float16))
    return PackedWeight(
        rows=rows,
        cols=cols,
        group=spec.group,
        code_type=spec.code_type,
        codes=codes,
        scale=scale,
        zero_point=None if split else extra,
        correction=correction,
        source_type=tensor_type.name,
    )


def _dense_fallback(
    tensor_type: GGMLQuantizationType, raw: np.ndarray, shape: tuple[int, ...]
) -> DenseWeight:
    """gguf-py's dequantization, kept as f16 (half the memory of f32; says when that is lossy)."""
    rows, cols = shape
    blocks = raw.reshape(rows, -1)
    out = np.empty((rows, cols), np.float16)
    lossless = True
    step = max(1, _CHUNK_ELEMENTS // cols)
    for lo in range(0, rows, step):
        chunk = gguf_quants.dequantize(blocks[lo : lo + step], tensor_type)
        out[lo : lo + step] = chunk
        lossless = lossless and bool(np.array_equal(out[lo : lo + step].astype(np.float32), chunk))
    note = f"{tensor_type.name} dequantized to f16 ({'exact' if lossless else 'inexact'})"
    if not lossless:
        log.warning("%s tensor %s: %s", tensor_type.name, shape, note)
    return DenseWeight(out.reshape(shape), note)


_AFFINE = (
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q2_K,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
)
_AFFINE_FORMS: dict[str, tuple[str, GGUFExactness]] = {
    "split": ("block minimums (compressed) as a separate small matmul", "bit-exact"),
    "exact": ("f32 zero points", "within 1 f32 ulp"),
}


def describe(
    tensor_type: GGMLQuantizationType, form: Q4KForm, matrix: bool
) -> tuple[str, GGUFExactness]:
    """What ``from_gguf`` makes of a tensor of this type (a matrix, or 1-D), and how exact that
    is against gguf's de-quantization: ``bit-exact``, ``within 1 f32 ulp``, ``rounded to f16``
    or ``inexact``. Depends on the type alone, so an export can say it before reading a block."""
    t = GGMLQuantizationType
    if tensor_type in (t.F32, t.F16):
        return f"{tensor_type.name.lower()} as stored", "bit-exact"
    if tensor_type == t.BF16:
        return "widened to f32", "bit-exact"
    if tensor_type == t.F64:
        return "narrowed to f32", "inexact"
    spec = _SPECS.get(tensor_type)
    if tensor_type == t.MXFP4 and matrix:
        return "e2m1 codes as i8 (doubled values), f32 scales 2^(E-128) per 32", "bit-exact"
    if tensor_type == t.Q6_K and matrix and form == "fast":
        return "i8 codes regrouped per 32 (each pair's larger sub-block exact), f32 scales", (
            "inexact"
        )
    if spec is not None and matrix:
        becomes = f"{spec.code_type} codes as stored, f32 scales per {spec.group}"
        if tensor_type not in _AFFINE:
            return becomes, "bit-exact"
        how, exactness = _AFFINE_FORMS["split" if form == "fast" else form]
        return f"{becomes}, {how}", exactness
    if not matrix:
        return "de-quantized to f32", "bit-exact"
    return "de-quantized to f16 (no compressed form)", "rounded to f16"


def from_gguf(
    tensor_type: GGMLQuantizationType,
    raw: np.ndarray,
    shape: tuple[int, ...],
    form: Q4KForm = "exact",
) -> Weight:
    """One GGUF tensor -> DenseWeight | PackedWeight.

    raw: the tensor's bytes as stored (uint8, any shape whose total size is the tensor's byte
    size); shape: the logical numpy shape (rows, cols) or (n,) as GGUFReader reports it reversed
    into numpy order. ``form`` picks the encoding of scale+min types (Q4_1, Q5_1, Q2_K, Q4_K,
    Q5_K); others ignore it.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) not in (1, 2):
        raise ValueError(f"only 1-D and 2-D tensors are supported, got shape {shape}")
    flat = np.asarray(raw).reshape(-1).view(np.uint8)
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    n = int(np.prod(shape))
    if shape[-1] % block_size or flat.size != n // block_size * type_size:
        raise ValueError(f"{tensor_type.name} {shape}: {flat.size} bytes do not fit the shape")
    if tensor_type == GGMLQuantizationType.F32:
        return DenseWeight(flat.view(np.float32).reshape(shape))
    if tensor_type == GGMLQuantizationType.F16:
        return DenseWeight(flat.view(np.float16).reshape(shape))
    if tensor_type == GGMLQuantizationType.BF16:
        # bf16 is the high half of an f32: widening is exact
        wide = (flat.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return DenseWeight(wide.reshape(shape), "BF16 widened to f32 (exact)")
    if tensor_type == GGMLQuantizationType.F64:
        return DenseWeight(
            flat.view(np.float64).astype(np.float32).reshape(shape), "F64 narrowed to f32 (inexact)"
        )
    if tensor_type in _SPECS and len(shape) == 2:
        packed = _decode_packed(tensor_type, flat, shape[0], shape[1], form)
        if form == "fast" and tensor_type == GGMLQuantizationType.Q6_K:
            return regroup_q6_k(packed)
        return packed
    if len(shape) == 1:
        # small (norms, biases): the reference's f32 as is
        return DenseWeight(
            gguf_quants.dequantize(flat, tensor_type).reshape(shape),
            f"{tensor_type.name} 1-D dequantized to f32 (exact)",
        )
    try:
        return _dense_fallback(tensor_type, flat, shape)
    except NotImplementedError as exc:
        raise ValueError(f"no dequantization for GGML type {tensor_type.name}") from exc


def dequantize_reference(weight: Weight) -> np.ndarray:
    """float32 of what the weight_node subgraph computes, in numpy, in the same order."""
    if isinstance(weight, DenseWeight):
        return weight.array.astype(np.float32)
    shape = (weight.rows, weight.groups, weight.group)
    w = weight.codes.reshape(shape).astype(np.float32)
    if weight.zero_point is not None:
        w -= weight.zero_point[..., None]
    w *= weight.scale[..., None]
    if weight.correction is not None:
        w -= dequantize_reference(weight.correction)[..., None]
    return w.reshape(weight.rows, weight.cols)


# ---------------------------------------------------------------------------------------------
# OpenVINO nodes


def _i64(values: list[int]) -> ov.Output:
    return ops.constant(np.array(values, dtype=np.int64)).output(0)


def _float_constant(array: np.ndarray, name: str) -> ov.Output:
    """f32/f16 constant sharing the array's memory where numpy allows it."""
    share = array.flags.c_contiguous and array.flags.writeable and array.flags.aligned
    node = ops.constant(array if share else np.ascontiguousarray(array), shared_memory=share)
    node.set_friendly_name(name)
    return node.output(0)


def _code_constant(values: np.ndarray, code_type: str, shape: list[int], name: str) -> ov.Output:
    """Integer constant of code_type; 4-bit types packed two a byte, even element low."""
    ov_type = _OV_CODE_TYPES[code_type]
    if code_type in ("u4", "i4"):
        # Pack straight into an OpenVINO-owned tensor: a Constant sharing a numpy-backed u4
        # Tensor does not keep the numpy buffer alive (measured: garbage after gc).
        tensor = ov.Tensor(ov_type, shape)
        out = tensor.data.reshape(-1)
        flat = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
        half = flat.size // 2
        for lo in range(0, half, _CHUNK_ELEMENTS):  # chunks: small temporaries on big tables
            hi = min(half, lo + _CHUNK_ELEMENTS)
            pairs = flat[2 * lo : 2 * hi]
            np.bitwise_or(pairs[0::2] & 0x0F, pairs[1::2] << 4, out=out[lo:hi])
        if flat.size % 2:
            out[half] = flat[-1] & 0x0F
        node = ov.op.Constant(tensor, shared_memory=True)
    else:
        data = np.ascontiguousarray(values).reshape(shape)
        # ops.constant(shared_memory=True) holds a reference to the array (measured)
        node = ops.constant(data, ov_type, shared_memory=data.flags.writeable)
    node.set_friendly_name(name)
    return node.output(0)


def _zero_point(
    weight: PackedWeight, name: str, shape: list[int] | None = None
) -> ov.Output | None:
    """The zero point as a constant of ``shape`` (default [rows, groups, 1]; a scalar when
    every group has the same one)."""
    zp = weight.zero_point
    if zp is None:
        return None
    uniform = zp.size > 0 and bool(np.all(zp == zp.flat[0]))
    values = zp.flat[0:1] if uniform else zp
    shape = [] if uniform else (shape or [weight.rows, weight.groups, 1])
    lo, hi = _CODE_RANGES[weight.code_type]
    integral = bool(np.all((values == np.round(values)) & (values >= lo) & (values <= hi)))
    if integral:
        # an integer zero point of the codes' own type keeps dynamic quantization available
        dtype = np.int8 if weight.code_type[0] == "i" else np.uint8
        node = _code_constant(values.astype(dtype), weight.code_type, shape, f"{name}/zp")
        return ops.convert(node, ov.Type.f32).output(0)
    return _float_constant(np.ascontiguousarray(values, np.float32).reshape(shape), f"{name}/zp")


def _scaled_codes(weight: PackedWeight, name: str) -> ov.Output:
    """[rows, groups, group] f32 = (codes - zp) * scale (the compressed-weight pattern)."""
    shape = [weight.rows, weight.groups, weight.group]
    w = ops.convert(
        _code_constant(weight.codes, weight.code_type, shape, f"{name}/codes"), ov.Type.f32
    ).output(0)
    zp = _zero_point(weight, name)
    if zp is not None:
        w = ops.subtract(w, zp).output(0)
    scale = np.ascontiguousarray(weight.scale).reshape(weight.rows, weight.groups, 1)
    return ops.multiply(w, _float_constant(scale, f"{name}/scale")).output(0)


def _as_matrix(w: ov.Output, weight: PackedWeight, name: str) -> ov.Output:
    node = ops.reshape(w, _i64([weight.rows, weight.cols]), special_zero=False)
    node.set_friendly_name(name)
    return node.output(0)


def weight_node(weight: Weight, name: str) -> ov.Output:
    """The decompressed f32 weight: [rows, cols] (or the 1-D vector for a 1-D DenseWeight).

    For the split form this is codes*scale - correction, which OpenVINO folds into a dense
    constant when it feeds a MatMul: use linear() for matmuls, this for debugging.
    """
    if isinstance(weight, DenseWeight):
        const = _float_constant(
            weight.array, name if weight.array.dtype == np.float32 else f"{name}/f16"
        )
        if const.get_element_type() == ov.Type.f32:
            return const
        node = ops.convert(const, ov.Type.f32)
        node.set_friendly_name(name)
        return node.output(0)
    w = _scaled_codes(weight, name)
    if weight.correction is not None:
        m = ops.unsqueeze(weight_node(weight.correction, f"{name}/correction"), _i64([2]))
        w = ops.subtract(w, m).output(0)
    return _as_matrix(w, weight, name)


def expert_weights(weight: Weight, experts: int, name: str) -> ov.Output:
    """Every expert's matrix stacked, [experts, rows / experts, cols] f32, from one weight whose
    rows are the experts' rows one after another (a GGUF's 3-D ``*_exps`` tensor, or the
    experts' tensors concatenated), kept compressed in the pattern the CPU plugin's
    GatherMatmul takes: codes [E, O, groups, group] -> Convert -> Subtract zero point ->
    Multiply scale -> Reshape. The split form's correction cannot ride along (GatherMatmul
    takes a plain decompression): ask for the exact form."""
    if isinstance(weight, DenseWeight):
        array = weight.array.reshape(experts, -1, weight.array.shape[-1])
        return weight_node(DenseWeight(array), name)
    if weight.correction is not None:
        raise ValueError(f"{name}: expert weights need the exact form, not split")
    if weight.rows % experts:
        raise ValueError(f"{name}: {weight.rows} rows do not split into {experts} experts")
    out_rows = weight.rows // experts
    shape = [experts, out_rows, weight.groups, weight.group]
    w = ops.convert(
        _code_constant(weight.codes, weight.code_type, shape, f"{name}/codes"), ov.Type.f32
    ).output(0)
    zp = _zero_point(weight, name, [experts, out_rows, weight.groups, 1])
    if zp is not None:
        w = ops.subtract(w, zp).output(0)
    scale = np.ascontiguousarray(weight.scale).reshape(experts, out_rows, weight.groups, 1)
    w = ops.multiply(w, _float_constant(scale, f"{name}/scale")).output(0)
    node = ops.reshape(w, _i64([experts, out_rows, weight.cols]), special_zero=False)
    node.set_friendly_name(name)
    return node.output(0)


def _group_sums(x: ov.Output, weight: PackedWeight, name: str) -> ov.Output:
    """x [..., cols] -> [..., groups]: the sum of x over each group of input columns."""
    rank = x.get_partial_shape().rank
    if rank.is_static:
        target = _i64([0] * (rank.get_length() - 1) + [weight.groups, weight.group])
    else:
        lead = ops.slice(ops.shape_of(x), _i64([0]), _i64([-1]), _i64([1]))
        target = ops.concat([lead, _i64([weight.groups, weight.group])], 0).output(0)
    grouped = ops.reshape(x, target, special_zero=True)
    node = ops.reduce_sum(grouped, _i64([-1]), keep_dims=False)
    node.set_friendly_name(f"{name}/group_sums")
    return node.output(0)


def _negated(weight: Weight) -> Weight:
    """-W, exactly (a sign flip of the float part)."""
    if isinstance(weight, DenseWeight):
        return replace(weight, array=-weight.array)
    if weight.zero_point is not None or weight.correction is not None:
        raise ValueError("only a scale-only weight negates by its scale")
    return replace(weight, scale=-weight.scale)


def linear(x: ov.Output, weight: Weight, name: str, bias: Weight | None = None) -> ov.Output:
    """x [..., cols] -> x @ W^T (+ bias) [..., rows], with W kept compressed."""
    if isinstance(weight, DenseWeight) and weight.array.ndim != 2:
        raise ValueError(f"{name}: linear needs a 2-D weight, got {weight.array.shape}")
    if isinstance(weight, PackedWeight) and weight.correction is not None:
        # split form: x @ (q*S - M)^T = x @ (q*S)^T - groupsum(x) @ M^T
        w = _as_matrix(_scaled_codes(weight, name), weight, f"{name}/weight")
        main = ops.matmul(x, w, transpose_a=False, transpose_b=True)
        # main + groupsum(x) @ (-M)^T: a Subtract of the MatMul would be rewritten as a Multiply
        # by -1 into M's decompression, which then no longer fuses (measured)
        sums = _group_sums(x, weight, name)
        fix = linear(sums, _negated(weight.correction), f"{name}/correction")
        out = ops.add(main, fix).output(0)
    else:
        out = ops.matmul(
            x, weight_node(weight, f"{name}/weight"), transpose_a=False, transpose_b=True
        ).output(0)
    if bias is not None:
        out = ops.add(out, weight_node(bias, f"{name}/bias")).output(0)
    out.get_node().set_friendly_name(name)
    return out


def embedding(ids: ov.Output, weight: Weight, name: str) -> ov.Output:
    """ids [...] (integer) -> [..., cols] f32 rows of the table, gathered while compressed.

    The CPU plugin turns Gather over the decompression pattern into a compressed Gather; f16
    tables are gathered before the Convert for the same reason.
    """
    axis = ops.constant(np.array(0, dtype=np.int64)).output(0)
    if isinstance(weight, DenseWeight):
        table = _float_constant(weight.array, f"{name}/table")
        out = ops.gather(table, ids, axis).output(0)
        if out.get_element_type() != ov.Type.f32:
            out = ops.convert(out, ov.Type.f32).output(0)
    elif weight.correction is None:
        table = _as_matrix(_scaled_codes(weight, name), weight, f"{name}/table")
        out = ops.gather(table, ids, axis).output(0)
    else:
        # split form: gather q*S and M apart, subtract per group (same arithmetic as gguf)
        rows = ops.gather(_scaled_codes(weight, name), ids, axis)  # [..., groups, group]
        m = ops.unsqueeze(embedding(ids, weight.correction, f"{name}/correction"), _i64([-1]))
        target = ops.concat([ops.shape_of(ids), _i64([weight.cols])], 0)
        out = ops.reshape(ops.subtract(rows, m), target, special_zero=False).output(0)
    out.get_node().set_friendly_name(name)
    return out
