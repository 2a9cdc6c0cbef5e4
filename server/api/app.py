"""The FastAPI gateway: OpenAI routes, operations endpoints, authentication, errors.

``HTTP request -> (auth, size limit, request id) -> protocol model -> CompletionService ->
JSON or SSE``. Errors always leave in the OpenAI envelope; bad input is never a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any
from urllib.parse import quote

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from common import systemd
from common.net import check_can_listen, split_listen
from common.version import VERSION
from protos.manifest import ShardManifest
from server.api import anthropic, responses_api
from server.api.edge import Edge
from server.api.errors import (
    AnthropicErrorResponse,
    APIError,
    error_response_for,
    errors_to_api_error,
    short_json,
)
from server.api.ollama import lowering as ollama_lowering
from server.api.ollama import models as ollama_models
from server.api.ollama import render as ollama_render
from server.api.ollama.schema import ChatRequest as OllamaChatRequest
from server.api.ollama.schema import GenerateRequest as OllamaGenerateRequest
from server.api.ollama.schema import ShowRequest as OllamaShowRequest
from server.api.openapi import body_schema, document, operation_responses
from server.api.requests import ChatCompletionRequest, CompletionRequest, parse_request
from server.api.responses import ChatCompletion, Completion, ModelCard, ModelList
from server.api.serving import CompletionService
from server.api.sse import SSE_HEADERS, SSE_MEDIA_TYPE
from server.api.tokenization import codec_from_files, load_codec
from server.engine.constraints import Grammars
from server.engine.loop import Engine
from server.engine.speculative import DraftProposer, NgramProposer, Proposer
from server.metrics import GatewayMetrics
from server.ring import Ring, RingError
from server.ring.grpc_client import PipelineClient
from server.settings import GatewaySettings

log = logging.getLogger(__name__)


class StageReadiness(BaseModel):
    index: int
    address: str
    up: bool
    state: str


class Readiness(BaseModel):
    ready: bool
    stages: list[StageReadiness]


@dataclass
class Gateway:
    settings: GatewaySettings
    pipeline: Ring
    metrics: GatewayMetrics
    service: CompletionService | None = None
    created: int = 0
    start_error: str | None = None  # why the start failed (a stage missing, a bad draft)
    starting: asyncio.Future[Any] | None = None  # the start, while it runs
    manifest: ShardManifest | None = None  # the export served (once started)

    def abort_start(self, reason: str) -> None:
        """End a start still in progress as a failed one, for ``reason`` (`pipeshard up`: a
        stage process it started has exited)."""
        if self.starting is not None and not self.starting.done():
            self.start_error = reason
            self.starting.cancel()


class StartFailed(Exception):
    """The gateway cannot start for a reason it has logged in one line (a stage missing after
    start_timeout, a draft that is no export or does not fit the target). Its traceback is
    kept out of uvicorn's log: it would only repeat the line."""


class _HideStartFailedTraceback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "StartFailed" in record.getMessage())


