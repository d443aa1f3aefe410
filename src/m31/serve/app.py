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
give are in the OpenAPI schema. A body is read only by the routes that take one, after the
caller's token is checked, within a size limit (413) and a time limit (408).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import re
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import pyarrow.parquet as pq
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import BeforeValidator
from starlette.exceptions import HTTPException as StarletteHTTPException

from m31.engine import AdRequest, Engagement, InlineUser, RequestError, Retriever
from m31.engine.ad_encoder import AdEncoder, NewAd
from m31.index import AdIndexError, DurableIndex
from m31.serve.batcher import DeadlineExceeded, DynamicBatcher, Overloaded, WouldMissDeadline
from m31.serve.schemas import (
    I64_MAX,
    AdIn,
    AdOut,
    AttributesPatch,
    Error,
    Ranked,
    RetrieveBody,
    RetrieveRequest,
    RetrieveResponse,
    UpsertBody,
    VersionResponse,
    check_bounds,
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
    body_timeout_s: float = 10.0  # a body not in by then is a 408 (slow or stalled senders)
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
            encoder = AdEncoder(model, feats, embedding_cache_dir())
            # Now, not on the first upsert: loading the sentence model takes seconds to a minute.
            encoder.load_text_encoder()
        except BaseException:
            store.close()
            raise
        return cls(retriever, store, encoder)

    # -- retrieval: one call per batch of HTTP calls ------------------------------------------

    def retrieve_batch(self, chunks: Sequence[Sequence[tuple[AdRequest, int]]]):
        """Every (request, k) of the batch's chunks in one engine call at the largest k, then
        split: per chunk (results, index version, timings, requests in the engine call).

        The top-K is exact with ties to the lower row, so the first k of a larger K are the
        top k: truncating per request gives each what it would get alone.
        """
        requests = [r for chunk in chunks for r, _ in chunk]
        out = self.retriever.retrieve(requests, k=max(k for chunk in chunks for _, k in chunk))
        answers, at = [], 0
        for chunk in chunks:
            results = [
                Ranked(ad_ids=r.ad_ids[:k].tolist(), scores=r.scores[:k].tolist())
                for r, (_, k) in zip(out.results[at : at + len(chunk)], chunk, strict=True)
            ]
            at += len(chunk)
            answers.append((results, out.version, out.timings_ms, len(requests)))
        return answers

    @staticmethod
    def assemble(parts: Sequence[tuple[list[Ranked], int, dict[str, float], int]]):
        """One call's (results, index version, timings, batch requests) from its chunks' parts.

        A call larger than a batch runs in several engine calls, each at one version: the
        oldest is reported (every request saw it or a newer one), timings add up, and the
        batch size is the largest.
        """
        timings = {stage: round(sum(p[2][stage] for p in parts), 3) for stage in parts[0][2]}
        results = [r for p in parts for r in p[0]]
        return results, min(p[1] for p in parts), timings, max(p[3] for p in parts)

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

    def update(self, ad_id: int, changes: Mapping[str, Any]) -> int:
        """Change some attributes of one ad. A range with one end changed is checked against
        the ad's other end; on the writer thread, so no other write comes in between."""
        check_bounds(changes, self.store.index.get(ad_id).attributes)
        return self.store.update_attributes(ad_id, **changes)


_admin_scheme = HTTPBearer(auto_error=False, scheme_name="AdminToken")
_read_scheme = HTTPBearer(auto_error=False, scheme_name="ReadToken")


def _refusal(config: ServeConfig, which: str, given: str) -> HTTPException | None:
    """Why a caller with bearer token `given` may not use a route of kind `which` ("admin" or
    "read"), or None. The admin token reads too, so one token can do everything."""
    if which == "admin" and config.admin_token is None:
        return HTTPException(
            403,
            "ad management is disabled: start the server with an admin token "
            "(M31_ADMIN_TOKEN or --admin-token-file)",
        )
    if which == "read" and config.read_token is None:
        return None  # reads are open when no read token is set
    accepted = [config.admin_token] + ([config.read_token] if which == "read" else [])
    # Every token is compared, matching or not, so that the time taken tells nothing.
    matches = [hmac.compare_digest(given.encode(), token.encode()) for token in accepted if token]
    if not any(matches):
        return HTTPException(
            401, f"missing or wrong bearer token ({which})", {"WWW-Authenticate": "Bearer"}
        )
    return None


def _given(credentials: HTTPAuthorizationCredentials | None) -> str:
    return credentials.credentials if credentials else ""


async def require_admin(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_admin_scheme)],
) -> None:
    refused = _refusal(request.app.state.config, "admin", _given(credentials))
    if refused is not None:
        raise refused


