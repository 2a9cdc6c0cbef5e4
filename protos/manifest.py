"""The shard manifest: what the exporter writes beside the stage folders and every runtime reads.

Layer ranges are half-open, ``[layer_start, layer_end)``, in the numbering of the source model.
The manifest file is the identity of an export: its sha256 (``manifest_hash``) is what stages
compare to refuse a ring assembled from different exports.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MANIFEST_NAME = "manifest.json"
# 2: a manifest made from the plan alone (stage files are not listed: stages may be exported on
# different machines), the "gguf" weight format
SCHEMA_VERSION = 2

# "gguf": a GGUF file's own quantized blocks, kept as they are (docs/export.md)
WeightFormat = Literal["fp32", "fp16", "int8", "int4", "gguf"]
# how "gguf" weights encode blocks with a scale and a minimum (Q4_K, Q5_K, Q4_1, Q5_1, Q2_K):
# "exact" f32 fractional zero points, "split" the minimum as a separate small matmul (also
# exact); "rounded" (integer zero points, inexact) is no longer made, read from older exports
GGUFForm = Literal["exact", "split", "fast", "rounded"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# how exactly a GGUF tensor type's weights decompress to gguf's de-quantization
GGUFExactness = Literal["bit-exact", "within 1 f32 ulp", "rounded to f16", "inexact"]


class GGUFTypeEntry(_Frozen):
    """One GGML tensor type of a "gguf" export's file, and what the export makes of it."""

    type: str = Field(description="GGML type name, e.g. Q4_K")
    matrix: bool = Field(description="2-D tensors (1-D ones: norms and biases)")
    tensors: int = Field(description="tensors of this type and rank in the file")
    becomes: str = Field(description="the OpenVINO weights they become")
    exactness: GGUFExactness = Field(
        description="against gguf's de-quantization (what llama.cpp and transformers compute)"
    )


class WeightSpec(_Frozen):
    """How the weights of every stage were stored (the same for all stages of an export)."""

    format: WeightFormat
    group_size: int | None = Field(default=None, description="int4 group size; -1 = per channel")
    symmetric: bool | None = Field(default=None, description="int4 symmetric quantization")
    gguf_form: GGUFForm | None = Field(
        default=None, description="gguf: how blocks with a minimum are encoded"
    )
    gguf_types: list[GGUFTypeEntry] | None = Field(
        default=None, description="gguf: the file's tensor types and what each became"
    )


class FileEntry(_Frozen):
    path: str = Field(description="path relative to the export root")
    sha256: str
    size: int


class StageEntry(_Frozen):
    """One pipeline stage: a stateful OpenVINO IR over a half-open layer range.

    A boundary may fall inside a layer's MLP (a fractional ``--split``, e.g. 15.7,12.3). The
    earlier stage then holds that layer's attention and KV cache and the MLP's first
    ``mlp_out`` intermediate channels; it passes the layer's output so far and the MLP's input
    on, side by side (``[tokens, 2 * hidden]``). The next stage (``mlp_in``, the same number)
    adds the remaining channels' product before its own layers.
    """

    index: int
    layer_start: int
    layer_end: int
    mlp_in: int | None = Field(
        default=None,
        description="first finishes the previous stage's last layer: MLP channels [mlp_in, I)",
    )
    mlp_out: int | None = Field(
        default=None, description="its last layer's MLP computes only channels [0, mlp_out)"
    )
    directory: str = Field(description="folder of this stage relative to the export root")
    inputs: list[str]
    outputs: list[str]
    beam_idx: bool = Field(
        description="a beam_idx Gather sits between each KV ReadValue and Concat"
    )

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def span(self, intermediate_size: int | None) -> str:
        """Its layers as --split counts them, e.g. ``[0, 15.76)``."""
        return layer_span(
            self.layer_start, self.layer_end, self.mlp_in, self.mlp_out, intermediate_size or 1
        )

    def share(self, intermediate_size: int | None) -> float:
        """Its --split share: its layers, a cut MLP counted by its share of channels."""
        channels = intermediate_size or 1
        end = boundary(self.layer_end, self.mlp_out, channels)
        return end - boundary(self.layer_start, self.mlp_in, channels)

    def input_width(self, hidden_size: int) -> int:
        """Width of the hidden states this stage takes (stage 0 takes token ids)."""
        return 2 * hidden_size if self.mlp_in is not None else hidden_size

    @property
    def model_xml(self) -> str:
        return f"{self.directory}/model.xml"


