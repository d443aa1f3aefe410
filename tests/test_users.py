"""Live users: the user store against a plain reference, its log (replay, snapshots, retries,
SIGKILL), frequency caps against a plain reference, and the routes on the real server."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import threading
import time

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from serve_helpers import ADMIN, ProcessServer, ThreadServer, World, fresh_state

from m31.client import Client, ServiceError
from m31.engine import AdRequest, InlineUser
from m31.engine.load import load_engine
from m31.engine.requests import Engagement, FrequencyCap, StoredUser
from m31.index import AdIndex
from m31.index import RequestContext as AdRequestContext
from m31.serve.app import ServeConfig, create_app
from m31.serve.local import LocalBackend
from m31.users import UserStore, Vocab
from m31.users.idempotency import KeyReused

VOCAB = Vocab(("feed", "reels"), ("DE", "US"), ("f", "m"), (0, 1), 8)
HEADERS = {"Authorization": f"Bearer {ADMIN}"}


def reference_history(log: list[tuple[int, int, int, int]], user: int, ts: int, L: int):
    """What the store must hold of `user` before `ts`: of all its events (user, ad, ts,
    surface) in time order (ties: arrival), the last L, then those strictly before ts."""
    mine = [(t, i, a, s) for i, (u, a, t, s) in enumerate(log) if u == user]
    held = sorted(mine)[-L:]
    return [(a, t, s) for t, _, a, s in held if t < ts]


events_st = st.lists(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 30), st.integers(0, 40), st.integers(0, 2)),
        min_size=1,
        max_size=12,
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(batches=events_st, L=st.integers(1, 6), ts=st.integers(0, 45))
def test_the_store_keeps_what_the_reference_does(batches, L, ts):
    store = UserStore(L, VOCAB, capacity=2)  # small: the store grows while events come
    log = []
    for version, batch in enumerate(batches, 1):
        u, a, t, s = (list(c) for c in zip(*batch, strict=True))
        surfaces = [VOCAB.surfaces[x] if x < 2 else None for x in s]
        store.add(store.check(u, a, t, surfaces), version)
        log += batch
    users = sorted({e[0] for e in log})
    rows = store.rows_of(users)
    _, ads, surface, when = store.history(rows, np.full(len(rows), ts))
    for r, user in enumerate(users):
        want = reference_history(log, user, ts, L)
        got = [
            (int(x), int(t), int(sf))
            for x, t, sf in zip(ads[r], when[r], surface[r], strict=True)
            if x >= 0
        ]
        assert got == want
        # Padding on the left, most recent last.
        assert (ads[r][: L - len(want)] == -1).all()
    # A frequency window counts exactly the held events in [ts - w, ts).
    held_users = [StoredUser({}, {}, ads[r], surface[r], when[r], None) for r in range(len(rows))]
    for w in (1, 10, 100):
        got = [u.engaged(ts, w) for u in held_users]
        for (ids, counts), user in zip(got, users, strict=True):
            held = [a for a, t, _ in reference_history(log, user, ts, L) if t >= ts - w]
            want = dict(zip(*np.unique(held, return_counts=True), strict=True)) if held else {}
            assert dict(zip(ids.tolist(), counts.tolist(), strict=True)) == want


def test_the_store_refuses_and_restores(tmp_path):
    store = UserStore(3, VOCAB)
    with pytest.raises(
        ValueError, match=r"events\[1\]\.surface: 'watch' is not one of feed, reels"
    ):
        store.check([1, 2], [1, 1], [5, 6], ["feed", "watch"])
    with pytest.raises(ValueError, match="give at least one event"):
        store.check([], [], [], [])
    store.add(store.check([7, 7, 8], [1, 2, 3], [10, 11, 12], ["reels", None, "feed"]), 4, "k")
    store.set_attributes(9, {"country": 1, "age": 30})
    assert store.targeting(store.rows_of([9])[0]) == {"country": "US", "age": 30, "gender": None}
    store.save(tmp_path / "u")
    back = UserStore(3, VOCAB)
    back.restore(tmp_path / "u")
    rows = np.array([0, 1, 2])
    for a, b in zip(
        store.history(rows, np.full(3, 99)), back.history(rows, np.full(3, 99)), strict=True
    ):
        if isinstance(a, dict):
            assert all((a[k] == b[k]).all() for k in a)
        else:
            np.testing.assert_array_equal(a, b)
    assert back.version_of("k") == 4 and len(back) == 3
    with pytest.raises(ValueError, match="L = 3, this store keeps 5"):
        UserStore(5, VOCAB).restore(tmp_path / "u")


def state_of(store: UserStore, user: int) -> dict[str, list]:
    """One user's state in `store` (`dump`), as lists."""
    return {k: v.tolist() for k, v in store.dump(lambda ids: ids == user).items()}


