"""Stage module -> stateful OpenVINO IR with the beam_idx Gather, compressed and saved.

``torch StageModule -> ov.Model (named ports) -> stateful (+ beam_idx) -> NNCF -> model.xml/bin``
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import openvino as ov
import torch

from exporter.errors import ExportError
from exporter.stage_module import StageModule
from protos.manifest import WeightSpec

log = logging.getLogger(__name__)


def _input_specs(module: StageModule) -> list[tuple[ov.PartialShape, ov.Type]]:
    facts = module.facts
    if module.first:
        main = (ov.PartialShape([-1, -1]), ov.Type.i64)
    else:
        main = (ov.PartialShape([-1, -1, module.input_width]), ov.Type.f32)
    specs = [
        main,
        (ov.PartialShape([-1, -1]), ov.Type.i64),
        (ov.PartialShape([-1, -1]), ov.Type.i64),
    ]
    if module.last:
        specs.append((ov.PartialShape([]), ov.Type.i64))
    kv = (ov.PartialShape([-1, facts.num_kv_heads, -1, facts.head_dim]), ov.Type.f32)
    specs += [kv, kv] * len(module.layer_ids)
    return specs


def trace_stage(module: StageModule) -> ov.Model:
    """Convert the stage module and give every port the optimum-style name."""
    module.eval()
    # The tracer warns about shape-dependent Python values (mask constants, transformers'
    # is_causal check); the ports are dynamic and the results are checked against torch.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        model = ov.convert_model(
            module, example_input=module.example_inputs(), input=_input_specs(module)
        )
    for port, name in zip(model.inputs, module.input_names(), strict=True):
        port.get_tensor().set_names({name})
    for port, name in zip(model.outputs, module.output_names(), strict=True):
        port.get_tensor().set_names({name})
    return model


def make_stage_stateful(model: ov.Model, config: Any, beam_idx: bool) -> None:
    """KV past/present pairs -> ReadValue/Assign; with ``beam_idx`` also the fusing Gather."""
    from optimum.exporters.openvino.stateful import make_stateful, patch_stateful

    if beam_idx:
        patch_stateful(config, model)
    else:
        kv_in = [n for p in model.inputs for n in p.get_names() if "key_values" in n]
        kv_out = [n for p in model.outputs for n in p.get_names() if "present" in n]
        not_kv = [p for p in model.inputs if not set(p.get_names()) & set(kv_in)]
        make_stateful(model, not_kv, kv_in, kv_out, 0, None)
    if any(p.get_any_name().startswith("past_key_values") for p in model.inputs):
        raise ExportError("internal error: the KV cache was not made stateful")


def _edge_weight_nodes(model: ov.Model, vocab_size: int) -> list[str]:
    """Embedding Gathers and lm_head MatMuls: the nodes whose weight has a vocabulary dimension."""
    names = []
    for op in model.get_ops():
        if op.get_type_name() not in ("MatMul", "Gather"):
            continue
        for value in op.input_values():
            node = value.get_node()
            if node.get_type_name() == "Convert":
                node = node.input_value(0).get_node()
            shape = list(node.get_output_partial_shape(0))
            if node.get_type_name() == "Constant" and len(shape) == 2 and shape[0] == vocab_size:
                names.append(op.get_friendly_name())
                break
    return names


def compress_stage(model: ov.Model, weights: WeightSpec, vocab_size: int) -> ov.Model:
    """Apply the export's weight format with NNCF, the same way in every stage.

    NNCF's default int4 mode keeps the embedding and the *last* MatMul of a graph at 8 bit. Per
    shard that would be each stage's last decoder layer, so the split model would differ from the
    unsplit one. Instead: embeddings and lm_head at int8 (as the unsplit default does), every
    decoder-layer matrix at int4, whichever stage it lands in.
    """
    if weights.format in ("fp32", "fp16"):
        return model
    import nncf

    if weights.format == "int8":
        return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
    edge_nodes = _edge_weight_nodes(model, vocab_size)
    if edge_nodes:
        others = [
            op.get_friendly_name()
            for op in model.get_ops()
            if op.get_type_name() == "MatMul" and op.get_friendly_name() not in edge_nodes
        ]
        model = nncf.compress_weights(
            model,
            mode=nncf.CompressWeightsMode.INT8_ASYM,
            ignored_scope=nncf.IgnoredScope(names=others, validate=False),
        )
    mode = (
        nncf.CompressWeightsMode.INT4_SYM
        if weights.symmetric
        else nncf.CompressWeightsMode.INT4_ASYM
    )
    return nncf.compress_weights(
        model,
        mode=mode,
        group_size=weights.group_size or 128,
        ratio=1.0,
        all_layers=True,
        ignored_scope=nncf.IgnoredScope(names=edge_nodes, validate=False),
    )


def save_stage(model: ov.Model, out_dir: Path, weights: WeightSpec) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, out_dir / "model.xml", compress_to_fp16=weights.format == "fp16")
