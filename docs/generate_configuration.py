"""Write docs/configuration.md from the settings classes of the stage and the gateway.

    .venv/bin/python docs/generate_configuration.py          # rewrite docs/configuration.md
    .venv/bin/python docs/generate_configuration.py --check  # exit 1 if it is out of date

Every setting, its command-line flag, its environment variable, its default and its
description come from the pydantic fields of ``stage_node.settings.StageSettings`` and
``server.settings.GatewaySettings``; tests/test_docs.py checks that the committed page is what
this script writes. Only the settings modules are imported (not the command line), so the page
follows the code wherever the commands live.
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: the packages live in ROOT
    sys.path.insert(0, str(ROOT))

from server.settings import GatewaySettings  # noqa: E402
from stage_node.settings import StageSettings  # noqa: E402

PAGE = ROOT / "docs" / "configuration.md"

# Flags whose spelling is not `--` + the field name with dashes (the rest are).
STAGE_FLAGS = {
    "ov_properties": "--ov-property KEY=VALUE (repeatable)",
    "batch_invariant": "--batch-invariant / --no-batch-invariant",
}
GATEWAY_FLAGS = {
    "api_keys": "--api-key KEY (repeatable)",
    "model_aliases": "--model-alias NAME (repeatable)",
    "batching": "--batching / --no-batching",
    "prefix_cache": "--prefix-cache / --no-prefix-cache",
}
# Fields without a description of their own.
DESCRIPTIONS = {"log_level": "log level: DEBUG, INFO, WARNING or ERROR"}
# How a value is written in an environment variable, where that is not plain text.
ENV_FORMS = {
    ("stage", "ov_properties"): 'a JSON object, e.g. `{"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}`',
    ("gateway", "stages"): "comma-separated",
    ("gateway", "api_keys"): "comma-separated",
    ("gateway", "model_aliases"): "comma-separated",
}
# Where each setting is explained at length (page#anchor under docs/).
SEE = {
    ("stage", "listen"): "stages.md#starting-a-stage",
    ("stage", "cpus"): "deployment.md#devices-threads-and-the-openvino-cache",
    ("stage", "threads"): "deployment.md#devices-threads-and-the-openvino-cache",
    ("stage", "device"): "deployment.md#devices-threads-and-the-openvino-cache",
    ("stage", "kv_backend"): "stages.md#kv-backends-paged-and-stateful",
    ("stage", "kv_cache_size"): "stages.md#kv-backends-paged-and-stateful",
    ("stage", "state_sessions"): "stages.md#hybrid-models-on-the-paged-backend",
    ("stage", "state_cache_size"): "stages.md#hybrid-models-on-the-paged-backend",
    ("stage", "state_window"): "stages.md#hybrid-models-on-the-paged-backend",
    ("stage", "max_batch"): "stages.md#kv-backends-paged-and-stateful",
    ("stage", "streams"): "stages.md#kv-backends-paged-and-stateful",
    ("stage", "batch_invariant"): "scheduling.md#batch-invariance",
    ("stage", "kv_cache_precision"): "deployment.md#devices-threads-and-the-openvino-cache",
    ("stage", "inference_precision"): "deployment.md#devices-threads-and-the-openvino-cache",
    ("stage", "ov_cache_dir"): "deployment.md#devices-threads-and-the-openvino-cache",
    ("stage", "ov_properties"): "deployment.md#devices-threads-and-the-openvino-cache",
    ("stage", "max_sessions"): "stages.md#sessions",
    ("stage", "session_idle_timeout"): "stages.md#sessions",
    ("stage", "compute_timeout"): "failures.md#a-hung-device",
    ("stage", "hidden_dtype"): "stages.md#the-ring",
    ("stage", "secret"): "security.md",
    ("stage", "tls_cert"): "security.md",
    ("stage", "tls_key"): "security.md",
    ("stage", "tls_ca"): "security.md",
    ("stage", "tls_server_name"): "security.md",
    ("stage", "metrics_port"): "metrics.md",
    ("gateway", "listen"): "api.md",
    ("gateway", "api_keys"): "security.md",
    ("gateway", "secret"): "security.md",
    ("gateway", "tls_ca"): "security.md",
    ("gateway", "tls_server_name"): "security.md",
    ("gateway", "tls_cert"): "security.md",
    ("gateway", "tls_key"): "security.md",
    ("gateway", "step_timeout"): "failures.md",
    ("gateway", "start_timeout"): "api.md#starting-the-gateway",
    ("gateway", "health_interval"): "failures.md",
    ("gateway", "health_timeout"): "failures.md",
    ("gateway", "link_loss_timeout"): "failures.md",
    ("gateway", "max_body_bytes"): "api.md#errors",
    ("gateway", "max_concurrent"): "scheduling.md#admission",
    ("gateway", "max_queued"): "scheduling.md#admission",
    ("gateway", "queue_timeout"): "scheduling.md#admission",
    ("gateway", "prefill_chunk"): "scheduling.md#prompts-in-chunks",
    ("gateway", "max_prefill_in_flight"): "scheduling.md#prompts-in-chunks",
    ("gateway", "prefill_chunk_busy"): "scheduling.md#micro-batch-groups",
    ("gateway", "micro_batch_groups"): "scheduling.md#micro-batch-groups",
    ("gateway", "batching"): "scheduling.md#no-batching",
    ("gateway", "prefix_cache"): "scheduling.md#prefix-caching",
    ("gateway", "json_schema_additional_properties"): "api.md#closed-objects",
    ("gateway", "unknown_fields"): "api.md#unknown-fields",
    ("stage", "prefix_cache_blocks"): "scheduling.md#prefix-caching",
    ("gateway", "ring_decode"): "scheduling.md#the-ring-decodes-on-its-own",
    ("gateway", "ring_decode_batched"): "scheduling.md#the-ring-decodes-on-its-own",
    ("gateway", "resume_grace"): "failures.md",
    ("gateway", "shutdown_grace"): "failures.md",
    ("gateway", "reasoning_parser"): "api.md#reasoning",
    ("gateway", "draft"): "scheduling.md#speculative-decoding",
    ("gateway", "speculation"): "scheduling.md#speculative-decoding",
    ("gateway", "spec_k"): "scheduling.md#adaptive-k",
    ("gateway", "spec_max_k"): "scheduling.md#adaptive-k",
    ("gateway", "speculation_max_users"): "scheduling.md#speculation-under-load",
    ("gateway", "draft_device"): "deployment.md#devices-threads-and-the-openvino-cache",
    ("gateway", "draft_threads"): "deployment.md#devices-threads-and-the-openvino-cache",
    ("gateway", "ov_cache_dir"): "deployment.md#devices-threads-and-the-openvino-cache",
}

_TYPE_NAMES = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    Path: "path",
    SecretStr: "secret string",
}
_BOUNDS = (
    (annotated_types.Ge, "ge", "≥"),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "≤"),
    (annotated_types.Lt, "lt", "<"),
)


def flag(role: str, name: str) -> str:
    """The command-line flag of setting ``name`` of ``role`` (stage or gateway)."""
    special = STAGE_FLAGS if role == "stage" else GATEWAY_FLAGS
    return special.get(name, "--" + name.replace("_", "-"))


def flag_names(role: str, name: str) -> list[str]:
    """The option strings (``--x``, ``--no-x``) that the flag of ``name`` consists of."""
    return [word for word in flag(role, name).split() if word.startswith("--")]


def env_var(settings: type[BaseSettings], name: str) -> str:
    return f"{settings.model_config.get('env_prefix', '')}{name.upper()}"


def type_text(annotation: Any) -> str:
    """A reader's name for a field's type: ``integer``, ``one of `a`, `b```, ..."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        values = [f"`{value}`" for value in typing.get_args(annotation)]
        return values[0] if len(values) == 1 else "one of " + ", ".join(values)
    if origin in (typing.Union, types.UnionType):
        parts = [a for a in typing.get_args(annotation) if a is not type(None)]
        return " or ".join(type_text(a) for a in parts)
    if origin is list:
        (item,) = typing.get_args(annotation)
        return f"list of {type_text(item)}s"
    if origin is dict:
        return "KEY=VALUE pairs"
    return _TYPE_NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)))


