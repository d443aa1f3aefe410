"""The body guard on every route of a real server on loopback (`m31.serve.middleware.BodyGuard`):
a caller without the route's token is answered before a byte of its body is read, whatever its
size; with the token a body is read only within the size and time limits; and an idempotency
key names one call. (The cluster's ingress: `tests/test_cluster_hardening.py`.)

A 300 MB upload is what an outside test sent to the events route, which skipped the guard: the
server read and parsed it before its 401 (RSS +2.4 GB). Nothing here times anything: a server
that read the body first would still be waiting for it (and the body sender would send it all)."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi import Depends
from serve_helpers import (
    ADMIN,
    ProcessServer,
    ThreadServer,
    World,
    check_every_route_is_guarded,
    fresh_state,
    push_body,
    rss_bytes,
    status_of,
)

from m31.serve.app import ServeConfig, create_app
from m31.serve.auth import require_admin
from m31.serve.config import MAX_BODY_BYTES
from m31.serve.local import LocalBackend
from m31.serve.schemas import UsersBody

AUTH = {"Authorization": f"Bearer {ADMIN}"}
HUGE = 300 << 20  # bytes
JSON = "Content-Type: application/json\n"


@pytest.fixture(scope="module")
def world(served_world) -> World:
    return served_world


@pytest.mark.parametrize("read_token", [None, "read-secret"])
def test_every_route_is_guarded(world, read_token):
    config = ServeConfig(index=fresh_state(world, "guard"), model=world.model, admin_token=ADMIN,
                         read_token=read_token, body_timeout_s=0.5)  # fmt: skip
    app = create_app(config, LocalBackend.load)
    with ThreadServer(app) as s:
        check_every_route_is_guarded(s.url, app, ADMIN, config.body_timeout_s)


def test_a_route_added_later_is_guarded_too(world):
    """The guard reads the app's route table, not a list of its own: a route added after the
    app was made (here an admin route taking a body) is guarded from its first call."""
    config = ServeConfig(index=fresh_state(world, "later"), model=world.model, admin_token=ADMIN,
                         body_timeout_s=0.5)  # fmt: skip
    app = create_app(config, LocalBackend.load)
    with ThreadServer(app) as s:
        assert httpx.get(f"{s.url}/health/live").status_code == 200  # the guard's first call

        @app.post("/v1/later", dependencies=[Depends(require_admin)])
        async def later(body: UsersBody) -> dict:
            return {"users": len(body.users)}

        check_every_route_is_guarded(s.url, app, ADMIN, config.body_timeout_s)
        answer, sent = push_body(s.url, "POST /v1/later", f"{JSON}Content-Length: {HUGE}\n", HUGE)
        assert status_of(answer) == 401 and sent < HUGE, answer[:200]
        r = httpx.post(f"{s.url}/v1/later", headers=AUTH, json={"users": [{"user_id": 1}]})
        assert r.status_code == 200 and r.json() == {"users": 1}, r.text


def test_a_300_mb_events_body_is_not_read(world):
    """On `m31 serve` in its own process: without the token 300 MB are answered 401 before they
    are read (the server's memory unchanged), with it 413, declared or streamed."""
    server = ProcessServer(world, fresh_state(world, "huge"), "--body-timeout-s", "600").start()
    try:
        pid = server.proc.pid
        before = rss_bytes(pid)
        for call in ("POST /v1/events", "PUT /v1/users", "PUT /v1/ads"):
            answer, sent = push_body(server.url, call, f"{JSON}Content-Length: {HUGE}\n", HUGE)
            assert status_of(answer) == 401 and sent < HUGE, (call, answer[:200])
        assert rss_bytes(pid) - before < 8 << 20, (before, rss_bytes(pid))

        head = f"{JSON}Authorization: Bearer {ADMIN}\n"
        answer, sent = push_body(server.url, "POST /v1/events", f"{head}Content-Length: {HUGE}\n",
                                 HUGE)  # fmt: skip
        assert status_of(answer) == 413 and sent < HUGE, answer[:200]
        assert f"body larger than {MAX_BODY_BYTES} bytes".encode() in answer
        # Streamed in chunks, without a length: read up to the limit, then refused.
        answer, sent = push_body(server.url, "POST /v1/events",
                                 f"{head}Transfer-Encoding: chunked\n", HUGE, chunked=True)  # fmt: skip
        assert status_of(answer) == 413 and sent < HUGE, answer[:200]
        assert rss_bytes(pid) - before < 4 * MAX_BODY_BYTES, (before, rss_bytes(pid))
        ok = httpx.post(f"{server.url}/v1/events", headers=AUTH,
                        json={"events": [{"user_id": 1, "ad_id": 1, "ts": 1}]})  # fmt: skip
        assert ok.status_code == 200, ok.text
    finally:
        server.stop()


def test_an_idempotency_key_names_one_call(world):
    config = ServeConfig(index=fresh_state(world, "keys"), model=world.model, admin_token=ADMIN)
    with ThreadServer(create_app(config, LocalBackend.load)) as s:
        check_one_call_per_key(s.url)


def check_one_call_per_key(url: str) -> None:
    """A retry under a key answers the first call's version, though its JSON is written
    differently; another call under the key is a 422 naming it, with nothing applied."""
    events = [{"user_id": 7, "ad_id": 40 + i, "ts": 1_000 + i, "surface": "feed"} for i in range(3)]
    first = httpx.post(f"{url}/v1/events", headers=AUTH,
                       json={"events": events, "idempotency_key": "k-1"})  # fmt: skip
    assert first.status_code == 200, first.text
    version = first.json()["index_version"]
    rewritten = json.dumps({"idempotency_key": "k-1", "events": [dict(reversed(e.items()))
                                                                for e in events]}, indent=2)  # fmt: skip
    retry = httpx.post(f"{url}/v1/events", content=rewritten,
                       headers={**AUTH, "Content-Type": "application/json"})  # fmt: skip
    assert retry.status_code == 200 and retry.json()["index_version"] == version, retry.text
    for other in (events[:2], [{**events[0], "surface": None}, *events[1:]]):
        r = httpx.post(f"{url}/v1/events", headers=AUTH,
                       json={"events": other, "idempotency_key": "k-1"})  # fmt: skip
        assert r.status_code == 422, r.text
        assert r.json()["detail"].startswith(
            f"idempotency_key: 'k-1' was used at version {version} for a different call"
        ), r.text
    assert httpx.get(f"{url}/health/ready").json()["index_version"] == version  # none applied
