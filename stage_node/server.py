"""`pipeshard stage`: one process serving one stage shard over gRPC."""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np
from prometheus_client import start_http_server

from common import systemd
from common.net import bind_problem, check_can_listen
from protos import pipeshard_v1_pb2_grpc as pb_grpc
from protos.manifest import MANIFEST_NAME, manifest_hash
from protos.transport import MANIFEST_KEY, OPEN_METHODS, SECRET_KEY, SERVER_OPTIONS
from shard_runtime.paged import GIB, PagedRunner, PagedStep
from shard_runtime.runner import RunnerOptions, ShardRunner
from stage_node.metrics import StageMetrics
from stage_node.service import StageService
from stage_node.settings import StageSettings, hung_call, pin_process

log = logging.getLogger(__name__)


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> Any:
    """A handler of the same shape as ``handler`` that only aborts the call."""

    async def abort(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class StageGuard(grpc.aio.ServerInterceptor):
    """Checks the shared secret on every call and the caller's manifest hash on the data path."""

    def __init__(self, secret: str | None, manifest_sha256: str) -> None:
        self.secret = secret.encode() if secret else None
        self.manifest_sha256 = manifest_sha256

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        if self.secret is not None:
            presented = str(metadata.get(SECRET_KEY, "")).encode()
            if not hmac.compare_digest(presented, self.secret):
                return _refusal(
                    handler, grpc.StatusCode.UNAUTHENTICATED, "missing or wrong shared secret"
                )
        method = details.method.rsplit("/", 1)[-1]
        if method not in OPEN_METHODS:
            presented_hash = metadata.get(MANIFEST_KEY)
            if presented_hash != self.manifest_sha256:
                return _refusal(
                    handler,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"caller's manifest {presented_hash or '(none)'} differs from this stage's "
                    f"{self.manifest_sha256}",
                )
        return handler


def _server_credentials(settings: StageSettings) -> grpc.ServerCredentials | None:
    if settings.tls_cert is None or settings.tls_key is None:
        return None  # both or neither: StageSettings checked the pair
    return grpc.ssl_server_credentials(
        [(settings.tls_key.read_bytes(), settings.tls_cert.read_bytes())]
    )


def warm_up(runner: ShardRunner | PagedRunner) -> None:
    """One throwaway prompt and decode step before serving: OpenVINO's first inference of a
    shape takes seconds (docs/benchmarks.md, "Start-up costs"), which the first user would
    otherwise wait for."""
    started = time.perf_counter()
    session = "__warm-up__"
    length = max(1, min(16, runner.max_context - 1))
    prompt: np.ndarray
    if runner.is_first:
        prompt = np.zeros(length, dtype=np.int64)
    else:
        prompt = np.zeros((length, runner.input_width), dtype=np.float32)
    try:
        for start, chunk in ((0, prompt), (length, prompt[:1])):
            if isinstance(runner, PagedRunner):
                step = PagedStep(session, chunk, start)
                runner.place(step)
                runner.forward([step])
            else:
                runner.forward(session, chunk, np.arange(start, start + len(chunk)))
    finally:
        runner.release(session)
    # The first inference read weights the plugin then keeps in its own form: drop the pages
    # of the mapped weights file they came from (ShardBase.release_weight_pages)
    runner.release_weight_pages()
    log.info("warmed up in %.2f s", time.perf_counter() - started)


async def serve(settings: StageSettings, ready: Callable[[int], None] | None = None) -> None:
    # A port in use fails at once, before loading and compiling the shard (seconds to
    # minutes) and before gRPC logs its own error; add_port below stays the authority.
    check_can_listen(settings.listen)
    if settings.metrics_port and (why := bind_problem("0.0.0.0", settings.metrics_port)):
        raise ValueError(f"cannot serve metrics on port {settings.metrics_port}: {why}")
    cpus = settings.cpu_list()
    if cpus:
        pin_process(cpus)
    options = RunnerOptions.from_settings(settings)
    if settings.ov_cache_dir is not None:
        settings.ov_cache_dir.mkdir(parents=True, exist_ok=True)
    runner: ShardRunner | PagedRunner
    backend = settings.resolved_kv_backend()
    try:
        if backend == "paged":
            runner = PagedRunner(
                settings.shards,
                settings.stage,
                options,
                kv_cache_bytes=int(settings.kv_cache_size * GIB),
                prefix_cache_blocks=settings.prefix_cache_blocks,
                state_cache_bytes=(
                    None
                    if settings.state_cache_size is None
                    else int(settings.state_cache_size * GIB)
                ),
                state_sessions=settings.state_sessions,
                state_window=settings.state_window,
            )
        else:
            runner = ShardRunner(settings.shards, settings.stage, options)
        warm_up(runner)
    except RuntimeError as exc:  # OpenVINO's: an unknown device or property, a bad driver
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        why = lines[-1] if lines else type(exc).__name__
        raise ValueError(
            f"cannot load stage {settings.stage} on {settings.device}: {why}"
        ) from None
    digest = manifest_hash(settings.shards)
    manifest_json = (settings.shards / MANIFEST_NAME).read_bytes()
    metrics = StageMetrics()
    if settings.metrics_port is not None:
        # With a certificate, /metrics is served over HTTPS with it too.
        try:
            start_http_server(
                settings.metrics_port,
                registry=metrics.registry,
                certfile=str(settings.tls_cert) if settings.tls_cert else None,
                keyfile=str(settings.tls_key) if settings.tls_key else None,
            )
        except OSError as exc:
            raise ValueError(
                f"cannot serve metrics on port {settings.metrics_port}: {str(exc.strerror).lower()}"
            ) from None

    secret = settings.secret.get_secret_value() if settings.secret else None
    server = grpc.aio.server(
        interceptors=[StageGuard(secret, digest)],
        # gRPC's default SO_REUSEPORT would let a second stage (another fleet, an old process
        # that has not exited) bind the same port and take a share of the connections
        options=[*SERVER_OPTIONS, ("grpc.so_reuseport", 0)],
    )
    service = StageService(runner, settings, metrics, digest, manifest_json)
    pb_grpc.add_StageServicer_to_server(service, server)
    credentials = _server_credentials(settings)
    try:
        if credentials is None:
            port = server.add_insecure_port(settings.listen)
        else:
            port = server.add_secure_port(settings.listen, credentials)
    except RuntimeError:
        port = 0
    if port == 0:
        check_can_listen(settings.listen)
        raise ValueError(f"cannot listen on {settings.listen}: gRPC refused the address")
    await server.start()
    stage = runner.stage
    log.info(
        "stage %d/%d of %s (layers %s) serving on %s%s",
        stage.index,
        runner.manifest.num_stages,
        runner.manifest.model.model_id,
        stage.span(runner.manifest.model.intermediate_size),
        settings.listen,
        " with TLS" if credentials else "",
    )
    if ready is not None:
        ready(port)
    systemd.notify("READY=1", f"STATUS=stage {stage.index} serving on {settings.listen}")
    watchdog = None
    if (interval := systemd.watchdog_interval()) is not None:
        watchdog = asyncio.create_task(
            systemd.feed_watchdog(
                interval, lambda: hung_call(service.compute_seconds(), settings.compute_timeout)
            )
        )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def reap() -> None:
        interval = min(30.0, settings.session_idle_timeout / 2)
        while True:
            await asyncio.sleep(interval)
            idle = runner.release_idle(settings.session_idle_timeout)
            if idle:
                log.info("released %d idle session(s)", len(idle))
                metrics.sessions.set(runner.session_count)

    reaper = asyncio.create_task(reap())
    await stop.wait()
    log.info("stage %d stopping", stage.index)
    systemd.notify("STOPPING=1")
    reaper.cancel()
    if watchdog is not None:
        watchdog.cancel()
    await service.stop()
    await server.stop(grace=1.0)
    await service.close()


def run(settings: StageSettings) -> int:
    logging.getLogger().setLevel(settings.log_level.upper())
    asyncio.run(serve(settings, ready=lambda port: print(f"READY {port}", flush=True)))
    return 0