def test_users_move_between_stores_exactly():
    """`dump` / `put` / `owned`: a store made of another's users holds exactly their state;
    users not moved stay as they were; a store of another L refuses them."""
    rng = np.random.default_rng(3)
    source = UserStore(4, VOCAB, capacity=2)
    for version in range(1, 6):
        n = int(rng.integers(1, 30))
        users = rng.integers(0, 40, n)
        source.add(source.check(users, rng.integers(0, 99, n), rng.integers(0, 50, n),
                                [VOCAB.surfaces[i] for i in rng.integers(0, 2, n)]), version)  # fmt: skip
    source.set_attributes(8, {"country": 1, "age": 44})
    part = source.owned(lambda ids: ids % 2 == 0)
    held = [u for u in range(40) if u in source]
    assert sorted(part.dump()["ids"].tolist()) == [u for u in held if u % 2 == 0]
    other = UserStore(4, VOCAB)
    other.add(other.check([1, 2, 99], [5, 5, 5], [1, 1, 1], ["feed"] * 3), 1)
    before = state_of(other, 1)
    other.put(part.dump())
    for u in held:
        if u % 2 == 0:
            assert state_of(other, u) == state_of(source, u), u
    assert state_of(other, 1) == before and 99 in other
    assert other.targeting(other.rows_of([8])[0]) == {"country": "US", "age": 44, "gender": None}
    with pytest.raises(ValueError, match="L = 4, this store keeps 5"):
        UserStore(5, VOCAB).put(part.dump())


def test_online_users_are_the_seeded_store(world):
    """What a shard seeds from a cluster state's online features (reading only the users and
    engagements) is the store a server seeds from the loaded features, in part or whole."""
    from m31.engine.load import online_users
    from m31.engine.user_inputs import seed_users
    from m31.features import Features

    feats = Features.load(world.snapshot / "online")
    want = seed_users(feats, int(feats.meta["max_len"])).dump()
    for keep in (None, lambda ids: ids % 3 == 1):
        got = online_users(world.snapshot, keep).dump()
        rows = np.arange(len(want["ids"])) if keep is None else np.flatnonzero(keep(want["ids"]))
        assert len(rows) and set(got) == set(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name][rows], err_msg=name)


def test_organic_events_by_user_id_are_the_features(world, tmp_path):
    """A user's organic events read by id (`OrganicEvents`, what a server and a shard hold) are
    the features' (`Features.organic_history`, by row) at any time, in part or whole; a user
    the features do not hold reads as padding. The features loaded without their users keep
    every country's default cohort."""
    from m31.engine.load import online_organic
    from m31.engine.user_inputs import organic_of
    from m31.features import Features

    feats = Features.load(world.snapshot / "online")
    rng = np.random.default_rng(0)
    rows = rng.integers(0, feats.n_users, 300)
    ts = np.quantile(feats.organic.ts, rng.random(300)).astype(np.int64)
    want = feats.organic_history(rows, ts)[0]
    assert (want >= 0).any() and (want < 0).any()
    ids = feats.users["user_id"][rows]
    for keep in (None, lambda u: u % 3 == 1):
        for events in (organic_of(feats), online_organic(world.snapshot)):
            part = events if keep is None else events.owned(keep)
            got = part.before(np.append(ids, 10**12), np.append(ts, ts[0]))
            held = np.ones(len(ids), bool) if keep is None else keep(ids)
            np.testing.assert_array_equal(got[:-1][held], want[held])
            assert (got[:-1][~held] == -1).all() and (got[-1] == -1).all()
    older = tmp_path / "online"  # online features written before they kept the cohorts
    shutil.copytree(world.snapshot / "online", older)
    meta = json.loads((older / "meta.json").read_text())
    del meta["country_cohort"]
    (older / "meta.json").write_text(json.dumps(meta))
    for folder in (world.snapshot / "online", older):
        bare = Features.load(folder, users=False)
        assert bare.n_users == 0 and not len(bare.organic.ts) and not len(bare.engagements.ts)
        assert bare.common_cohorts() == feats.common_cohorts()
    assert len(set(feats.common_cohorts().values())) > 1  # the countries' defaults differ


