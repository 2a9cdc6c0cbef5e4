"""Conversions between protobuf messages and native types: the only place that does them.

``numpy array <-> pb.Tensor``, ``SamplingParams <-> pb.SamplingParams``,
``SampledToken <-> pb.SampledToken``. Decoding validates what arrives (dtype, shape, byte
length) and raises ``ValueError`` with a readable reason.
"""

from __future__ import annotations

import numpy as np

from protos import pipeshard_v1_pb2 as pb
from protos.sampling import SampledToken, SamplingParams

_DTYPES: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT16: np.dtype("<f2"),
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
}
_ENUMS = {np.dtype("float16"): pb.DTYPE_FLOAT16, np.dtype("float32"): pb.DTYPE_FLOAT32}
HIDDEN_DTYPES: dict[str, np.dtype] = {"fp16": np.dtype("float16"), "fp32": np.dtype("float32")}
MAX_TENSOR_DIMS = 4
_SEED_MOD = 1 << 64


def tensor_to_numpy(tensor: pb.Tensor) -> np.ndarray:
    dtype = _DTYPES.get(tensor.dtype)
    if dtype is None:
        raise ValueError(f"unsupported tensor dtype {tensor.dtype}")
    shape = [int(d) for d in tensor.shape]
    if not shape or len(shape) > MAX_TENSOR_DIMS or any(d < 0 for d in shape):
        raise ValueError(f"bad tensor shape {shape}")
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(tensor.data) != expected:
        raise ValueError(
            f"tensor of shape {shape} {dtype} needs {expected} bytes, got {len(tensor.data)}"
        )
    return np.frombuffer(tensor.data, dtype=dtype).reshape(shape)


def numpy_to_tensor(array: np.ndarray, dtype: np.dtype | None = None) -> pb.Tensor:
    target = np.dtype(dtype or array.dtype)
    data = np.ascontiguousarray(array, dtype=target.newbyteorder("<"))
    return pb.Tensor(dtype=_ENUMS[target], shape=list(data.shape), data=data.tobytes())


def sampling_to_pb(params: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        # The wire field is uint64: a negative 64-bit seed travels as its two's complement,
        # the key the sampler draws with anyway (seed mod 2**64).
        seed=(params.seed or 0) % _SEED_MOD,
        logprobs=params.logprobs,
        top_logprobs=params.top_logprobs,
        logit_bias={int(k): float(v) for k, v in params.logit_bias.items()},
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
    )


def sampling_from_pb(message: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=message.temperature,
        top_p=message.top_p if 0.0 < message.top_p <= 1.0 else 1.0,
        top_k=message.top_k,
        # Back to a signed 64-bit seed, as SamplingParams holds it (same draws: seed mod 2**64).
        seed=message.seed - _SEED_MOD if message.seed >= _SEED_MOD >> 1 else message.seed,
        logprobs=message.logprobs,
        top_logprobs=message.top_logprobs,
        logit_bias=dict(message.logit_bias),
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        min_p=message.min_p,
        repetition_penalty=message.repetition_penalty or 1.0,  # unset: off
    )


def sampled_to_pb(token: SampledToken) -> pb.SampledToken:
    return pb.SampledToken(
        token_id=token.token_id,
        logprob=token.logprob or 0.0,
        has_logprob=token.logprob is not None,
        top=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in token.top],
    )


def sampled_from_pb(message: pb.SampledToken) -> SampledToken:
    return SampledToken(
        token_id=message.token_id,
        logprob=message.logprob if message.has_logprob else None,
        top=[(t.token_id, t.logprob) for t in message.top],
    )
