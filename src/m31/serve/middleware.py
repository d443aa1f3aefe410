"""ASGI middleware: `BodyGuard` (every route: its token before the body, size and time limits),
`HeadAsGet` (HEAD of every GET route) and `Counted` (calls and latency by route and status into
the metrics)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.security.utils import get_authorization_scheme_param

from m31.serve.auth import TOKEN_KIND, refusal
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


def _declares_body(headers: dict[bytes, bytes]) -> bool:
    """Whether a call's head announces a body (RFC 9112 §6.3: a length above 0, or chunks)."""
    return headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers


@dataclass(frozen=True)
class _Guarded:
    route: Any
    token: str | None  # "admin" or "read": the token it requires; None: open
    body: bool  # it declares a body (a FastAPI route with a body parameter)


def _no_body(receive):
    """`receive` with an empty body first: what a route that declares none reads, whatever the
    caller sent (later messages, such as a disconnect, come from `receive`)."""
    pending = [{"type": "http.request", "body": b"", "more_body": False}]

    async def empty():
        return pending.pop() if pending else await receive()

    return empty


class BodyGuard:
    """ASGI middleware in front of every route: a call's body reaches a route only through it.

    The route is found in the app's route table (`routes`, the app's own list, read again
    whenever it has grown, so that a route added later is guarded like the others); the token
    it requires is read off its auth dependency (`auth.TOKEN_KIND`) and checked before a byte
    of the body is read, so a caller without one cannot make the server hold bodies. A route
    that declares a body gets it read whole (the app parses it at once) within
    `max_body_bytes` (else 413, whether declared or streamed) and `body_timeout_s` (else 408:
    a sender that stalls holds nothing for longer); any other route sees an empty body,
    whatever was sent. A call to no route passes on untouched: the router answers 404 or 405
    without reading its body.
    """

    def __init__(self, app, config: ServeConfig, routes: Sequence[Any]) -> None:
        self.app, self.config, self.routes = app, config, routes
        self._table: list[_Guarded] | None = None

    def table(self) -> list[_Guarded]:
        """How each route is guarded, in the router's order. A route whose token cannot be
        told (two kinds at once) is refused here, at the first call after it was added."""
        if self._table is None or len(self._table) != len(self.routes):
            table = []
            for route in self.routes:
                dependant = getattr(route, "dependant", None)
                calls = [d.call for d in dependant.dependencies] if dependant is not None else []
                kinds = {TOKEN_KIND[c] for c in calls if c in TOKEN_KIND}
                if len(kinds) > 1:
                    raise RuntimeError(f"route {route.path}: requires tokens {sorted(kinds)}")
                body = getattr(route, "body_field", None) is not None
                table.append(_Guarded(route, kinds.pop() if kinds else None, body))
            self._table = table
        return self._table

    def route_of(self, scope) -> _Guarded | None:
        """How the route a call goes to is guarded; None if no route takes the call."""
        path, method = _route_path(scope), scope["method"]
        method = "GET" if method == "HEAD" else method  # `HeadAsGet`
        for guarded in self.table():
            methods = getattr(guarded.route, "methods", None)
            if methods is not None and method in methods and guarded.route.path_regex.match(path):
                return guarded
        return None

    async def __call__(self, scope, receive, send) -> None:
        guarded = self.route_of(scope) if scope["type"] == "http" else None
        if guarded is None:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if guarded.token is not None:
            scheme, token = get_authorization_scheme_param(
                headers.get(b"authorization", b"").decode("latin-1")
            )
            given = token if scheme.lower() == "bearer" else ""
            refused = refusal(self.config, guarded.token, given)
            if refused is not None:
                return await error(refused.status_code, refused.detail, refused.headers)(
                    scope, receive, send
                )
        if not _declares_body(headers):
            return await self.app(scope, receive, send)
        if not guarded.body:
            return await self.app(scope, _no_body(receive), send)
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