async def require_read(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_read_scheme)],
) -> None:
    refused = _refusal(request.app.state.config, "read", _given(credentials))
    if refused is not None:
        raise refused


class ErrorResponse(JSONResponse):
    """`{"detail": message}`; non-ASCII is escaped, so that no message can fail to encode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def _error(status: int, detail: str, headers: Mapping[str, str] | None = None) -> ErrorResponse:
    return ErrorResponse({"detail": detail}, status, dict(headers or {}))


def _body_route(method: str, path: str) -> str | None:
    """The token kind of the route `method path` if it reads a body, else None."""
    if method == "POST" and path == "/v1/retrieve":
        return "read"
    if (method == "PUT" and path == "/v1/ads") or (
        method == "PATCH" and path.startswith("/v1/ads/")
    ):
        return "admin"
    return None


class BodyGuard:
    """ASGI middleware in front of the routes that read a body.

    The caller's token is checked before a byte of the body is read, so a caller without one
    cannot make the server hold bodies. The body is then read whole (the app parses it at
    once) within `max_body_bytes` (else 413, whether declared or streamed) and `body_timeout_s`
    (else 408: a sender that stalls holds nothing for longer). Elsewhere no body is read.
    """

    def __init__(self, app, config: ServeConfig) -> None:
        self.app, self.config = app, config

    async def __call__(self, scope, receive, send) -> None:
        which = _body_route(scope["method"], scope["path"]) if scope["type"] == "http" else None
        if which is None:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        scheme, token = get_authorization_scheme_param(
            headers.get(b"authorization", b"").decode("latin-1")
        )
        refused = _refusal(self.config, which, token if scheme.lower() == "bearer" else "")
        if refused is not None:
            return await _error(refused.status_code, refused.detail, refused.headers)(
                scope, receive, send
            )
        too_large = _error(413, f"body larger than {self.config.max_body_bytes} bytes")
        length = headers.get(b"content-length")
        if length is not None and (
            not length.isdigit() or int(length) > self.config.max_body_bytes
        ):
            return await too_large(scope, receive, send)
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                body = await self._read(receive)
        except TimeoutError:
            timeout = _error(
                408,
                f"body not received within {self.config.body_timeout_s:g} s",
                {"Connection": "close"},
            )
            return await timeout(scope, receive, send)
        if body is None:  # the client went away: nobody to answer
            return None
        if len(body) > self.config.max_body_bytes:
            return await too_large(scope, receive, send)
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()

        return await self.app(scope, replay, send)

    async def _read(self, receive) -> bytes | None:
        """The body, cut short once over the limit; None if the client disconnects."""
        body, more = bytearray(), True
        while more and len(body) <= self.config.max_body_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
        return bytes(body)


class Counted:
    """ASGI middleware: calls and latency by route and status into the metrics. A call whose
    client left before any answer counts as status "disconnected"."""

    def __init__(self, app, metrics: Metrics, routes: Sequence[Any]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), "disconnected"

        async def sending(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except BaseException:
            if status == "disconnected":
                status = "500"  # unanswered: the server's error middleware answers it
            raise
        finally:
            # A call that BodyGuard answered (or saw leave) never reached the router.
            route = scope.get("route") or next(
                (r for r in self.routes if r.path_regex.match(scope["path"])), None
            )
            path = route.path if route is not None else "unmatched"
            self.metrics.requests.labels(path, status).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - start)


def _parse_json(body: bytes) -> Any:
    """`json.loads`, refusing what Python's parser takes but JSON and UTF-8 do not: NaN and
    ±Infinity (also as numbers that overflow to them) and lone surrogates ("\\ud800")."""
    too_deep = HTTPException(400, "body: JSON nested too deep to parse")
    try:
        value = json.loads(body)
    except UnicodeDecodeError as e:
        raise HTTPException(400, f"body: not UTF-8 (byte {e.start})") from None
    except RecursionError:
        raise too_deep from None
    try:  # at C speed; only a body that fails is walked to say where
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode()
    except RecursionError:
        raise too_deep from None
    except ValueError:  # UnicodeEncodeError is one
        raise HTTPException(422, _unrepresentable(value)) from None
    return value


def _unrepresentable(value: Any) -> str:
    """Where the first NaN, infinity or lone surrogate of a parsed JSON value is."""
    stack = [(value, "")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return (
                f"{where or 'body'}: not a finite number (NaN, Infinity or beyond the float range)"
            )
        if isinstance(item, str) and not _is_text(item):
            return f"{where or 'body'}: holds a lone surrogate (e.g. \\ud800), which is not text"
        if isinstance(item, dict):
            if not all(_is_text(key) for key in item):
                return f"{where or 'body'}: a key holds a lone surrogate, which is not text"
            stack.extend((v, f"{where}.{k}" if where else k) for k, v in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(item))))
    return "body: not representable in JSON"


def _is_text(s: str) -> bool:
    try:
        s.encode()
    except UnicodeEncodeError:
        return False
    return True


class _JSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = _parse_json(await self.body())
        return self._json


class CheckedJSONRoute(APIRoute):
    """A route whose JSON body is parsed by `_parse_json`."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            return await handler(_JSONRequest(request.scope, request.receive))

        return checked