def bounds_text(field: FieldInfo) -> str:
    found = []
    for item in field.metadata:
        for kind, attribute, sign in _BOUNDS:
            if isinstance(item, kind):
                found.append(f"{sign} {getattr(item, attribute):g}")
    return ", ".join(found)


def value_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, Path):  # the same page on every machine: ~ for the home folder
        home = Path.home()
        return "~/" + str(value.relative_to(home)) if value.is_relative_to(home) else str(value)
    return str(value)


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "**required**"
    factory = field.default_factory
    value = factory() if factory is not None else field.default  # type: ignore[call-arg]
    if value is None or value is PydanticUndefined or value in ({}, []):
        return "unset"
    return f"`{value_text(value)}`"


def row(role: str, settings: type[BaseSettings], name: str, field: FieldInfo) -> str:
    kind = type_text(field.annotation)
    bounds = bounds_text(field)
    if bounds:
        kind += f" ({bounds})"
    form = ENV_FORMS.get((role, name))
    env = f"`{env_var(settings, name)}`" + (f" ({form})" if form else "")
    description = field.description or DESCRIPTIONS.get(name, "")
    see = SEE.get((role, name))
    if see:
        description += f"; see [{see.split('#')[0]}]({see})"
    cells = [f"`{name}`", f"`{flag(role, name)}`", env, kind, default_text(field), description]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def table(role: str, settings: type[BaseSettings]) -> list[str]:
    lines = [
        "| setting | flag | environment variable | type | default | description |",
        "|---|---|---|---|---|---|",
    ]
    lines += [row(role, settings, n, f) for n, f in settings.model_fields.items()]
    return lines


