"""Live users on a sharded index (`m31 serve --ray`): a shard answering its users as one
server's store does, group commit, and on the real server through Ray Serve over 3 shards,
events that reach the next retrieve with their owner killed, frequency caps per group, and
owners and the coordinator killed during an event stream losing no acknowledged event."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

ray = pytest.importorskip("ray")

from serve_helpers import (  # noqa: E402
    ADMIN,
    RayServer,
    World,
    fresh_state,
    start_cluster,
    stop_cluster,
    until,
)

from m31.cluster import channel  # noqa: E402
from m31.cluster.actors import ClusterOptions, start_shards  # noqa: E402
from m31.cluster.cluster import Cluster  # noqa: E402
from m31.cluster.coordinator import Coordinator  # noqa: E402
from m31.cluster.group import Call, merged  # noqa: E402
from m31.cluster.layout import coordinator_dir, init_cluster, reshard, shard_dir, shard_of  # noqa: E402
from m31.cluster.mutations import event_ops  # noqa: E402
from m31.cluster.shard import Answer, Moved, Shard  # noqa: E402
from m31.engine.load import copy_online, load_engine, online_organic, online_users  # noqa: E402
from m31.engine.requests import AdRequest, FrequencyCap  # noqa: E402
from m31.index import AdIndexError  # noqa: E402
from m31.index.wal import LOG  # noqa: E402
from m31.serve.app import ServeConfig  # noqa: E402
from m31.users.stored import read_users  # noqa: E402

S = 3
HEADERS = {"Authorization": f"Bearer {ADMIN}"}
# Kill cycles of the owner during an event stream (the single server's test runs 30; each
# cycle here restarts a Ray actor, so `make test` runs fewer: set the variable for more).
CYCLES = int(os.environ.get("M31_CLUSTER_KILL_CYCLES", "5"))
BOUND_S = 600.0  # the longest any wait here may take before the test fails (not a timing)


@pytest.fixture(scope="module")
def world(served_world) -> World:
    return served_world


def new_state(world: World, shards: int) -> Path:
    state = init_cluster(world.snapshot, Path(tempfile.mkdtemp(dir=world.root)) / "c", shards)
    copy_online(world.snapshot, state)
    return state


def state_of(users, user: int) -> dict[str, list]:
    return {k: v.tolist() for k, v in users.dump(lambda ids: ids == user).items()}


def same_users(got, want) -> None:
    """Two reads of users (`StoredUser` or None each) hold the same."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            assert (g.attributes, g.targeting) == (w.attributes, w.targeting)
            for name in ("ads", "surfaces", "times", "organic"):
                assert getattr(g, name).tolist() == getattr(w, name).tolist(), name


