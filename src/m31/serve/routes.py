"""The routes of the HTTP API (see `m31.serve.app` for the list). Handlers read the loaded
backend (`m31.serve.backend.Backend`) from the app's state; what a route may answer is in its
OpenAPI entry. A backend's `NotFound` and `Unavailable` reach the app's handlers (404, 503);
invalid input is mapped here, where it is known which input it was."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from m31.engine import PreparedRequest, RequestError
from m31.index import AdIndexError
from m31.index.errors import Unavailable
from m31.serve.auth import require_admin, require_read
from m31.serve.backend import Ask, Backend, Part, assemble
from m31.serve.batcher import DeadlineExceeded, DynamicBatcher, Overloaded, WouldMissDeadline
from m31.serve.bodies import to_engine
from m31.serve.config import ServeConfig
from m31.serve.errors import error_responses
from m31.serve.metrics import Metrics
from m31.serve.middleware import arrival
from m31.serve.schemas import (
    AdIdPath,
    AdOut,
    AttributesPatch,
    EventsBody,
    EventsResponse,
    RetrieveBody,
    RetrieveRequest,
    RetrieveResponse,
    UpsertBody,
    UsersBody,
    VersionResponse,
)

T = TypeVar("T")


def ready_backend(request: Request) -> Backend:
    """The loaded backend, or 503 while it loads (or after it failed to)."""
    state = request.app.state
    if state.batcher is None:
        detail = state.load_error or "not ready: the index is loading"
        raise HTTPException(503, detail, {"Retry-After": "1"})
    return state.backend


async def write(request: Request, fn, *args) -> Any:
    """Run a mutation on the writer thread; index errors become 422 naming the field."""
    try:
        return await asyncio.get_running_loop().run_in_executor(request.app.state.writer, fn, *args)
    except (AdIndexError, ValueError) as e:
        raise HTTPException(422, str(e)) from e


def _missed(timeout: float) -> HTTPException:
    return HTTPException(504, f"deadline passed ({timeout * 1000:.0f} ms from arrival)")


def left_of(deadline: float, timeout: float) -> float:
    """Seconds left until `deadline` (`time.monotonic()`); a 504 if none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise _missed(timeout)
    return left


