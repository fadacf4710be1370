"""The HTTP edge of the ingress: OpenAI-style error bodies and the handlers that produce them, metric tags by
route, and the API-key and body-size guard."""

from __future__ import annotations

import hmac
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from ray.exceptions import TaskCancelledError
from starlette.datastructures import Headers
from starlette.routing import Match

from app.api.wire import ErrorReply
from app.errors import BodyTooLarge, InternalError, InvalidRequest, SchemaViolation, ServingError, Unauthorized
from deploy import metrics

UNMATCHED_ROUTE = "unmatched"


def route_tag(scope) -> str:
    """A request's metric tag: its route's template. Never the raw path: every unknown path would add a tag
    value the ingress keeps for good, and Ray's metrics cannot encode one that is not ASCII."""
    route = scope.get("route")  # set once routing has matched
    if route is None and "app" in scope:
        route = next((r for r in _leaf_routes(scope["app"].router.routes) if r.matches(scope)[0] != Match.NONE), None)
    return getattr(route, "path", None) or UNMATCHED_ROUTE


def _leaf_routes(routes):
    """The routes under FastAPI's include_router nodes, where serve.ingress puts the class's (with no prefix)."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from _leaf_routes(included.routes)
        else:
            yield route


def error_response(error: ServingError | ErrorReply) -> JSONResponse:
    """Raised here, or sent by a replica: the OpenAI body, with Retry-After where the error gives one."""
    reply = error if isinstance(error, ErrorReply) else ErrorReply.of(error)
    headers = {"Retry-After": str(max(1, round(reply.retry_after_s)))} if reply.retry_after_s else None
    return JSONResponse(reply.body, status_code=reply.status, headers=headers)


class RequestGuard:
    """API key and body-size checks as plain ASGI middleware.

    Not `@app.middleware("http")`: Starlette's BaseHTTPMiddleware relays every response chunk
    through an extra task and memory stream (milliseconds per request on the TTFT path) and turns
    a client that hangs up mid-stream into an ExceptionGroup.
    """

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        receive = _disconnect_on_cancel(receive)
        try:
            self._check_headers(scope)
            if scope["method"] in ("POST", "PUT", "PATCH"):
                receive = await self._buffer_body(receive)
        except ServingError as e:
            response = error_response(e)
            metrics.requests().inc(tags={"route": route_tag(scope), "status": str(response.status_code)})
            return await response(scope, receive, send)
        await self.app(scope, receive, send)

    def _check_headers(self, scope) -> None:
        headers = Headers(scope=scope)
        if len(headers.getlist("authorization")) > 1:  # proxies and servers disagree on which one counts
            raise InvalidRequest("more than one Authorization header: send one")
        if self.api_key and scope["path"] != "/health":
            scheme, _, supplied = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(supplied.strip().encode(), self.api_key.encode()):
                raise Unauthorized("missing or wrong API key (send 'Authorization: Bearer <key>')")
        declared = headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise BodyTooLarge(f"request body is {declared} bytes; the limit is {self.max_body_bytes}")

    async def _buffer_body(self, receive):
        """Read the body up to the limit (a chunked body declares no length), then replay it to the app."""
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                raise BodyTooLarge(f"request body is at least {size} bytes; the limit is {self.max_body_bytes}")
            if not message.get("more_body", False):
                break
        messages.reverse()

        async def replay():
            return messages.pop() if messages else await receive()

        return replay


def _disconnect_on_cancel(receive):
    """Serve's proxy cancels the body fetch when the client hangs up: tell the app it is a
    disconnect, so a stream ends quietly instead of raising and logging a traceback per request."""

    async def receive_or_disconnect():
        try:
            return await receive()
        except TaskCancelledError:
            return {"type": "http.disconnect"}

    return receive_or_disconnect


log = logging.getLogger("ray.serve")


async def _invalid_body(request: Request, exc: RequestValidationError):
    errors = exc.errors()
    if any(e.get("type") == "missing" and tuple(e.get("loc", ())) == ("body", "model") for e in errors):
        # OpenAI's answer, which clients and SDKs expect, rather than the schema's 422
        return _serving_error_response(request, InvalidRequest("you must provide a model parameter"))
    malformed = any(e.get("type") in ("json_invalid", "model_attributes_type") for e in errors)
    detail = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in errors[:5])
    error = InvalidRequest(f"malformed request body: {detail}") if malformed else SchemaViolation(
        f"invalid request: {detail}")
    return _serving_error_response(request, error)


async def _http_error(request: Request, exc: HTTPException):
    """Starlette's own errors (unknown route, wrong method, a body that is not UTF-8) in the OpenAI shape."""
    metrics.requests().inc(tags={"route": route_tag(request.scope), "status": str(exc.status_code)})
    phrase = HTTPStatus(exc.status_code).phrase.lower().replace(" ", "_")  # not_found, method_not_allowed
    code = "invalid_request" if exc.status_code == 400 else phrase
    body = {"error": {"message": str(exc.detail), "type": "invalid_request_error", "code": code}}
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _serving_error(request: Request, exc: ServingError):
    return _serving_error_response(request, exc)


def _serving_error_response(request: Request, error: ServingError) -> JSONResponse:
    response = error_response(error)
    metrics.requests().inc(tags={"route": route_tag(request.scope), "status": str(response.status_code)})
    return response


async def _unexpected(request: Request, exc: Exception):
    log.exception("unhandled error on %s", request.url.path)
    return error_response(InternalError(f"internal error: {type(exc).__name__}"))


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app returns, its own or Starlette's, in the OpenAI shape and counted by route."""
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(ServingError, _serving_error)
    app.add_exception_handler(Exception, _unexpected)
