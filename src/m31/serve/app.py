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
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import pyarrow.parquet as pq
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from m31.engine import AdRequest, Engagement, InlineUser, RequestError, Retriever
from m31.engine.ad_encoder import AdEncoder, NewAd
from m31.index import AdIndexError, DurableIndex
from m31.serve.batcher import DeadlineExceeded, DynamicBatcher, QueueFull, WouldMissDeadline
from m31.serve.schemas import (
    AdIn,
    AdOut,
    AttributesPatch,
    Ranked,
    RetrieveBody,
    RetrieveRequest,
    RetrieveResponse,
    UpsertBody,
    VersionResponse,
)

log = logging.getLogger("m31.serve")


@dataclass
class ServeConfig:
    index: Path  # durable serving state (snapshot + write-ahead log)
    model: Path  # checkpoint of the retrieval model whose ad tower made the index
    data: Path  # dataset folder: the feature store and users the model reads
    device: str = "cpu"
    max_batch_size: int = 64  # requests per device call; 1 turns batching off
    max_queue_delay_ms: float = 2.0
    max_queue: int = 1024  # requests waiting, beyond which calls get 429
    timeout_ms: int = 1000  # default deadline of a retrieve call
    max_body_bytes: int = 16 << 20
    admin_token: str | None = None  # bearer token of the write endpoints; None = disabled
    read_token: str | None = None  # bearer token of the read endpoints; None = open


class Service:
    """The loaded parts: engine, durable index, ad encoder; its methods run off the loop."""

    def __init__(self, retriever: Retriever, store: DurableIndex, encoder: AdEncoder) -> None:
        self.retriever, self.store, self.encoder = retriever, store, encoder

    @classmethod
    def load(cls, config: ServeConfig) -> Service:
        from m31.model import load_checkpoint
        from m31.pipeline import embedding_cache_dir, features_for

        feats = features_for(Path(config.data))
        model, _ = load_checkpoint(Path(config.model), feats, device=config.device)
        users = pq.read_table(Path(config.data) / "users.parquet")  # targeting: country, age…
        store = DurableIndex.open(config.index, device=config.device)
        try:
            if store.index.dim_g != model.G or store.index.dim_x != model.D:
                raise ValueError(
                    f"{config.index}: index vectors are G = {store.index.dim_g}, "
                    f"D = {store.index.dim_x}; the model's are G = {model.G}, D = {model.D}"
                )
            digest = hashlib.sha256(Path(config.model).read_bytes()).hexdigest()[:16]
            made_by = store.index.model_hash
            if made_by is not None and made_by != digest:
                log.warning(
                    "the index was made by checkpoint %s, not %s (%s): scores mix two models",
                    made_by, digest, config.model,
                )  # fmt: skip
            retriever = Retriever(model, feats, store.index, users)
        except BaseException:
            store.close()
            raise
        return cls(retriever, store, AdEncoder(model, feats, embedding_cache_dir()))

    # -- retrieval: one call per batch of HTTP calls ------------------------------------------

    def retrieve_batch(self, calls: Sequence[tuple[list[AdRequest], list[int]]]):
        """Every request of the calls in one engine call at the largest k, then split.

        The top-K is exact with ties to the lower row, so the first k of a larger K are the
        top k: truncating per request gives each what it would get alone.
        """
        requests = [r for reqs, _ in calls for r in reqs]
        out = self.retriever.retrieve(requests, k=max(k for _, ks in calls for k in ks))
        answers, at = [], 0
        for reqs, ks in calls:
            results = [
                Ranked(ad_ids=r.ad_ids[:k].tolist(), scores=r.scores[:k].tolist())
                for r, k in zip(out.results[at : at + len(reqs)], ks, strict=True)
            ]
            at += len(reqs)
            answers.append((results, out.version, out.timings_ms, len(requests)))
        return answers

    # -- mutations ------------------------------------------------------------------------------

    def upsert(self, ads: list[AdIn]) -> int:
        new = [
            NewAd(
                a.ad_id,
                a.advertiser_id,
                a.objective,
                a.format,
                a.topic,
                a.category,
                a.text,
                a.quality,
            )
            for a in ads
        ]
        self.encoder.check(new)  # ValueError naming ads[i].field before any work
        g, x, b = self.encoder.encode(new)
        schema = self.store.index.schema
        attributes = []
        for a in ads:
            given = a.model_dump()
            attributes.append({name: given.get(name) for name in schema})
        return self.store.upsert([a.ad_id for a in ads], g, x, b, attributes)


_admin_scheme = HTTPBearer(auto_error=False, scheme_name="AdminToken")
_read_scheme = HTTPBearer(auto_error=False, scheme_name="ReadToken")