def _describe(errors: Sequence[Mapping[str, Any]], shown: int = 5) -> str:
    """Validation errors as `requests[0].k: message; ...`: the fields and what is wrong with
    them, never the input (which need not be representable in JSON)."""
    parts = []
    for e in errors[:shown]:
        if e["type"] == "json_invalid":
            parts.append(f"body: invalid JSON at character {e['loc'][-1]} ({e['ctx']['error']})")
            continue
        where = ""
        for part in e["loc"][1:]:  # after "body" or "path"
            where += f"[{part}]" if isinstance(part, int) else f".{part}" if where else str(part)
        parts.append(f"{where or 'body'}: {e['msg'].removeprefix('Value error, ')}")
    if len(errors) > shown:
        parts.append(f"and {len(errors) - shown} more")
    return "; ".join(parts)


def _plain_decimal(value: Any) -> Any:
    if isinstance(value, str) and not re.fullmatch(r"0|[1-9][0-9]*", value):
        raise ValueError(
            "expected a plain decimal integer (digits only: no sign, point, separator, space "
            "or leading zero)"
        )
    return value


# An ad id in a path, as written: "1.0", " 1", "1_000" or "007" are not ids, though int() takes them.
AdIdPath = Annotated[
    int, PathParam(ge=0, le=I64_MAX, description="the ad's id"), BeforeValidator(_plain_decimal)
]

