"""What one call may cost the others, on a real uvicorn server on loopback: a filter too large to
serve is refused before any work and the event loop stays free meanwhile; deadlines count from
a call's arrival; a large call shares the device in slices with small calls and is admitted
after steady small traffic; bodies are UTF-8 with unique keys; a call's results are bounded;
HEAD answers as GET.

Nothing here depends on the machine's speed: the tests check what is answered while a heavy call
runs and how the heavy call is refused, not how long anything takes."""

from __future__ import annotations

import concurrent.futures
import json
import re
import socket
import threading

import httpx
import pyarrow.parquet as pq
import pytest
from serve_helpers import ThreadServer, World, fresh_state

from m31.index.filters import MAX_NODES
from m31.serve.app import ServeConfig, create_app
from m31.serve.local import LocalBackend
from m31.serve.schemas import MAX_REQUESTS, MAX_RESULTS

OK = {"user_id": 1, "surface": "feed", "platform": "ios", "k": 10}  # user 1 is stored
LONG = 60_000  # ms: the longest deadline, where a test is about something else


@pytest.fixture(scope="module")
def world(served_world) -> World:
    return served_world


@pytest.fixture(scope="module")
def server(world):
    # A slice of 1 ms: twice one request's time, so a large call is cut into a few requests a
    # batch here too, as on a CPU serving a real corpus.
    config = ServeConfig(
        index=fresh_state(world, "limits"),
        model=world.model,
        max_slice_ms=1.0,
        max_queue=4096,
    )
    with ThreadServer(create_app(config, LocalBackend.load)) as s:
        yield s


def stored_users(world: World) -> list[int]:
    return pq.read_table(world.data / "users.parquet").column("user_id").to_pylist()


def retrieve(server, requests: list[dict], **body) -> httpx.Response:
    """A retrieve call, by default with the longest deadline: a test about something else must
    not fail because a loaded machine answers one request in more than the default second."""
    body = {"requests": requests, "timeout_ms": LONG, **body}
    return httpx.post(f"{server.url}/v1/retrieve", json=body, timeout=600)


def ids(response: httpx.Response) -> list[list[int]]:
    assert response.status_code == 200, response.text
    return [r["ad_ids"] for r in response.json()["results"]]


def while_running(server, heavy, light) -> tuple[httpx.Response, list]:
    """`heavy()` in a thread; `light()` over and over until it is answered: (heavy's answer,
    the answers of `light` that came back while heavy ran)."""
    done = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(lambda: (heavy(), done.set())[0])
        during = []
        while not done.is_set():
            answer = light()
            if not done.is_set():
                during.append(answer)
        return future.result(), during


def test_a_filter_too_large_is_refused_before_any_work(world, server):
    # 400,000 clauses, 13 MB: compiled on the event loop and masked on the device before, it
    # held every other call for a minute; refused now, and the loop answers meanwhile.
    huge = {"any": [{"eq": ["advertiser_id", i]} for i in range(400_000)]}
    body = json.dumps({"requests": [{**OK, "filter": huge}]}).encode()
    assert len(body) > 12 << 20

    def heavy():
        return httpx.post(
            f"{server.url}/v1/retrieve",
            content=body,
            headers={"content-type": "application/json"},
            timeout=600,
        )

    refused, during = while_running(
        server, heavy, lambda: httpx.get(f"{server.url}/health/live", timeout=600)
    )
    assert refused.status_code == 422, refused.text
    assert f"requests[0].filter: filter: more than {MAX_NODES} objects" in refused.text
    assert all(r.status_code == 200 for r in during)
    assert retrieve(server, [OK]).status_code == 200  # nothing left running

    # The same advertisers as one `in` list are served, and so are 999 `eq` clauses, which cost
    # one predicate: both answer what the short list of advertisers that exist answers.
    advertisers = pq.read_table(world.data / "ads.parquet").column("advertiser_id").to_pylist()
    few = sorted(set(advertisers))[:3]
    expected = ids(retrieve(server, [{**OK, "filter": {"in": ["advertiser_id", few]}}]))
    assert expected[0]
    wanted = few + list(range(10**9, 10**9 + 99_000))  # ids no ad has
    as_in = {"in": ["advertiser_id", wanted]}
    assert ids(retrieve(server, [{**OK, "filter": as_in}])) == expected
    as_any = {"any": [{"eq": ["advertiser_id", a]} for a in wanted[: MAX_NODES - 1]]}
    assert ids(retrieve(server, [{**OK, "filter": as_any}])) == expected
    # 10,000 blocked advertisers are one predicate too.
    blocked = retrieve(server, [{**OK, "exclude_advertisers": list(range(10_000))}])
    assert blocked.status_code == 200 and blocked.json()["results"][0]["ad_ids"] == []


