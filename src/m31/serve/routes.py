"""The routes of the HTTP API (see `m31.serve.app` for the list). Handlers read the loaded
service from the app's state; what a route may answer is in its OpenAPI entry."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from m31.engine import AdRequest, Engagement, InlineUser, PreparedRequest, RequestError
from m31.engine.requests import FrequencyCap
from m31.index import AdIndexError
from m31.serve.auth import require_admin, require_read
from m31.serve.batcher import DeadlineExceeded, Overloaded, WouldMissDeadline
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
from m31.serve.service import Ask, NotFound, Service, Unavailable

T = TypeVar("T")


def ready_service(request: Request) -> Service:
    """The loaded service, or 503 while it loads (or after it failed to)."""
    state = request.app.state
    if state.batcher is None:
        detail = state.load_error or "not ready: the index is loading"
        raise HTTPException(503, detail, {"Retry-After": "1"})
    return state.service


async def write(request: Request, fn, *args) -> Any:
    """Run a mutation on the writer thread; index errors become 422 naming the field, an
    unknown ad 404, an index part that is down 503."""
    try:
        return await asyncio.get_running_loop().run_in_executor(request.app.state.writer, fn, *args)
    except NotFound as e:
        raise HTTPException(404, str(e)) from e
    except Unavailable as e:
        raise HTTPException(503, str(e), {"Retry-After": "1"}) from e
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


def version_response(svc: Service, version: int) -> VersionResponse:
    return VersionResponse(index_version=version, ads=svc.ads)


def to_engine(r: RetrieveRequest, now: int) -> AdRequest:
    """An API request as the engine takes it (`ts` defaults to the server's clock)."""
    user = None
    if r.user is not None:
        u = r.user
        user = InlineUser(
            country=u.country,
            age=u.age,
            gender=u.gender,
            cohort=u.cohort,
            history=tuple(Engagement(e.ad_id, e.ts, e.surface) for e in u.history),
            organic_topics=tuple(u.organic_topics),
        )
    return AdRequest(
        user_id=r.user_id,
        ts=now if r.ts is None else r.ts,
        surface=r.surface,
        platform=r.platform,
        hour=r.hour,
        exclude_ads=tuple(r.exclude_ads),
        exclude_advertisers=tuple(r.exclude_advertisers),
        filter=r.filter,
        user=user,
        frequency_cap=None
        if r.frequency_cap is None
        else FrequencyCap(r.frequency_cap.per, r.frequency_cap.max, r.frequency_cap.window_s),
        max_per=r.max_per,
        rank=r.rank,
    )


def add_routes(app: FastAPI, config: ServeConfig, metrics: Metrics) -> None:
    """The API's routes, onto `app` (whose route class parses JSON strictly); the read routes
    declare a token only when the server has one."""
    # With no read token reads are open, and the schema says so (no security, no 401).
    read_auth = [Depends(require_read)] if config.read_token is not None else []
    read_401 = (401,) if config.read_token is not None else ()

    @app.post(
        "/v1/retrieve",
        response_model=RetrieveResponse,
        dependencies=read_auth,
        responses=error_responses(400, *read_401, 408, 409, 413, 422, 429, 503, 504),
    )
    async def retrieve(request: Request, body: RetrieveBody) -> RetrieveResponse:
        svc = ready_service(request)
        start = time.perf_counter()
        # The deadline counts from the call's arrival; checks and mask work run off the event
        # loop, and whatever is still waiting at the deadline is answered 504 and dropped.
        timeout = (body.timeout_ms or config.timeout_ms) / 1000
        deadline = arrival(request.scope) + timeout
        if body.min_version is not None and not await by_deadline(
            deadline, timeout, svc.reached, body.min_version
        ):
            raise HTTPException(
                409, f"index is at version {svc.version}, older than min_version {body.min_version}"
            )
        now = int(time.time())

        def prepare() -> list[PreparedRequest]:
            engine = [to_engine(r, now) for r in body.requests]
            return svc.retriever.prepare(engine, [r.k for r in body.requests])

        try:  # checked once, here: a bad request fails alone, before batching
            prepared = await by_deadline(deadline, timeout, prepare)
        except (RequestError, ValueError) as e:
            raise HTTPException(422, str(e)) from e
        asks = [Ask(p, deadline, body.allow_partial) for p in prepared]
        batcher = request.app.state.batcher
        metrics.queue_depth.set(batcher.depth)
        try:
            parts = await batcher.submit(asks, left_of(deadline, timeout))
        except Unavailable as e:
            raise HTTPException(503, str(e), {"Retry-After": "1"}) from e
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
        results, version, timings, batch, missing = Service.assemble(parts)
        total = round(1000 * (time.perf_counter() - start), 3)
        return RetrieveResponse(
            results=results,
            index_version=version,
            batch_requests=batch,
            timings_ms={**timings, "total": total},
            partial=bool(missing),
            missing_shards=missing,
        )

    @app.get(
        "/v1/ads/{ad_id}",
        response_model=AdOut,
        dependencies=read_auth,
        responses=error_responses(*read_401, 404, 422, 503),
    )
    async def get_ad(request: Request, ad_id: AdIdPath) -> AdOut:
        svc = ready_service(request)
        try:
            attributes, version = await asyncio.to_thread(svc.get_ad, ad_id)
        except NotFound as e:
            raise HTTPException(404, str(e)) from e
        except Unavailable as e:
            raise HTTPException(503, str(e), {"Retry-After": "1"}) from e
        return AdOut(ad_id=ad_id, attributes=attributes, index_version=version)

    @app.put(
        "/v1/ads",
        response_model=VersionResponse,
        dependencies=[Depends(require_admin)],
        responses=error_responses(400, 401, 403, 408, 413, 422, 503),
    )
    async def upsert_ads(request: Request, body: UpsertBody) -> VersionResponse:
        svc = ready_service(request)
        version = await write(request, svc.upsert, body.ads)
        metrics.index_gauges(svc)
        return version_response(svc, version)

    @app.patch(
        "/v1/ads/{ad_id}",
        response_model=VersionResponse,
        dependencies=[Depends(require_admin)],
        responses=error_responses(400, 401, 403, 404, 408, 413, 422, 503),
    )
    async def patch_ad(request: Request, ad_id: AdIdPath, body: AttributesPatch) -> VersionResponse:
        svc = ready_service(request)
        changes = body.model_dump(exclude_unset=True)
        if not changes:
            raise HTTPException(422, "nothing to change: give at least one attribute")
        version = await write(request, svc.update, ad_id, changes)
        metrics.index_gauges(svc)
        return version_response(svc, version)

    @app.delete(
        "/v1/ads/{ad_id}",
        response_model=VersionResponse,
        dependencies=[Depends(require_admin)],
        responses=error_responses(401, 403, 404, 422, 503),
    )
    async def delete_ad(request: Request, ad_id: AdIdPath) -> VersionResponse:
        svc = ready_service(request)
        version = await write(request, svc.delete, ad_id)
        metrics.index_gauges(svc)
        return version_response(svc, version)

    @app.post(
        "/v1/events",
        response_model=EventsResponse,
        dependencies=[Depends(require_admin)],
        responses=error_responses(400, 401, 403, 408, 413, 422, 503),
    )
    async def add_events(request: Request, body: EventsBody) -> EventsResponse:
        """Engagement events: durable once answered, in every retrieve at or after the version
        answered (`min_version`)."""
        svc = ready_service(request)
        version = await write(request, svc.add_events, body.events, body.idempotency_key)
        return EventsResponse(index_version=version, users=svc.users)

    @app.put(
        "/v1/users",
        response_model=EventsResponse,
        dependencies=[Depends(require_admin)],
        responses=error_responses(400, 401, 403, 408, 413, 422, 503),
    )
    async def set_users(request: Request, body: UsersBody) -> EventsResponse:
        """Users' attributes, each replaced whole (their engagements are kept)."""
        svc = ready_service(request)
        version = await write(request, svc.set_users, body.users)
        return EventsResponse(index_version=version, users=svc.users)

    @app.post(
        "/v1/admin/snapshot",
        response_model=VersionResponse,
        dependencies=[Depends(require_admin)],
        responses=error_responses(401, 403, 422, 503),
    )
    async def snapshot(request: Request) -> VersionResponse:
        svc = ready_service(request)
        version = await write(request, svc.snapshot)
        metrics.index_gauges(svc)
        return version_response(svc, version)

    @app.get("/health/live")
    async def live() -> dict:
        return {"status": "live"}

    @app.get("/health/ready", responses=error_responses(503))
    async def ready(request: Request) -> dict:
        """200 once the index and the models are loaded, the text encoder of new ads included
        (`text_encoder`: "loaded", or "not used" by a model without text features)."""
        svc = ready_service(request)
        loaded = svc.encoder.text_encoder_loaded
        _, _, version = await asyncio.to_thread(svc.stats)
        return {
            "status": "ready",
            "index_version": version,
            "text_encoder": "not used" if loaded is None else "loaded" if loaded else "not loaded",
        }

    @app.get("/metrics", response_class=Response)
    async def prometheus(request: Request) -> Response:
        svc = request.app.state.service
        if svc is not None and request.app.state.batcher is not None:
            try:
                await asyncio.to_thread(svc.stats)  # refreshes what the gauges read
            except Unavailable:
                pass  # part of a sharded index is down: the last values; /health/ready names it
            metrics.index_gauges(svc)
            metrics.queue_depth.set(request.app.state.batcher.depth)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