def boundary(layer: int, channels: int | None, intermediate_size: int) -> float:
    """Where a stage starts or ends as --split counts layers: a cut inside layer L - 1's MLP
    after c channels (the stage before ends with L - 1's attention) is at L - 1 + c / I."""
    return layer if channels is None else layer - 1 + channels / intermediate_size


def layer_span(
    start: int, end: int, mlp_in: int | None, mlp_out: int | None, intermediate_size: int
) -> str:
    """``[start, end)`` where a cut inside layer L's MLP after c channels reads L + c / I."""

    def at(layer: int, channels: int | None) -> str:
        return (
            str(layer)
            if channels is None
            else f"{boundary(layer, channels, intermediate_size):.2f}"
        )

    return f"[{at(start, mlp_in)}, {at(end, mlp_out)})"


class ModelSpec(_Frozen):
    """The architecture facts the runtimes need (shapes of what crosses between stages)."""

    model_id: str
    architecture: str = Field(description="transformers model_type, e.g. qwen2")
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    layer_types: list[str] = Field(
        description="full_attention / sliding_attention / linear_attention per layer"
    )
    sliding_window: int | None = None
    intermediate_size: int | None = Field(default=None, description="MLP channels per layer")

    def recurrent_layers(self, start: int = 0, end: int | None = None) -> list[int]:
        """The linear-attention (Gated DeltaNet) layers among ``[start, end)``: each keeps a
        fixed-size recurrent state per sequence, which cannot be trimmed back by position."""
        stop = self.num_layers if end is None else end
        return [i for i in range(start, stop) if self.layer_types[i] == "linear_attention"]


class TokenizerSpec(_Frozen):
    directory: str = Field(description="folder holding the tokenizer files, relative to the root")
    files: list[FileEntry]
    chat_template: str | None
    eos_token_ids: list[int]
    bos_token_id: int | None = None
    pad_token_id: int | None = None


class DraftEntry(_Frozen):
    """A draft model exported beside the target as its own one-stage export."""

    directory: str
    model_id: str
    manifest_sha256: str


class SourceSpec(_Frozen):
    """Where the weights came from, so `pipeshard verify` can load the reference again."""

    kind: Literal["hf_dir", "gguf"]
    path: str
    sha256: str | None = None


class ShardManifest(_Frozen):
    schema_version: int = SCHEMA_VERSION
    model: ModelSpec
    weights: WeightSpec
    stages: list[StageEntry]
    tokenizer: TokenizerSpec
    source: SourceSpec
    draft: DraftEntry | None = None
    exporter_version: str
    openvino_version: str

    @model_validator(mode="after")
    def _check_layers(self) -> ShardManifest:
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(
                f"manifest schema version {self.schema_version} is not supported "
                f"(this pipeshard reads version {SCHEMA_VERSION})"
            )
        expected = 0
        for i, stage in enumerate(self.stages):
            if stage.index != i:
                raise ValueError(f"stage {i} is listed with index {stage.index}")
            if stage.layer_start != expected or stage.layer_end <= stage.layer_start:
                raise ValueError(
                    f"stage {i} covers layers [{stage.layer_start}, {stage.layer_end}), "
                    f"expected to start at {expected} and be non-empty"
                )
            expected = stage.layer_end
            before = self.stages[i - 1].mlp_out if i else None
            if stage.mlp_in != before:
                raise ValueError(
                    f"stage {i} finishes MLP channels from {stage.mlp_in}, the stage before "
                    f"it stops at {before}"
                )
            channels = self.model.intermediate_size
            if stage.mlp_out is not None and not (channels and 0 < stage.mlp_out < channels):
                raise ValueError(
                    f"stage {i} splits its last layer's MLP at channel {stage.mlp_out}, "
                    f"which is not inside the layer's {channels} channels"
                )
        if self.stages and self.stages[-1].mlp_out is not None:
            raise ValueError("the last stage cannot split its last layer's MLP")
        if self.stages and expected != self.model.num_layers:
            raise ValueError(f"stages cover {expected} layers of {self.model.num_layers}")
        return self

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"


def manifest_hash(root: Path) -> str:
    """The identity of an export: sha256 of its manifest without the source's local path
    (stages exported on different machines, from copies of the model in different folders,
    are one export; the source's content hash is part of it)."""
    manifest = load_manifest(root)
    identity = manifest.model_dump_json(exclude={"source": {"path"}})
    return hashlib.sha256(identity.encode("utf-8")).hexdigest()


def load_manifest(root: Path) -> ShardManifest:
    """Read and validate ``root/manifest.json``; raises ``ValueError`` with a readable reason."""
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise ValueError(f"{path} does not exist: not a pipeshard export folder")
    return ShardManifest.model_validate_json(path.read_text(encoding="utf-8"))


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