def test_a_shard_answers_its_users_as_one_store_does(world):
    """In-process: a shard seeds the users it owns (attributes, engagements, organic events),
    validates and commits user mutations, and answers its users as of a time exactly as one
    server's store answers them after the same writes: before and after a restart (its logs
    replayed) and a snapshot; None for a user it does not own or nobody holds."""
    state = new_state(world, 2)
    shard = Shard(shard_dir(state, 0), 0)
    store, organic = online_users(state), online_organic(state)  # one server's: every user
    ids = store.dump()["ids"]
    mine = ids[shard_of(ids, 2) == 0]
    assert sorted(shard._store.users.dump()["ids"].tolist()) == sorted(mine.tolist())
    u, theirs = int(mine[0]), int(ids[shard_of(ids, 2) == 1][0])
    asked = [u, *mine[1:40].tolist()]
    ts = np.full(len(asked), 2**40)
    times = store.dump()["ts"]
    middle = np.full(len(asked), int(np.median(times[times > 0])))
    for when in (ts, middle):  # after every event, and amid them
        same_users(shard.stored_users(asked, when)[0], read_users(store, organic, asked, when))
    assert any((g.organic >= 0).any() for g in shard.stored_users(asked, ts)[0])  # organic
    assert shard.stored_users([theirs, 10**12], ts[:2])[0] == [None, None]  # not its; nobody's
    base = shard.applied
    with pytest.raises(AdIndexError, match=r"events\[1\]\.surface: 'tv'"):
        shard.prepare("t0", "events", {"user_id": [u, u], "ad_id": [1, 2], "ts": [5, 6],
                                       "surface": ["feed", "tv"]})  # fmt: skip
    events = ([u, u, 10**12], [40, 41, 42], [10**10, 10**10 + 1, 7], ["feed", None, "feed"])
    columns = dict(zip(("user_id", "ad_id", "ts", "surface"), events, strict=True))
    shard.prepare("t1", "events", columns)
    shard.commit("t1", base + 1)
    store.add(store.check(*events), base + 1)
    shard.prepare("t2", "users", {"users": [[u, {"age": 33}]]})
    shard.commit("t2", base + 2)
    store.set_attributes(u, {"age": 33})
    asked.append(10**12)  # created by its event
    ts = np.full(len(asked), 2**40)
    for restart in range(3):
        got, at = shard.stored_users(asked, ts)
        assert at == base + 2
        same_users(got, read_users(store, organic, asked, ts))
        assert got[0].targeting["age"] == 33 and got[0].ads[-2:].tolist() == [40, 41]
        if restart == 1:
            shard.snapshot()
        shard.close()
        shard = Shard(shard_dir(state, 0), 0)  # the logs replayed (then the snapshot read)
    shard.close()


@dataclass
class OneShard:
    """Shard 0 of a fresh 2-shard state, opened in-process, and one of its users."""

    folder: Path
    shard: Shard
    user: int
    base: int  # the shard's global version at the start
    history: list[int]  # the user's ads as the shard holds them at the start

    @classmethod
    def open(cls, world: World) -> OneShard:
        folder = shard_dir(new_state(world, 2), 0)
        shard = Shard(folder, 0)
        user = int(shard._store.users.dump()["ids"][0])
        history = shard.stored_users([user], [2**40])[0][0].ads.tolist()
        return cls(folder, shard, user, shard.applied, history)

    @property
    def logs(self) -> tuple[Path, Path]:
        """(the index's write-ahead log, the transaction log)."""
        return self.folder / "index" / LOG, self.folder / "txn.log"

    def reopen(self) -> Shard:
        self.shard.close()
        self.shard = Shard(self.folder, 0)
        return self.shard

    def holds(self, version: int, *ads: int) -> None:
        """The shard is at `version` and its user's history ends with `ads`, each once."""
        got, at = self.shard.stored_users([self.user], [2**40])
        assert at == version
        assert got[0].ads.tolist() == [*self.history, *ads][-len(self.history) :]


def test_a_shard_answers_a_search_at_any_version_since_its_ads_last_changed(world):
    """Users' events change no ad: a search asked at a version a stream of events has moved
    the shard past is answered (at that version) instead of `Moved`, which would send the read
    back to the coordinator; a version before an ad changed is not, unless its view is kept."""
    one = OneShard.open(world)
    shard, info = one.shard, one.shard.info()
    rng = np.random.default_rng(5)
    dims = ((1, 2, info["dim_g"]), (1, 2, info["dim_x"]), (1, 2))
    query = tuple(rng.normal(size=d).astype(np.float32) for d in dims)
    who = {"country": "US", "age": 30, "gender": "f"}  # some of the world's ads target them
    payload = (query, [(AdRequest(None, int(time.time()), "feed", "ios"), who)], [5])
    first = shard.search(payload)  # at the latest: its view is kept
    v0, top = first.version, first.results[0][0].tolist()
    assert len(top) == 5

    def commit(txn: str, op: str, args: dict, version: int) -> None:
        shard.prepare(txn, op, args)
        shard.commit(txn, version)

    for i in (1, 2):
        event = {"user_id": [one.user], "ad_id": [i], "ts": [10**9 + i], "surface": ["feed"]}
        commit(f"events {i}", "events", event, v0 + i)
    for at in (v0, v0 + 1, v0 + 2):
        got = shard.search(payload, at)
        assert isinstance(got, Answer) and got.version == at and got.results[0][0].tolist() == top
    commit("delete", "delete", {"ad_ids": np.array([top[0]])}, v0 + 3)
    assert shard.search(payload, v0 + 1) == Moved(v0 + 3)  # the ads changed since
    assert shard.search(payload, v0).results[0][0].tolist() == top  # a view kept
    assert top[0] not in shard.search(payload).results[0][0].tolist()
    shard.close()