def _check_token(request: Request, credentials, which: str) -> None:
    expected = getattr(request.app.state.config, f"{which}_token")
    if expected is None:
        if which == "admin":
            raise HTTPException(
                403,
                "ad management is disabled: start the server with an admin token "
                "(M31_ADMIN_TOKEN or --admin-token-file)",
            )
        return  # reads are open when no read token is set
    given = credentials.credentials if credentials else ""
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise HTTPException(
            401, f"missing or wrong bearer token ({which})", {"WWW-Authenticate": "Bearer"}
        )


async def require_admin(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_admin_scheme)],
) -> None:
    _check_token(request, credentials, "admin")


async def require_read(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_read_scheme)],
) -> None:
    _check_token(request, credentials, "read")


class BodyLimit:
    """ASGI middleware: a body over `max_bytes` is a 413, whether it declares its length or
    arrives in chunks. The body is read (up to the limit) before the app runs, then handed on."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def _too_large(self, scope, receive, send) -> None:
        response = JSONResponse(
            {"detail": f"body larger than {self.max_bytes} bytes"}, status_code=413
        )
        await response(scope, receive, send)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._too_large(scope, receive, send)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self._too_large(scope, receive, send)
        pending = [{"type": "http.request", "body": bytes(body), "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()

        return await self.app(scope, replay, send)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "m31_http_requests", "HTTP calls by route and status", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "m31_http_latency_seconds",
            "HTTP call latency by route",
            ["route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.batch_size = Histogram(
            "m31_batch_requests",
            "requests per device call",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
            registry=r,
        )
        self.batch_seconds = Histogram(
            "m31_batch_seconds",
            "time of one device call (encode, masks, score and top-K)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=r,
        )
        self.device_calls = Counter("m31_device_calls", "batches run on the device", registry=r)
        self.ads_scored = Counter(
            "m31_ads_scored", "(request, ad) pairs scored exhaustively", registry=r
        )
        self.queue_depth = Gauge("m31_queue_depth", "requests waiting to be batched", registry=r)
        self.index_ads = Gauge("m31_index_ads", "live ads in the index", registry=r)
        self.index_rows = Gauge("m31_index_rows", "rows scored per request", registry=r)
        self.index_version = Gauge("m31_index_version", "index version", registry=r)
        self.ready = Gauge("m31_ready", "1 once the index is loaded", registry=r)


def create_app(config: ServeConfig, service: Service | None = None) -> FastAPI:
    """The app; with `service` given (already loaded) it is ready at once, else it loads at
    start-up in a thread while /health/live answers."""
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
                app.state.service.store.close()

    app = FastAPI(
        title="m31",
        summary="Exhaustive personalized ads retrieval: a retrieval mixture of experts over every "
        "eligible ad, top-K in one fused pass.",
        version="1",
        lifespan=lifespan,
    )
    app.state.config = config
    app.state.service = service
    app.state.batcher = None
    app.state.load_error = None
    app.state.metrics = metrics

    async def _load(app: FastAPI) -> None:
        try:
            app.state.service = await asyncio.to_thread(Service.load, config)
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
            metrics.ads_scored.inc(size * svc.store.index.num_rows)

        batcher = DynamicBatcher(
            svc.retrieve_batch,
            config.max_batch_size,
            config.max_queue_delay_ms,
            config.max_queue,
            on_batch,
        )
        batcher.start()
        app.state.batcher = batcher
        metrics.ready.set(1)
        log.info(
            "ready: %d ads, index version %d, batches of up to %d requests",
            len(svc.store.index),
            svc.store.version,
            config.max_batch_size,
        )

    def service_or_503() -> Service:
        if app.state.batcher is None:
            detail = app.state.load_error or "not ready: the index is loading"
            raise HTTPException(503, detail, {"Retry-After": "1"})
        return app.state.service

    # Added first, so inside `count`: refused bodies show in the metrics too.
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)

    @app.middleware("http")
    async def count(request: Request, call_next):
        start = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        path = route.path if route is not None else "unmatched"
        metrics.requests.labels(path, str(response.status_code)).inc()
        metrics.latency.labels(path).observe(time.perf_counter() - start)
        return response

    async def write(fn, *args) -> Any:
        """Run a mutation on the writer thread; index errors become 422 naming the field."""
        try:
            return await asyncio.get_running_loop().run_in_executor(app.state.writer, fn, *args)
        except (AdIndexError, ValueError) as e:
            raise HTTPException(422, str(e)) from e

    def version_response(svc: Service, version: int) -> VersionResponse:
        return VersionResponse(index_version=version, ads=len(svc.store.index))

    def to_engine(r: RetrieveRequest, now: int) -> AdRequest:
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
        )

    @app.post(
        "/v1/retrieve",
        response_model=RetrieveResponse,
        dependencies=[Depends(require_read)],
        responses={
            409: {"description": "index older than min_version"},
            422: {"description": "invalid request (the message names the field)"},
            429: {"description": "queue full"},
            503: {"description": "not ready, or the deadline cannot be met"},
            504: {"description": "deadline passed"},
        },
    )
    async def retrieve(body: RetrieveBody) -> RetrieveResponse:
        svc = service_or_503()
        start = time.perf_counter()
        if body.min_version is not None and svc.store.version < body.min_version:
            raise HTTPException(
                409,
                f"index is at version {svc.store.version}, older than min_version "
                f"{body.min_version}",
            )
        now = int(time.time())
        requests = [to_engine(r, now) for r in body.requests]
        try:
            svc.retriever.check(requests)  # a bad request fails alone, before batching
        except (RequestError, ValueError) as e:
            raise HTTPException(422, str(e)) from e
        timeout = (body.timeout_ms or config.timeout_ms) / 1000
        metrics.queue_depth.set(app.state.batcher.depth)
        try:
            results, version, timings, batch = await app.state.batcher.submit(
                (requests, [r.k for r in body.requests]), len(requests), timeout
            )
        except QueueFull as e:
            raise HTTPException(429, str(e), {"Retry-After": "1"}) from e
        except WouldMissDeadline as e:
            raise HTTPException(503, str(e), {"Retry-After": "1"}) from e
        except DeadlineExceeded as e:
            raise HTTPException(504, str(e)) from e
        except (RequestError, ValueError) as e:
            raise HTTPException(422, str(e)) from e
        finally:
            metrics.queue_depth.set(app.state.batcher.depth)
        total = round(1000 * (time.perf_counter() - start), 3)
        return RetrieveResponse(
            results=results,
            index_version=version,
            batch_requests=batch,
            timings_ms={**timings, "total": total},
        )

    @app.get("/v1/ads/{ad_id}", response_model=AdOut, dependencies=[Depends(require_read)])
    async def get_ad(ad_id: int) -> AdOut:
        svc = service_or_503()
        index = svc.store.index
        try:
            with index.snapshot_view() as view:
                row = index.get(ad_id)
                version = view.version
        except AdIndexError as e:
            raise HTTPException(404, str(e)) from e
        return AdOut(ad_id=ad_id, attributes=row.attributes, index_version=version)

    @app.put("/v1/ads", response_model=VersionResponse, dependencies=[Depends(require_admin)])
    async def upsert_ads(body: UpsertBody) -> VersionResponse:
        svc = service_or_503()
        version = await write(svc.upsert, body.ads)
        _index_gauges(svc)
        return version_response(svc, version)

    @app.patch(
        "/v1/ads/{ad_id}", response_model=VersionResponse, dependencies=[Depends(require_admin)]
    )
    async def patch_ad(ad_id: int, body: AttributesPatch) -> VersionResponse:
        svc = service_or_503()
        if ad_id not in svc.store.index:
            raise HTTPException(404, f"ad id {ad_id} is not in the index")
        changes = body.model_dump(exclude_unset=True)
        if not changes:
            raise HTTPException(422, "nothing to change: give at least one attribute")
        version = await write(lambda: svc.store.update_attributes(ad_id, **changes))
        _index_gauges(svc)
        return version_response(svc, version)

    @app.delete(
        "/v1/ads/{ad_id}", response_model=VersionResponse, dependencies=[Depends(require_admin)]
    )
    async def delete_ad(ad_id: int) -> VersionResponse:
        svc = service_or_503()
        if ad_id not in svc.store.index:
            raise HTTPException(404, f"ad id {ad_id} is not in the index")
        version = await write(svc.store.delete, [ad_id])
        _index_gauges(svc)
        return version_response(svc, version)

    @app.post(
        "/v1/admin/snapshot",
        response_model=VersionResponse,
        dependencies=[Depends(require_admin)],
    )
    async def snapshot() -> VersionResponse:
        svc = service_or_503()
        version = await write(svc.store.snapshot)
        _index_gauges(svc)
        return version_response(svc, version)

    @app.get("/health/live")
    async def live() -> dict:
        return {"status": "live"}

    @app.get("/health/ready", responses={503: {"description": "still loading, or failed"}})
    async def ready() -> dict:
        service_or_503()
        return {"status": "ready", "index_version": app.state.service.store.version}

    @app.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        svc = app.state.service
        if svc is not None and app.state.batcher is not None:
            _index_gauges(svc)
            metrics.queue_depth.set(app.state.batcher.depth)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def _index_gauges(svc: Service) -> None:
        index = svc.store.index
        metrics.index_ads.set(len(index))
        metrics.index_rows.set(index.num_rows)
        metrics.index_version.set(svc.store.version)

    return app