async def by_deadline(deadline: float, timeout: float, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a worker thread, or a 504 at `deadline` (the thread goes on, bounded by
    the request's limits, but nobody waits for it)."""
    left = left_of(deadline, timeout)  # first: a coroutine made before a 504 is never awaited
    try:
        return await asyncio.wait_for(asyncio.to_thread(fn, *args), left)
    except TimeoutError:
        raise _missed(timeout) from None


def version_response(backend: Backend, version: int) -> VersionResponse:
    return VersionResponse(index_version=version, ads=backend.ads)


# -- the steps of a retrieve call --------------------------------------------------------------


async def check_min_version(
    backend: Backend, min_version: int | None, deadline: float, timeout: float
) -> None:
    """409 if the index is older than `min_version` (a backend may first catch up to it)."""
    if min_version is not None and not await by_deadline(
        deadline, timeout, backend.reached, min_version
    ):
        raise HTTPException(
            409, f"index is at version {backend.version}, older than min_version {min_version}"
        )


async def prepare(
    backend: Backend, requests: Sequence[RetrieveRequest], deadline: float, timeout: float
) -> list[PreparedRequest]:
    """The requests checked and prepared, off the event loop: a bad request fails its call
    alone (422), before batching."""
    now = int(time.time())

    def run() -> list[PreparedRequest]:
        engine = [to_engine(r, now) for r in requests]
        return backend.retriever.prepare(engine, [r.k for r in requests])

    try:
        return await by_deadline(deadline, timeout, run)
    except (RequestError, ValueError) as e:
        raise HTTPException(422, str(e)) from e


async def submit(
    batcher: DynamicBatcher, metrics: Metrics, asks: list[Ask], deadline: float, timeout: float
) -> list[Part]:
    """The call's parts from the batcher, its refusals as their status codes."""
    metrics.queue_depth.set(batcher.depth)
    try:
        return await batcher.submit(asks, left_of(deadline, timeout))
    except Overloaded as e:
        raise HTTPException(429, str(e), {"Retry-After": "1"}) from e
    except WouldMissDeadline as e:
        raise HTTPException(503, str(e), {"Retry-After": "1"}) from e
    except DeadlineExceeded as e:
        raise HTTPException(504, str(e)) from e
    except (RequestError, ValueError) as e:
        raise HTTPException(422, str(e)) from e
    finally:
        metrics.queue_depth.set(batcher.depth)


def retrieve_response(parts: list[Part], start: float) -> RetrieveResponse:
    results, version, timings, batch, missing = assemble(parts)
    total = round(1000 * (time.perf_counter() - start), 3)
    return RetrieveResponse(
        results=results,
        index_version=version,
        batch_requests=batch,
        timings_ms={**timings, "total": total},
        partial=bool(missing),
        missing_shards=missing,
    )


# -- the routes --------------------------------------------------------------------------------


def add_routes(app: FastAPI, config: ServeConfig, metrics: Metrics) -> None:
    """The API's routes, onto `app` (whose route class parses JSON strictly); the read routes
    declare a token only when the server has one."""
    # With no read token reads are open, and the schema says so (no security, no 401).
    read_auth = [Depends(require_read)] if config.read_token is not None else []
    read_401 = (401,) if config.read_token is not None else ()
    add_read_routes(app, config, metrics, read_auth, read_401)
    add_ad_routes(app, metrics)
    add_user_routes(app)
    add_snapshot_route(app, metrics)
    add_health_routes(app, metrics)


def add_read_routes(
    app: FastAPI, config: ServeConfig, metrics: Metrics, read_auth: list, read_401: tuple
) -> None:
    @app.post(
        "/v1/retrieve",
        response_model=RetrieveResponse,
        dependencies=read_auth,
        responses=error_responses(400, *read_401, 408, 409, 413, 422, 429, 503, 504),
    )
    async def retrieve(request: Request, body: RetrieveBody) -> RetrieveResponse:
        backend = ready_backend(request)
        start = time.perf_counter()
        # The deadline counts from the call's arrival; checks and mask work run off the event
        # loop, and whatever is still waiting at the deadline is answered 504 and dropped.
        timeout = (body.timeout_ms or config.timeout_ms) / 1000
        deadline = arrival(request.scope) + timeout
        await check_min_version(backend, body.min_version, deadline, timeout)
        prepared = await prepare(backend, body.requests, deadline, timeout)
        asks = [Ask(p, deadline, body.allow_partial) for p in prepared]
        parts = await submit(request.app.state.batcher, metrics, asks, deadline, timeout)
        return retrieve_response(parts, start)

    @app.get(
        "/v1/ads/{ad_id}",
        response_model=AdOut,
        dependencies=read_auth,
        responses=error_responses(*read_401, 404, 422, 503),
    )
    async def get_ad(request: Request, ad_id: AdIdPath) -> AdOut:
        backend = ready_backend(request)
        attributes, version = await asyncio.to_thread(backend.get_ad, ad_id)
        return AdOut(ad_id=ad_id, attributes=attributes, index_version=version)


def add_ad_routes(app: FastAPI, metrics: Metrics) -> None:
    admin = [Depends(require_admin)]

    @app.put(
        "/v1/ads",
        response_model=VersionResponse,
        dependencies=admin,
        responses=error_responses(400, 401, 403, 408, 413, 422, 503),
    )
    async def upsert_ads(request: Request, body: UpsertBody) -> VersionResponse:
        backend = ready_backend(request)
        version = await write(request, backend.upsert, body.ads)
        metrics.index_gauges(backend)
        return version_response(backend, version)

    @app.patch(
        "/v1/ads/{ad_id}",
        response_model=VersionResponse,
        dependencies=admin,
        responses=error_responses(400, 401, 403, 404, 408, 413, 422, 503),
    )
    async def patch_ad(request: Request, ad_id: AdIdPath, body: AttributesPatch) -> VersionResponse:
        backend = ready_backend(request)
        changes = body.model_dump(exclude_unset=True)
        if not changes:
            raise HTTPException(422, "nothing to change: give at least one attribute")
        version = await write(request, backend.update, ad_id, changes)
        metrics.index_gauges(backend)
        return version_response(backend, version)

    @app.delete(
        "/v1/ads/{ad_id}",
        response_model=VersionResponse,
        dependencies=admin,
        responses=error_responses(401, 403, 404, 422, 503),
    )
    async def delete_ad(request: Request, ad_id: AdIdPath) -> VersionResponse:
        backend = ready_backend(request)
        version = await write(request, backend.delete, ad_id)
        metrics.index_gauges(backend)
        return version_response(backend, version)


def add_user_routes(app: FastAPI) -> None:
    admin = [Depends(require_admin)]

    @app.post(
        "/v1/events",
        response_model=EventsResponse,
        dependencies=admin,
        responses=error_responses(400, 401, 403, 408, 413, 422, 503),
    )
    async def add_events(request: Request, body: EventsBody) -> EventsResponse:
        """Engagement events: durable once answered, in every retrieve at or after the version
        answered (`min_version`)."""
        backend = ready_backend(request)
        version = await write(request, backend.add_events, body.events, body.idempotency_key)
        return EventsResponse(index_version=version, users=backend.users)

    @app.put(
        "/v1/users",
        response_model=EventsResponse,
        dependencies=admin,
        responses=error_responses(400, 401, 403, 408, 413, 422, 503),
    )
    async def set_users(request: Request, body: UsersBody) -> EventsResponse:
        """Users' attributes, each replaced whole (their engagements are kept)."""
        backend = ready_backend(request)
        version = await write(request, backend.set_users, body.users)
        return EventsResponse(index_version=version, users=backend.users)


def add_snapshot_route(app: FastAPI, metrics: Metrics) -> None:
    admin = [Depends(require_admin)]

    @app.post(
        "/v1/admin/snapshot",
        response_model=VersionResponse,
        dependencies=admin,
        responses=error_responses(401, 403, 422, 503),
    )
    async def snapshot(request: Request) -> VersionResponse:
        backend = ready_backend(request)
        version = await write(request, backend.snapshot)
        metrics.index_gauges(backend)
        return version_response(backend, version)


def add_health_routes(app: FastAPI, metrics: Metrics) -> None:
    @app.get("/health/live")
    async def live() -> dict:
        return {"status": "live"}

    @app.get("/health/ready", responses=error_responses(503))
    async def ready(request: Request) -> dict:
        """200 once the index and the models are loaded, the text encoder of new ads included
        (`text_encoder`: "loaded", or "not used" by a model without text features)."""
        backend = ready_backend(request)
        loaded = backend.encoder.text_encoder_loaded
        _, _, version = await asyncio.to_thread(backend.stats)
        return {
            "status": "ready",
            "index_version": version,
            "text_encoder": "not used" if loaded is None else "loaded" if loaded else "not loaded",
        }

    @app.get("/metrics", response_class=Response)
    async def prometheus(request: Request) -> Response:
        backend, batcher = request.app.state.backend, request.app.state.batcher
        if backend is not None and batcher is not None:
            try:
                await asyncio.to_thread(backend.stats)  # refreshes what the gauges read
            except Unavailable:
                pass  # part of a sharded index is down: the last values; /health/ready names it
            metrics.index_gauges(backend)
            metrics.queue_depth.set(batcher.depth)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