@pytest.mark.parametrize("index_kept_it", [False, True])
def test_a_commit_a_power_loss_cut_from_a_shard_is_applied_once(world, tmp_path, index_kept_it):
    """A shard fsyncs its prepares, not its commits (the coordinator's decision log is the
    commit point): a machine that loses power may cut the commit record from its transaction
    log, with or without the change from its index's log (neither synced). Reopened, the shard
    holds the transaction in doubt; the coordinator's resolve commits it, applied once."""
    one = OneShard.open(world)
    shard, u, base = one.shard, one.user, one.base
    wal, txn_log = one.logs
    index_before = wal.stat().st_size
    columns = {"user_id": [u, u], "ad_id": [40, 41], "ts": [10**10, 10**10 + 1],
               "surface": ["feed", None]}  # fmt: skip
    shard.prepare("t1", "events", columns)
    prepared = txn_log.stat().st_size  # what the prepare's fsync made durable
    shard.commit("t1", base + 1)
    shard.close()
    assert txn_log.stat().st_size > prepared and wal.stat().st_size > index_before
    os.truncate(txn_log, prepared)
    if not index_kept_it:
        os.truncate(wal, index_before)
    shard = one.reopen()
    assert shard.info()["in_doubt"] == "t1" and shard.applied == base
    assert shard.resolve(("t1", base + 1)) == shard.held()
    one.holds(base + 1, 40, 41)
    one.reopen()
    one.holds(base + 1, 40, 41)  # the recovered commit is logged as taken
    one.shard.close()


def test_a_shard_whose_index_log_lost_an_earlier_record_than_a_later_one_recovers(world):
    """An index log written without fsync may keep, after a power loss, a later record and not
    an earlier one: the shard's index ends its log at the damaged record, and the transaction
    log (synced by the next prepare) applies both commits again, each once."""
    one = OneShard.open(world)
    shard, u, base = one.shard, one.user, one.base
    wal, txn_log = one.logs
    sizes = [wal.stat().st_size]
    for i, ad in enumerate((40, 41)):
        columns = {"user_id": [u], "ad_id": [ad], "ts": [10**10 + i], "surface": ["feed"]}
        shard.prepare(f"t{i}", "events", columns)
        prepared = txn_log.stat().st_size
        shard.commit(f"t{i}", base + 1 + i)
        sizes.append(wal.stat().st_size)
    shard.close()
    os.truncate(txn_log, prepared)  # t1's commit record cut; t0's synced by t1's prepare
    with open(wal, "r+b") as f:  # t0's index record damaged, t1's intact after it
        at = (sizes[0] + sizes[1]) // 2
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    shard = one.reopen()
    assert shard.info()["in_doubt"] == "t1" and shard.applied == base + 1
    shard.resolve(("t1", base + 2))
    one.holds(base + 2, 40, 41)
    shard.close()


def all_users(state: Path, shards: int) -> dict[int, dict[str, list]]:
    """Every user of a cluster state as its shards hold them (opened in-process)."""
    found = {}
    for s in range(shards):
        shard = Shard(shard_dir(state, s), s)
        users = shard._store.users
        for u in users.dump()["ids"].tolist():
            assert shard_of([u], shards)[0] == s and u not in found
            found[u] = state_of(users, u)
        shard.close()
    return found