HEADER = """\
# Configuration reference

<!-- Generated by docs/generate_configuration.py from stage_node/settings.py and
server/settings.py: do not edit by hand; run `.venv/bin/python docs/generate_configuration.py`
after changing a setting (tests/test_docs.py fails while this page is out of date). -->

Every setting of the two long-running processes: `pipeshard stage` (one per stage shard) and
`pipeshard serve` (the gateway). `pipeshard up` starts both with its own options (see
[deployment.md](deployment.md#one-pc-pipeshard-up)); the one-shot commands `pipeshard export`
and `pipeshard verify` are described in [export.md](export.md), `pipeshard health` in
[deployment.md](deployment.md#health-checks).

Rules for both processes:

- A setting is given as a command-line flag or as an environment variable; the flag wins.
  The gateway also reads a TOML file given with `--config FILE`, whose keys are the setting
  names below (`max_concurrent = 32`); the environment wins over the file.
- Booleans in the environment are `true` / `false`. Leave a setting you do not use unset: an
  empty value (`PIPESHARD_STAGE_THREADS=`) is a value, not the default, and a number setting
  refuses it.
- A bad value stops the process at start with one line naming the setting
  (`pipeshard stage: error: bad settings: ...`, exit status 2).
- `--log-level` is accepted by every command (default `INFO` for the services, `WARNING` for
  the tools).
"""

STAGE_INTRO = """\
## `pipeshard stage`

Environment variables: `PIPESHARD_STAGE_<SETTING>`. Under systemd they live in
`/etc/pipeshard/stage-K.env` (see `deploy/systemd/stage.env.example`, which lists every one).
"""

GATEWAY_INTRO = """\
## `pipeshard serve`

Environment variables: `PIPESHARD_GATEWAY_<SETTING>`; TOML keys (`--config`): the setting names.
Under systemd they live in `/etc/pipeshard/gateway.env` (see
`deploy/systemd/gateway.env.example`, which lists every one).
"""

# Environment variables read outside the two settings classes: (variable, read by, meaning,
# default).
OTHER_VARIABLES = (
    (
        "PIPESHARD_CACHE_DIR",
        "`pipeshard export`, `pipeshard up`",
        "where built-in models are downloaded and assembled, and where the configs and "
        "tokenizers read from GGUF files are cached (`--cache-dir` wins)",
        "`~/.cache/pipeshard`",
    ),
    ("PYTHON", "`deploy/bootstrap.sh`", "the Python that creates `.venv`", "`python3`"),
    (
        "PIPESHARD_EXTRAS",
        "`deploy/bootstrap.sh`",
        "the extras installed",
        "`gguf` (with `--dev`: `export,bench,dev`)",
    ),
    ("FUZZ_EXAMPLES", "`tests/test_fuzz.py`", "examples the API fuzzer tries", "`60`"),
)


def other_variables() -> str:
    lines = [
        "## Other environment variables",
        "",
        "| variable | read by | meaning | default |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| `{name}` | {who} | {what} | {default} |" for name, who, what, default in OTHER_VARIABLES
    ]
    return "\n".join(lines) + "\n"


def render() -> str:
    """The text of docs/configuration.md for the settings as the code defines them now."""
    parts = [
        HEADER,
        STAGE_INTRO,
        "\n".join(table("stage", StageSettings)) + "\n",
        GATEWAY_INTRO,
        "\n".join(table("gateway", GatewaySettings)) + "\n",
        other_variables(),
    ]
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
