"""The HTTP retrieval service (DESIGN §7): FastAPI on uvicorn, one process serving one index.

    POST   /v1/retrieve          ranked ads for one or many requests (read token, if set)
    GET    /v1/ads/{ad_id}       an ad's attributes (read token, if set)
    PUT    /v1/ads               upsert ads, encoded by the model's ad tower   (admin token)
    PATCH  /v1/ads/{ad_id}       change attributes or status                   (admin token)
    DELETE /v1/ads/{ad_id}       remove an ad                                  (admin token)
    POST   /v1/admin/snapshot    write a snapshot and truncate the log         (admin token)
    GET    /health/live, /health/ready, /metrics (Prometheus), /openapi.json

Retrieval goes through the dynamic batcher (`m31.serve.batcher`) onto one device thread.
Mutations run one at a time on a writer thread; each is in the write-ahead log, fsync'd, before
its reply (`m31.index.durable`), and returns the index version that holds it. A query's batch
reads one consistent version, at least the `min_version` it asks for.

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

from m31.serve.batcher import DynamicBatcher
from m31.serve.config import ServeConfig
from m31.serve.errors import CheckedJSONRoute, describe, error
from m31.serve.metrics import Metrics
from m31.serve.middleware import BodyGuard, Counted, HeadAsGet
from m31.serve.routes import add_routes
from m31.serve.schemas import vocab_schema
from m31.serve.service import Service

__all__ = ["ServeConfig", "Service", "create_app"]

log = logging.getLogger("m31.serve")


def create_app(
    config: ServeConfig,
    service: Service | None = None,
    load: Callable[[ServeConfig], Service] = Service.load,
) -> FastAPI:
    """The app; with `service` given (already loaded) it is ready at once, else `load(config)`
    makes it at start-up in a thread while /health/live answers. (`m31.cluster.serve` loads a
    `ClusterService`, which drives the same routes over a sharded index.)"""
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.writer = ThreadPoolExecutor(1, thread_name_prefix="m31-writer")
        loading = None
        if app.state.service is None:
            loading = asyncio.get_running_loop().create_task(_load(app))
        else:
            _started(app)
        try:
            yield
        finally:
            if loading is not None and not loading.done():
                loading.cancel()
            if app.state.batcher is not None:
                await app.state.batcher.stop()
            app.state.writer.shutdown(wait=True)
            if app.state.service is not None:
                app.state.service.close()

    app = FastAPI(
        title="m31",
        summary="Exhaustive personalized ads retrieval: a retrieval mixture of experts over every "
        "eligible ad, top-K in one fused pass.",
        version="1",
        lifespan=lifespan,
        # A redirect to the slash-less path would be built from the client's Host header.
        redirect_slashes=False,
    )
    app.router.route_class = CheckedJSONRoute
    openapi = app.openapi

    def openapi_with_vocabularies() -> dict:
        """The schema, with the served model's values once it is loaded (they are data)."""
        schema = openapi()
        svc = app.state.service if app.state.batcher is not None else None
        if svc is not None and not getattr(app.state, "vocab_listed", False):
            vocab = {**svc.retriever.vocab, **{k: list(v) for k, v in svc.encoder.codes.items()}}
            vocab_schema(schema, vocab, closed=set(svc.retriever.vocab))
            app.state.vocab_listed = True
        return schema

    app.openapi = openapi_with_vocabularies
    app.state.config = config
    app.state.service = service
    app.state.batcher = None
    app.state.load_error = None
    app.state.metrics = metrics

    async def _load(app: FastAPI) -> None:
        try:
            app.state.service = await asyncio.to_thread(load, config)
        except Exception as e:  # reported by /health/ready and the log; live stays up
            log.exception("loading failed")
            app.state.load_error = f"{type(e).__name__}: {e}"
            return
        _started(app)

    def _started(app: FastAPI) -> None:
        svc: Service = app.state.service

        def on_batch(size: int, seconds: float) -> None:
            metrics.batch_size.observe(size)
            metrics.batch_seconds.observe(seconds)
            metrics.device_calls.inc()
            metrics.ads_scored.inc(size * svc.rows)

        batcher = DynamicBatcher(
            svc.retrieve_batch,
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
            svc.ads,
            svc.version,
            config.max_batch_size,
        )

    # Added first, so inside `Counted`: refused bodies show in the metrics too.
    app.add_middleware(HeadAsGet)
    app.add_middleware(BodyGuard, config=config, routes=app.routes)
    app.add_middleware(Counted, metrics=metrics, routes=app.routes)

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

    add_routes(app, config, metrics)
    return app
