"""The Gated DeltaNet recurrence in the one form OpenVINO fuses into its ``GatedDeltaNet`` node.

OpenVINO has no public op for it. Its ``GatedDeltaNetFusion`` (``FuseGDNLoop`` and friends, run
by the CPU plugin) matches the ``Loop`` that optimum-intel's ``convert_recurrent_attention_cell``
builds (``optimum/exporters/openvino/_ov_ops.py``), fed a query scaled as
``q / Power(Convert(Gather(ShapeOf(q), 3)), 0.5)``, with its output split back into the
attention output and the new state as optimum's patched ``recurrent_gated_delta_rule`` traces
it. Other forms (a pre-scaled query, another loop body) compile and compute the same numbers,
but as a ``TensorIterator`` stepping token by token: the pattern is copied here op for op (the
fusion is asserted by tests/test_fusion.py).

Per step t, per value head (transformers' ``torch_recurrent_gated_delta_rule``)::

    S = S * exp(g_t);  d = (v_t - k_t @ S) * beta_t;  S = S + outer(k_t, d);  o_t = q_t @ S
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset14 as ops
from openvino import Output


def _body() -> tuple[ov.Model, list[ov.Node], Output, Output]:
    """The loop body as optimum builds it: (model, its parameters in the order below, the new
    state, the output so far)."""
    timestep = ops.parameter([], np.int32, "timestep")
    q_t = ops.parameter([-1, -1, 1, -1], np.float32, "q_t")
    k_t = ops.parameter([-1, -1, 1, -1], np.float32, "k_t")
    v_t = ops.parameter([-1, -1, 1, -1], np.float32, "v_t")
    g_t = ops.parameter([-1, -1, 1], np.float32, "g_t")
    beta_t = ops.parameter([-1, -1, 1], np.float32, "beta_t")
    state_t = ops.parameter([-1, -1, -1, -1], np.float32, "last_recurrent_state_t")
    out_t = ops.parameter([-1, -1, -1, -1], np.float32, "core_attn_out_t")

    two = ops.constant(2, dtype=np.int32)
    q = ops.squeeze(q_t, two)
    k = ops.squeeze(k_t, two)
    v = ops.squeeze(v_t, two)
    minus_one = ops.constant(-1, dtype=np.int32)
    decay = ops.unsqueeze(ops.exp(g_t), minus_one)
    state = ops.multiply(state_t, decay)
    minus_two = ops.constant(-2, dtype=np.int32)
    kv_mem = ops.reduce_sum(ops.multiply(state, ops.unsqueeze(k, minus_one)), minus_two, False)
    delta = ops.multiply(ops.subtract(v, kv_mem), beta_t)
    update = ops.multiply(ops.unsqueeze(k, minus_one), ops.unsqueeze(delta, minus_two))
    state = ops.add(state, update)
    attended = ops.reduce_sum(ops.multiply(state, ops.unsqueeze(q, minus_one)), minus_two, True)
    step = ops.unsqueeze(timestep, ops.constant(0, dtype=np.int32))
    out = ops.scatter_update(out_t, step, attended, two)
    params = [timestep, q_t, k_t, v_t, g_t, beta_t, state_t, out_t]
    body = ov.Model([ops.constant([True], dtype=bool), state, out], params, "body_model")
    return body, params, state.output(0), out.output(0)


def gated_delta_rule(
    q: Output, k: Output, v: Output, g: Output, beta: Output, state: Output
) -> tuple[Output, Output]:
    """q, k [B, H, T, Dk] (l2-normalised, not yet scaled), v [B, H, T, Dv], g and beta
    [B, H, T], state [B, H, Dk, Dv] -> (output [B, H, T, Dv], new state [B, H, Dk, Dv])."""
    head_dim = ops.convert(
        ops.gather(ops.shape_of(q), ops.constant(np.int64(3)), ops.constant(np.int64(0))),
        ov.Type.f32,
    )
    q = ops.divide(q, ops.power(head_dim, ops.constant(np.float32(0.5)))).output(0)

    value_shape = ops.shape_of(v)
    zeros = ops.broadcast(ops.constant(0, dtype=np.float32), value_shape)
    steps = ops.gather(
        value_shape, ops.constant(2, dtype=np.int32), ops.constant(0, dtype=np.int32)
    )
    body, params, state_res, out_res = _body()
    _, q_t, k_t, v_t, g_t, beta_t, state_t, out_t = params
    loop = ops.loop(ops.convert(steps, "i32"), ops.constant(True, dtype="bool"))
    loop.set_function(body)
    for param, value in ((q_t, q), (k_t, k), (v_t, v), (g_t, g), (beta_t, beta)):
        loop.set_sliced_input(param, value, 0, 1, 1, -1, 2)
    loop.set_merged_input(state_t, state, state_res)
    loop.set_merged_input(out_t, zeros.output(0), out_res)
    loop.set_special_body_ports([0, 0])
    new_out = loop.get_iter_value(out_res, -1)
    new_state = loop.get_iter_value(state_res, -1)
    flat_shape = ops.constant([-1], dtype=np.int32)
    flat = ops.concat(
        [ops.reshape(new_out, flat_shape, False), ops.reshape(new_state, flat_shape, False)], 0
    )
    # as optimum's patched recurrent_gated_delta_rule traces the split of the cell's output
    count = ops.unsqueeze(
        ops.reduce_prod(ops.shape_of(v), ops.constant(np.int64(0)), False),
        ops.constant(np.int64(0)),
    )
    zero, one = ops.constant(np.array([0], np.int64)), ops.constant(np.array([1], np.int64))
    end = ops.constant(np.array([2**62], np.int64))
    out = ops.reshape(ops.slice(flat, zero, count, one, zero), ops.shape_of(v), False)
    new = ops.reshape(ops.slice(flat, count, end, one, zero), ops.shape_of(state), False)
    return out.output(0), new.output(0)