def test_bytes_per_user_at_L_50():
    rng = np.random.default_rng(0)
    n = 20_000
    store = UserStore(50, VOCAB, capacity=n)
    users = rng.integers(0, n, 200_000)
    store.add(store.check(users, rng.integers(0, 1000, len(users)), rng.integers(0, 10**6, len(users)),
                          ["feed"] * len(users)), 1)  # fmt: skip
    per_user = store.nbytes_per_user()
    # 50 x 18 B of engagements, 24 of attributes and count, the id's map entry
    assert 900 < per_user < 1200, per_user


# ---------------------------------------------------------------- the log: replay, snapshots


@pytest.fixture(scope="module")
def world(served_world) -> World:
    return served_world


def opened(world: World, state):
    """The serving folder `state` opened as a server opens it (seeded user store)."""
    return load_engine(state, world.model)


def test_events_survive_reopen_and_snapshot_and_retries_apply_once(world):
    state = fresh_state(world, "replay")
    engine = opened(world, state)
    user = int(engine.retriever.users._ids[0])
    call = ([user, 10**9], [5, 6], [100, 101], ["feed", None])
    v1 = engine.store.add_events(*call, key="a")
    assert engine.store.add_events(*call, key="a") == v1
    v2 = engine.store.add_events([user], [7], [102], ["reels"])
    engine.store.set_users([(10**9, {"country": 0, "age": 40})])
    before = engine.retriever.users.history(
        engine.retriever.users.rows_of([user, 10**9]), np.full(2, 10**6)
    )
    engine.close()
    for step in ("replay", "snapshot"):
        engine = opened(world, state)
        users = engine.retriever.users
        after = users.history(users.rows_of([user, 10**9]), np.full(2, 10**6))
        for a, b in zip(before[1:], after[1:], strict=True):
            np.testing.assert_array_equal(a, b)
        assert users.version_of("a") == v1 and engine.store.version >= v2
        assert users.targeting(users.rows_of([10**9])[0])["age"] == 40
        # The retry after a restart is still applied once, and another call under its key is
        # still refused, with nothing applied: the key's digest is logged and snapshotted.
        assert engine.store.add_events(*call, key="a") == v1
        version = engine.store.version
        with pytest.raises(KeyReused, match=r"idempotency_key: 'a' was used at version \d+ for"):
            engine.store.add_events([user], [5], [100], ["feed"], key="a")
        assert engine.store.version == version
        if step == "replay":
            engine.store.snapshot()
        engine.close()


def _stream_events(state: str, model: str, cycle: int, conn) -> None:
    """A child process: open the serving folder as a server does and add batches of events
    until killed, telling the parent each acknowledged batch's number."""
    engine = load_engine(state, model)
    for n in range(10**6):
        engine.store.add_events(*batch(cycle, n), ["feed"] * 10)
        conn.send(n)  # acknowledged


def batch(cycle: int, n: int) -> tuple[list[int], list[int], list[int]]:
    """(users, ad ids, times) of batch n of a kill cycle: ten users of their own (so that no
    event of theirs rolls off the store's last L, whatever the number of batches), one ad id
    and time per batch."""
    users = [10_000 + cycle * 1_000_000 + n * 10 + j for j in range(10)]
    return users, [cycle * 10_000 + n] * 10, [cycle * 10_000 + n] * 10


