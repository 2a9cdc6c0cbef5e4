"""A built stage's weights compressed with NNCF (Hugging Face sources: ``--weights int8|int4``)
and saved.

GGUF sources keep their own quantized blocks (:mod:`exporter.gguf_quant`) and skip NNCF; NNCF
leaves constants that are already u4/u8/i8 alone anyway.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

import openvino as ov

from common.telemetry import keep_telemetry_off
from protos.manifest import WeightSpec

log = logging.getLogger(__name__)


def import_nncf() -> ModuleType:
    """NNCF, with its usage telemetry off (common/telemetry.py), also where the exporter is
    used as a library rather than through the `pipeshard` command."""
    keep_telemetry_off()
    import nncf

    return nncf


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
    """Apply the export's NNCF weight format, the same way in every stage.

    NNCF's default int4 mode keeps the embedding and the *last* MatMul of a graph at 8 bit. Per
    shard that would be each stage's last decoder layer, so the split model would differ from the
    unsplit one. Instead: embeddings and lm_head at int8 (as the unsplit default does), every
    decoder-layer matrix at int4, whichever stage it lands in.
    """
    if weights.format not in ("int8", "int4"):
        return model
    nncf = import_nncf()

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


def save_stage(model: ov.Model, out_dir: Path) -> None:
    """Save as built: f16 weights are f16 constants already, and f32 scales must stay f32."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, out_dir / "model.xml", compress_to_fp16=False)
