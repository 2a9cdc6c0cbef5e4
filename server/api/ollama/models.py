"""What Ollama's model routes tell of the one model served: ``/api/tags`` (the models
"installed"), ``/api/ps`` (the models loaded), ``/api/show`` (details, model info,
capabilities, template) and ``/api/version``.

The model is named as Ollama names models, ``NAME:latest`` (a request may leave the tag out);
``format`` is ``openvino``, ``family`` the architecture, ``quantization_level`` the export's
weight format, ``digest`` the export's manifest hash. The stages hold the model for as long as
they run: ``/api/ps`` lists it as never expiring.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos.manifest import ShardManifest
from server.api.ollama.lowering import DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P, LATEST
from server.api.ollama.render import timestamp
from server.api.ollama.schema import (
    ListedModel,
    ListResponse,
    ModelDetails,
    ProcessResponse,
    RunningModel,
    ShowResponse,
)
from server.api.reasoning import template_text
from server.api.serving import CompletionService

# The Ollama release whose API (docs/api.md, api/types.go) this follows. Clients compare it
# with the least version they need (pipeshard's own version is no Ollama version).
OLLAMA_API_VERSION = "0.32.15"
NEVER = "2318-01-01T00:00:00.000000Z"  # (Ollama's expires_at for a model kept loaded for good)


@dataclass(frozen=True)
class ServedModel:
    """What the model routes need of the gateway: the service, the export's manifest and
    hash, and when the gateway started (``modified_at``)."""

    service: CompletionService
    manifest: ShardManifest
    digest: str
    started: float

    @property
    def name(self) -> str:
        model = self.service.model
        return model if ":" in model else model + LATEST

    def details(self) -> ModelDetails:
        arch = self.manifest.model.architecture
        return ModelDetails(
            format="openvino",
            family=arch,
            families=[arch],
            parameter_size="",
            quantization_level=self.manifest.weights.format,
        )

    def capabilities(self) -> list[str]:
        found = ["completion"]
        if self.service.tool_format is not None:
            found.append("tools")
        if self.service.reasoning != "none":
            found.append("thinking")
        return found


def tags(served: ServedModel) -> ListResponse:
    return ListResponse(
        models=[
            ListedModel(
                name=served.name,
                model=served.name,
                modified_at=timestamp(served.started),
                size=0,
                digest=served.digest,
                details=served.details(),
            )
        ]
    )


def running(served: ServedModel) -> ProcessResponse:
    return ProcessResponse(
        models=[
            RunningModel(
                name=served.name,
                model=served.name,
                size=0,
                digest=served.digest,
                details=served.details(),
                expires_at=NEVER,
                size_vram=0,
                context_length=served.service.max_context,
            )
        ]
    )


def show(served: ServedModel) -> ShowResponse:
    spec = served.manifest.model
    arch = spec.architecture
    info: dict[str, object] = {
        "general.architecture": arch,
        "general.basename": spec.model_id,
        f"{arch}.context_length": served.service.max_context,
        f"{arch}.block_count": spec.num_layers,
        f"{arch}.embedding_length": spec.hidden_size,
        f"{arch}.attention.head_count": spec.num_heads,
        f"{arch}.attention.head_count_kv": spec.num_kv_heads,
        f"{arch}.attention.key_length": spec.head_dim,
        f"{arch}.vocab_size": spec.vocab_size,
    }
    if spec.intermediate_size is not None:
        info[f"{arch}.feed_forward_length"] = spec.intermediate_size
    parameters = "\n".join(
        f"{name:<30} {value}"
        for name, value in (
            ("temperature", DEFAULT_TEMPERATURE),
            ("top_k", DEFAULT_TOP_K),
            ("top_p", DEFAULT_TOP_P),
            ("num_ctx", served.service.max_context),
        )
    )
    template = template_text(served.service.codec.chat_template)
    return ShowResponse(
        license="",
        modelfile=f"# served by pipeshard from an OpenVINO export of {spec.model_id}\n"
        f"FROM {served.name}\n",
        parameters=parameters,
        template=template,
        details=served.details(),
        model_info=info,
        capabilities=served.capabilities(),
        modified_at=timestamp(served.started),
    )