# SIGKILL cycles per run: `make test` runs 10; M31_KILL_CYCLES=30 (or more) for a longer soak.
KILL_CYCLES = int(os.environ.get("M31_KILL_CYCLES", "10"))


def test_sigkill_cycles_lose_no_acknowledged_event(world):
    """SIGKILLs at random moments of a stream of events (`KILL_CYCLES`): after each, reopening
    the folder holds every acknowledged batch, and the one in flight entirely or not at all."""
    state = fresh_state(world, "killed")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["m31.engine.load"])  # a cycle forks, not imports
    rng = np.random.default_rng(0)
    for cycle in range(KILL_CYCLES):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_stream_events, args=(str(state), str(world.model), cycle, child))
        proc.start()
        child.close()
        # Wait for acknowledgements, not for time: a random number of them, then kill.
        acked = [parent.recv() for _ in range(int(rng.integers(1, 12)))]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        while parent.poll():
            try:
                acked.append(parent.recv())
            except EOFError:
                break
        parent.close()
        engine = opened(world, state)
        store = engine.retriever.users

        def holds(n: int, cycle=cycle, store=store) -> list[bool]:
            users, ads, _ = batch(cycle, n)
            _, held, _, _ = store.history(store.rows_of(users), np.full(10, 10**9))
            return [ads[0] in row for row in held.tolist()]

        for n in acked:
            assert all(holds(n)), (cycle, n)
        assert len(set(holds(max(acked) + 1))) == 1  # the batch in flight: all or nothing
        engine.close()


# ---------------------------------------------------------------- frequency caps


@pytest.fixture(scope="module")
def capped(world):
    """A retriever over the world's snapshot with a store of its users (L = 50)."""
    engine = opened(world, fresh_state(world, "caps"))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def groups(world) -> dict[str, dict[int, int]]:
    """Each ad's campaign and advertiser as the dataset's ads file gives them (every ad's own
    id as its "ad" group): the reference's groups, read apart from the index."""
    ads = pq.read_table(world.data / "ads.parquet").to_pydict()
    out = {"ad": {a: a for a in ads["ad_id"]}}
    for per in ("campaign", "advertiser"):
        out[per] = dict(zip(ads["ad_id"], ads[f"{per}_id"], strict=True))
    return out


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    per=st.sampled_from(["ad", "campaign", "advertiser"]),
    cap=st.integers(1, 3),
    window=st.sampled_from([50, 500, 10**6]),
)
def test_frequency_caps_equal_the_reference(capped, groups, seed, per, cap, window):
    retriever = capped.retriever
    index: AdIndex = retriever.index
    rng = np.random.default_rng(seed)
    ads = rng.choice(index.ids().numpy(), 8, replace=False)
    stored = retriever.feats.users["user_id"]
    user = int(stored[seed % len(stored)])
    ts = retriever.feats.meta["time_range"][1] + 3600  # every ad of the world has started
    when = rng.integers(ts - 1000, ts + 10, 30)  # some after the request: not counted
    picked = rng.choice(ads, 30)
    capped.store.add_events([user] * 30, picked.tolist(), when.tolist(), ["feed"] * 30)
    request = AdRequest(user, ts, "feed", "ios", frequency_cap=FrequencyCap(per, cap, window))
    # The reference: counts over the user's held events in the window, groups from the index.
    _, held, _, t = retriever.users.history(retriever.users.rows_of([user]), np.array([ts]))
    inside = held[0][(held[0] >= 0) & (t[0] >= ts - window)].tolist()
    group = groups[per]
    counts: dict[int, int] = {}
    for a in inside:
        counts[group[a]] = counts.get(group[a], 0) + 1
    out = {g for g, c in counts.items() if c >= cap}
    plain = AdRequest(user, ts, "feed", "ios")
    want = retriever.retrieve([plain], k=2000).results[0].ad_ids
    assert len(want) > 100  # not vacuous: many ads are eligible without the cap
    keep = [a for a in want.tolist() if group[a] not in out]
    got = retriever.retrieve([request], k=2000).results[0].ad_ids
    assert got.tolist() == keep[: len(got)] and len(got) == min(len(keep), 2000)


