"""KV ports -> OpenVINO state, with the ``beam_idx`` Gather that makes the CPU plugin fuse it.

A hybrid's linear-attention states (``cache_params.past.conv.*`` / ``.ssm.*``) go the same way:
behind the same Gather (without it the CPU plugin fails to compile such a graph).

What optimum-intel's ``patch_stateful`` does for a decoder (``fuse_cache_reorder`` +
``make_stateful``), without its torch-importing package: a ``beam_idx`` input and a Gather of
every past KV port by it, then ``apply_make_stateful_transformation`` (past/present pairs ->
ReadValue/Assign), then each ReadValue initialised to an empty cache of the batch's size. The
Gather between ReadValue and Concat is what ``StatefulSDPAFusion`` (CPU) and the GPU plugin's
indirect KV cache look for.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from exporter.errors import ExportError


def _main_input(model: ov.Model) -> ov.Output:
    for port in model.inputs:
        if port.get_names() & {"input_ids", "inputs_embeds"}:
            return port
    raise ExportError("internal error: the stage has no input_ids/inputs_embeds port")


def make_stateful(model: ov.Model, beam_idx: bool = True) -> None:
    """Turn ``past_key_values.*`` / ``present.*`` ports into state (in place)."""
    from openvino._offline_transformations import apply_make_stateful_transformation

    pairs = {}
    for port in model.inputs:
        name = port.get_any_name()
        if name.startswith("past_key_values."):
            pairs[name] = "present." + name[len("past_key_values.") :]
        elif name.startswith("cache_params.past."):  # a linear-attention layer's conv/ssm state
            pairs[name] = "cache_params.present." + name[len("cache_params.past.") :]
    if beam_idx:
        batch = _main_input(model).get_partial_shape()[0]
        beam = ops.parameter(ov.PartialShape([batch]), ov.Type.i32, name="beam_idx")
        beam.output(0).get_tensor().add_names({"beam_idx"})
        model.add_parameters([beam])
        for name in pairs:
            port = model.input(name)
            consumers = port.get_target_inputs()
            gather = ops.gather(port, beam, ops.constant(np.int64(0)))
            for consumer in consumers:
                consumer.replace_source_output(gather.output(0))
        model.validate_nodes_and_infer_types()
    apply_make_stateful_transformation(model, pairs)
    _initialise_states(model)
    if any(p.get_any_name().startswith(("past_key_values", "cache_params")) for p in model.inputs):
        raise ExportError("internal error: the KV cache was not made stateful")


def _initialise_states(model: ov.Model) -> None:
    """Each ReadValue starts as an empty cache [batch, kv_heads, 0, head_dim], or a
    linear-attention layer's state as zeros of its fixed shape [batch, ...]."""
    main = _main_input(model)
    batch = ops.gather(ops.shape_of(main, "i64"), ops.constant(np.array([0])), ops.constant(0))
    for op in model.get_ops():
        if op.get_type_name() != "ReadValue":
            continue
        dims: list[ov.Output | ov.Node] = []
        for axis, dim in enumerate(op.get_output_partial_shape(0)):
            if axis == 0:
                dims.append(batch)
            else:
                dims.append(ops.constant(np.array([dim.get_min_length()], dtype=np.int64)))
        zero = ops.constant(np.float32(0.0), dtype=op.get_output_element_type(0))
        op.set_arguments([ops.broadcast(zero, ops.concat(dims, 0))])
    model.validate_nodes_and_infer_types()