def test_users_carry_over_from_a_serving_folder_and_through_a_reshard(world):
    """A cluster made from a serving folder's snapshot starts with its users (events taken by
    one server); resharding keeps every user as it was, each on its new owner."""
    serving = fresh_state(world, "users-cluster")
    engine = load_engine(serving, world.model)
    engine.store.add_events([3, 3, 10**12], [40, 41, 42], [10**10, 10**10 + 1, 9],
                            ["feed", None, "reels"])  # fmt: skip
    engine.store.set_users([(10**12, {"age": 41})])
    engine.store.snapshot()
    want = {
        u: state_of(engine.retriever.users, u)
        for u in engine.retriever.users.dump()["ids"].tolist()
    }
    engine.close()
    state = init_cluster(serving / "snapshot", serving.with_name(serving.name + ".c"), 2)
    copy_online(serving, state)
    assert all_users(state, 2) == want
    shard = Shard(shard_dir(state, int(shard_of([3], 2)[0])), int(shard_of([3], 2)[0]))
    base = shard.applied
    shard.prepare("t1", "events", {"user_id": [3], "ad_id": [43], "ts": [10**10 + 2],
                                   "surface": ["feed"]})  # fmt: skip
    shard.commit("t1", base + 1)
    want[3] = state_of(shard._store.users, 3)
    shard.close()
    out = reshard(state, 3, state.with_name(state.name + "3"))
    copy_online(state, out)
    assert all_users(out, 3) == want


def test_a_group_is_its_calls_one_after_the_other():
    """`merged`: one operation per shard, the calls' columns (or users) in queue order, the
    optional columns None per event where a call gave none."""
    a = Call({0: ("events", {"user_id": [1, 2], "ad_id": [5, 6], "ts": [7, 8],
                             "surface": ["feed", None], "type": None, "weight": None}, None)})  # fmt: skip
    b = Call({0: ("events", {"user_id": [3], "ad_id": [9], "ts": [10], "surface": ["reels"],
                             "type": ["view"], "weight": None}, None),
              1: ("events", {"user_id": [4], "ad_id": [1], "ts": [2], "surface": [None],
                             "type": None, "weight": [0.5]}, None)})  # fmt: skip
    got = merged([a, b])
    assert got[0] == ("events", {"user_id": [1, 2, 3], "ad_id": [5, 6, 9], "ts": [7, 8, 10],
                                 "surface": ["feed", None, "reels"],
                                 "type": [None, None, "view"], "weight": None}, None)  # fmt: skip
    assert got[1][1]["weight"] == [0.5] and got[1][1]["type"] is None
    users = [Call({1: ("users", {"users": [[4, {"age": 3}]]}, None)}),
             Call({1: ("users", {"users": [[7, {"age": 5}]]}, None)})]  # fmt: skip
    assert merged(users) == {1: ("users", {"users": [[4, {"age": 3}], [7, {"age": 5}]]}, None)}
    with pytest.raises(ValueError, match="one of"):
        merged([a, users[0]])
    assert Call({0: ("upsert", {}, None)}).kind is None