def test_an_inline_users_cap_counts_its_history(capped):
    retriever = capped.retriever
    ts = retriever.feats.meta["time_range"][1] + 3600
    who = retriever.users.targeting(0)  # a stored user's country, age and gender
    first = retriever.retrieve([AdRequest(None, ts, "feed", "ios", user=InlineUser(**who))], k=1)
    ad = int(first.results[0].ad_ids[0])
    user = InlineUser(**who, history=(Engagement(ad, ts - 5), Engagement(ad, ts - 4)))
    for n, present in ((2, False), (3, True)):
        cap = FrequencyCap("ad", n, 60)
        r = AdRequest(None, ts, "feed", "ios", user=user, frequency_cap=cap)
        assert (ad in retriever.retrieve([r], k=2000).results[0].ad_ids) == present


# ---------------------------------------------------------------- the routes


def test_an_event_reaches_the_next_retrieve(world):
    config = ServeConfig(index=fresh_state(world, "http"), model=world.model, admin_token=ADMIN,
                         timeout_ms=60_000)  # fmt: skip
    with ThreadServer(create_app(config, LocalBackend.load)) as s:
        body = {"user_id": 3, "k": 10, "surface": "feed", "platform": "ios"}
        before = httpx.post(f"{s.url}/v1/retrieve", json={"requests": [body]}).json()
        now = int(time.time())
        events = {"events": [{"user_id": 3, "ad_id": a, "ts": now - 60 + i, "surface": "reels",
                              "type": "click", "weight": 1.0} for i, a in enumerate(range(40, 45))],
                  "idempotency_key": "batch-1"}  # fmt: skip
        r = httpx.post(f"{s.url}/v1/events", json=events, headers=HEADERS)
        assert r.status_code == 200, r.text
        version = r.json()["index_version"]
        assert version > before["index_version"]
        again = httpx.post(f"{s.url}/v1/events", json=events, headers=HEADERS).json()
        assert again["index_version"] == version  # a retry: applied once
        after = httpx.post(
            f"{s.url}/v1/retrieve", json={"requests": [body], "min_version": version}
        ).json()
        assert after["index_version"] >= version
        assert after["results"][0] != before["results"][0]
        # A first event creates the user; PUT /v1/users gives it attributes.
        new = {"events": [{"user_id": 10**12, "ad_id": 41, "ts": now - 5}]}
        assert httpx.post(f"{s.url}/v1/events", json=new, headers=HEADERS).json()["users"] == 501
        r = httpx.put(f"{s.url}/v1/users", headers=HEADERS,
                      json={"users": [{"user_id": 10**12, "country": "US", "age": 33}]})  # fmt: skip
        assert r.status_code == 200, r.text
        ask = {"requests": [{"user_id": 10**12, "k": 5}], "min_version": r.json()["index_version"]}
        assert httpx.post(f"{s.url}/v1/retrieve", json=ask).status_code == 200
        # Bad input: a 422 naming the field; no token: 401; nothing applied.
        for bad, field in (
            ({"events": [{"user_id": 1, "ad_id": 1, "ts": 1, "surface": "tv"}]}, "surface"),
            ({"events": []}, "events"),
            ({"events": [{"user_id": 1, "ad_id": 1, "ts": "1"}]}, "ts"),
            ({"events": [{"user_id": 1, "ad_id": 1, "ts": 1, "weight": -1}]}, "weight"),
        ):
            r = httpx.post(f"{s.url}/v1/events", json=bad, headers=HEADERS)
            assert r.status_code == 422 and field in r.text, r.text
        r = httpx.put(f"{s.url}/v1/users", headers=HEADERS,
                      json={"users": [{"user_id": 1, "country": "ZZ"}]})  # fmt: skip
        assert r.status_code == 422 and "users[0].country" in r.text
        assert httpx.post(f"{s.url}/v1/events", json=new).status_code == 401
        cap = {**body, "frequency_cap": {"per": "ad", "max": 1, "window_s": 3600}, "k": 2000}
        got = httpx.post(f"{s.url}/v1/retrieve", json={"requests": [cap]}).json()
        assert not set(range(40, 45)) & set(got["results"][0]["ad_ids"])  # L = 8 holds all five


