"""The HTTP retrieval service (DESIGN §7): one FastAPI app over a backend, on uvicorn or Ray Serve.

    POST   /v1/retrieve          ranked ads for one or many requests (read token, if set)
    GET    /v1/ads/{ad_id}       an ad's attributes (read token, if set)
    PUT    /v1/ads               upsert ads, encoded by the model's ad tower   (admin token)
    PATCH  /v1/ads/{ad_id}       change attributes or status                   (admin token)
    DELETE /v1/ads/{ad_id}       remove an ad                                  (admin token)
    POST   /v1/events            engagement events, durable once answered      (admin token)
    PUT    /v1/users             replace users' attributes                     (admin token)
    POST   /v1/admin/snapshot    write a snapshot and truncate the log         (admin token)
    GET    /health/live, /health/ready, /metrics (Prometheus), /openapi.json

The app drives a `Backend` (`m31.serve.backend`), which the caller's loader makes: one
process over a durable index (`m31.serve.local`), or a sharded index on Ray (`m31.cluster`).
Retrieval goes through the dynamic batcher (`m31.serve.batcher`) onto one device thread.
Mutations run on writer threads, as many at once as the backend takes (one on one process;
a cluster's coordinator groups concurrent ones); each is durable before its reply, and returns
the index version that holds it. A query's batch reads one consistent version, at least the
`min_version` it asks for.

Every error answers `{"detail": message}`, a 422's naming the field; the codes each route can
give are in the OpenAPI schema. Every call to a route passes `BodyGuard`: the token the route
requires is checked before any byte of a body is read, and a body is read within a size limit
(413) and a time limit (408).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from m31.index.errors import NotFound, Unavailable
from m31.serve.backend import Backend
from m31.serve.batcher import DynamicBatcher
from m31.serve.config import ServeConfig
from m31.serve.errors import CheckedJSONRoute, describe, error
from m31.serve.metrics import Metrics
from m31.serve.middleware import BodyGuard, Counted, HeadAsGet
from m31.serve.routes import add_routes
from m31.serve.schemas import vocab_schema

__all__ = ["ServeConfig", "create_app"]

log = logging.getLogger("m31.serve")


def create_app(config: ServeConfig, load: Callable[[ServeConfig], Backend]) -> FastAPI:
    """The app over the backend `load(config)` makes, at start-up in a thread while
    /health/live answers (`m31.serve.local.LocalBackend.load`, or the cluster's)."""
    metrics = Metrics()
    app = FastAPI(
        title="m31",
        summary="Exhaustive personalized ads retrieval: a retrieval mixture of experts over every "
        "eligible ad, top-K in one fused pass.",
        version="1",
        lifespan=_lifespan(config, load, metrics),
        # A redirect to the slash-less path would be built from the client's Host header.
        redirect_slashes=False,
    )
    app.router.route_class = CheckedJSONRoute
    app.openapi = _with_vocabularies(app, app.openapi)
    app.state.config = config
    app.state.backend = None
    app.state.batcher = None
    app.state.load_error = None
    app.state.metrics = metrics
    # Added first, so inside `Counted`: refused bodies show in the metrics too.
    app.add_middleware(HeadAsGet)
    app.add_middleware(BodyGuard, config=config, routes=app.routes)
    app.add_middleware(Counted, metrics=metrics, routes=app.routes)
    add_error_handlers(app)
    add_routes(app, config, metrics)
    return app


def _lifespan(config: ServeConfig, load: Callable[[ServeConfig], Backend], metrics: Metrics):
    """The backend loaded in a thread (its batcher started once it is), then, at the end, the
    batcher stopped, the writes under way finished and the backend closed."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.writer = None  # made with the backend: as many threads as it takes writes
        loading = asyncio.get_running_loop().create_task(_load(app, config, load, metrics))
        try:
            yield
        finally:
            if not loading.done():
                loading.cancel()
            if app.state.batcher is not None:
                await app.state.batcher.stop()
            if app.state.writer is not None:
                app.state.writer.shutdown(wait=True)
            if app.state.backend is not None:
                app.state.backend.close()

    return lifespan


async def _load(
    app: FastAPI, config: ServeConfig, load: Callable[[ServeConfig], Backend], metrics: Metrics
) -> None:
    try:
        backend = await asyncio.to_thread(load, config)
        app.state.writer = ThreadPoolExecutor(backend.writers, thread_name_prefix="m31-writer")
        app.state.backend = backend
    except Exception as e:  # reported by /health/ready and the log; live stays up
        log.exception("loading failed")
        app.state.load_error = f"{type(e).__name__}: {e}"
        return
    _started(app, config, metrics)


def _started(app: FastAPI, config: ServeConfig, metrics: Metrics) -> None:
    backend: Backend = app.state.backend

    def on_batch(size: int, seconds: float) -> None:
        metrics.batch_size.observe(size)
        metrics.batch_seconds.observe(seconds)
        metrics.device_calls.inc()
        metrics.ads_scored.inc(size * backend.rows)

    batcher = DynamicBatcher(
        backend.retrieve_batch,
        config.max_batch_size,
        config.max_queue_delay_ms,
        config.max_queue,
        on_batch,
        max_slice_ms=config.max_slice_ms,
    )
    batcher.start()
    app.state.batcher = batcher
    metrics.ready.set(1)
    log.info(
        "ready: %d ads, index version %d, batches of up to %d requests",
        backend.ads,
        backend.version,
        config.max_batch_size,
    )


def _with_vocabularies(app: FastAPI, openapi: Callable[[], dict]) -> Callable[[], dict]:
    def openapi_with_vocabularies() -> dict:
        """The schema, with the served model's values once it is loaded (they are data)."""
        schema = openapi()
        backend = app.state.backend if app.state.batcher is not None else None
        if backend is not None and not getattr(app.state, "vocab_listed", False):
            retriever, encoder = backend.retriever, backend.encoder
            vocab = {**retriever.vocab, **{k: list(v) for k, v in encoder.codes.items()}}
            vocab_schema(schema, vocab, closed=set(retriever.vocab))
            app.state.vocab_listed = True
        return schema

    return openapi_with_vocabularies


def add_error_handlers(app: FastAPI) -> None:
    """Every error as `{"detail": message}`: HTTP errors, invalid bodies (422 naming the
    field), and a backend's errors wherever a route lets them through (a read of one ad, a
    mutation, min_version, readiness): no such ad 404, an outage 503, never 500."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        headers = e.headers
        if e.status_code == 405:  # the router names the methods of one route of the path only
            path = request.scope["path"]
            methods = {
                method
                for route in app.routes
                if route.path_regex.match(path)
                for method in getattr(route, "methods", None) or ()
            }
            if "GET" in methods:
                methods.add("HEAD")  # `HeadAsGet`
            headers = {"Allow": ", ".join(sorted(methods))}
        return error(e.status_code, str(e.detail), headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> Response:
        return error(422, describe(e.errors()))

    @app.exception_handler(NotFound)
    async def not_found(request: Request, e: NotFound) -> Response:
        return error(404, str(e))

    @app.exception_handler(Unavailable)
    async def unavailable(request: Request, e: Unavailable) -> Response:
        return error(503, str(e), {"Retry-After": "1"})
