"""The HTTP service on real servers on loopback: answers, batching, auth, bad input, overload,
ad management with versions, and durability across SIGKILL. The API tests run on each backend
(`launch`): uvicorn in a thread, and Ray Serve over a 3-shard cluster (`m31 serve --ray`),
where a shard that stops answering gives partial answers naming it."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import replace

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from serve_helpers import (
    ADMIN,
    READ,
    ProcessServer,
    RayServer,
    ThreadServer,
    World,
    fresh_state,
    new_ad,
    start_cluster,
    stop_cluster,
    until,
)

from m31.bench.loadtest import _metric
from m31.client import Client, ServiceError
from m31.engine import AdRequest
from m31.serve.app import ServeConfig, create_app
from m31.serve.local import LocalBackend
from m31.serve.schemas import MAX_EXPLAINED, MAX_WHY_NOT


@pytest.fixture(scope="module")
def world(served_world) -> World:
    return served_world


def config(world: World, state, **over) -> ServeConfig:
    """A server's config; its default deadline is generous, so that a busy machine does not
    turn a correctness test into a 504 (the tests of deadlines set their own)."""
    return ServeConfig(
        index=state, model=world.model, **{"admin_token": ADMIN, "timeout_ms": 60_000, **over}
    )


@pytest.fixture(scope="module", params=["thread", pytest.param("ray", marks=pytest.mark.ray)])
def launch(request, world):
    """How a test starts a server on a config. "thread": uvicorn in a thread of this process,
    loaded through its lifespan as `m31 serve` is. "ray": a Serve application on the run's Ray
    Serve (`m31 serve --ray`; skipped without Ray) over a 3-shard cluster made from the world's
    snapshot, in place of the config's serving folder; the module's Ray servers share that one
    cluster (its start costs seconds), so each test writes ads of its own. Module-scoped, so
    that pytest runs the tests a backend at a time."""
    if request.param == "thread":
        yield lambda cfg: ThreadServer(create_app(cfg, LocalBackend.load))
        return
    base = request.getfixturevalue("ray_serve")
    state, cluster = start_cluster(world.snapshot, world.root)
    yield lambda cfg: RayServer(base, replace(cfg, index=state), cluster)
    stop_cluster(cluster)


@pytest.fixture(scope="module")
def server(world, launch):
    """One server for the read-mostly tests."""
    with launch(config(world, fresh_state(world, "shared"), max_queue_delay_ms=5.0)) as s:
        yield s


def users_and_time(world: World, n: int, seed: int = 0):
    ids = pq.read_table(world.data / "users.parquet").column("user_id").to_numpy()
    meta = json.loads((world.data / "meta.json").read_text())
    rng = np.random.default_rng(seed)
    return [int(u) for u in rng.choice(ids, n)], int(meta["time_range"][1])


def test_an_explained_answer_is_the_engines_and_bounded(world, server):
    """`explain` and `why_not` over HTTP: the engine's explanation of the same request, on one
    server and merged from the shards' parts on a sharded one; too many explained requests in
    one call, too many ids, or ids that are not integers are 422s naming the field."""
    (user,), ts = users_and_time(world, 1, seed=5)
    request = {"user_id": user, "ts": ts, "surface": "feed", "platform": "ios", "k": 5}
    asked = {**request, "explain": True, "why_not": [*range(0, 60, 2), 10**12]}
    with Client(server.url) as c:
        got = c.retrieve([request, asked])
        plain, explained = got["results"]
        assert plain["explanation"] is None and explained["ad_ids"] == plain["ad_ids"]
        for bad, where in (
            ([asked] * (MAX_EXPLAINED + 1), "ask for an explanation"),
            ([{**request, "why_not": list(range(MAX_WHY_NOT + 1))}], "why_not"),
            ([{**request, "why_not": ["12"]}], "why_not"),
            ([{**request, "explain": "yes"}], "explain"),
        ):
            with pytest.raises(ServiceError, match=where) as e:
                c.retrieve(bad)
            assert e.value.status == 422
    svc = LocalBackend.load(config(world, fresh_state(world, "explain")))
    want = svc.retriever.retrieve(
        [AdRequest(user, ts, "feed", "ios", explain=True, why_not=tuple(asked["why_not"]))], k=5
    ).results[0]
    svc.store.close()
    e = explained["explanation"]
    assert e["eligible"] == want.explanation.eligible and e["experts"] == want.explanation.experts
    stages = [w["stage"] for w in e["why_not"]]
    assert stages == [w.stage for w in want.explanation.why_not] and "rank" in stages
    assert [w["rank"] for w in e["why_not"]] == [w.rank for w in want.explanation.why_not]
    assert e["why_not"][-1] == {"ad_id": 10**12, "stage": "unknown", "score": None,
                                "rank": None, "reason": want.explanation.why_not[-1].reason}  # fmt: skip
    for ad, w in zip(e["ads"], want.explanation.ads, strict=True):
        assert ad["ad_id"] == w.ad_id
        np.testing.assert_allclose(ad["contributions"], w.contributions, rtol=1e-5, atol=1e-6)


def test_results_equal_the_engine(world, server):
    users, ts = users_and_time(world, 6)
    requests = [
        {"user_id": u, "ts": ts, "surface": s, "platform": p, "k": k}
        for u, s, p, k in zip(
            users,
            ["feed", "reels", "stories", "search", "marketplace", "feed"],
            ["ios", "android", "web", "ios", "android", "web"],
            [10, 50, 1, 100, 7, 2000],
            strict=True,
        )
    ]
    requests[1]["filter"] = {"eq": ["format", "video"]}
    requests[2]["exclude_advertisers"] = [1, 2, 3]
    with Client(server.url) as c:
        got = c.retrieve(requests)
    svc = LocalBackend.load(config(world, fresh_state(world, "direct")))
    want = svc.retriever.retrieve(
        [
            AdRequest(
                r["user_id"],
                r["ts"],
                r["surface"],
                r["platform"],
                filter=r.get("filter"),
                exclude_advertisers=tuple(r.get("exclude_advertisers", ())),
            )
            for r in requests
        ],
        k=2000,
    )
    svc.store.close()
    assert got["index_version"] == want.version
    for r, a, b in zip(requests, got["results"], want.results, strict=True):
        assert a["ad_ids"] == b.ad_ids[: r["k"]].tolist()
        # The server may run the call in several device calls (slices, `m31.serve.batcher`),
        # whose batch sizes round the fp32 products in another order than one engine call.
        np.testing.assert_allclose(a["scores"], b.scores[: r["k"]], rtol=1e-5, atol=1e-6)
    assert set(got["timings_ms"]) >= {"encode", "mask", "score_topk", "total"}


def test_concurrent_requests_are_batched(world, server):
    users, ts = users_and_time(world, 48, seed=1)
    before = httpx.get(f"{server.url}/metrics").text

    def one(u):
        body = {
            "requests": [{"user_id": u, "ts": ts, "surface": "feed", "platform": "ios"}],
            "timeout_ms": 60_000,  # generous: a busy machine must not turn this into a 504
        }
        return httpx.post(f"{server.url}/v1/retrieve", json=body, timeout=120).json()

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(one, users))
    after = httpx.get(f"{server.url}/metrics").text
    calls = _metric(after, "m31_device_calls") - _metric(before, "m31_device_calls")
    assert all(len(a["results"][0]["ad_ids"]) == 100 for a in answers)
    assert 0 < calls < len(users), f"{calls} device calls for {len(users)} requests"
    assert max(a["batch_requests"] for a in answers) > 1
    assert _metric(after, "m31_batch_requests_count") >= calls
    assert _metric(after, "m31_index_ads") > 0 and "m31_queue_depth" in after


def nested(depth: int) -> dict:
    f = {"eq": ["status", "active"]}
    for _ in range(depth):
        f = {"not": f}
    return f


def test_bad_input_is_4xx(world, server):
    users, _ = users_and_time(world, 1)
    ok = {"user_id": users[0], "surface": "feed", "platform": "ios"}
    url = f"{server.url}/v1/retrieve"

    def post(body, **kw):
        return httpx.post(url, json=body, **kw) if "content" not in kw else httpx.post(url, **kw)

    cases = {
        "malformed JSON": post(None, content=b'{"requests": [', headers={"content-type": "application/json"}),
        "wrong type": post({"requests": [{**ok, "user_id": "seven"}]}),
        "unknown key": post({"requests": [{**ok, "colour": "red"}]}),
        "unknown filter field": post({"requests": [{**ok, "filter": {"eq": ["colour", "red"]}}]}),
        "bad filter shape": post({"requests": [{**ok, "filter": {"eq": 3}}]}),
        "k = 0": post({"requests": [{**ok, "k": 0}]}),
        "k too large": post({"requests": [{**ok, "k": 100_000}]}),
        "no requests": post({"requests": []}),
        "unknown user": post({"requests": [{**ok, "user_id": 10**9}]}),
        "both user kinds": post({"requests": [{**ok, "user": {"country": "US", "age": 3, "gender": "F"}}]}),
        "unknown country": post({"requests": [{"user": {"country": "XX", "age": 30, "gender": "F"}, "surface": "feed", "platform": "ios"}]}),
        "surface": post({"requests": [{**ok, "surface": "tv"}]}),
        "int64 overflow": post({"requests": [{**ok, "exclude_ads": [2**64]}]}),
        "deep filter": post({"requests": [{**ok, "filter": nested(900)}]}),
        "deep filter at the limit + 1": post({"requests": [{**ok, "filter": nested(33)}]}),
    }  # fmt: skip
    text = json.dumps({"requests": [{**ok, "filter": "HERE"}]})
    deep = b'{"not": ' * 5000 + b'{"eq": ["status", "active"]}' + b"}" * 5000
    deep = post(None, content=text.replace('"HERE"', deep.decode()).encode(),
                headers={"content-type": "application/json"})  # fmt: skip
    assert deep.status_code == 400, deep.text  # beyond the JSON parser's depth
    for what, r in cases.items():
        assert r.status_code == 422, (what, r.status_code, r.text)
        assert r.json()["detail"], what
    assert "colour" in cases["unknown filter field"].json()["detail"]
    assert "deeper than 32" in cases["deep filter"].json()["detail"]
    limit = post({"requests": [{**ok, "filter": nested(32)}]})
    assert limit.status_code == 200 and limit.json()["results"][0]["ad_ids"], limit.text
    big = {"requests": [ok], "pad": "x" * (17 << 20)}
    assert post(big).status_code == 413

    def chunks():  # no content-length: the limit is enforced while the body streams in
        yield b'{"requests": [], "pad": "'
        for _ in range(17):
            yield b"x" * (1 << 20)
        yield b'"}'

    r = post(None, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert post({"requests": [ok] * 1025}).status_code == 422  # more requests than one call takes
    assert 'status="413"' in httpx.get(f"{server.url}/metrics").text
    assert httpx.get(f"{server.url}/v1/ads/123456789").status_code == 404


def test_auth(world, server, launch):
    ad = new_ad(900_001, "auth")
    r = httpx.put(f"{server.url}/v1/ads", json={"ads": [ad]})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    bad = {"Authorization": "Bearer nope"}
    assert httpx.put(f"{server.url}/v1/ads", json={"ads": [ad]}, headers=bad).status_code == 401
    assert httpx.delete(f"{server.url}/v1/ads/1").status_code == 401
    assert httpx.patch(f"{server.url}/v1/ads/1", json={"status": "paused"}).status_code == 401
    assert httpx.post(f"{server.url}/v1/admin/snapshot").status_code == 401
    # A read token protects the read endpoints; health and metrics stay open.
    with launch(config(world, fresh_state(world, "auth"), read_token=READ)) as s:
        users, _ = users_and_time(world, 1)
        body = {"requests": [{"user_id": users[0], "surface": "feed", "platform": "ios"}]}
        assert httpx.post(f"{s.url}/v1/retrieve", json=body).status_code == 401
        with Client(s.url, token=READ) as c:
            assert len(c.retrieve(body["requests"])["results"]) == 1
        assert httpx.get(f"{s.url}/metrics").status_code == 200
    # Without an admin token ad management is off.
    with launch(config(world, fresh_state(world, "noadmin"), admin_token=None)) as s:
        r = httpx.put(f"{s.url}/v1/ads", json={"ads": [ad]}, headers={"Authorization": "Bearer x"})
        assert r.status_code == 403 and "disabled" in r.json()["detail"]


def test_overload_and_deadlines(world, launch):
    overload = config(world, fresh_state(world, "overload"), max_batch_size=1, max_queue=2)
    users, _ = users_and_time(world, 64, seed=2)
    with launch(overload) as s:

        def one(u):
            body = {
                "requests": [{"user_id": u, "surface": "feed", "platform": "ios", "k": 4000}],
                "timeout_ms": 60_000,  # generous: this part is about the bounded queue
            }
            return httpx.post(f"{s.url}/v1/retrieve", json=body, timeout=60)

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            codes = [r.status_code for r in pool.map(one, users)]
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
        text = httpx.get(f"{s.url}/metrics").text
        assert 'status="429"' in text
        # A deadline that cannot be met is answered at once (503 or 504), never a hang.
        body = {
            "requests": [{"user_id": users[0], "surface": "feed", "platform": "ios"}],
            "timeout_ms": 1,  # below the time of one batch
        }
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            post = lambda _: httpx.post(f"{s.url}/v1/retrieve", json=body, timeout=60)  # noqa: E731
            rs = list(pool.map(post, range(8)))
        assert {r.status_code for r in rs} & {503, 504}, [r.status_code for r in rs]


def tagged(client: Client, user: int, tag: str, k: int = 50, **kw) -> dict:
    req = {"user_id": user, "surface": "feed", "platform": "ios", "k": k,
           "filter": {"contains": ["tags", tag]}}  # fmt: skip
    return client.retrieve([req], **kw)


def test_ad_management_and_versions(world, server):
    users, _ = users_and_time(world, 1)
    with Client(server.url, admin_token=ADMIN) as c:
        v0 = c.retrieve([{"user_id": users[0], "surface": "feed", "platform": "ios"}])[
            "index_version"
        ]
        out = c.upsert([new_ad(800_000 + i, "mgmt") for i in range(3)])
        assert out["index_version"] > v0
        got = tagged(c, users[0], "mgmt", min_version=out["index_version"])
        assert sorted(got["results"][0]["ad_ids"]) == [800_000, 800_001, 800_002]
        assert got["index_version"] >= out["index_version"]
        assert c.get_ad(800_001)["attributes"]["tags"] == ["mgmt"]
        v = c.pause(800_001)["index_version"]
        assert 800_001 not in tagged(c, users[0], "mgmt", min_version=v)["results"][0]["ad_ids"]
        v = c.resume(800_001)["index_version"]
        assert 800_001 in tagged(c, users[0], "mgmt", min_version=v)["results"][0]["ad_ids"]
        v = c.delete(800_002)["index_version"]
        assert sorted(tagged(c, users[0], "mgmt", min_version=v)["results"][0]["ad_ids"]) == [
            800_000,
            800_001,
        ]
        with pytest.raises(ServiceError) as e:
            c.delete(800_002)
        assert e.value.status == 404
        with pytest.raises(ServiceError) as e:
            tagged(c, users[0], "mgmt", min_version=v + 1000)
        assert e.value.status == 409
        with pytest.raises(ServiceError) as e:
            c.upsert([new_ad(1, "x", topic=10**6)])
        assert e.value.status == 422 and "ads[0].topic" in str(e.value.detail)
        with pytest.raises(ServiceError) as e:  # duplicate ids in one batch: nothing applied
            c.upsert([new_ad(800_010, "dup"), new_ad(800_010, "dup")])
        assert e.value.status == 422
        assert tagged(c, users[0], "dup")["results"][0]["ad_ids"] == []
        with pytest.raises(ServiceError) as e:
            c.update(800_000)
        assert e.value.status == 422
        v = c.snapshot()["index_version"]
        assert tagged(c, users[0], "mgmt", min_version=v)["results"][0]["ad_ids"]


def test_concurrent_updates_and_queries_stay_consistent(world, launch):
    """Ad i is upserted at version v_i; a query answered at version V sees exactly the ads
    with v_i <= V, whatever the interleaving."""
    users, _ = users_and_time(world, 1)
    versions: dict[int, int] = {}
    done = threading.Event()
    seen: list[tuple[int, list[int], int]] = []
    with launch(config(world, fresh_state(world, "consistency"))) as s:

        def writer():
            with Client(s.url, admin_token=ADMIN) as c:
                for i in range(30):
                    versions[700_000 + i] = c.upsert([new_ad(700_000 + i, "cons")])["index_version"]
            done.set()

        def reader():
            last = 0
            with Client(s.url) as c:
                while not done.is_set():
                    floor = max(versions.values(), default=0)
                    out = tagged(c, users[0], "cons", k=100, min_version=floor)
                    assert out["index_version"] >= max(floor, last)
                    last = out["index_version"]
                    seen.append((out["index_version"], out["results"][0]["ad_ids"], floor))

        threads = [threading.Thread(target=writer)] + [
            threading.Thread(target=reader) for _ in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert len(seen) > 10
    for version, ids, _ in seen:
        assert sorted(ids) == sorted(a for a, v in versions.items() if v <= version)


@pytest.mark.parametrize("launch", [pytest.param("ray", marks=pytest.mark.ray)], indirect=True)
def test_partial_answers_name_the_missing_shards(world, server):
    """A shard that stops answering: a call waits for it until its deadline and answers 503
    naming it, or, with allow_partial, 200 with partial: true and the shard listed."""
    import ray

    from m31.cluster.layout import shard_of

    users, _ = users_and_time(world, 20)
    shards = len(server.cluster.shards)
    user = next(u for u in users if shard_of([u], shards)[0] != 2)  # its owner stays up
    body = {"requests": [{"user_id": user, "surface": "feed", "platform": "ios", "k": 20}]}
    whole = httpx.post(f"{server.url}/v1/retrieve", json=body, timeout=60).json()
    assert whole["partial"] is False and whole["missing_shards"] == []
    pid = ray.get(server.cluster.shards[2].pid.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        r = httpx.post(f"{server.url}/v1/retrieve", json={**body, "timeout_ms": 1500}, timeout=60)
        assert r.status_code == 503 and "shards [2]" in r.json()["detail"], r.text
        r = httpx.post(
            f"{server.url}/v1/retrieve",
            json={**body, "timeout_ms": 1500, "allow_partial": True},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["partial"] is True and got["missing_shards"] == [2]
        assert got["index_version"] == whole["index_version"]
    finally:
        os.kill(pid, signal.SIGKILL)  # Ray restarts it
    # Ray restarts the shard; until then a strict call is a 503 naming it (on a loaded machine
    # the restart can outlast one call's deadline), then the whole answer again.
    answers: list[httpx.Response] = []

    def whole_again() -> bool:
        answers.append(httpx.post(f"{server.url}/v1/retrieve", timeout=120,
                                  json={**body, "timeout_ms": 60_000}))  # fmt: skip
        assert answers[-1].status_code in (200, 503), answers[-1].text
        return answers[-1].status_code == 200

    until(whole_again, "the restarted shard answering", timeout=600)
    again = answers[-1].json()
    assert again["partial"] is False
    assert again["results"][0]["ad_ids"] == whole["results"][0]["ad_ids"]


def test_sigkill_loses_no_acknowledged_upsert(world):
    """Three rounds: upserts stream into `m31 serve`, which is SIGKILLed at a random moment;
    the server restarted on the same folder holds every acknowledged batch, the one in flight
    entirely or not at all, and takes the next round's stream."""
    state = fresh_state(world, "killed")
    acked: list[list[int]] = []
    rng = random.Random(0)
    server = ProcessServer(world, state).start()
    try:
        for round_ in range(3):
            stop = threading.Event()
            streaming = threading.Event()  # this round's first acknowledgements are in, or it ended
            inflight: list[list[int]] = []

            def stream(url=server.url, stop=stop, streaming=streaming, inflight=inflight,
                       round_=round_):  # fmt: skip
                # Generous: on a busy machine the first upsert (text encoder, caches) takes long.
                with Client(url, admin_token=ADMIN, timeout=300) as c:
                    try:
                        for n in range(10_000):
                            if stop.is_set():
                                return
                            ids = [600_000 + round_ * 100_000 + n * 10 + j for j in range(5)]
                            inflight[:] = [ids]
                            try:
                                c.upsert([new_ad(i, f"kill{round_}") for i in ids])
                            except (httpx.HTTPError, ServiceError):
                                return  # the server died under this call: not acknowledged
                            acked.append(ids)
                            if n == 2:
                                streaming.set()
                    finally:
                        streaming.set()

            t = threading.Thread(target=stream)
            t.start()
            assert streaming.wait(600), "no acknowledgement in 600 s"
            time.sleep(rng.random() * 0.5)  # then kill at a random moment of the stream
            server.kill()
            stop.set()
            t.join(30)
            assert acked, "no upsert was acknowledged before the kill"
            # Restart on the same folder: every acknowledged batch is there, the one in flight
            # entirely or not at all.
            server = ProcessServer(world, state).start()
            with Client(server.url) as c:
                for ids in acked:
                    for i in ids:
                        assert c.get_ad(i)["attributes"]["tags"], i
                for ids in inflight:
                    present = []
                    for i in ids:
                        try:
                            c.get_ad(i)
                            present.append(True)
                        except ServiceError:
                            present.append(False)
                    assert all(present) or not any(present), present
    finally:
        server.stop()


