"""Bearer tokens: the admin token writes (and reads), the read token reads; with no read token
reads are open, with no admin token ad management is off (403)."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from m31.serve.config import ServeConfig

_admin_scheme = HTTPBearer(auto_error=False, scheme_name="AdminToken")
_read_scheme = HTTPBearer(auto_error=False, scheme_name="ReadToken")


def refusal(config: ServeConfig, which: str, given: str) -> HTTPException | None:
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
    refused = refusal(request.app.state.config, "admin", _given(credentials))
    if refused is not None:
        raise refused


async def require_read(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_read_scheme)],
) -> None:
    refused = refusal(request.app.state.config, "read", _given(credentials))
    if refused is not None:
        raise refused


# The token each auth dependency requires: `middleware.BodyGuard` checks it before a route's
# body is read, so that a route's dependency is the one place its token is declared.
TOKEN_KIND = {require_admin: "admin", require_read: "read"}