class GatewayServer(uvicorn.Server):
    """uvicorn's server, telling the gateway when a stop begins (SIGTERM, SIGINT): requests
    in flight get ``shutdown_grace`` seconds to finish, then end with a 503 (an error event
    on a stream). Plain uvicorn would wait for every open connection, so one long
    generation would hold up the stop until systemd or Docker killed the process and cut
    the streams off without a word."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway
        uvicorn_log = logging.getLogger("uvicorn.error")
        if not any(isinstance(f, _HideStartFailedTraceback) for f in uvicorn_log.filters):
            uvicorn_log.addFilter(_HideStartFailedTraceback())
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        # Listening: tell systemd (Type=notify) and feed its watchdog (WatchdogSec=) from this
        # event loop, which every request goes through.
        systemd.notify("READY=1", f"STATUS=serving on {self.gateway.settings.listen}")
        if (interval := systemd.watchdog_interval()) is not None:
            self._watchdog = asyncio.create_task(systemd.feed_watchdog(interval, lambda: None))

    async def shutdown(self, sockets: Any = None) -> None:
        systemd.notify("STOPPING=1")
        if self._watchdog is not None:
            self._watchdog.cancel()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None:  # a signal handler: hand over to the event loop
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        service = self.gateway.service
        if self._draining is None and service is not None:
            grace = self.gateway.settings.shutdown_grace
            self._draining = asyncio.create_task(service.engine.shut_down(grace))


def make_proposer(settings: GatewaySettings) -> Proposer | None:
    """The speculative-decoding proposer the settings ask for (None: no speculation). A draft
    is not checked against the target here (its vocabulary: DraftProposer.check_target)."""
    mode = settings.speculation
    if mode == "auto":
        mode = "draft" if settings.draft is not None else "off"
    if mode == "off":
        return None
    if mode == "ngram":
        return NgramProposer()
    if settings.draft is None:
        raise ValueError("speculation = draft needs --draft DIR (the export's draft folder)")
    proposer = DraftProposer(
        settings.draft,
        settings.draft_runner_options(),
        None,
        kv_cache_bytes=int(settings.draft_kv_cache_size * (1 << 30)),
        prefix_cache_blocks=None if settings.prefix_cache else 0,
    )
    log.info("speculative decoding with draft %s on %s", proposer.model_id, settings.draft_device)
    return proposer


def gateway_server(app: FastAPI, log_level: str) -> GatewayServer:
    """uvicorn serving ``app`` (made by :func:`create_app`) on its settings' listen address,
    over HTTPS when they name a certificate. Raises ValueError when the address cannot be
    listened on (in use, not this machine's); warns when it is open to the network with no
    API key."""
    gateway: Gateway = app.state.gateway
    settings = gateway.settings
    host, port = split_listen(settings.listen)
    # uvicorn binds only after the start (the stages, up to start_timeout; the draft): a port
    # in use would be found minutes late
    check_can_listen(settings.listen)
    if settings.open_to_the_network:
        log.warning(
            "listening on %s with no API key: anyone who can reach it can use the model "
            "(give --api-key, or listen on 127.0.0.1)",
            settings.listen,
        )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        ssl_certfile=settings.tls_cert,  # HTTPS when set (both or neither)
        ssl_keyfile=settings.tls_key,
    )
    return GatewayServer(config, gateway)


def create_app(settings: GatewaySettings, pipeline: Ring | None = None) -> FastAPI:
    """The gateway's FastAPI app over ``pipeline`` (default: the gRPC ring of the settings'
    stages), which it starts in its lifespan."""
    gateway = Gateway(
        settings=settings, pipeline=pipeline or grpc_ring(settings), metrics=GatewayMetrics()
    )
    app = FastAPI(title="pipeshard", version=VERSION, lifespan=_lifespan(gateway))
    app.state.gateway = gateway
    gateway.metrics.watch_links(lambda: gateway.pipeline.stages)
    keys = [k.get_secret_value().encode() for k in settings.api_keys]
    app.add_middleware(Edge, keys=keys, max_body=settings.max_body_bytes, metrics=gateway.metrics)
    document(app, secured=bool(keys))
    auth = (401,) if keys else ()
    _add_error_handlers(app)
    _add_generation_routes(app, gateway, auth)
    _add_messages_routes(app, gateway, auth)
    _add_responses_routes(app, gateway, auth)
    _add_model_routes(app, gateway, auth)
    _add_ollama_routes(app, gateway)
    _add_operations_routes(app, gateway)
    return app


def grpc_ring(settings: GatewaySettings) -> PipelineClient:
    """The ring of stage processes the settings name, over gRPC."""
    secret = settings.secret.get_secret_value() if settings.secret else None
    return PipelineClient(
        settings.stages,
        secret=secret,
        tls_ca=settings.tls_ca,
        tls_server_name=settings.tls_server_name,
        step_timeout=settings.step_timeout,
        health_interval=settings.health_interval,
        health_timeout=settings.health_timeout,
        link_loss_timeout=settings.link_loss_timeout,
    )


def _lifespan(gateway: Gateway) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gateway.starting = asyncio.ensure_future(_start(gateway))
        try:
            engine, model, stages = await gateway.starting
        except (RingError, ValueError) as exc:
            gateway.start_error = str(exc)
            log.error("cannot start: %s", exc)
            raise StartFailed(str(exc)) from None
        except asyncio.CancelledError:
            if gateway.start_error is None:  # the lifespan itself is cancelled
                raise
            log.error("cannot start: %s", gateway.start_error)
            raise StartFailed(gateway.start_error) from None
        log.info("serving %s over %d stage(s)", model, stages)
        yield
        await engine.close()
        await gateway.pipeline.close()

    return lifespan


async def _start(gateway: Gateway) -> tuple[Engine, str, int]:
    """Connect to the stages and load the draft: the engine, the model id, the stages."""
    settings = gateway.settings
    # The draft compiles (or loads from the OpenVINO cache) while the stages start, not
    # after: `pipeshard up` serves seconds sooner. Either failing ends the start at once.
    starting = asyncio.ensure_future(gateway.pipeline.start(timeout=settings.start_timeout))
    drafting = asyncio.ensure_future(asyncio.to_thread(make_proposer, settings))
    try:
        manifest, proposer = await asyncio.gather(starting, drafting)
    except BaseException:
        starting.cancel()  # a draft still compiling runs out in its thread
        drafting.cancel()
        raise
    if isinstance(proposer, DraftProposer):
        proposer.check_target(manifest.model.vocab_size)
    if settings.tokenizer is not None:
        codec = load_codec(settings.tokenizer, manifest)
    else:
        codec = codec_from_files(await gateway.pipeline.tokenizer_files(), manifest)
    spec_max_users, why = settings.speculation_limit(isinstance(proposer, DraftProposer))
    if proposer is not None and spec_max_users:
        log.info(
            "speculation only while at most %d request(s) decode at once (%s)",
            spec_max_users,
            why,
        )
    context = _context(gateway.pipeline, manifest.model.max_context)
    spec_k, spec_max_k = settings.spec_k, settings.spec_max_k
    window = gateway.pipeline.max_rollback
    if proposer is not None and window is not None and max(spec_k, spec_max_k) > window:
        # a hybrid model's paged stages roll back only this far: K rejected proposals at most
        if window < 1:
            log.warning("no speculation: the stages cannot roll back (--state-window 0)")
            proposer = None
        else:
            log.warning(
                "speculation proposes at most %d token(s): the stages roll back no further "
                "(--state-window)",
                window,
            )
            spec_k, spec_max_k = min(spec_k, window), min(spec_max_k, window)
    _log_state_sessions(gateway.pipeline, settings.max_concurrent)
    engine = Engine(
        gateway.pipeline,
        codec.eos_ids,
        context,
        settings.ring_scheduler_config(
            manifest.num_stages,
            gateway.pipeline.paged,
            gateway.pipeline.kv_pools,
            gateway.pipeline.prefix_block_size,
            gateway.pipeline.state_pools,
        ),
        gateway.metrics,
        proposer=proposer,
        spec_k=spec_k,
        spec_max_k=spec_max_k,
        spec_max_users=spec_max_users,
        grammars=Grammars(codec.chat, codec.vocab_size, sorted(codec.eos_ids)),
    )
    model = settings.model_name or manifest.model.model_id
    gateway.service = CompletionService(
        engine,
        codec,
        model,
        context,
        gateway.metrics,
        reasoning_parser=settings.reasoning_parser,
        architecture=manifest.model.architecture,
        close_schemas=settings.json_schema_additional_properties == "closed",
        aliases=settings.model_aliases,
        keepalive_s=settings.stream_keepalive_s,
    )
    if gateway.service.reasoning != "none":
        log.info("reasoning parser: %s", gateway.service.reasoning)
    gateway.created = int(time.time())
    gateway.manifest = manifest
    return engine, model, manifest.num_stages


def _log_state_sessions(ring: Ring, max_concurrent: int) -> None:
    """Say where a hybrid model's paged stages hold fewer sessions' states than the gateway
    runs requests: the rest wait in the queue for slots (admission counts them)."""
    sessions = min((slots // per for slots, per in ring.state_pools), default=None)
    if sessions is not None and sessions < max_concurrent:
        log.info(
            "the stages' linear-attention state pools hold %d session(s) at once (fewer "
            "than --max-concurrent %d): more requests wait for slots (raise the stages' "
            "--state-sessions)",
            sessions,
            max_concurrent,
        )


def _context(ring: Ring, model_context: int) -> int:
    """The longest request: the model's context, or less where a paged stage's KV pool holds
    fewer positions (one sequence can never hold more than a whole pool)."""
    capacity = min((b * n for b, n in ring.kv_pools), default=model_context)
    if capacity >= model_context:
        return model_context
    log.warning(
        "the paged stages' KV pools hold %d positions, fewer than the model's context "
        "of %d: requests are limited to %d tokens (raise --kv-cache-size on the stages)",
        capacity,
        model_context,
        capacity,
    )
    return capacity


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves in the OpenAI envelope (Anthropic's on /v1/messages, Ollama's on
    /api/); an unexpected one is a logged 500."""

    def envelope(request: Request, exc: APIError) -> JSONResponse:
        request_id = getattr(request.state, "request_id", None)
        return error_response_for(request.url.path, exc, request_id=request_id)

    def refused(request: Request, exc: APIError) -> JSONResponse:
        # the reason beside the access log's status line (a client's 400 says why to its
        # operator too); the message names fields and limits, never a prompt
        log.info(
            "request %s refused (%d): %s",
            getattr(request.state, "request_id", "?"),
            exc.status,
            exc.message[:300],
        )
        return envelope(request, exc)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return refused(request, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return refused(request, errors_to_api_error(exc.errors(), strip_body=True))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = str(exc.detail)
        if exc.status_code == 404 and request.url.path.startswith("/api/"):
            message = f"{request.url.path} is not served here ({OLLAMA_ROUTES})"
        # Keep the exception's headers: a 405 must say which methods are allowed (Allow).
        return envelope(
            request,
            APIError(exc.status_code, message, type=kind, headers=dict(exc.headers or {})),
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in request %s", getattr(request.state, "request_id", "?"))
        return envelope(request, APIError(500, "internal error", type="server_error"))


def _service(gateway: Gateway) -> CompletionService:
    if gateway.service is None:
        raise APIError(503, "the gateway is starting", type="service_unavailable")
    return gateway.service


def _add_generation_routes(app: FastAPI, gateway: Gateway, auth: tuple[int, ...]) -> None:
    """/v1/chat/completions and /v1/completions, JSON or SSE."""
    max_body = gateway.settings.max_body_bytes

    async def run(
        request: Request, prepared_kind: type[ChatCompletionRequest] | type[CompletionRequest]
    ) -> Response:
        svc = _service(gateway)
        _check_json_body(request)
        body = await _read_body(request, max_body)
        req = parse_request(prepared_kind, body)
        ignored = ignored_fields_headers(gateway.settings, req.ignored_fields, request)
        prefix = "chatcmpl" if prepared_kind is ChatCompletionRequest else "cmpl"
        prep = svc.prepare(req, f"{prefix}-{request.state.request_id}")
        if prep.stream:
            # Waits for the first token (a queued request waits here): leaving frees its place.
            stream = await _until_disconnect(request, svc.open_stream(prep))
            return StreamingResponse(
                stream, media_type=SSE_MEDIA_TYPE, headers={**SSE_HEADERS, **ignored}
            )
        result = await _until_disconnect(request, svc.complete(prep))
        return JSONResponse(result.model_dump(mode="json"), headers=ignored)

    generation_errors = (400, *auth, 404, 413, 415, 429, 503, 504)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=body_schema(ChatCompletionRequest),
        responses=operation_responses(ChatCompletion, generation_errors, stream=True),
    )
    async def chat_completions(request: Request) -> Response:
        return await run(request, ChatCompletionRequest)

    @app.post(
        "/v1/completions",
        openapi_extra=body_schema(CompletionRequest),
        responses=operation_responses(Completion, generation_errors, stream=True),
    )
    async def completions(request: Request) -> Response:
        return await run(request, CompletionRequest)


IGNORED_FIELDS_HEADER = "x-pipeshard-ignored-fields"
MAX_IGNORED_NAMED = 16  # names in the header; more are counted


def ignored_fields_headers(
    settings: GatewaySettings, ignored: Sequence[str], request: Request
) -> dict[str, str]:
    """What a generation endpoint does with the request fields it does not know
    (``ignored``, from :func:`~server.api.requests.parse_request`): with ``unknown_fields``
    "reject", a 400 naming the first; else a warning in the log and the response header
    ``x-pipeshard-ignored-fields`` listing them (returned, to go on the response)."""
    if not ignored:
        return {}
    if settings.unknown_fields == "reject":
        raise APIError(
            400,
            f"Unrecognized request argument supplied: {short_json(ignored[0])} (this gateway "
            "refuses fields it does not know: --unknown-fields reject).",
            param=ignored[0],
        )
    # a field name is any JSON string: percent-encoded to be a header value, and only so many
    names = [quote(name, safe="_.[]-$@") for name in ignored[:MAX_IGNORED_NAMED]]
    if len(ignored) > MAX_IGNORED_NAMED:
        names.append(f"...{len(ignored) - MAX_IGNORED_NAMED}-more")
    value = ",".join(names)
    log.warning(
        "request %s: ignored the fields this gateway does not know: %s",
        getattr(request.state, "request_id", "?"),
        value,
    )
    return {IGNORED_FIELDS_HEADER: value}


def _add_messages_routes(app: FastAPI, gateway: Gateway, auth: tuple[int, ...]) -> None:
    """The Anthropic Messages API: /v1/messages (JSON or Anthropic's event stream) and
    /v1/messages/count_tokens; errors in Anthropic's envelope (server/api/anthropic.py)."""
    max_body = gateway.settings.max_body_bytes
    errors = (400, *auth, 404, 413, 415, 429, 503, 504)

    @app.post(
        "/v1/messages",
        openapi_extra=body_schema(anthropic.MessagesRequest),
        responses=operation_responses(
            anthropic.Message, errors, stream=True, envelope=AnthropicErrorResponse
        ),
    )
    async def messages(request: Request) -> Response:
        svc = _service(gateway)
        _check_json_body(request)
        req = parse_request(anthropic.MessagesRequest, await _read_body(request, max_body))
        ignored = ignored_fields_headers(gateway.settings, req.ignored_fields, request)
        prep = anthropic.prepare(svc, req, f"msg-{request.state.request_id}")
        if req.stream:
            stream = await _until_disconnect(request, anthropic.open_stream(svc, prep, req.model))
            return StreamingResponse(
                stream, media_type=SSE_MEDIA_TYPE, headers={**SSE_HEADERS, **ignored}
            )
        result = await _until_disconnect(request, anthropic.create(svc, prep, req.model))
        return JSONResponse(result.model_dump(mode="json"), headers=ignored)

    @app.post(
        "/v1/messages/count_tokens",
        openapi_extra=body_schema(anthropic.CountTokensRequest),
        responses=operation_responses(
            anthropic.TokenCount, (400, *auth, 404, 413, 415, 503), envelope=AnthropicErrorResponse
        ),
    )
    async def count_tokens(request: Request) -> dict[str, int]:
        svc = _service(gateway)
        _check_json_body(request)
        req = parse_request(anthropic.CountTokensRequest, await _read_body(request, max_body))
        return anthropic.count_tokens(svc, req)


def _add_responses_routes(app: FastAPI, gateway: Gateway, auth: tuple[int, ...]) -> None:
    """The OpenAI Responses API: /v1/responses (JSON or its event stream), GET and DELETE
    /v1/responses/{id} on the in-memory store (server/api/responses_api.py)."""
    max_body = gateway.settings.max_body_bytes
    store = responses_api.ResponseStore(gateway.settings.responses_store_size)
    errors = (400, *auth, 404, 413, 415, 429, 503, 504)

    @app.post(
        "/v1/responses",
        openapi_extra=body_schema(responses_api.ResponsesRequest),
        responses=operation_responses(responses_api.ResponseObject, errors, stream=True),
    )
    async def create(request: Request) -> Response:
        svc = _service(gateway)
        _check_json_body(request)
        req = parse_request(responses_api.ResponsesRequest, await _read_body(request, max_body))
        ignored = ignored_fields_headers(gateway.settings, req.ignored_fields, request)
        prep, turn = responses_api.prepare(svc, store, req, f"resp-{request.state.request_id}")
        if req.stream:
            stream = await _until_disconnect(
                request, responses_api.open_stream(svc, store, prep, req, turn)
            )
            return StreamingResponse(
                stream, media_type=SSE_MEDIA_TYPE, headers={**SSE_HEADERS, **ignored}
            )
        result = await _until_disconnect(request, responses_api.create(svc, store, prep, req, turn))
        return JSONResponse(result, headers=ignored)

    @app.get(
        "/v1/responses/{response_id}",
        response_model=responses_api.ResponseObject,
        responses=operation_responses(None, (*auth, 404)),
    )
    async def retrieve(response_id: str) -> JSONResponse:
        found = store.get(response_id)
        if found is None:
            raise responses_api.not_found(response_id)
        return JSONResponse(found[0])

    @app.delete(
        "/v1/responses/{response_id}",
        response_model=responses_api.Deleted,
        responses=operation_responses(None, (*auth, 404)),
    )
    async def delete(response_id: str) -> dict[str, Any]:
        if not store.delete(response_id):
            raise responses_api.not_found(response_id)
        return responses_api.Deleted(id=response_id).model_dump()

    @app.post("/v1/responses/{rest:path}", include_in_schema=False)
    async def not_served(rest: str) -> None:
        # POST /v1/responses/compact (compaction), /{id}/cancel (background responses): a 404
        # in the envelope, as for any unknown route, not the 405 that /{id}'s GET would make
        raise APIError(
            404,
            f"POST /v1/responses/{rest} is not served (no compaction, no background responses)",
            type="not_found_error",
        )


def _add_model_routes(app: FastAPI, gateway: Gateway, auth: tuple[int, ...]) -> None:
    """/v1/models and /v1/models/{id}."""

    @app.get(
        "/v1/models", response_model=ModelList, responses=operation_responses(None, (*auth, 503))
    )
    async def models() -> dict[str, Any]:
        svc = _service(gateway)
        return ModelList(data=[ModelCard(id=svc.model, created=gateway.created)]).model_dump()

    @app.get(
        "/v1/models/{model_id:path}",
        response_model=ModelCard,
        responses=operation_responses(None, (*auth, 404, 503)),
    )
    async def model(model_id: str) -> dict[str, Any]:
        svc = _service(gateway)
        if not svc.serves(model_id):
            raise APIError(
                404,
                f"The model '{model_id}' does not exist.",
                param="model",
                code="model_not_found",
            )
        return ModelCard(id=model_id, created=gateway.created).model_dump()


OLLAMA_ROUTES = (
    "Ollama's API here: /api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version"
)


def _add_ollama_routes(app: FastAPI, gateway: Gateway) -> None:
    """Ollama's API (server/api/ollama/): /api/chat and /api/generate (NDJSON, or one object
    with ``"stream": false``), /api/tags, /api/ps, /api/show, /api/version; errors in Ollama's
    envelope. Not in the OpenAPI document: Ollama's own API reference describes it."""
    max_body = gateway.settings.max_body_bytes

    async def generate(request: Request, kind: ollama_render.Kind) -> Response:
        clock = ollama_render.Clock()
        svc = _service(gateway)
        # (no Content-Type check: Ollama reads any body as JSON, and its documentation's curl
        # examples send JSON as a form)
        body = await _read_body(request, max_body)
        req: OllamaChatRequest | OllamaGenerateRequest
        if kind == "chat":
            req = parse_request(OllamaChatRequest, body)
            empty = not req.messages
        else:
            req = parse_request(OllamaGenerateRequest, body)
            empty = not req.prompt
        ignored = ignored_fields_headers(gateway.settings, req.ignored_fields, request)
        if empty:  # Ollama's way to load a model: it is loaded while the stages run
            ollama_lowering.check_model(svc, req.model)
            return JSONResponse(ollama_render.loaded(kind, req.model), headers=ignored)
        request_id = f"ollama-{request.state.request_id}"
        if isinstance(req, OllamaChatRequest):
            prep = ollama_lowering.lower_chat(svc, req, request_id)
        else:
            prep = ollama_lowering.lower_generate(svc, req, request_id)
        if prep.stream:
            opening = ollama_render.open_stream(svc, prep, kind, req.model, clock)
            stream = await _until_disconnect(request, opening)
            return StreamingResponse(
                stream, media_type=ollama_render.NDJSON_MEDIA_TYPE, headers=ignored
            )
        whole = ollama_render.whole(svc, prep, kind, req.model, clock)
        return JSONResponse(await _until_disconnect(request, whole), headers=ignored)

    @app.post("/api/chat", include_in_schema=False)
    async def chat(request: Request) -> Response:
        return await generate(request, "chat")

    @app.post("/api/generate", include_in_schema=False)
    async def generate_text(request: Request) -> Response:
        return await generate(request, "generate")

    def served() -> ollama_models.ServedModel:
        svc = _service(gateway)
        assert gateway.manifest is not None  # (set with the service)
        digest = gateway.pipeline.manifest_hash or ""
        return ollama_models.ServedModel(svc, gateway.manifest, digest, gateway.created)

    @app.api_route("/api/tags", methods=["GET", "HEAD"], include_in_schema=False)
    async def tags() -> dict[str, Any]:
        return ollama_models.tags(served()).model_dump()

    @app.get("/api/ps", include_in_schema=False)
    async def ps() -> dict[str, Any]:
        return ollama_models.running(served()).model_dump()

    @app.post("/api/show", include_in_schema=False)
    async def show(request: Request) -> Response:
        model = served()
        req = parse_request(OllamaShowRequest, await _read_body(request, max_body))
        ignored = ignored_fields_headers(gateway.settings, req.ignored_fields, request)
        if not ollama_lowering.served_name(model.service, req.wanted):
            raise APIError(404, f"model '{req.wanted}' not found", param="model")
        return JSONResponse(ollama_models.show(model).model_dump(), headers=ignored)

    @app.api_route("/api/version", methods=["GET", "HEAD"], include_in_schema=False)
    async def version() -> dict[str, str]:
        return {"version": ollama_models.OLLAMA_API_VERSION}

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def running() -> PlainTextResponse:
        # Ollama's heartbeat (its CLI asks HEAD / before anything else); open, as /health
        return PlainTextResponse("pipeshard is running (Ollama's API: /api/*, OpenAI's: /v1/*)")


def _add_operations_routes(app: FastAPI, gateway: Gateway) -> None:
    """/health (the process), /ready (the ring, stage by stage), /metrics (Prometheus)."""

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/ready",
        response_model=Readiness,
        responses={503: {"model": Readiness, "description": "Not ready: starting or a stage down"}},
    )
    async def ready() -> JSONResponse:
        ok = gateway.service is not None and gateway.pipeline.ready
        body = Readiness(ready=ok, stages=_stage_readiness(gateway.pipeline)).model_dump()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _stage_readiness(ring: Ring) -> list[StageReadiness]:
    stages = ring.stages
    found = []
    for i, s in enumerate(stages):
        after = stages[(i + 1) % len(stages)]
        # a broken link to a stage that is down is that stage's failure, not this one's
        linked = s.link_ok or (after is not s and not after.up)
        state = (
            s.detail
            if s.link_ok or not s.up
            else f"{s.detail}; its link to {after.address} is down"
        )
        found.append(
            StageReadiness(index=s.index, address=s.address, up=s.up and linked, state=state)
        )
    return found


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
    # request.is_disconnected() only peeks: it does not wait for the message.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _check_json_body(request: Request) -> None:
    """415 for a body declared as anything but JSON (a form, say), which would otherwise be
    read as JSON; a body with no Content-Type is read as JSON."""
    declared = request.headers.get("content-type", "")
    media = declared.split(";", 1)[0].strip().lower()
    if not media or media == "application/json":
        return
    if media.startswith("application/") and media.endswith("+json"):
        return
    raise APIError(
        415,
        f"Unsupported Content-Type '{media}': the request body must be JSON, sent with "
        "'Content-Type: application/json'.",
    )


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it grows past ``limit`` bytes.

    The middleware already refuses a declared Content-Length over the limit; this catches a
    chunked body (no Content-Length), and stops reading it at the chunk that passes the limit.
    """
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body over {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # the client left before it sent the whole body
        raise APIError(499, "client closed the request") from None
    return b"".join(chunks)
