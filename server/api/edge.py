"""The gateway's HTTP edge (a plain ASGI middleware before any route): the request id,
API-key authentication (``Authorization: Bearer KEY`` or ``x-api-key: KEY``), the body-size
limit, the request counter and the access log."""

from __future__ import annotations

import hmac
import logging
import re
import time
import uuid

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.errors import APIError, error_response_for
from server.metrics import GatewayMetrics

log = logging.getLogger(__name__)
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class Edge:
    """The gateway's edge, before any route work: the request id, authentication, the
    body-size limit, the request counter and the access log.

    A plain ASGI middleware: an ``@app.middleware("http")`` one would pass every streamed
    chunk through a task and a memory stream of its own, and hide the client's disconnect
    from the route. The request id (the client's ``x-request-id`` when it is well formed,
    else a new one) is in ``request.state.request_id`` and in every response's headers; the
    log line and the counter come when the response has been sent (a stream: its end).
    """

    def __init__(self, app: ASGIApp, keys: list[bytes], max_body: int, metrics: GatewayMetrics):
        self.app, self.keys, self.max_body, self.metrics = app, keys, max_body, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        incoming = headers.get("x-request-id", "")
        request_id = incoming if _REQUEST_ID.match(incoming) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.perf_counter()
        status = 500  # what the client gets when the route raises past its handlers
        tag = (b"x-request-id", request_id.encode())

        async def tagged(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), tag]}
            await send(message)

        try:
            refusal = self._refusal(scope["path"], headers, request_id)
            await (refusal or self.app)(scope, receive, tagged)
        finally:
            route = scope.get("route")
            endpoint = route.path if route is not None else "other"
            self.metrics.requests.labels(endpoint, str(status)).inc()
            log.info(
                "request %s %s %s -> %d in %.1f ms",
                request_id,
                scope["method"],
                scope["path"],
                status,
                (time.perf_counter() - started) * 1000,
            )

    def _refusal(self, path: str, headers: Headers, request_id: str) -> JSONResponse | None:
        """A 401 without a valid key (on /v1/ and Ollama's /api/ when keys are set), a 413 for
        a declared body over the limit; None to go on."""
        if self.keys and path.startswith(("/v1/", "/api/")):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            presented = token.strip().encode() if scheme.lower() == "bearer" else b""
            if not presented:  # the Anthropic SDK's (and Claude Code's) way to send the key
                presented = headers.get("x-api-key", "").strip().encode()
            # Compare with every key, always, so the time taken says nothing about which matched.
            matched = False
            for key in self.keys:
                matched |= hmac.compare_digest(presented, key)
            if not matched:
                message = "Incorrect API key provided." if presented else "Missing API key."
                return error_response_for(
                    path,
                    APIError(401, message, type="invalid_request_error", code="invalid_api_key"),
                    headers={"WWW-Authenticate": "Bearer"},
                    request_id=request_id,
                )
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return error_response_for(
                path,
                APIError(413, f"request body over {self.max_body} bytes"),
                request_id=request_id,
            )
        return None
