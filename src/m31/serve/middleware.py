"""ASGI middleware: `BodyGuard` (token before body, size and time limits), `HeadAsGet` (HEAD of
every GET route) and `Counted` (calls and latency by route and status into the metrics)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from fastapi.security.utils import get_authorization_scheme_param

from m31.serve.auth import refusal
from m31.serve.config import ServeConfig
from m31.serve.errors import error
from m31.serve.metrics import Metrics

_ARRIVAL = "m31_arrival"


def arrival(scope) -> float:
    """When the call arrived (`time.monotonic()` seconds), as `Counted` saw it."""
    return scope.get("state", {}).get(_ARRIVAL, time.monotonic())


def _route_path(scope) -> str:
    """The path the routes match: without the prefix the app is mounted at (`root_path`, as
    behind Ray Serve's proxy)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


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
        which = (
            _body_route(scope["method"], _route_path(scope)) if scope["type"] == "http" else None
        )
        if which is None:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        scheme, token = get_authorization_scheme_param(
            headers.get(b"authorization", b"").decode("latin-1")
        )
        refused = refusal(self.config, which, token if scheme.lower() == "bearer" else "")
        if refused is not None:
            return await error(refused.status_code, refused.detail, refused.headers)(
                scope, receive, send
            )
        too_large = error(413, f"body larger than {self.config.max_body_bytes} bytes")
        length = headers.get(b"content-length")
        if length is not None and (
            not length.isdigit() or int(length) > self.config.max_body_bytes
        ):
            return await too_large(scope, receive, send)
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                body = await self._read(receive)
        except TimeoutError:
            timeout = error(
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


class HeadAsGet:
    """HEAD answers as GET would, without the body (RFC 9110 §9.3.2): the same status and
    headers, `content-length` included. A path without a GET route answers 405 or 404 as GET
    would. The OpenAPI schema lists GET only, as HTTP frameworks commonly do."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def head(message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        return await self.app({**scope, "method": "GET"}, receive, head)


class Counted:
    """ASGI middleware: calls and latency by route and status into the metrics. A call whose
    client left before any answer counts as status "disconnected"."""

    def __init__(self, app, metrics: Metrics, routes: Sequence[Any]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), "disconnected"
        # Deadlines count from here (`arrival`): reading and parsing the body are part of a call.
        scope.setdefault("state", {})[_ARRIVAL] = time.monotonic()

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
                (r for r in self.routes if r.path_regex.match(_route_path(scope))), None
            )
            path = route.path if route is not None else "unmatched"
            self.metrics.requests.labels(path, status).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - start)
