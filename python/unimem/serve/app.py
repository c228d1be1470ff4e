"""The FastAPI application: the OpenAI and native routes, OpenAI-style error bodies for every
failure, and the API key.

Errors: an :class:`~unimem.serve.protocol.ApiError` becomes ``{"error": {"message", "type",
"param", "code"}}`` with its status; an unknown route 404 and a wrong method 405 get the same
shape; anything unexpected is a 500 with that shape (logged), and the server keeps serving.

``--api-key``: every route except ``/health*`` and ``/metrics`` (as in SGLang) needs
``Authorization: Bearer KEY``; otherwise 401.
"""

from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from unimem.serve.args import ServerOptions
from unimem.serve.engine_loop import EngineLoop
from unimem.serve.errors import ApiError, error_body
from unimem.serve.generation import Serving
from unimem.serve.metrics import ServerMetrics
from unimem.serve.native_api import native_router
from unimem.serve.openai_api import openai_router
from unimem.serve.router_compat import SGLangGauges, router_compat_router

__all__ = ["build_app", "make_app"]

log = logging.getLogger("unimem.serve")

OPEN_PREFIXES = ("/health", "/metrics")
"""Routes that need no API key (SGLang's exemptions)."""


class _ApiKeyMiddleware:
    """Pure ASGI (streams and disconnects pass through untouched)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"].startswith(OPEN_PREFIXES):
            return await self.app(scope, receive, send)
        got = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(got, self.expected):
            return await self.app(scope, receive, send)
        err = ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        response = JSONResponse(error_body(err), status_code=401)
        await response(scope, receive, send)


def make_app(engine, options: ServerOptions) -> FastAPI:
    """The application over a built :class:`unimem.Engine`: its engine thread starts with
    the application and stops (aborting every running request) when it shuts down."""
    loop: EngineLoop | None = None
    metrics = ServerMetrics(lambda: loop.snapshot(), {"model_name": options.served_model_name})
    loop = EngineLoop(engine.core, observe=metrics, stream_interval=options.stream_interval)
    return build_app(Serving(engine, loop, options), metrics)


def build_app(serving: Serving, metrics: ServerMetrics) -> FastAPI:
    """The application over ``serving`` (module docstring); its start-up starts the engine
    thread, its shutdown stops it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        serving.loop.start()
        yield
        serving.loop.stop()

    app = FastAPI(title="unimem", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = ApiError(exc.status_code, str(exc.detail), code=code)
        return JSONResponse(error_body(err), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s", request.url.path)
        err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
        return JSONResponse(error_body(err), status_code=500)

    app.state.serving = serving  # the server's SIGTERM handler drains it
    app.include_router(openai_router(serving))
    app.include_router(native_router(serving, metrics))
    app.include_router(router_compat_router(serving))  # what SGLang's router asks of a worker
    labels = {"model_name": serving.options.served_model_name}
    metrics.registry.register(SGLangGauges(serving, labels))
    if serving.options.api_key is not None:
        app.add_middleware(_ApiKeyMiddleware, api_key=serving.options.api_key)
    return app