def test_the_deadline_counts_from_arrival(server):
    # The body arrives in two pieces; the second comes after the deadline has passed (the pause
    # makes the condition, it does not wait for one): 504, before any work.
    body = json.dumps({"requests": [OK], "timeout_ms": 50}).encode()
    port = int(server.url.rsplit(":", 1)[1])
    head = (
        f"POST /v1/retrieve HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=600) as sock:
        sock.sendall(head + body[:10])
        threading.Event().wait(0.3)
        sock.sendall(body[10:])
        answer = b""
        while piece := sock.recv(65536):
            answer += piece
    assert answer.startswith(b"HTTP/1.1 504"), answer
    assert b"deadline passed (50 ms from arrival)" in answer


def test_small_calls_are_answered_while_a_large_call_runs(world, server):
    """Small calls sent while a 1,024-request call runs are answered before it is: the large
    call is cut into slices and the small ones run between them. How many requests of the large
    call share a batch with a small one depends on the machine's speed (the slice is device
    time), so that is `tests/test_batcher.py`'s, on a clock of its own."""
    users = stored_users(world)
    n, during = MAX_REQUESTS, []
    for _ in range(20):  # a machine fast enough to finish the large call first gets retries
        big = [{**OK, "user_id": users[i % len(users)]} for i in range(n)]
        answer, more = while_running(
            server,
            lambda big=big: retrieve(server, big),
            lambda: retrieve(server, [OK]),
        )
        if answer.status_code == 503 and "more than the deadline" in answer.text and n > 2:
            # A loaded machine: the server expects the call to outlast the longest deadline
            # (seen at 128 requests beside two CPU-bound jobs). Smaller, it still runs longer
            # than a small call on such a machine.
            n //= 2
            continue
        assert answer.status_code == 200, answer.text
        assert len(ids(answer)) == n
        during += more
        if len(during) >= 5:
            break
    assert len(during) >= 5
    assert all(r.status_code == 200 for r in during), [r.text for r in during]
    assert all(len(ids(r)[0]) == OK["k"] for r in during)


def test_a_large_call_is_admitted_after_steady_small_traffic(world, server):
    users = stored_users(world)
    for u in users[:100]:
        assert retrieve(server, [{**OK, "user_id": u}]).status_code == 200
    batcher = server.server.config.app.state.batcher
    # Charged per request, as before, 1,024 requests would take 1,024 times one: a deadline
    # below that was refused at once (503), though batches make the call far cheaper. The
    # server's own estimate of the batched call, with room, is the deadline here: on an idle
    # machine it is a fraction of the per-request charge, on a busy one (where one request's
    # cost is most of a batch's) it may not be, and only the admission is this test's.
    batched = batcher.expected_seconds(MAX_REQUESTS)[0]
    deadline_ms = max(1, int(1.5 * 1000 * batched))
    big = [{**OK, "user_id": users[i % len(users)]} for i in range(MAX_REQUESTS)]
    answer = retrieve(server, big, timeout_ms=min(deadline_ms, LONG))
    if deadline_ms > LONG:  # a machine so loaded that the batched call outlasts any deadline
        assert answer.status_code in (200, 503, 504), answer.text
        assert answer.status_code != 503 or "more than the deadline" in answer.text
        return
    # Admitted; a machine that slows down meanwhile may still miss the deadline (504).
    assert answer.status_code in (200, 504), answer.text


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ('{"requests": [{}]}'.encode("utf-16"), 400, "body: not UTF-8"),
        ('{"requests": [{}]}'.encode("utf-16-le"), 400, "a NUL byte at 1; UTF-16 or UTF-32?"),
        ('{"requests": [{}]}'.encode("utf-32"), 400, "body: not UTF-8"),
        (b'{"requests": [], "requests": [{}]}', 422, "an object has the key 'requests' twice"),
        (
            json.dumps(
                {"requests": [{**OK, "filter": {"range": ["advertiser_id", 2, 1]}}]}
            ).encode(),
            422,
            "requests[0].filter: filter.range: lo 2 is above hi 1",
        ),
        (
            json.dumps({"requests": [{**OK, "k": 257}] * MAX_REQUESTS}).encode(),
            422,
            f"asks for {257 * MAX_REQUESTS} results in all (the sum of its requests' k), "
            f"more than {MAX_RESULTS}",
        ),
    ],
)
def test_bodies_are_utf8_with_unique_keys_and_bounded_results(server, body, status, message):
    r = httpx.post(
        f"{server.url}/v1/retrieve", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    assert message in r.json()["detail"]


def test_the_largest_answer_allowed(server):
    answer = retrieve(server, [{**OK, "k": 4096}] * (MAX_RESULTS // 4096), timeout_ms=LONG)
    assert len(ids(answer)) == MAX_RESULTS // 4096


def test_unknown_ads_in_an_inline_history_are_skipped(server):
    user = {"country": "US", "age": 30, "gender": "F"}
    known = retrieve(server, [{**OK, "user_id": None, "user": user}])
    history = [{"ad_id": 10**15, "ts": 1, "surface": "feed"}]
    unknown = retrieve(server, [{**OK, "user_id": None, "user": {**user, "history": history}}])
    assert ids(unknown) == ids(known)


def test_head_answers_as_get_without_a_body(server):
    for path in ("/health/live", "/health/ready", "/metrics", "/v1/ads/1", "/v1/ads/999999999"):
        get, head = httpx.get(server.url + path), httpx.head(server.url + path)
        assert head.status_code == get.status_code and head.content == b"", path
        assert head.headers["content-type"] == get.headers["content-type"]
    r = httpx.head(f"{server.url}/v1/retrieve")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    allow = httpx.post(f"{server.url}/health/live").headers["allow"]
    assert re.fullmatch(r"GET, HEAD", allow), allow
