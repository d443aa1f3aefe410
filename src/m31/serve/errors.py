"""Errors as the API gives them: every error is `{"detail": message}`, a 422's naming the field
and never echoing the input; JSON bodies are parsed strictly (no NaN, no infinities, no lone
surrogates); the codes of each route go into the OpenAPI schema."""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from m31.serve.schemas import Error


class ErrorResponse(JSONResponse):
    """`{"detail": message}`; non-ASCII is escaped, so that no message can fail to encode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def error(status: int, detail: str, headers: Mapping[str, str] | None = None) -> ErrorResponse:
    return ErrorResponse({"detail": detail}, status, dict(headers or {}))


# Bodies from this size on are parsed on a worker thread, so that the event loop (and with it
# /health/live and every other call) never waits on a large one.
PARSE_OFF_LOOP_BYTES = 64 << 10


# A `\uD800`-`\uDFFF` escape: the only way a lone surrogate gets into text decoded from UTF-8.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _parse_json(body: bytes) -> Any:
    """`json.loads`, refusing what Python's parser takes but JSON and UTF-8 do not: bytes that
    are not UTF-8 (`json.loads` would guess UTF-16 or UTF-32), an object with a key twice (which
    value was meant?), NaN and ±Infinity (also as numbers that overflow to them) and lone
    surrogates ("\\ud800"). One pass of the parser; only a body that may hold one of the last
    two is walked, to say where."""
    if (nul := body.find(0)) >= 0:  # UTF-16 or UTF-32 of ASCII text would decode as UTF-8
        raise HTTPException(400, f"body: not UTF-8 text (a NUL byte at {nul}; UTF-16 or UTF-32?)")
    try:
        text = body.decode()
    except UnicodeDecodeError as e:
        raise HTTPException(400, f"body: not UTF-8 (byte {e.start})") from None
    suspect = False

    def constant(name: str) -> float:  # NaN, Infinity, -Infinity
        nonlocal suspect
        suspect = True
        return float(name)

    def number(digits: str) -> float:
        nonlocal suspect
        value = float(digits)
        suspect = suspect or not math.isfinite(value)
        return value

    try:
        value = json.loads(
            text, object_pairs_hook=_unique_keys, parse_constant=constant, parse_float=number
        )
    except RecursionError:
        raise HTTPException(400, "body: JSON nested too deep to parse") from None
    if suspect or _SURROGATE_ESCAPE.search(text):
        problem = _unrepresentable(value)
        if problem is not None:
            raise HTTPException(422, problem)
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        shown = repr(key) if len(key) <= 64 else repr(key[:64]) + "…"
        raise HTTPException(422, f"body: an object has the key {shown} twice")
    return value


def _unrepresentable(value: Any) -> str | None:
    """Where the first NaN, infinity or lone surrogate of a parsed JSON value is, if any."""
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
    return None


def _is_text(s: str) -> bool:
    try:
        s.encode()
    except UnicodeEncodeError:
        return False
    return True


class _JSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) < PARSE_OFF_LOOP_BYTES:
                self._json = _parse_json(body)
            else:
                self._json = await asyncio.to_thread(_parse_json, body)
        return self._json


class CheckedJSONRoute(APIRoute):
    """A route whose JSON body is parsed by `_parse_json`."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            return await handler(_JSONRequest(request.scope, request.receive))

        return checked


def describe(errors: Sequence[Mapping[str, Any]], shown: int = 5) -> str:
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


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries of the error answers a route gives, each `{"detail": message}`."""
    entries: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        entries[code] = {"model": Error, "description": _ERRORS[code]}
        if code in _ERROR_HEADERS:
            entries[code]["headers"] = _ERROR_HEADERS[code]
    return entries
