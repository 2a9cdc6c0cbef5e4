"""The `pipeshard` command line: one entry point, one subcommand per role.

Subcommands import their packages lazily so that the runtime roles never import torch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import resource
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeshard.arguments import (
    COMMON,
    add_export_parser,
    defaults_help,
    export_options,
    settings_defaults,
)
from server.options import parse_properties

if TYPE_CHECKING:
    from shard_runtime.runner import RunnerOptions


def _add_runner_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("OpenVINO")
    # no defaults here: RunnerOptions holds them
    group.add_argument("--device", help="CPU (default), GPU, NPU, AUTO, ...")
    group.add_argument("--threads", type=int, help="inference threads (0: default)")
    group.add_argument(
        "--kv-cache-precision", default=None, help="KV_CACHE_PRECISION, e.g. f32, f16, u8"
    )
    group.add_argument(
        "--inference-precision", default=None, help="INFERENCE_PRECISION_HINT, e.g. f32"
    )
    group.add_argument(
        "--ov-cache-dir", type=Path, default=None, help="OpenVINO model cache folder (CACHE_DIR)"
    )
    group.add_argument(
        "--ov-property",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other OpenVINO compile property, e.g. DYNAMIC_QUANTIZATION_GROUP_SIZE=0",
    )


def _runner_options(args: argparse.Namespace) -> RunnerOptions:
    from shard_runtime.runner import RunnerOptions

    return RunnerOptions.from_settings(args, properties=parse_properties(args.ov_property))


def _run_export(args: argparse.Namespace) -> int:
    from exporter.export import export_model
    from exporter.plan import format_bytes

    report = export_model(export_options(args))
    if not args.quiet and not report.reused:  # a reuse said so already
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        phases = ", ".join(f"{k} {v:.1f}s" for k, v in report.phases.items())
        print(
            f"exported {report.manifest.model.model_id} to {args.out} "
            f"({report.manifest.num_stages} stages) in {report.seconds:.1f}s ({phases}); "
            f"peak memory {format_bytes(peak)}"
        )
    return 0


def _plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        parents=[COMMON],
        help="plan a known big model over your PCs without its file: each stage's weights, "
        "KV cache and export memory",
        description="Plan a real model from its published shape (no file, no download): the "
        "GGUF a quantization makes of it, what each stage holds at run time (weights, KV "
        "cache, recurrent state), what exporting a stage needs, and whether it fits each set "
        "of hosts; where it does not, what would. `pipeshard export` prints the plan of a "
        "model file.",
    )
    p.add_argument("preset", nargs="?", metavar="MODEL", help="the model (see --list)")
    p.add_argument(
        "--list", action="store_true", help="list the models and where their numbers come from"
    )
    p.add_argument(
        "--quant",
        action="append",
        default=None,
        help="GGUF quantization, e.g. Q4_K_M, Q8_0, MXFP4 (repeatable or comma-separated; "
        "default: the model's common ones)",
    )
    p.add_argument(
        "--hosts",
        action="append",
        default=None,
        help="a set of hosts: NxSIZE (3x32GB) or one size each (64GB,32GB); repeatable "
        "(default: the sets the model is commonly split over)",
    )
    p.add_argument(
        "--context",
        type=int,
        default=32768,
        help="positions of KV cache per sequence (default 32768)",
    )
    p.add_argument("--sequences", type=int, default=1, help="sequences held at once (default 1)")


def _run_plan(args: argparse.Namespace) -> int:
    from exporter.plan_sessions import format_sessions
    from exporter.presets import (
        PRESETS,
        describe_preset,
        find_preset,
        format_preset_plan,
        plan_preset,
        summary_table,
    )

    if args.list:
        for preset in PRESETS.values():
            print(f"{preset.name}: {preset.title}, {describe_preset(preset)}")
            print(f"  quantizations: {', '.join(preset.quants)}")
            print(f"  source: {preset.source}")
        return 0
    if not args.preset:
        raise ValueError(f"name a model ({', '.join(PRESETS)}) or give --list")
    preset = find_preset(args.preset)
    quants = [q.strip().upper() for given in args.quant or [] for q in given.split(",")]
    hosts = args.hosts or list(preset.default_hosts)
    plans = [
        plan_preset(preset, quant, spec, args.context, args.sequences)
        for quant in quants or preset.default_quants
        for spec in hosts
    ]
    print(f"### {preset.title}\n\n{describe_preset(preset)}.\n\n{summary_table(plans)}")
    for plan in plans:
        sessions = format_sessions(plan)
        print(f"\n{format_preset_plan(plan)}" + (f"\n\n{sessions}" if sessions else ""))
    return 0


def _verify_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify", parents=[COMMON], help="compare the chained stages with the unsplit model"
    )
    p.add_argument("export_dir", type=Path)
    p.add_argument("--against", type=Path, default=None, help="another export to compare with")
    p.add_argument("--steps", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--prompt", action="append", default=None, help="prompt (repeatable)")
    p.add_argument(
        "--no-reference", action="store_true", help="skip the transformers reference (no torch)"
    )
    p.add_argument(
        "--atol",
        type=float,
        default=None,
        help="logit tolerance for strict checks (default 1e-3 where the runtime is exact: f32 "
        "compute, and for the transformers check also an f32 KV cache; else 0.5)",
    )
    _add_runner_options(p)


def _run_verify(args: argparse.Namespace) -> int:
    from exporter.verify import format_report, verify_export

    report = verify_export(
        args.export_dir,
        prompts=args.prompt,
        steps=args.steps,
        against=args.against,
        reference=not args.no_reference,
        options=_runner_options(args),
        atol=args.atol,
    )
    print(format_report(report, args.against))
    return 1 if report.failures() else 0


def _stage_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "stage",
        parents=[COMMON],
        help="serve one stage shard over gRPC",
        description="Each flag can also be set as PIPESHARD_STAGE_<NAME>, e.g. "
        "PIPESHARD_STAGE_THREADS=2.",
        formatter_class=defaults_help(_stage_defaults),
    )
    p.add_argument("--shards", type=Path, help="export folder (manifest.json + stage folders)")
    p.add_argument("--stage", type=int, help="stage index K")
    p.add_argument("--listen", help="HOST:PORT (default {default})")
    p.add_argument("--device", help="OpenVINO device (default {default})")
    p.add_argument("--threads", type=int, help="inference threads (0: default)")
    p.add_argument("--cpus", help="pin to these CPUs, e.g. 0 or 0-3")
    p.add_argument(
        "--streams",
        type=int,
        help="stateful: sessions computed at the same time (default {default})",
    )
    p.add_argument(
        "--kv-backend",
        choices=["auto", "stateful", "paged"],
        help="KV cache: an infer request per session (stateful) or a shared block pool, every "
        "ready session in one inference call (paged); auto (default): paged unless "
        "--max-sessions 1",
    )
    p.add_argument(
        "--kv-cache-size", type=float, help="paged: GiB of KV blocks (default {default})"
    )
    p.add_argument(
        "--max-batch", type=int, help="paged: sessions per inference call (default {default})"
    )
    p.add_argument(
        "--prefix-cache-blocks",
        type=int,
        help="paged: KV blocks of known prompt prefixes kept for later sessions when no session "
        "holds them (default: every free block, evicted oldest first; 0: no prefix cache)",
    )
    p.add_argument(
        "--state-sessions",
        type=int,
        help="paged, hybrid models: sessions the linear-attention state pool holds at once, "
        "each at the full --state-window; the gateway admits no more (default: "
        "--max-sessions, at most 8)",
    )
    p.add_argument(
        "--state-cache-size",
        type=float,
        help="paged, hybrid models: GiB of linear-attention state slots instead of "
        "--state-sessions (as many sessions as it holds at the window)",
    )
    p.add_argument(
        "--state-window",
        type=int,
        help="paged, hybrid models: positions a session can be rolled back, at least the "
        "gateway's --spec-max-k (default {default})",
    )
    p.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        help="paged, CPU: each row's result independent of its batch, so greedy output is the same "
        "alone, batched and speculative (default on; off saves padding one-row calls to two "
        "where this CPU needs it: up to 1.4x a one-user decode step, pipeshard bench batch-cost)",
    )
    p.add_argument("--kv-cache-precision", help="KV_CACHE_PRECISION, e.g. f16, f32, u8")
    p.add_argument("--inference-precision", help="INFERENCE_PRECISION_HINT, e.g. f32")
    p.add_argument("--ov-cache-dir", type=Path, help="OpenVINO model cache (CACHE_DIR)")
    p.add_argument(
        "--ov-property",
        dest="ov_properties",
        action="append",
        metavar="KEY=VALUE",
        help="any other OpenVINO compile property (repeatable), e.g. "
        "DYNAMIC_QUANTIZATION_GROUP_SIZE=0",
    )
    p.add_argument("--max-sessions", type=int, help="sessions held at once (default {default})")
    p.add_argument("--session-idle-timeout", type=float, help="seconds (default {default})")
    p.add_argument(
        "--compute-timeout",
        type=float,
        help="seconds an inference call may run before the stage counts as hung "
        "(default {default})",
    )
    p.add_argument("--hidden-dtype", choices=["fp16", "fp32"], help="hidden states sent on")
    p.add_argument("--secret", help="shared secret required on every call")
    p.add_argument(
        "--tls-cert", type=Path, help="PEM certificate to serve gRPC (and --metrics-port) with"
    )
    p.add_argument("--tls-key", type=Path, help="PEM key of --tls-cert")
    p.add_argument("--tls-ca", type=Path, help="CA bundle to verify the next stage (TLS to it)")
    p.add_argument("--tls-server-name", help="name expected in the next stage's certificate")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port")


def _stage_defaults() -> dict[str, Any]:
    from stage_node.settings import StageSettings

    return settings_defaults(StageSettings)


def _run_stage(args: argparse.Namespace) -> int:
    from stage_node.server import run
    from stage_node.settings import StageSettings

    overrides = _overrides(args, StageSettings)
    if args.ov_properties:
        overrides["ov_properties"] = parse_properties(args.ov_properties)
    return run(_settings(lambda: StageSettings(**overrides)))


def _overrides(args: argparse.Namespace, settings_class: type[Any]) -> dict[str, Any]:
    fields = settings_class.model_fields
    overrides = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    if args.log_level:
        overrides["log_level"] = args.log_level
    return overrides


def _settings(make: Callable[[], Any]) -> Any:
    from pydantic import ValidationError

    try:
        return make()
    except ValidationError as exc:
        problems = "; ".join(
            # a whole-model check has no field: its message alone, without pydantic's prefix
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
            if e["loc"]
            else e["msg"].removeprefix("Value error, ")
            for e in exc.errors()
        )
        raise ValueError(f"bad settings: {problems}") from None


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        parents=[COMMON],
        help="run the OpenAI-compatible gateway over a ring of stages",
        description="Each flag can also be set as PIPESHARD_GATEWAY_<NAME> or in the --config "
        "TOML file (flags win over the environment, which wins over the file).",
        formatter_class=defaults_help(_gateway_defaults),
    )
    p.add_argument("--stages", help="stage addresses in order: HOST:PORT[,HOST:PORT...]")
    p.add_argument("--listen", help="HTTP HOST:PORT (default {default})")
    p.add_argument("--api-key", dest="api_keys", action="append", help="accepted key (repeat)")
    p.add_argument("--model-name", help="model id to serve (default: the export's)")
    p.add_argument(
        "--model-alias",
        dest="model_aliases",
        action="append",
        help="another model name requests may give (repeat; e.g. the names Claude Code sends)",
    )
    p.add_argument(
        "--responses-store-size",
        type=int,
        help="/v1/responses kept for previous_response_id ({default}; 0: none)",
    )
    p.add_argument(
        "--stream-keepalive-s",
        type=float,
        help="a stream whose first token is slower than this starts anyway and sends "
        "keep-alives this often ({default} s; 0: wait for the first token)",
    )
    p.add_argument("--tokenizer", type=Path, help="local tokenizer folder (default: from stages)")
    p.add_argument("--secret", help="the stages' shared secret")
    p.add_argument("--tls-ca", type=Path, help="CA bundle to verify the stages (TLS)")
    p.add_argument("--tls-server-name", help="name expected in stage certificates")
    p.add_argument("--tls-cert", type=Path, help="PEM certificate (chain): serve HTTPS")
    p.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    p.add_argument("--step-timeout", type=float, help="seconds one pipeline step may take")
    p.add_argument("--start-timeout", type=float, help="seconds to wait for the stages")
    p.add_argument(
        "--health-interval",
        type=float,
        help="seconds between health probes of the stages ({default})",
    )
    p.add_argument(
        "--health-timeout",
        type=float,
        help="seconds a stage may take to answer a probe ({default})",
    )
    p.add_argument(
        "--link-loss-timeout",
        type=float,
        help="seconds a stage or its link may not answer the probes before the steps in "
        "flight through it count as lost ({default})",
    )
    p.add_argument("--max-body-bytes", type=int, help="larger request bodies get 413")
    p.add_argument("--max-concurrent", type=int, help="choices generating at once ({default})")
    p.add_argument("--max-queued", type=int, help="choices waiting; beyond it 429 ({default})")
    p.add_argument("--queue-timeout", type=float, help="seconds a choice may wait ({default})")
    p.add_argument("--prefill-chunk", type=int, help="prompt tokens per prefill step ({default})")
    p.add_argument(
        "--max-prefill-in-flight",
        type=int,
        help="prefill chunks in the ring at once ({default}; paged rings: the token budget "
        "decides)",
    )
    p.add_argument(
        "--prefill-chunk-busy",
        type=int,
        help="paged rings: prompt tokens of a micro-batch group in the ring while it decodes "
        "({default})",
    )
    p.add_argument(
        "--micro-batch-groups",
        type=int,
        help="groups the running requests are spread over (default: one per stage; paged "
        "rings: one per {paged_group_size} running requests, up to one per stage)",
    )
    p.add_argument(
        "--batching",
        action=argparse.BooleanOptionalAction,
        help="several requests' rows in one inference call (default on); --no-batching: each "
        "request computed alone, pipelined across the stages, one-row steps not padded unless "
        "speculating (faster for a few users where batch_cost.py shows 2 rows cost >> 1 row)",
    )
    p.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        help="open a request's session on the KV blocks of its prompt's longest prefix the "
        "paged stages already hold, prefill only the rest (default on; the stages' "
        "--prefix-cache-blocks sizes it); --no-prefix-cache: prefill every prompt whole",
    )
    p.add_argument(
        "--ring-decode",
        type=int,
        help="with --no-batching and no speculation: tokens the stages decode on their own "
        "after each decode step, the last stage feeding each token straight back to stage 0 "
        "(default {default}; 0: every step through the gateway)",
    )
    p.add_argument(
        "--ring-decode-batched",
        type=int,
        help="with batching and no speculation: tokens a micro-batch group decodes on the "
        "ring on its own after each decode step while no request waits to join a group "
        "(default {default}; 0: every step through the gateway)",
    )
    p.add_argument(
        "--resume-grace",
        type=float,
        help="seconds in-flight requests wait for a failed stage to return, then go on ({default})",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        help="on SIGTERM/Ctrl-C: seconds requests in flight get to finish before they end "
        "with 503 / an error event ({default})",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=["auto", "none", "think", "harmony"],
        help="how the model's reasoning is split from its answer (reasoning_content): "
        "<think> blocks, gpt-oss's harmony channels, none (all is content); auto, the "
        "default: read from the chat template or the architecture",
    )
    p.add_argument("--draft", type=Path, help="draft export folder: speculative decoding")
    p.add_argument(
        "--speculation",
        choices=["auto", "draft", "ngram", "off"],
        help="proposer (auto: the draft if given, else off)",
    )
    p.add_argument("--spec-k", type=int, help="draft tokens per step (0: adaptive, default)")
    p.add_argument("--spec-max-k", type=int, help="largest adaptive K ({default})")
    p.add_argument(
        "--speculation-max-users",
        metavar="N|auto",
        help="speculate only while at most N requests decode at once, plain decoding above "
        "(0: no limit; auto, the default: 1 where a stage runs on this machine, else 0)",
    )
    p.add_argument("--draft-device", help="OpenVINO device of the draft ({default})")
    p.add_argument("--draft-threads", type=int, help="draft inference threads (0: auto)")
    p.add_argument(
        "--draft-kv-cache-size",
        type=float,
        help="GiB of KV blocks the draft holds, its prefix cache included (default {default})",
    )
    p.add_argument("--ov-cache-dir", type=Path, help="OpenVINO model cache (draft)")
    p.add_argument(
        "--json-schema-additional-properties",
        choices=["closed", "open"],
        help="tool arguments and strict JSON schemas: closed (default), objects take no keys "
        "their schema does not name unless it sets additionalProperties; open: as written",
    )
    p.add_argument(
        "--unknown-fields",
        choices=["warn", "reject"],
        help="request fields the gateway does not know: warn (default), ignored, named in the "
        "log and the x-pipeshard-ignored-fields header; reject: a 400 naming the field",
    )
    p.add_argument("--config", type=Path, help="TOML file with the same settings")


def _gateway_defaults() -> dict[str, Any]:
    from server.settings import (
        PAGED_BUSY_PREFILL_CHUNK,
        PAGED_GROUP_SIZE,
        SCHEDULER_DEFAULTS,
        GatewaySettings,
    )

    defaults = settings_defaults(GatewaySettings)
    # what the settings' None means: the scheduler's default, and the paged rings' own
    defaults["max_prefill_in_flight"] = SCHEDULER_DEFAULTS.max_prefill_in_flight
    defaults["prefill_chunk_busy"] = PAGED_BUSY_PREFILL_CHUNK
    defaults["paged_group_size"] = PAGED_GROUP_SIZE
    return defaults


def _run_serve(args: argparse.Namespace) -> int:
    from server.api.app import create_app, gateway_server
    from server.api.tokenization import keep_torch_out
    from server.settings import GatewaySettings

    keep_torch_out()
    overrides = _overrides(args, GatewaySettings)
    settings = _settings(lambda: GatewaySettings.load(args.config, **overrides))
    logging.getLogger().setLevel(settings.log_level.upper())
    server = gateway_server(create_app(settings), settings.log_level.lower())
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 0 if server.started else 3  # uvicorn's exit status for a failed start


def _up_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "up",
        parents=[COMMON],
        help="export (once) and run a whole local fleet: stages + gateway on 127.0.0.1",
        formatter_class=defaults_help(_fleet_defaults),
    )
    p.add_argument("--model", help="model to export (default: built-in)")
    p.add_argument("--export", type=Path, help="use this existing export instead")
    p.add_argument("--exports-dir", type=Path, help="where exports are cached")
    p.add_argument("--stages", type=int, help="number of stages (default {default})")
    p.add_argument(
        "--weights",
        choices=["auto", "gguf", "fp32", "fp16", "int8", "int4"],
        help="as `pipeshard export --weights` (auto: a GGUF's own blocks, int4 for a folder)",
    )
    p.add_argument(
        "--gguf-form",
        choices=["split", "exact", "fast"],
        help="as `pipeshard export --gguf-form`, for a GGUF model only (default here: fast, "
        "Q6_K regrouped to 32 columns a scale, inexact and faster; split: the exact form)",
    )
    p.add_argument(
        "--host",
        help="the gateway's address (default {default}; 0.0.0.0: every interface, with "
        "--api-key); the stages listen on 127.0.0.1 only",
    )
    p.add_argument("--port", type=int, help="gateway port (default {default})")
    p.add_argument("--stage-port", type=int, help="first stage's port")
    p.add_argument("--threads", type=int, help="inference threads per stage")
    p.add_argument(
        "--kv-backend",
        choices=["auto", "stateful", "paged"],
        help="the stages' KV backend (see `pipeshard stage --help`)",
    )
    p.add_argument("--api-key", dest="api_keys", action="append")
    p.add_argument("--log-dir", type=Path, help="stage logs go here (default: this terminal)")
    p.add_argument(
        "--draft",
        help="draft model for speculative decoding, exported beside the target "
        "(default: the built-in pair's draft for the default model)",
    )
    p.add_argument("--no-draft", action="store_true", help="no draft, no speculative decoding")
    p.add_argument(
        "--speculation-max-users",
        metavar="N|auto",
        help="the gateway's --speculation-max-users: speculate only while at most N requests "
        "decode at once (auto, the default: 1, as the draft shares the cores with the stages "
        "here; 0: no limit)",
    )
    p.add_argument(
        "--micro-batch-groups",
        type=int,
        metavar="N",
        help="the gateway's --micro-batch-groups (default {default}: the stages share this "
        "machine's cores, so one batch of every request, each stage in turn on all the "
        "cores, serves more than groups pipelined across the stages)",
    )
    p.add_argument(
        "--no-batching",
        dest="batching",
        action="store_false",
        default=None,
        help="the gateway's --no-batching: each request alone, pipelined across the stages "
        "(with --no-draft, faster for a few users on CPUs where batch_cost.py shows 2 rows "
        "cost far more than 1)",
    )


def _fleet_defaults() -> dict[str, Any]:
    from pipeshard.fleet import FleetOptions

    return dataclasses.asdict(FleetOptions())


def _run_up(args: argparse.Namespace) -> int:
    from pipeshard.fleet import FleetOptions, run_fleet
    from server.settings import speculation_users

    # the flags given; FleetOptions holds the defaults
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(FleetOptions)
        if getattr(args, f.name, None) is not None
    }
    if args.no_draft:
        given["draft"] = None
    if "speculation_max_users" in given:
        try:
            given["speculation_max_users"] = speculation_users(given["speculation_max_users"])
        except ValueError as exc:
            raise ValueError(f"--speculation-max-users {exc}") from None
    groups = given.get("micro_batch_groups")
    if groups is not None and groups < 1:
        raise ValueError(f"--micro-batch-groups must be 1 or more, not {groups}")
    if groups is not None and given.get("batching") is False:
        raise ValueError(
            "--micro-batch-groups and --no-batching do not go together: without batching "
            "every running request is a group of its own"
        )
    return run_fleet(FleetOptions(**given))


def _health_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "health",
        parents=[COMMON],
        help="is a stage or a gateway serving? exit 0 if so, 1 if not (Docker's HEALTHCHECK)",
        description="Ask a stage (its gRPC Health call: a stopped or stuck stage fails it, and "
        "so does one whose inference call runs too long) or a gateway (GET /health) whether "
        "it serves. Without --address the service's own "
        "environment settings say where and how (PIPESHARD_STAGE_LISTEN, _SECRET, _TLS_CA or "
        "_TLS_CERT, _TLS_SERVER_NAME; PIPESHARD_GATEWAY_LISTEN, _TLS_CERT).",
        formatter_class=defaults_help(_health_defaults),
    )
    p.add_argument(
        "role",
        nargs="?",
        default="auto",
        choices=["stage", "gateway", "auto"],
        help="auto (default): the service PID 1 runs, as in a container",
    )
    p.add_argument("--address", help="HOST:PORT (a gateway also takes http(s)://HOST:PORT)")
    p.add_argument("--timeout", type=float, help="seconds to wait for the answer")
    p.add_argument("--tls-ca", help="a stage over TLS: the CA (or self-signed certificate)")
    p.add_argument("--server-name", help="a stage over TLS: the name in its certificate")
    p.add_argument(
        "--max-compute-seconds",
        type=float,
        help="a stage: unhealthy while an inference call has run longer, a hung device "
        "(default: PIPESHARD_STAGE_COMPUTE_TIMEOUT, else {default})",
    )
    p.add_argument("--cmdline", type=Path, default=Path("/proc/1/cmdline"), help=argparse.SUPPRESS)


def _health_defaults() -> dict[str, Any]:
    from pipeshard.health import COMPUTE_TIMEOUT

    return {"max_compute_seconds": COMPUTE_TIMEOUT}


def _run_health(args: argparse.Namespace) -> int:
    from pipeshard.health import check

    given = {"timeout": args.timeout} if args.timeout is not None else {}
    verdict = check(
        args.role,
        args.address,
        **given,
        tls_ca=args.tls_ca,
        server_name=args.server_name,
        max_compute_s=args.max_compute_seconds,
        cmdline=args.cmdline,
    )
    print(verdict.message, file=sys.stdout if verdict.healthy else sys.stderr)
    return 0 if verdict.healthy else 1


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    # Its suites and their options are the benchmarks' own (`pipeshard bench --help`, `pipeshard
    # bench SUITE --help`): main() hands them over.
    sub.add_parser(
        "bench",
        add_help=False,
        help="measure on this machine, one suite at a time (the paper's experiments when none "
        "is named): report, raw data, plots",
    )


def _run_bench(args: argparse.Namespace) -> int:
    """A thin entry: the benchmarks are not installed with pipeshard (`pip install .` ships the
    runtime and the exporter); they run from a checkout, whose root is put on the path here
    (and on PYTHONPATH, for the workers they start), and only when `pipeshard bench` is used."""
    import os

    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "benchmarks" / "suite" / "cli.py").is_file():
        if str(checkout) not in sys.path:
            sys.path.insert(0, str(checkout))
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        os.environ["PYTHONPATH"] = os.pathsep.join([str(checkout), *paths])
    try:
        from benchmarks.suite.cli import main as bench_main
    except ImportError as exc:
        raise ValueError(
            f"pipeshard bench runs from a checkout of pipeshard installed with "
            f"`bash deploy/bootstrap.sh --dev` (the benchmarks are not installed: {exc})"
        ) from None
    result: int = bench_main(args.bench_args)
    return result


COMMANDS = {
    "export": _run_export,
    "plan": _run_plan,
    "verify": _run_verify,
    "stage": _run_stage,
    "serve": _run_serve,
    "up": _run_up,
    "bench": _run_bench,
    "health": _run_health,
}
SERVICES = {"stage", "serve", "up"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipeshard", description=__doc__)
    parser.add_argument(
        "--log-level",
        default=None,
        help="DEBUG, INFO, WARNING, ERROR (default: INFO for services, WARNING for tools)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_export_parser(sub)
    _plan_parser(sub)
    _verify_parser(sub)
    _stage_parser(sub)
    _serve_parser(sub)
    _up_parser(sub)
    _bench_parser(sub)
    _health_parser(sub)
    # no prefixes: `--stage 1` must never be taken for `--stages 1`
    for command in sub.choices.values():
        command.allow_abbrev = False
    parser.allow_abbrev = False
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        args.bench_args = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    service = args.command in SERVICES
    level = args.log_level or ("INFO" if service else "WARNING")
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from exporter.errors import ExportError

    try:
        return COMMANDS[args.command](args)
    except (ExportError, ValueError) as exc:
        print(f"pipeshard {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        # the run path installs pipeshard[gguf]; an int8/int4 export (NNCF) needs the rest
        print(
            f"pipeshard {args.command}: error: {exc.name} is not installed; this needs the "
            "export extra: PIPESHARD_EXTRAS=export bash deploy/bootstrap.sh, or "
            "pip install 'pipeshard[export]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(f"pipeshard {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