def test_cli_serve_query_and_loadtest(world, tmp_path):
    """`m31 serve` on a plain snapshot makes its serving folder; `m31 query` and
    `m31 loadtest` talk to it."""
    from typer.testing import CliRunner

    from m31.cli import app

    snapshot = tmp_path / "index"
    shutil.copytree(world.snapshot, snapshot)
    server = ProcessServer(world, snapshot).start()
    try:
        assert (tmp_path / "index.serving" / "wal.log").is_file()
        users, _ = users_and_time(world, 1)
        runner = CliRunner()
        out = runner.invoke(
            app, ["query", "--url", server.url, "--user-id", str(users[0]), "--k", "5"]
        )
        assert out.exit_code == 0, out.output
        assert "index version" in out.output and out.output.count("\n") >= 8
        bad = runner.invoke(app, ["query", "--url", server.url, "--user-id", "999999999"])
        assert bad.exit_code == 2 and "unknown user" in bad.output
        out = runner.invoke(
            app,
            ["query", "--url", server.url, "--user-id", str(users[0]), "--k", "3", "--explain",
             "--why-not", "0, 1,123456789"],
        )  # fmt: skip
        assert out.exit_code == 0, out.output
        assert "eligible after each stage: live" in out.output and "K-th score" in out.output
        assert "ad 123456789: unknown: ad 123456789 is not in the index" in out.output
        for bad_ids in ("1,x", "1,,2"):
            bad = runner.invoke(app, ["query", "--url", server.url, "--user-id", str(users[0]),
                                      "--why-not", bad_ids])  # fmt: skip
            assert bad.exit_code == 2 and "--why-not" in bad.output, bad.output
        rows = tmp_path / "load.json"
        out = runner.invoke(
            app,
            ["loadtest", "--url", server.url, "--data", str(world.data), "--concurrency", "1,4",
             "--duration", "1", "--out", str(rows)],
        )  # fmt: skip
        assert out.exit_code == 0, out.output
        got = json.loads(rows.read_text())
        assert [r["concurrency"] for r in got] == [1, 4]
        assert all(r["calls"] > 0 and r["errors"] == 0 and r["ads_scored_per_s"] > 0 for r in got)
        assert got[1]["requests_per_device_call"] >= 1
    finally:
        server.stop()


def test_new_ads_are_encoded_with_the_real_text_encoder(world):
    """The ad tower sees a new ad's text through the same sentence encoder as the catalogue."""
    from m31.engine.ad_encoder import AdEncoder, NewAd
    from m31.features.folder import features_for
    from m31.model import Catalog, load_checkpoint

    feats = features_for(world.data)
    model, _ = load_checkpoint(world.model, feats)
    rows = [3, 11]
    ads = pq.read_table(world.data / "ads.parquet").take(rows).to_pylist()
    new = [
        NewAd(a["ad_id"], a["advertiser_id"], a["objective"], a["format"], a["topic"],
              a["category"], a["text"], a["quality"])
        for a in ads
    ]  # fmt: skip
    assert feats.config.text_embeddings and np.abs(feats.text_emb[rows]).sum() > 0
    catalog = Catalog.from_features(feats).take(torch.tensor(rows))
    catalog.cooc_emb = torch.zeros_like(catalog.cooc_emb)
    with torch.no_grad():
        want = model.encode_ads(catalog)
    for a, b in zip(AdEncoder(model, feats).encode(new), want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
