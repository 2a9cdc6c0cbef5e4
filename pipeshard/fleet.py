"""`pipeshard up`: a whole local fleet in one command.

Exports the model once (reused while the source and options are unchanged), starts one
`pipeshard stage` process per stage on 127.0.0.1, runs the gateway in this process, prints the
URL and a curl example once the ring is ready, and on Ctrl-C or SIGTERM stops everything. The
stage processes are tied to this one (they get SIGTERM if it dies), so none is left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from common.net import bind_problem, split_listen
from server.settings import GatewaySettings
from stage_node.settings import StageSettings

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
# The gateway's and the stages' own defaults, where `up` has no reason to differ from them.
_GATEWAY = GatewaySettings.model_fields
_STAGE = StageSettings.model_fields
_HOST, _PORT = split_listen(_GATEWAY["listen"].default)
_STAGE_PORT = split_listen(_STAGE["listen"].default)[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class FleetOptions:
    model: str = "default"
    export: Path | None = None  # an existing export: skips exporting
    exports_dir: Path = field(default_factory=lambda: Path.home() / ".cache/pipeshard/exports")
    stages: int = 2
    weights: str = "auto"  # `pipeshard export --weights`: a GGUF's own blocks, int4 for a folder
    # `pipeshard export --gguf-form`, for a GGUF model only. None: "fast" (Q6_K regrouped to 32
    # columns a scale, which the CPU plugin runs faster; inexact, its speed and agreement in
    # docs/export.md); `pipeshard export` keeps the exact "split"
    gguf_form: str | None = None
    host: str = _HOST  # the gateway's listen address
    port: int = _PORT
    stage_port: int = _STAGE_PORT  # the first stage's; the others' follow it
    threads: int = _STAGE["threads"].default  # the stages' --threads, the draft's too
    kv_backend: str = _STAGE["kv_backend"].default  # the stages' --kv-backend
    batching: bool = _GATEWAY["batching"].default  # the gateway's --batching
    api_keys: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    # The draft for speculative decoding, exported beside the target; "auto": the built-in
    # pair's draft for the default model, none for other models; None: no draft.
    draft: str | None = "auto"
    # The gateway's speculation_max_users ("auto": 1 here, as every stage runs on this
    # machine: once two requests decode, plain decoding serves more).
    speculation_max_users: int | Literal["auto"] = _GATEWAY["speculation_max_users"].default
    # The gateway's micro_batch_groups. 1: every stage runs on this machine's cores, so one
    # batch of every request, each stage in turn on all the cores, serves more than groups
    # pipelined across stages that share them (docs/scheduling.md#micro-batch-groups).
    # None: the gateway's default (one group per stage, for stages on PCs of their own).
    micro_batch_groups: int | None = 1

    def form(self) -> str:
        """The GGUF form `up` exports in."""
        return self.gguf_form or "fast"

    def draft_model(self) -> str | None:
        if self.draft == "auto":
            return "default-draft" if self.model == "default" else None
        return self.draft


def export_path(options: FleetOptions, model_id: str, gguf: bool = True) -> Path:
    """Where `up` keeps the export of ``model_id`` made with these options: with or without a
    draft, the same folder (an export with a draft serves `--no-draft` as it is)."""
    form = "" if not gguf or options.form() == "split" else f"-{options.form()}"
    return options.exports_dir / f"{model_id}-{options.stages}stage-{options.weights}{form}"


def ensure_export(options: FleetOptions) -> Path:
    """The export to serve: the given one, or ours for this model and these options. Whether
    ours is in place already (every `up` after the first) is checked here, torch hidden: the
    check reads configs only (about 1.3 s, against 5.5 s in a child that loaded torch).
    Where it is not, `pipeshard export --reuse` makes it in a child process, so nothing of
    the export's heap (nor transformers, which builds a GGUF's tokenizer the first time, nor
    torch, which a Hugging Face folder's NNCF compression may load) stays in this process,
    which goes on as the gateway. run_fleet hides torch first."""
    if options.export is not None:
        return options.export
    from exporter.errors import ExportError
    from exporter.export import reusable_export
    from exporter.source import resolve_source
    from pipeshard.arguments import export_options

    source = resolve_source(options.model)  # a built-in model is fetched here, once
    if source.kind != "gguf" and options.gguf_form is not None:
        raise ExportError(f"--gguf-form is for a GGUF model; {options.model} is not one")
    out = export_path(options, source.model_id, source.kind == "gguf")
    argv = [
        "export",
        options.model,
        "--out",
        str(out),
        "--stages",
        str(options.stages),
        "--weights",
        options.weights,
        "--reuse",
    ]
    if source.kind == "gguf":
        argv += ["--gguf-form", options.form()]
    draft = options.draft_model()
    if draft is not None:
        argv += ["--draft", draft]
    try:
        if reusable_export(export_options(_parse_export(argv))) is not None:
            return out
    except (ExportError, ImportError) as exc:  # the child says why, or needs torch to tell
        log.debug("reuse check of %s: %s", out, exc)
    code = subprocess.run([sys.executable, "-m", "pipeshard", *argv], check=False).returncode
    if code != 0:
        raise ExportError(f"the export of {options.model} failed (exit status {code}; see above)")
    return out


def _parse_export(argv: list[str]) -> argparse.Namespace:
    """``pipeshard export ARGV...`` parsed as the command line parses it."""
    from pipeshard.arguments import add_export_parser

    parser = argparse.ArgumentParser(prog="pipeshard", allow_abbrev=False)
    add_export_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def check_ports_free(options: FleetOptions, stages: int) -> None:
    """Raise ValueError naming the option to change when the gateway's port or a stage's is
    taken (another fleet, most likely) or the gateway's host is not this machine's."""
    wanted = [(options.host, options.port, "--port")]
    wanted += [("127.0.0.1", options.stage_port + i, "--stage-port") for i in range(stages)]
    for host, port, option in wanted:
        problem = bind_problem(host, port)
        if problem == "address already in use":
            raise ValueError(
                f"cannot listen on port {port} of {host}: {problem} (another pipeshard up?); "
                f"choose another with {option}"
            )
        if problem is not None:
            raise ValueError(f"cannot listen on {host}: {problem} (see --host)")


def start_stages(export: Path, options: FleetOptions, count: int) -> list[subprocess.Popen[bytes]]:
    procs = []
    for index in range(count):
        args = [
            sys.executable,
            "-m",
            "pipeshard.cli",
            "stage",
            "--shards",
            str(export),
            "--stage",
            str(index),
            "--listen",
            f"127.0.0.1:{options.stage_port + index}",
            "--threads",
            str(options.threads),
            "--kv-backend",
            options.kv_backend,
        ]
        out = None
        if options.log_dir is not None:
            options.log_dir.mkdir(parents=True, exist_ok=True)
            out = (options.log_dir / f"stage-{index}.log").open("ab")
        procs.append(
            subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                preexec_fn=_die_with_parent,
            )
        )
    return procs


def stop_all(procs: list[subprocess.Popen[bytes]], grace: float = 10.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace)


def gateway_settings(
    options: FleetOptions, addresses: list[str], draft: Path | None = None
) -> GatewaySettings:
    """The gateway's settings for a local fleet (the rest, e.g. HTTPS with
    PIPESHARD_GATEWAY_TLS_CERT/_KEY, from the environment)."""
    host = f"[{options.host}]" if ":" in options.host else options.host  # IPv6
    return GatewaySettings(
        stages=addresses,
        listen=f"{host}:{options.port}",
        api_keys=options.api_keys,  # type: ignore[arg-type]
        draft=draft,
        draft_threads=options.threads,
        speculation_max_users=options.speculation_max_users,
        batching=options.batching,
        micro_batch_groups=options.micro_batch_groups if options.batching else None,
    )


async def _serve(
    options: FleetOptions,
    addresses: list[str],
    procs: list[subprocess.Popen[bytes]],
    draft: Path | None = None,
) -> None:
    from server.api.app import create_app, gateway_server

    settings = gateway_settings(options, addresses, draft)
    server = gateway_server(create_app(settings), "warning")
    gateway = server.gateway

    async def serve() -> None:
        try:
            await server.serve()
        except SystemExit:  # uvicorn's way out of a failed start (the log says why)
            if server.started:
                raise
            why = gateway.start_error or "see the log above"
            raise ValueError(f"the gateway did not start: {why}") from None

    serving = asyncio.create_task(serve())
    while not serving.done():
        await asyncio.sleep(0.2)
        dead = [i for i, p in enumerate(procs) if p.poll() is not None]
        if dead:
            index = dead[0]
            where = (
                f"its log: {options.log_dir / f'stage-{index}.log'}"
                if options.log_dir is not None
                else "see its log above"
            )
            why = (
                f"stage {index} exited during start-up (exit status {procs[index].returncode}; "
                f"{where})"
            )
            server.should_exit = True
            gateway.abort_start(why)  # the gateway's start ends cleanly, as a failed one
            with contextlib.suppress(ValueError):
                await serving
            raise ValueError(why)
        if server.started and gateway.service is not None and gateway.pipeline.ready:
            break
    if not serving.done():
        service = gateway.service
        assert service is not None
        url = settings.url
        auth = f" -H 'Authorization: Bearer {options.api_keys[0]}'" if options.api_keys else ""
        if settings.tls_cert is not None:  # a self-signed certificate is its own CA
            auth += f" --cacert {settings.tls_cert}"
        speculation = ", speculative decoding with the draft" if draft else ""
        limit = service.engine.spec_max_users
        if draft and limit:
            speculation += (
                f" while at most {limit} request{'s decode' if limit > 1 else ' decodes'}"
            )
        print(
            f"pipeshard is serving {service.model} on {url} "
            f"({len(addresses)} stages{speculation}). Try:\n"
            f"  curl -N {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
            f'    -d \'{{"model": "{service.model}", "stream": true, '
            '"messages": [{"role": "user", "content": "Write a Python hello world."}]}\'\n'
            "Stop with Ctrl-C.",
            flush=True,
        )
    await serving


def run_fleet(options: FleetOptions) -> int:
    from protos.manifest import load_manifest
    from server.api.tokenization import keep_torch_out

    keep_torch_out()  # this process is the gateway: no torch (exports run in a child)
    # before an export of minutes and the stages' compiles: a port in use fails at once
    count = load_manifest(options.export).num_stages if options.export else options.stages
    check_ports_free(options, count)
    export = ensure_export(options)
    manifest = load_manifest(export)
    procs = start_stages(export, options, manifest.num_stages)
    addresses = [f"127.0.0.1:{options.stage_port + i}" for i in range(manifest.num_stages)]
    # Our own handler for both signals: asyncio.run's SIGINT handler would cancel the main
    # task while the app's lifespan is still shutting down (a traceback on every Ctrl-C).
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        # uvicorn turns SIGTERM and SIGINT into a graceful shutdown and raises them again
        # afterwards; both end up here as KeyboardInterrupt, and the stages are stopped.
        draft = None
        if manifest.draft is not None and options.draft is not None:  # not --no-draft
            draft = export / manifest.draft.directory
        asyncio.run(_serve(options, addresses, procs, draft))
    except KeyboardInterrupt:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop_all(procs)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
