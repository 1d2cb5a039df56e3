"""The FastAPI app: auth, errors in the OpenAI shape, and the small routes (models, health,
version, metrics, debug). The generation endpoints live in `completions.py`, the tokenizer's in
`tokenize.py`; the OpenAPI docs at /docs (`docs_page.py`) unless `--no-docs`; the web console at
/console and its /v1/kv/state (`console.py`), the page unless `--no-console`."""
from __future__ import annotations

import contextlib
import hmac
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvreplay import __version__
from kvreplay.server.async_engine import AsyncEngine
from kvreplay.server.completions import router
from kvreplay.server.config import ServerConfig
from kvreplay.server.console import PATHS as CONSOLE_PATHS, add_console, add_state_route
from kvreplay.server.docs_page import PATHS as DOCS_PATHS
from kvreplay.server.docs_page import STATIC_PREFIX as DOCS_STATIC, add_docs
from kvreplay.server.formatting import TokenFormatter, error_body
from kvreplay.server.metrics import CONTENT_TYPE, ServerMetrics
from kvreplay.server.state import ApiError, ServerState
from kvreplay.server.tokenize import router as tokenize_router

logger = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")


class _Gatekeeper:
    """Pure ASGI middleware, outermost: checks the API key (all routes but /health, /version, the
    docs, the console page and its files, and /metrics with metrics_public) and counts generation responses by status for
    /metrics (streams count when their headers go out).

    The key comes as `Authorization: Bearer KEY`, the scheme in any case (RFC 9110). With a key
    set, a request with more than one Authorization header gets 400: which one would count is
    not defined."""

    def __init__(self, app, config: ServerConfig, metrics: ServerMetrics):
        self.app = app
        self.key = config.api_key.encode() if config.api_key else None
        self.open_paths = {"/health", "/version"}
        self.open_prefix = DOCS_STATIC if config.docs else None
        if config.metrics_public:
            self.open_paths.add("/metrics")
        if config.docs:
            self.open_paths.update(DOCS_PATHS)
        if config.console:
            self.open_paths.update(CONSOLE_PATHS)
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path in GENERATION_PATHS:
            send = self._counting(path, send)
        if (self.key is not None and path not in self.open_paths
                and not (self.open_prefix and path.startswith(self.open_prefix))):
            error = self._check_key(scope["headers"])
            if error is not None:
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)

    def _check_key(self, headers) -> ApiError | None:
        given = [value for name, value in headers if name.lower() == b"authorization"]
        if len(given) > 1:
            return ApiError(400, f"the request has {len(given)} Authorization headers: send one",
                            code="duplicate_authorization")
        scheme, _, key = (given[0] if given else b"").strip().partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.key):
            return None
        return ApiError(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'",
                        code="invalid_api_key")

    def _counting(self, path: str, send):
        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(path, str(message["status"])).inc()
            await send(message)
        return counting_send


def build_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """The app for one loaded engine. Its lifespan starts the engine loop and, on shutdown
    (after SIGTERM's drain, runner.py), aborts what is left and stops it."""
    metrics = ServerMetrics(lambda: engine.snapshot, config.served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="kvreplay", version=__version__, lifespan=lifespan, redoc_url=None,
                  description="OpenAI-compatible server of kvreplay (docs/architecture.md §7)",
                  docs_url=None, openapi_url="/openapi.json" if config.docs else None)
    if config.docs:
        add_docs(app)
    if config.console:
        add_console(app)
    add_state_route(app)
    app.state.server = ServerState(config, engine, metrics, TokenFormatter(engine.llm.tokenizer),
                                   int(time.time()))
    app.add_middleware(_Gatekeeper, config=config, metrics=metrics)
    _add_error_handlers(app)
    _add_routes(app, config)
    app.include_router(router)
    app.include_router(tokenize_router)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return ApiError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return ApiError(400, str(exc.errors()[:3])).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)


def _add_routes(app: FastAPI, config: ServerConfig) -> None:
    @app.get("/health")
    async def health(request: Request):
        engine: AsyncEngine = request.app.state.server.engine
        if engine.failure is not None:
            return JSONResponse({"status": "failed", "error": str(engine.failure)}, status_code=503)
        if not engine.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    def model_card(state: ServerState) -> dict:
        return {"id": config.served_model_name, "object": "model", "created": state.created,
                "owned_by": "kvreplay", "max_model_len": state.engine.engine.max_model_len}

    @app.get("/v1/models")
    async def list_models(request: Request):
        return {"object": "list", "data": [model_card(request.app.state.server)]}

    @app.get("/v1/models/{model:path}")
    async def get_model(request: Request, model: str):
        state: ServerState = request.app.state.server
        state.check_model(model)
        return model_card(state)

    @app.get("/version")
    async def version():
        """The kvreplay version serving (no API key needed)."""
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics(request: Request):
        return Response(request.app.state.server.metrics.render(), media_type=CONTENT_TYPE)

    if config.debug_endpoints:
        @app.get("/debug/kv")
        async def debug_kv(request: Request):
            """KV pool state, checked on the engine thread between steps."""
            engine: AsyncEngine = request.app.state.server.engine

            def inspect():
                state = {"num_blocks": engine.engine.kv.num_blocks,
                         "num_used_blocks": engine.engine.kv.num_used_blocks,
                         "num_running": engine.engine.num_running,
                         "num_waiting": engine.engine.num_waiting,
                         "num_requests": len(engine.engine.requests)}
                try:
                    engine.engine.check_integrity()
                    state.update(integrity="ok")
                except AssertionError as exc:
                    state.update(integrity=f"failed: {exc}")
                return state
            state = await engine.call(inspect)
            state["num_queued_seqs"] = engine.num_queued_seqs
            return JSONResponse(state, status_code=200 if state["integrity"] == "ok" else 500)
