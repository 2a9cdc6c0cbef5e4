"""The FastAPI gateway: OpenAI routes, operations endpoints, authentication, errors.

``HTTP request -> (auth, size limit, request id) -> protocol model -> CompletionService ->
JSON or SSE``. Errors always leave in the OpenAI envelope; bad input is never a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.engine import Engine
from server.metrics import GatewayMetrics
from server.pipeline import PipelineClient
from server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    errors_to_api_error,
    parse_request,
)
from server.serving import CompletionService
from server.settings import GatewaySettings
from server.speculative import DraftProposer, NgramProposer, Proposer
from server.sse import SSE_HEADERS, SSE_MEDIA_TYPE
from server.tokenization import codec_from_files, load_codec
from stage_node.runner import RunnerOptions

log = logging.getLogger(__name__)
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
OPEN_PATHS = ("/health", "/ready", "/metrics", "/docs", "/openapi.json")


@dataclass
class Gateway:
    settings: GatewaySettings
    pipeline: PipelineClient
    metrics: GatewayMetrics
    service: CompletionService | None = None
    created: int = 0


def make_proposer(settings: GatewaySettings, vocab_size: int) -> Proposer | None:
    """The speculative-decoding proposer the settings ask for (None: no speculation)."""
    mode = settings.speculation
    if mode == "auto":
        mode = "draft" if settings.draft is not None else "off"
    if mode == "off":
        return None
    if mode == "ngram":
        return NgramProposer()
    if settings.draft is None:
        raise ValueError("speculation = draft needs --draft DIR (the export's draft folder)")
    options = RunnerOptions(
        device=settings.draft_device,
        threads=settings.draft_threads,
        cache_dir=settings.ov_cache_dir,
        max_sessions=4 * settings.max_concurrent,
    )
    proposer = DraftProposer(settings.draft, options, vocab_size)
    log.info("speculative decoding with draft %s on %s", proposer.model_id, settings.draft_device)
    return proposer


def _error(exc: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        exc.response(), status_code=exc.status, headers={**exc.headers, **(headers or {})}
    )


def create_app(settings: GatewaySettings, pipeline: PipelineClient | None = None) -> FastAPI:
    secret = settings.secret.get_secret_value() if settings.secret else None
    gateway = Gateway(
        settings=settings,
        pipeline=pipeline
        or PipelineClient(
            settings.stages,
            secret=secret,
            tls_ca=settings.tls_ca,
            tls_server_name=settings.tls_server_name,
            step_timeout=settings.step_timeout,
        ),
        metrics=GatewayMetrics(),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        manifest = await gateway.pipeline.start(timeout=settings.start_timeout)
        if settings.tokenizer is not None:
            codec = load_codec(settings.tokenizer, manifest)
        else:
            codec = codec_from_files(await gateway.pipeline.tokenizer_files(), manifest)
        engine = Engine(
            gateway.pipeline,
            codec.eos_ids,
            manifest.model.max_context,
            settings.scheduler_config(),
            gateway.metrics,
            proposer=make_proposer(settings, manifest.model.vocab_size),
            spec_k=settings.spec_k,
            spec_max_k=settings.spec_max_k,
        )
        model = settings.model_name or manifest.model.model_id
        gateway.service = CompletionService(
            engine, codec, model, manifest.model.max_context, gateway.metrics
        )
        gateway.created = int(time.time())
        log.info("serving %s over %d stage(s)", model, manifest.num_stages)
        yield
        await engine.close()
        await gateway.pipeline.close()

    app = FastAPI(title="pipeshard", version="0.1.0", lifespan=lifespan)
    app.state.gateway = gateway
    keys = [k.get_secret_value().encode() for k in settings.api_keys]

    @app.middleware("http")
    async def edge(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        incoming = request.headers.get("x-request-id", "")
        request_id = incoming if _REQUEST_ID.match(incoming) else uuid.uuid4().hex
        request.state.request_id = request_id
        started = time.perf_counter()
        response = await _guarded(request, call_next, keys, settings.max_body_bytes)
        response.headers["x-request-id"] = request_id
        endpoint = request.scope.get("route").path if request.scope.get("route") else "other"  # type: ignore[union-attr]
        gateway.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        log.info(
            "request %s %s %s -> %d in %.1f ms",
            request_id,
            request.method,
            request.url.path,
            response.status_code,
            (time.perf_counter() - started) * 1000,
        )
        return response

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(errors_to_api_error(exc.errors(), strip_body=True))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in request %s", getattr(request.state, "request_id", "?"))
        return _error(APIError(500, "internal error", type="server_error"))

    def service() -> CompletionService:
        if gateway.service is None:
            raise APIError(503, "the gateway is starting", type="service_unavailable")
        return gateway.service

    async def run(
        request: Request, prepared_kind: type[ChatCompletionRequest] | type[CompletionRequest]
    ) -> Response:
        svc = service()
        body = await request.body()
        if len(body) > settings.max_body_bytes:
            raise APIError(413, f"request body over {settings.max_body_bytes} bytes")
        req = parse_request(prepared_kind, body)
        prefix = "chatcmpl" if prepared_kind is ChatCompletionRequest else "cmpl"
        prep = svc.prepare(req, f"{prefix}-{request.state.request_id}")
        if prep.stream:
            # Waits for the first token (a queued request waits here): leaving frees its place.
            stream = await _until_disconnect(request, svc.open_stream(prep))
            return StreamingResponse(stream, media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
        result = await _until_disconnect(request, svc.complete(prep))
        return JSONResponse(result.model_dump(mode="json"))

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await run(request, ChatCompletionRequest)

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await run(request, CompletionRequest)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        svc = service()
        return ModelList(data=[ModelCard(id=svc.model, created=gateway.created)]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        svc = service()
        if model_id != svc.model:
            raise APIError(
                404,
                f"The model '{model_id}' does not exist.",
                param="model",
                code="model_not_found",
            )
        return ModelCard(id=svc.model, created=gateway.created).model_dump()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        stages = [
            {"index": s.index, "address": s.address, "up": s.up and s.link_ok, "state": s.detail}
            for s in gateway.pipeline.stages
        ]
        ok = gateway.service is not None and gateway.pipeline.ready
        return JSONResponse({"ready": ok, "stages": stages}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _guarded(
    request: Request,
    call_next: Callable[[Request], Awaitable[Response]],
    keys: list[bytes],
    max_body: int,
) -> Response:
    """Authentication and the body-size limit, before any route work."""
    if keys and request.url.path.startswith("/v1/"):
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        presented = token.strip().encode() if scheme.lower() == "bearer" else b""
        # Compare with every key, always, so the time taken says nothing about which matched.
        matched = False
        for key in keys:
            matched |= hmac.compare_digest(presented, key)
        if not matched:
            message = "Incorrect API key provided." if presented else "Missing API key."
            return _error(
                APIError(401, message, type="invalid_request_error", code="invalid_api_key"),
                headers={"WWW-Authenticate": "Bearer"},
            )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_body:
        return _error(APIError(413, f"request body over {max_body} bytes"))
    return await call_next(request)


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work``; cancel it (and so free its queue place or sessions) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise APIError(499, "client closed the request")
    finally:
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the request body was read already)."""
    # request.is_disconnected() only peeks and, behind an http middleware, never sees it.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _body_schema(model: type[Any]) -> dict[str, Any]:
    """Document the JSON body in the OpenAPI schema (the route parses it itself, for 400s)."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }
