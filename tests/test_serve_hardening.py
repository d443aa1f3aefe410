"""Hardening of the HTTP service on real uvicorn servers on loopback: no input gives a 5xx,
bodies are read only after the token check and within a time limit, inputs are strict, null
means one documented thing per field, every error is in the OpenAPI schema, and /health/ready
waits for the text encoder."""

from __future__ import annotations

import json
import logging
import re
import socket

import httpx
import pytest
from serve_helpers import (
    ADMIN,
    READ,
    ProcessServer,
    ThreadServer,
    World,
    fresh_state,
    new_ad,
    until,
)

from m31.serve.app import ServeConfig, create_app
from m31.serve.local import LocalBackend

AUTH = {"Authorization": f"Bearer {ADMIN}"}  # the admin token reads too
OK = {"user_id": 1, "surface": "feed", "platform": "ios", "k": 3}  # user 1 is stored


@pytest.fixture(scope="module")
def world(served_world) -> World:
    return served_world


@pytest.fixture(scope="module")
def server(world):
    """Both tokens set, and a short body timeout."""
    config = ServeConfig(
        index=fresh_state(world, "hardened"),
        model=world.model,
        admin_token=ADMIN,
        read_token=READ,
        body_timeout_s=0.5,
    )
    with ThreadServer(create_app(config, LocalBackend.load)) as s:
        yield s


def raw_json(server, method: str, path: str, text: str) -> httpx.Response:
    """Send JSON text as is: NaN, Infinity and lone surrogates, which json.dumps will not write
    unasked, are valid input to Python's parser."""
    headers = {**AUTH, "content-type": "application/json"}
    return httpx.request(method, server.url + path, content=text.encode(), headers=headers)


def with_value(body: dict, token: str) -> str:
    """`body` as JSON with its "HERE" string replaced by the JSON token `token`."""
    return json.dumps(body).replace('"HERE"', token)


def raw_http(server, head: str, body: bytes = b"", timeout: float = 10.0) -> bytes:
    """Send a request head (and the start of a body) on a raw socket; the whole answer (which
    may arrive in several pieces)."""
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n")[1]) < int(
            re.search(rb"content-length: (\d+)", answer.lower())[1]
        ):
            piece = sock.recv(4096)
            assert piece, f"the server closed the connection after {answer!r}"
            answer += piece
        return answer


def test_non_finite_numbers_and_lone_surrogates_are_422(server):
    ad = new_ad(920_001, "finite")
    cases = [  # (method, path, JSON text, the field the message must name)
        ("POST", "/v1/retrieve", with_value({"requests": [{**OK, "k": "HERE"}]}, "NaN"),
         "requests[0].k"),
        ("POST", "/v1/retrieve", with_value({"requests": [{**OK, "ts": "HERE"}]}, "Infinity"),
         "requests[0].ts"),
        ("POST", "/v1/retrieve", with_value({"requests": [OK], "timeout_ms": "HERE"}, "-Infinity"),
         "timeout_ms"),
        ("POST", "/v1/retrieve", with_value({"requests": [OK], "min_version": "HERE"}, "NaN"),
         "min_version"),
        ("POST", "/v1/retrieve", with_value({"requests": [OK], "min_version": "HERE"}, "1e999"),
         "min_version"),
        ("POST", "/v1/retrieve",
         with_value({"requests": [{**OK, "filter": {"gt": ["topic", "HERE"]}}]}, "Infinity"),
         "requests[0].filter.gt[1]"),
        ("PUT", "/v1/ads", with_value({"ads": [{**ad, "quality": "HERE"}]}, "Infinity"),
         "ads[0].quality"),
        ("PUT", "/v1/ads", with_value({"ads": [{**ad, "schedule_start": "HERE"}]}, "-Infinity"),
         "ads[0].schedule_start"),
        ("PATCH", "/v1/ads/1", with_value({"schedule_start": "HERE"}, "NaN"), "schedule_start"),
        ("PUT", "/v1/ads", json.dumps({"ads": [{**ad, "text": "shoes \ud800"}]}), "ads[0].text"),
        ("POST", "/v1/retrieve",
         json.dumps({"requests": [{**OK, "user_id": None,
                                   "user": {"country": "\udfff", "age": 30, "gender": "F"}}]}),
         "requests[0].user.country"),
    ]  # fmt: skip
    for method, path, text, field in cases:
        r = raw_json(server, method, path, text)
        assert r.status_code == 422, (text, r.status_code, r.text)
        assert r.json()["detail"].startswith(f"{field}: "), (text, r.text)
    assert httpx.get(f"{server.url}/v1/ads/920001", headers=AUTH).status_code == 404
    headers = {**AUTH, "content-type": "application/json"}
    r = httpx.post(f"{server.url}/v1/retrieve", content=b'{"requests": "\xff"}', headers=headers)
    assert r.status_code == 400 and r.json()["detail"] == "body: not UTF-8 (byte 14)", r.text


def test_a_body_is_not_read_before_the_token_is_checked(server):
    """A caller without the token is answered 401 before its body is read: it cannot make the
    server hold bodies. Each call declares 16 MB and sends 16 KiB of it; a server that read the
    body first would still be waiting when the socket times out."""
    declared = (16 << 20) - 1
    for method, path, authorization in [
        ("PUT", "/v1/ads", ""),
        ("PATCH", "/v1/ads/1", "Authorization: Bearer wrong\n"),
        ("PUT", "/v1/ads", f"Authorization: Bearer {READ}\n"),  # the read token cannot write
        ("POST", "/v1/retrieve", ""),
    ]:
        head = (
            f"{method} {path} HTTP/1.1\nHost: test\n{authorization}"
            f"Content-Type: application/json\nContent-Length: {declared}\n"
        )
        answer = raw_http(server, head, b" " * (16 << 10))
        assert answer.startswith(b"HTTP/1.1 401 "), (method, path, answer[:200])
        assert b"www-authenticate: bearer" in answer.lower()


def test_a_stalled_body_is_a_408(server):
    """A body that stops arriving is refused after the body timeout (0.5 s here), not held."""
    head = (
        f"POST /v1/retrieve HTTP/1.1\nHost: test\nAuthorization: Bearer {ADMIN}\n"
        "Content-Type: application/json\nContent-Length: 999\n"
    )
    answer = raw_http(server, head, b'{"requests": [{')  # 15 of the 999 bytes
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"0.5 s" in answer


def test_patch_null_semantics(server):
    url = f"{server.url}/v1/ads/920101"
    ad = new_ad(920_101, "nulls", target_countries=["US"], target_age_min=20, target_age_max=40,
                schedule_start=100, schedule_end=2**40, target_platforms=["ios"])  # fmt: skip
    assert httpx.put(f"{server.url}/v1/ads", json={"ads": [ad]}, headers=AUTH).status_code == 200
    assert httpx.patch(url, json={"status": "paused"}, headers=AUTH).status_code == 200
    # status has no "open" value: null is refused, and the ad stays paused.
    r = httpx.patch(url, json={"status": None}, headers=AUTH)
    assert r.status_code == 422 and r.json()["detail"].startswith("status: null"), r.text
    assert httpx.get(url, headers=AUTH).json()["attributes"]["status"] == "paused"
    # Null opens a bound and empties a list (no restriction); what is left out is kept.
    nulls = {"schedule_end": None, "target_age_max": None, "target_countries": None, "tags": None}
    assert httpx.patch(url, json=nulls, headers=AUTH).status_code == 200
    got = httpx.get(url, headers=AUTH).json()["attributes"]
    assert got["schedule_end"] is None and got["target_age_max"] is None
    assert got["target_countries"] == [] and got["tags"] == []
    assert got["schedule_start"] == 100 and got["target_age_min"] == 20
    assert got["target_platforms"] == ["ios"] and got["status"] == "paused"
    # An upsert reads null the same way.
    r = httpx.put(f"{server.url}/v1/ads", json={"ads": [{**ad, "tags": None}]}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert httpx.get(url, headers=AUTH).json()["attributes"]["tags"] == []


def test_strict_inputs(server):
    def retrieve(**over):
        body = {"requests": [{**OK, **over}]}
        return httpx.post(f"{server.url}/v1/retrieve", json=body, headers=AUTH)

    def upsert(**over):
        body = {"ads": [{**new_ad(920_201, "strict"), **over}]}
        return httpx.put(f"{server.url}/v1/ads", json=body, headers=AUTH)

    def refused(r, field):
        assert r.status_code == 422, (field, r.status_code, r.text)
        assert r.json()["detail"].startswith(field), (field, r.text)

    for k in ["10", True, 10.0]:  # no coercion
        refused(retrieve(k=k), "requests[0].k")
    refused(retrieve(user_id="1"), "requests[0].user_id")
    refused(retrieve(filter={}), "requests[0].filter")  # not "no filter": that is null
    refused(retrieve(exclude_ads=[-1]), "requests[0].exclude_ads[0]")
    assert retrieve(filter=None).status_code == 200
    refused(upsert(ad_id="920201"), "ads[0].ad_id")
    refused(upsert(ad_id=-5), "ads[0].ad_id")
    refused(upsert(topic=True), "ads[0].topic")
    refused(upsert(target_age_min=60, target_age_max=20), "ads[0]: target_age_min 60 is above")
    refused(upsert(schedule_start=2000, schedule_end=1000), "ads[0]: schedule_start 2000")
    refused(upsert(schedule_start=1000, schedule_end=1000), "ads[0]: schedule_start 1000")
    assert upsert(quality=1, target_age_max=20).status_code == 200  # a number may be integral
    # PATCH checks the changed end of a range against the ad's stored other end.
    r = httpx.patch(f"{server.url}/v1/ads/920201", json={"target_age_min": 60}, headers=AUTH)
    refused(r, "target_age_min 60 is above the ad's target_age_max 20")
    r = httpx.patch(f"{server.url}/v1/ads/920201", json={"schedule_end": 5}, headers=AUTH)
    assert r.status_code == 200, r.text
    # An ad id in a path is a plain decimal, as written.
    for raw in ["1.0", "%201", "1_000", "007", "-1", "+1", "1e3", "%EF%BC%91"]:  # last: fullwidth 1
        r = httpx.get(f"{server.url}/v1/ads/{raw}", headers=AUTH)
        refused(r, "ad_id: expected a plain decimal integer")
    for raw in ["1", "%31"]:  # %31 is "1", percent-encoded
        assert httpx.get(f"{server.url}/v1/ads/{raw}", headers=AUTH).json()["ad_id"] == 1
    r = httpx.get(f"{server.url}/v1/ads/{2**63}", headers=AUTH)
    refused(r, "ad_id: Input should be less than or equal to")


def test_errors_are_in_the_openapi_schema(server):
    spec = httpx.get(f"{server.url}/openapi.json").json()
    documented = {
        ("post", "/v1/retrieve"): {400, 401, 408, 409, 413, 422, 429, 503, 504},
        ("get", "/v1/ads/{ad_id}"): {401, 404, 422, 503},
        ("put", "/v1/ads"): {400, 401, 403, 408, 413, 422, 503},
        ("patch", "/v1/ads/{ad_id}"): {400, 401, 403, 404, 408, 413, 422, 503},
        ("delete", "/v1/ads/{ad_id}"): {401, 403, 404, 422, 503},
        ("post", "/v1/admin/snapshot"): {401, 403, 422, 503},
        ("get", "/health/ready"): {503},
    }
    error = {"$ref": "#/components/schemas/Error"}
    for (method, path), codes in documented.items():
        responses = spec["paths"][path][method]["responses"]
        assert {int(c) for c in responses if c != "200"} == codes, (method, path, responses)
        for code in codes:
            assert responses[str(code)]["content"]["application/json"]["schema"] == error
    assert spec["components"]["schemas"]["Error"]["required"] == ["detail"]
    assert "HTTPValidationError" not in spec["components"]["schemas"]  # one error shape
    # The answers have that shape: a validation error's detail is a message, not a list.
    for r in [
        httpx.post(f"{server.url}/v1/retrieve", json={"requests": [{**OK, "k": 0}]}, headers=AUTH),
        httpx.get(f"{server.url}/v1/ads/1", headers={"Authorization": "Bearer wrong"}),
        httpx.get(f"{server.url}/v1/ads/999999999", headers=AUTH),
    ]:
        assert r.status_code in (401, 404, 422) and list(r.json()) == ["detail"], r.text
        assert isinstance(r.json()["detail"], str)
    # A method the path does not have: 405, and Allow names every method the path has.
    r = httpx.request("POST", f"{server.url}/v1/ads/1", headers=AUTH)
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET, HEAD, PATCH", r.headers


def test_the_admin_token_reads_too(server):
    get, retrieve = f"{server.url}/v1/ads/1", f"{server.url}/v1/retrieve"
    body = {"requests": [OK]}
    for token in (ADMIN, READ):
        headers = {"Authorization": f"Bearer {token}"}
        assert httpx.get(get, headers=headers).status_code == 200
        assert httpx.post(retrieve, json=body, headers=headers).status_code == 200
    assert httpx.get(get).status_code == 401
    r = httpx.put(f"{server.url}/v1/ads", json={"ads": [new_ad(920_301, "r")]},
                  headers={"Authorization": f"Bearer {READ}"})  # fmt: skip
    assert r.status_code == 401


def test_a_trailing_slash_is_a_404_not_a_redirect(server):
    headers = {**AUTH, "Host": "evil.example"}
    r = httpx.get(f"{server.url}/v1/ads/1/", headers=headers, follow_redirects=False)
    assert r.status_code == 404 and "location" not in r.headers, (r.status_code, r.headers)
    r = httpx.post(f"{server.url}/v1/retrieve/", json={"requests": [OK]}, headers=headers)
    assert r.status_code == 404 and "location" not in r.headers


def counted(server, labels: str) -> float:
    """The server's count of calls with `labels` (m31_http_requests_total), 0 before the first."""
    text = httpx.get(f"{server.url}/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("m31_http_requests_total{") and labels in line
    )


def test_a_client_leaving_mid_body_logs_no_error(server):
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep(logging.ERROR)
    loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "m31", "")]
    for logger in loggers:
        logger.addHandler(keep)
    try:
        port = int(server.url.rsplit(":", 1)[1])
        for method, path in [("POST", "/v1/retrieve"), ("PUT", "/v1/ads")]:
            left = f'route="{path}",status="disconnected"'
            before = counted(server, left)
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(
                    f"{method} {path} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {ADMIN}"
                    "\r\nContent-Type: application/json\r\nContent-Length: 999\r\n\r\n{".encode()
                )
            # The call is over (counted) once the server has seen the client leave.
            gone = lambda left=left, before=before: counted(server, left) > before  # noqa: E731
            until(gone, f"{path}: the client's leaving")
        assert httpx.get(f"{server.url}/health/live").status_code == 200
    finally:
        for logger in loggers:
            logger.removeHandler(keep)
    assert not records, [r.getMessage() for r in records]
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'route="/v1/retrieve",status="disconnected"' in metrics


def test_ready_means_the_text_encoder_is_loaded(world):
    """`m31 serve` in a fresh process: once /health/ready answers 200, the sentence encoder of
    new ads is loaded, so the first upsert does not load it (seconds to a minute)."""
    server = ProcessServer(world, fresh_state(world, "ready")).start()
    try:
        ready = httpx.get(f"{server.url}/health/ready").json()
        assert ready["status"] == "ready" and ready["text_encoder"] == "loaded", ready
    finally:
        server.stop()