def test_the_load_test_streams_events_beside_retrieves(world):
    from m31.bench import loadtest

    config = ServeConfig(index=fresh_state(world, "load"), model=world.model, admin_token=ADMIN,
                         timeout_ms=60_000)  # fmt: skip
    user_ids, ad_ids, vocab = loadtest.inputs(world.snapshot)  # the served index's online/
    with ThreadServer(create_app(config, LocalBackend.load)) as s:
        stream = loadtest.EventLoad(clients=1, batch=20, ad_ids=ad_ids, token=ADMIN)
        result = loadtest.run(s.url, user_ids, 1, vocab["surface"], vocab["platform"], 1.0,
                              k=10, events=stream)  # fmt: skip
        row = result.row()
        assert row["errors"] == 0, row["error_kinds"]
        assert result.events >= 20 and result.events % 20 == 0 and row["calls"] > 0
        assert httpx.get(f"{s.url}/health/ready").status_code == 200  # still whole


def test_sigkill_of_the_server_loses_no_acknowledged_event(world):
    """`m31 serve` killed at a random moment of an event stream (three times): every
    acknowledged batch is in the folder it serves, the one in flight entirely or not at all."""
    state = fresh_state(world, "killed-http")
    rng = np.random.default_rng(1)
    for round_ in range(3):
        server = ProcessServer(world, state).start()
        acked: list[int] = []
        streaming = threading.Event()  # three acknowledgements are in, or the stream ended

        def stream(url=server.url, round_=round_, acked=acked, streaming=streaming) -> None:
            with Client(url, admin_token=ADMIN, timeout=300) as c:
                try:
                    for n in range(10**6):
                        users, ads, ts = batch(100 + round_, n)
                        events = [{"user_id": u, "ad_id": a, "ts": t}
                                  for u, a, t in zip(users, ads, ts, strict=True)]  # fmt: skip
                        try:
                            c.add_events(events)
                        except (httpx.HTTPError, ServiceError):
                            return  # the server died under this call: not acknowledged
                        acked.append(n)
                        if len(acked) == 3:
                            streaming.set()
                finally:
                    streaming.set()

        t = threading.Thread(target=stream)
        t.start()
        assert streaming.wait(600), "no acknowledgement in 600 s"
        for _ in range(int(rng.integers(0, 10))):  # then kill after a random number more
            if not t.is_alive():
                break
            n = len(acked)
            while len(acked) == n and t.is_alive():
                t.join(0.01)
        server.kill()
        t.join(60)
        assert acked
        engine = opened(world, state)
        store = engine.retriever.users
        for n in [*acked, max(acked) + 1]:
            users, ads, _ = batch(100 + round_, n)
            _, held, _, _ = store.history(store.rows_of(users), np.full(10, 10**9))
            present = [ads[0] in row for row in held.tolist()]
            assert all(present) if n in acked else len(set(present)) == 1, (round_, n, present)
        engine.close()


def test_a_users_only_version_keeps_the_ads_view(world):
    """Events number a new version without touching the ads: the next frozen view is the same
    view relabelled (its tensors, and what kernels keep per table, are reused), and a view
    taken before stays usable for masks; an ad write makes a new one."""
    index = AdIndex.load(world.snapshot)
    before = index.frozen_view()
    version = index.advance_version()
    after = index.frozen_view()
    assert after.version == version == before.version + 1
    assert after.g is before.g and after.attributes is before.attributes
    mask = after.eligible_mask(AdRequestContext(None, None, None, None, None, ts=0))
    assert mask.shape == (len(index),)
    with index.snapshot_view() as view:
        index_version = view.version
    assert index_version == version
    index.delete([int(index.ids()[0])])
    assert index.frozen_view().g is not None and index.frozen_view().version == version + 1
    assert index.frozen_view().attributes is not after.attributes