def test_concurrent_calls_share_one_transaction(world, ray_local):
    """Event calls queued while a transaction runs are committed as one (one version, one change
    per shard, in queue order); a keyed retry queued beside its call is answered as a retry;
    a group a shard refuses runs call by call, the invalid call alone refused."""
    state = new_state(world, 2)
    shards = start_shards(state, ClusterOptions(shard_cpus=0))
    coordinator = Coordinator(coordinator_dir(state), shards)
    assert coordinator.read_point(BOUND_S)[2] == []  # resolved
    base = coordinator.version
    new = np.arange(10**12, 10**12 + 64)  # users the events create: their whole history
    u0, u1 = (int(new[shard_of(new, 2) == s][0]) for s in (0, 1))

    def held(s: int, user: int) -> tuple[list[int], int]:
        """(the user's ad ids as its owner s holds them, the version s is at)."""
        users, at = ray.get(shards[s].stored_users.remote([user], [2**40]))
        return [a for a in users[0].ads.tolist() if a >= 0], at

    def ops(events):
        users, ads, ts, surfaces = zip(*events, strict=True)
        return event_ops(users, ads, ts, surfaces, None, None, 2)

    def together(calls):
        """The calls sent at once while the coordinator is busy: one group."""
        out = [None] * len(calls)

        def send(i, ops_, key):
            out[i] = coordinator.mutate(ops_, key)

        with coordinator._mutex:
            threads = [threading.Thread(target=send, args=(i, *c)) for i, c in enumerate(calls)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + BOUND_S
            while len(coordinator._queue) < len(calls):  # every call queued
                assert time.monotonic() < deadline
                time.sleep(0.01)
        for t in threads:
            t.join()
        return out

    a = ops([(u0, 40, 10**9, "feed"), (u1, 41, 10**9, "feed")])
    b, c = ops([(u0, 42, 10**9 + 1, "reels")]), ops([(u1, 43, 10**9 + 2, None)])
    d = ops([(u1, 47, 10**9 + 3, "feed")])
    got = together([(a, "a"), (b, "b"), (c, None), (a, "a"), (d, None)])
    assert [r[:2] for r in got] == [("ok", base + 1)] * 5 and coordinator.version == base + 1
    assert held(0, u0) == ([40, 42], base + 1) and held(1, u1) == ([41, 43, 47], base + 1)
    assert coordinator.mutate(a, "a")[:2] == ("ok", base + 1)  # a later retry
    bad = ops([(u1, 44, 10**9 + 3, "tv")])  # a surface the shard does not know
    good = [ops([(u0, 45, 10**9 + 4, "feed")]), ops([(u1, 46, 10**9 + 5, "feed")])]
    got = together([(good[0], None), (bad, None), (good[1], None)])
    assert got[1][0] == "invalid" and "surface" in got[1][1]
    assert sorted(r[1] for r in (got[0], got[2])) == [base + 2, base + 3]
    assert held(0, u0)[0] == [40, 42, 45] and held(1, u1)[0] == [41, 43, 47, 46]
    for shard in shards:
        ray.kill(shard)


def coordinated(world: World) -> tuple[list, Coordinator, list[int]]:
    """Two shard actors of a fresh state, a coordinator over them in this process (resolved),
    and a new user owned by each shard."""
    state = new_state(world, 2)
    shards = start_shards(state, ClusterOptions(shard_cpus=0))
    coordinator = Coordinator(coordinator_dir(state), shards)
    assert coordinator.read_point(BOUND_S)[2] == []
    new = np.arange(10**12, 10**12 + 64)
    return shards, coordinator, [int(new[shard_of(new, 2) == s][0]) for s in (0, 1)]


@pytest.mark.skipif(not channel.available(), reason="channels are Linux's")
def test_the_coordinator_prepares_and_commits_on_the_shards_channels(world, ray_local):
    """Once it knows their endpoints, the coordinator's prepares and commits take the shards'
    channels. A shard killed: the prepare that finds its channel closed is asked again through
    Ray, and the call commits once the restarted process answers (or is refused, changing
    nothing, while it restarts); the link then connects to the new process's channel."""
    shards, coordinator, users = coordinated(world)

    def send(ad: int) -> tuple:
        ops = event_ops(users, [ad, ad], [10**9 + ad] * 2, ["feed"] * 2, None, None, 2)
        deadline = time.monotonic() + BOUND_S
        while (out := coordinator.mutate(ops))[0] == "unavailable":
            assert time.monotonic() < deadline, out
            time.sleep(0.1)
        return out

    links = coordinator._links
    assert send(1)[0] == "ok"
    until(lambda: all(link.channel for link in links), "the shards' channels")
    first = [link.channel for link in links]
    assert send(2)[0] == "ok" and [link.channel for link in links] == first
    kill(shards[1])
    assert send(3)[0] == "ok" and first[1].closed
    until(lambda: links[1].channel is not None, "the restarted shard's channel")
    assert links[0].channel is first[0]
    assert send(4)[0] == "ok"
    for s, user in enumerate(users):  # each call applied once
        held, _ = ray.get(shards[s].stored_users.remote([user], [2**40]))
        assert [a for a in held[0].ads.tolist() if a >= 0] == [1, 2, 3, 4]
    for shard in shards:
        ray.kill(shard)


def test_a_shard_failing_on_its_own_is_not_taken_for_down(world, ray_local):
    """A prepare that fails with the shard's own error (not an invalid mutation, nor an
    outage) is answered unavailable naming that error (and logged), not "down or restarting":
    a shard recovering may fail so once, a bug every time; the transaction is aborted
    everywhere and the next call commits."""
    shards, coordinator, users = coordinated(world)
    broken = {0: ("update_attributes", {"ad_id": 1}, None)}  # no "attrs": a KeyError there
    out = coordinator.mutate(broken)
    assert out[0] == "unavailable" and out[2] == [0], out
    assert "shard 0 failed to prepare (KeyError: 'attrs')" in out[1], out
    ops = event_ops(users, [5, 5], [10**9] * 2, ["feed"] * 2, None, None, 2)
    assert coordinator.mutate(ops)[0] == "ok"
    for shard in shards:
        ray.kill(shard)


# ------------------------------------------------------------------- on the server, over Ray


@dataclass
class Served:
    url: str
    cluster: Cluster
    state: Path


@pytest.fixture(scope="module")
def served(world, ray_serve):
    """The API on the run's Ray Serve over a 3-shard cluster made from the world's snapshot."""
    state, cluster = start_cluster(world.snapshot, world.root, S)
    config = ServeConfig(index=state, model=world.model, admin_token=ADMIN, timeout_ms=60_000)
    with RayServer(ray_serve, config, cluster) as server:
        yield Served(server.url, cluster, state)
    stop_cluster(cluster)


def kill(actor) -> None:
    """SIGKILL the actor's process (Ray restarts it, and it recovers from its logs). Its pid is
    asked again while Ray says it is unavailable (a restart from an earlier kill under way)."""
    deadline = time.monotonic() + BOUND_S
    while True:
        try:
            pid = ray.get(actor.pid.remote(), timeout=BOUND_S)
            break
        except ray.exceptions.ActorUnavailableError:
            assert time.monotonic() < deadline, "the actor stayed unavailable"
            time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def kill_shard(served: Served, s: int) -> None:
    kill(served.cluster.shards[s])


def until_ok(call) -> httpx.Response:
    """`call()` again while it answers 503 (a shard restarting), up to `BOUND_S`."""
    deadline = time.monotonic() + BOUND_S
    while True:
        r = call()
        if r.status_code != 503:
            return r
        assert time.monotonic() < deadline, r.text
        time.sleep(0.1)


def held_users(served: Served, users, ts) -> list:
    """The users as their owners hold them as of each time (`StoredUser`, None: not held)."""
    return served.cluster.stored_users(users, ts, BOUND_S)


def test_an_event_reaches_the_next_retrieve_with_its_owner_killed(served):
    body = {"user_id": 3, "k": 10, "surface": "feed", "platform": "ios"}
    owner = int(shard_of([3], S)[0])
    before = httpx.post(f"{served.url}/v1/retrieve", json={"requests": [body]}, timeout=BOUND_S)
    assert before.status_code == 200, before.text
    now = int(time.time())
    events = {"events": [{"user_id": 3, "ad_id": a, "ts": now - 60 + i, "surface": "reels",
                          "type": "click", "weight": 1.0} for i, a in enumerate(range(40, 45))],
              "idempotency_key": "cluster-1"}  # fmt: skip
    post = lambda: httpx.post(f"{served.url}/v1/events", json=events, headers=HEADERS,  # noqa: E731
                              timeout=BOUND_S)  # fmt: skip
    r = post()
    assert r.status_code == 200, r.text
    version = r.json()["index_version"]
    assert version > before.json()["index_version"]
    kill_shard(served, owner)
    assert until_ok(post).json()["index_version"] == version  # a retry: applied once
    ask = {"requests": [body], "min_version": version}
    after = until_ok(lambda: httpx.post(f"{served.url}/v1/retrieve", json=ask, timeout=BOUND_S))
    assert after.status_code == 200, after.text
    assert after.json()["index_version"] >= version
    assert after.json()["results"][0] != before.json()["results"][0]
    ads = held_users(served, [3], [now])[0].ads.tolist()
    assert ads.count(40) == 1 and set(range(40, 45)) <= set(ads)
    cap = {**body, "frequency_cap": {"per": "ad", "max": 1, "window_s": 3600}, "k": 2000}
    got = httpx.post(f"{served.url}/v1/retrieve", json={"requests": [cap], "min_version": version},
                     timeout=BOUND_S).json()  # fmt: skip
    assert not set(range(40, 45)) & set(got["results"][0]["ad_ids"])
    # A first event creates the user; PUT /v1/users gives it attributes, on its owner.
    new = {"events": [{"user_id": 10**12, "ad_id": 41, "ts": now - 5}]}
    r = httpx.post(f"{served.url}/v1/events", json=new, headers=HEADERS, timeout=BOUND_S)
    assert r.status_code == 200, r.text
    r = httpx.put(f"{served.url}/v1/users", headers=HEADERS, timeout=BOUND_S,
                  json={"users": [{"user_id": 10**12, "country": "US", "age": 33}]})  # fmt: skip
    assert r.status_code == 200, r.text
    ask = {"requests": [{"user_id": 10**12, "k": 5}], "min_version": r.json()["index_version"]}
    r = httpx.post(f"{served.url}/v1/retrieve", json=ask, timeout=BOUND_S)
    assert r.status_code == 200, r.text
    assert held_users(served, [10**12], [now])[0].targeting["age"] == 33
    # Bad input: 422 naming the field (the call's own index, not a shard's part of it).
    bad = {"events": [{"user_id": 3, "ad_id": 1, "ts": 1},
                      {"user_id": 4, "ad_id": 1, "ts": 1, "surface": "tv"}]}  # fmt: skip
    r = httpx.post(f"{served.url}/v1/events", json=bad, headers=HEADERS, timeout=BOUND_S)
    assert r.status_code == 422 and "events[1].surface" in r.text, r.text


@pytest.mark.parametrize("per,most", [("campaign", 1), ("advertiser", 2)])
def test_frequency_caps_per_group_answer_as_one_server_does(served, world, per, most):
    """The ingress holds no ads: a cap per campaign or advertiser asks the shards for the
    groups of the ads the user engaged with, and answers what one server answers."""
    user, now = {"campaign": 5, "advertiser": 6}[per], int(time.time())
    body = {"user_id": user, "ts": now, "surface": "feed", "platform": "ios", "k": 60}
    r = httpx.post(f"{served.url}/v1/retrieve", json={"requests": [body]}, timeout=BOUND_S)
    # four ads engaged twice each (the store keeps the last L = 8): every group reached
    ads = r.json()["results"][0]["ad_ids"][:4] * 2
    ts = [now - 100 + i for i in range(len(ads))]
    stream = [
        {"user_id": user, "ad_id": a, "ts": t, "surface": "feed"}
        for a, t in zip(ads, ts, strict=True)
    ]
    events = {"events": stream, "idempotency_key": f"caps-{per}"}
    r = httpx.post(f"{served.url}/v1/events", json=events, headers=HEADERS, timeout=BOUND_S)
    assert r.status_code == 200, r.text
    cap = {"per": per, "max": most, "window_s": 3600}
    version = r.json()["index_version"]
    ask = {"requests": [body, {**body, "frequency_cap": cap}], "min_version": version}
    r = httpx.post(f"{served.url}/v1/retrieve", json=ask, timeout=BOUND_S)
    assert r.status_code == 200, r.text
    plain, capped = (res["ad_ids"] for res in r.json()["results"])
    one = load_engine(fresh_state(world, f"caps-{per}"), world.model)
    one.store.add_events([user] * len(ads), ads, ts, ["feed"] * len(ads))
    request = AdRequest(user, now, "feed", "ios", frequency_cap=FrequencyCap(per, most, 3600))
    assert capped == one.retriever.retrieve([request], 60).results[0].ad_ids.tolist()
    field = "campaign_id" if per == "campaign" else "advertiser_id"
    reached = set(one.retriever.index.numeric_values(ads, field)) - {None}
    held = one.retriever.index.numeric_values(plain, field)
    gone = {a for a, g in zip(plain, held, strict=True) if g in reached}
    assert reached and gone and not gone & set(capped)  # the cap took something out
    one.close()


def test_killed_owners_and_coordinator_lose_no_acknowledged_event(served):
    """Three senders stream events (so that their calls commit in groups) while the owner of
    their users and the coordinator are SIGKILLed in turn, `CYCLES` times, each after a random
    number of acknowledgements: every acknowledged call is held by its users exactly once
    (retries carry the call's key), every call in flight all or nothing."""
    s, senders = 1, 3
    candidates = np.arange(2 * 10**9, 2 * 10**9 + 200_000, dtype=np.int64)
    ids = candidates[shard_of(candidates, S) == s]
    batch = lambda n: ids[5 * n : 5 * n + 5].tolist()  # noqa: E731  users of their own
    acked: list[int] = []
    progress = threading.Condition()
    stop = threading.Event()

    def stream(first: int) -> None:
        with httpx.Client(timeout=BOUND_S) as c:
            for n in range(first, len(ids) // 5, senders):
                events = [{"user_id": u, "ad_id": 7, "ts": 1_000 + n} for u in batch(n)]
                body = {"events": events, "idempotency_key": f"kill-{n}"}
                while not stop.is_set():
                    try:
                        r = c.post(f"{served.url}/v1/events", json=body, headers=HEADERS)
                    except httpx.HTTPError:
                        continue
                    if r.status_code == 200:
                        break
                    assert r.status_code == 503, r.text  # a restart under way: again
                if stop.is_set():
                    return
                with progress:
                    acked.append(n)
                    progress.notify_all()

    threads = [threading.Thread(target=stream, args=(k,)) for k in range(senders)]
    for t in threads:
        t.start()
    alive = lambda: all(t.is_alive() for t in threads)  # noqa: E731
    coordinator = served.cluster.coordinator
    rng = np.random.default_rng(0)
    try:
        for cycle in range(CYCLES):
            with progress:
                want = len(acked) + int(rng.integers(1, 6))
                assert progress.wait_for(lambda w=want: len(acked) >= w or not alive(),
                                         BOUND_S), "no acknowledgement"  # fmt: skip
            assert alive()
            if cycle % 2:
                kill(coordinator)
            else:
                kill_shard(served, s)
        with progress:  # one more after the last restart
            want = len(acked) + 1
            assert progress.wait_for(lambda: len(acked) >= want, BOUND_S)
    finally:
        stop.set()
        for t in threads:
            t.join(BOUND_S)
    sent = range(max(acked) + senders + 1)
    every = [u for n in sent for u in batch(n)]
    found = held_users(served, every, np.full(len(every), 10**9))  # one read of them all
    for n in sent:
        users = found[5 * n : 5 * n + 5]
        if n not in acked and all(u is None for u in users):
            continue  # a call in flight, not applied
        assert all(u is not None for u in users), n
        ads, when = np.stack([u.ads for u in users]), np.stack([u.times for u in users])
        assert ((ads == 7).sum(1) == 1).all() and (when[:, -1] == 1_000 + n).all(), n