_ERRORS = {
    400: "body not parseable (not UTF-8, or JSON nested too deep)",
    401: "missing or wrong bearer token",
    403: "ad management is disabled (the server has no admin token)",
    404: "no such ad",
    408: "body not received in time",
    409: "index older than min_version",
    413: "body too large",
    422: "invalid input; the message names the field",
    429: "overloaded: more work queued than the server takes",
    503: "not ready, or the deadline cannot be met",
    504: "deadline passed",
}
_RETRY = {"Retry-After": {"description": "seconds", "schema": {"type": "string"}}}
_ERROR_HEADERS = {
    401: {"WWW-Authenticate": {"schema": {"type": "string"}}},
    429: _RETRY,
    503: _RETRY,
}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries of the error answers a route gives, each `{"detail": message}`."""
    entries: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        entries[code] = {"model": Error, "description": _ERRORS[code]}
        if code in _ERROR_HEADERS:
            entries[code]["headers"] = _ERROR_HEADERS[code]
    return entries


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
        # A redirect to the slash-less path would be built from the client's Host header.
        redirect_slashes=False,
    )
    app.router.route_class = CheckedJSONRoute
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

    # Added first, so inside `Counted`: refused bodies show in the metrics too.
    app.add_middleware(BodyGuard, config=config)
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
            headers = {"Allow": ", ".join(sorted(methods))}
        return _error(e.status_code, str(e.detail), headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> Response:
        return _error(422, _describe(e.errors()))

    # With no read token reads are open, and the schema says so (no security, no 401).
    read_auth = [Depends(require_read)] if config.read_token is not None else []
    read_401 = (401,) if config.read_token is not None else ()

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
        dependencies=read_auth,
        responses=_errors(400, *read_401, 408, 409, 413, 422, 429, 503, 504),
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
            parts = await app.state.batcher.submit(
                [(r, b.k) for r, b in zip(requests, body.requests, strict=True)], timeout
            )
        except Overloaded as e:
            raise HTTPException(429, str(e), {"Retry-After": "1"}) from e
        except WouldMissDeadline as e:
            raise HTTPException(503, str(e), {"Retry-After": "1"}) from e
        except DeadlineExceeded as e:
            raise HTTPException(504, str(e)) from e
        except (RequestError, ValueError) as e:
            raise HTTPException(422, str(e)) from e
        finally:
            metrics.queue_depth.set(app.state.batcher.depth)
        results, version, timings, batch = Service.assemble(parts)
        total = round(1000 * (time.perf_counter() - start), 3)
        return RetrieveResponse(
            results=results,
            index_version=version,
            batch_requests=batch,
            timings_ms={**timings, "total": total},
        )

    @app.get(
        "/v1/ads/{ad_id}",
        response_model=AdOut,
        dependencies=read_auth,
        responses=_errors(*read_401, 404, 422, 503),
    )
    async def get_ad(ad_id: AdIdPath) -> AdOut:
        svc = service_or_503()
        index = svc.store.index
        try:
            with index.snapshot_view() as view:
                row = index.get(ad_id)
                version = view.version
        except AdIndexError as e:
            raise HTTPException(404, str(e)) from e
        return AdOut(ad_id=ad_id, attributes=row.attributes, index_version=version)

    @app.put(
        "/v1/ads",
        response_model=VersionResponse,
        dependencies=[Depends(require_admin)],
        responses=_errors(400, 401, 403, 408, 413, 422, 503),
    )
    async def upsert_ads(body: UpsertBody) -> VersionResponse:
        svc = service_or_503()
        version = await write(svc.upsert, body.ads)
        _index_gauges(svc)
        return version_response(svc, version)

    @app.patch(
        "/v1/ads/{ad_id}",
        response_model=VersionResponse,
        dependencies=[Depends(require_admin)],
        responses=_errors(400, 401, 403, 404, 408, 413, 422, 503),
    )
    async def patch_ad(ad_id: AdIdPath, body: AttributesPatch) -> VersionResponse:
        svc = service_or_503()
        if ad_id not in svc.store.index:
            raise HTTPException(404, f"ad id {ad_id} is not in the index")
        changes = body.model_dump(exclude_unset=True)
        if not changes:
            raise HTTPException(422, "nothing to change: give at least one attribute")
        version = await write(svc.update, ad_id, changes)
        _index_gauges(svc)
        return version_response(svc, version)

    @app.delete(
        "/v1/ads/{ad_id}",
        response_model=VersionResponse,
        dependencies=[Depends(require_admin)],
        responses=_errors(401, 403, 404, 422, 503),
    )
    async def delete_ad(ad_id: AdIdPath) -> VersionResponse:
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
        responses=_errors(401, 403, 422, 503),
    )
    async def snapshot() -> VersionResponse:
        svc = service_or_503()
        version = await write(svc.store.snapshot)
        _index_gauges(svc)
        return version_response(svc, version)

    @app.get("/health/live")
    async def live() -> dict:
        return {"status": "live"}

    @app.get("/health/ready", responses=_errors(503))
    async def ready() -> dict:
        """200 once the index and the models are loaded, the text encoder of new ads included
        (`text_encoder`: "loaded", or "not used" by a model without text features)."""
        svc = service_or_503()
        loaded = svc.encoder.text_encoder_loaded
        return {
            "status": "ready",
            "index_version": svc.store.version,
            "text_encoder": "not used" if loaded is None else "loaded" if loaded else "not loaded",
        }

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
