"""The sharded index on a real local Ray cluster (m31.cluster): S = 3 shards answer exactly as
one AdIndex (ids and order) through random mutations, filters and ties; a shard or the
coordinator killed during a stream of cross-shard upserts loses nothing acknowledged and leaves
no batch half applied; reads during an outage follow the policy within their deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from serve_helpers import stop_cluster, until  # noqa: E402

from m31.cluster import channel  # noqa: E402
from m31.cluster.actors import ClusterOptions  # noqa: E402
from m31.cluster.cluster import Cluster  # noqa: E402
from m31.cluster.layout import init_cluster, shard_dir, shard_of  # noqa: E402
from m31.cluster.shard import Shard  # noqa: E402
from m31.engine import AdRequest, eligible_masks, request_context, search  # noqa: E402
from m31.index import AdIndex, AdIndexError, compile_filter  # noqa: E402
from m31.index.errors import Unavailable  # noqa: E402

S, G, D, E = 3, 8, 8, 3
EXTRA = {"format": "str"}
# A few distinct rows, so that equal scores (ties across shards) are common.
POOL = np.random.default_rng(1).normal(size=(6, G + D + 1)).astype(np.float32)
FILTERS = [
    None,
    {"eq": ["format", "video"]},
    {"contains": ["tags", "a"]},
    {"not": {"in": ["advertiser_id", [0, 1]]}},
    {"any": [{"eq": ["format", "image"]}, {"range": ["advertiser_id", 3, None]}]},
    {"all": [{"contains": ["tags", "b"]}, {"not": {"eq": ["format", "video"]}}]},
]


def ads(ids, rng) -> tuple:
    """Vectors from POOL (ties) and random attributes for the ads `ids`."""
    rows = POOL[rng.integers(0, len(POOL), len(ids))]
    attrs = [
        {
            "advertiser_id": int(rng.integers(0, 5)),
            "status": "active" if rng.random() < 0.9 else "paused",
            "format": ["video", "image"][int(rng.integers(2))],
            "tags": [t for t in ("a", "b") if rng.random() < 0.5],
        }
        for _ in ids
    ]
    return rows[:, :G], rows[:, G : G + D], rows[:, -1], attrs


def reference(index: AdIndex, query, requests, ks):
    view = index.frozen_view()
    ctx = [
        (request_context(r, who), compile_filter(r.filter, index.schema) if r.filter else None)
        for r, who in requests
    ]
    return search(tuple(torch.tensor(t) for t in query), view, eligible_masks(view, ctx), ks)


@pytest.fixture
def clusters(ray_local):
    """Where a test puts the clusters it starts, stopped after it (the run's Ray cluster
    outlives the module)."""
    started: list[Cluster] = []
    yield started
    for cluster in started:
        stop_cluster(cluster)


def start(tmp_path, index: AdIndex, started: list[Cluster], shards: int = S) -> Cluster:
    snapshot = index.save(tmp_path / "snapshot")
    state = init_cluster(snapshot, tmp_path / "state", shards)
    started.append(Cluster.start(state, ClusterOptions(shard_cpus=0)))
    return started[-1]


def test_core_imports_without_ray():
    code = "import sys, m31, m31.engine, m31.index, m31.ops, m31.model; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_partition_is_stable_and_even():
    ids = np.arange(30_000, dtype=np.int64) * 7
    owner = shard_of(ids, 4)
    assert owner.tolist()[:8] == shard_of(ids[:8], 4).tolist()
    counts = np.bincount(owner, minlength=4)
    assert counts.min() > 0.9 * len(ids) / 4, counts
    assert shard_of([2**63 - 1], 3)[0] in range(3)


@pytest.fixture(scope="module")
def mirrored(ray_local, tmp_path_factory):
    """A running S-shard cluster and an AdIndex that receives the same mutations."""
    rng = np.random.default_rng(0)
    index = AdIndex(G, D, dtype=torch.float32, extra_fields=EXTRA)
    ids = rng.choice(10_000, 300, replace=False)
    index.upsert(ids, *ads(ids, rng))
    cluster = start(tmp_path_factory.mktemp("mirrored"), index, [])
    yield cluster, index
    stop_cluster(cluster)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    seed=st.integers(0, 2**31),
    n_upsert=st.integers(0, 40),
    n_delete=st.integers(0, 10),
    filters=st.lists(st.sampled_from(range(len(FILTERS))), min_size=1, max_size=5),
    ks=st.lists(st.integers(1, 400), min_size=5, max_size=5),
)
def test_shards_equal_one_index(mirrored, seed, n_upsert, n_delete, filters, ks):
    cluster, index = mirrored
    rng = np.random.default_rng(seed)
    version = cluster.read_point()[0]
    if n_upsert:
        ids = rng.choice(10_000, n_upsert, replace=False)  # new ads and replacements
        g, x, b, attrs = ads(ids, rng)
        index.upsert(ids, g, x, b, attrs)
        assert cluster.upsert(ids, g, x, b, attrs) == version + 1
        version += 1
    live = index.ids().numpy()
    if n_delete and len(live):
        gone = rng.choice(live, min(n_delete, len(live)), replace=False)
        index.delete(gone)
        assert cluster.delete(gone) == version + 1
        version += 1
    B = len(filters)
    query = (
        rng.normal(size=(B, E, G)).astype(np.float32),  # [B, E, G]
        rng.normal(size=(B, E, D)).astype(np.float32),  # [B, E, D]
        rng.normal(size=(B, E)).astype(np.float32),  # [B, E]
    )
    requests = [
        (AdRequest(None, 0, "feed", "ios", exclude_ads=tuple(live[:3].tolist()),
                   filter=FILTERS[f]), {})
        for f in filters
    ]  # fmt: skip
    got = cluster.search(query, requests, ks[:B], time.monotonic() + 60)
    want = reference(index, query, requests, ks[:B])
    assert got.version == version and not got.missing
    assert got.rows == sum(i["rows"] for i in cluster.info())
    for a, w in zip(got.results, want, strict=True):
        assert a.ad_ids.tolist() == w.ad_ids.tolist()
        np.testing.assert_array_equal(a.scores, w.scores)


def test_invalid_mutations_change_nothing(mirrored):
    cluster, index = mirrored
    version = cluster.read_point()[0]
    live = index.ids().numpy()
    missing = int(np.setdiff1d(np.arange(20_000), live)[0])
    with pytest.raises(AdIndexError, match="not in the index"):
        cluster.delete([int(live[0]), missing])  # spans shards; one part is invalid
    with pytest.raises(AdIndexError, match="more than once"):
        g, x, b, attrs = ads([5, 5], np.random.default_rng(0))
        cluster.upsert(np.array([5, 5]), g, x, b, attrs)
    ids = np.arange(20_000, 20_006)
    g, x, b, attrs = ads(ids, np.random.default_rng(0))
    attrs[4]["status"] = "sleeping"  # invalid on one shard only: no shard applies the batch
    with pytest.raises(AdIndexError, match="status"):
        cluster.upsert(ids, g, x, b, attrs)
    assert cluster.read_point()[0] == version
    assert all(cluster.get(int(i)) is None for i in ids)
    assert cluster.get(int(live[0])) is not None
    # The coordinator sends its aborts without waiting for them: each lands in its own time.
    until(lambda: not any(i["in_doubt"] for i in cluster.info()), "a shard still in doubt")


def test_shard_recovers_prepared_and_decided_transactions(tmp_path):
    """In-process: a prepared transaction survives a restart in doubt until decided (by the
    coordinator's resolve, or at the next prepare from its last commit on the shard); a
    decision logged but not yet applied is applied when the shard reopens."""
    rng = np.random.default_rng(0)
    index = AdIndex(G, D, dtype=torch.float32, extra_fields=EXTRA)
    index.upsert([1, 2], *ads([1, 2], rng))
    init_cluster(index.save(tmp_path / "snapshot"), tmp_path / "state", 1)
    path = shard_dir(tmp_path / "state", 0)
    g, x, b, attrs = ads([7], rng)
    shard = Shard(path, 0)
    shard.prepare("t1", "upsert", {"ad_ids": [7], "g": g, "x": x, "b": b, "attributes": attrs})
    shard.close()  # a crash after the prepare record
    shard = Shard(path, 0)
    assert shard.info()["in_doubt"] == "t1" and shard.get(7) is None
    # The coordinator's log says t1 committed as version 5: the next prepare applies it first.
    shard.prepare("t2", "delete", {"ad_ids": [1]}, last=("t1", 5))
    assert shard.get(7) == (shard.get(7)[0], 5) and shard.applied == 5
    assert shard.info()["in_doubt"] == "t2"
    shard._log.append(("commit", "t2", 6))  # the decision is logged, then the process dies
    shard.close()
    shard = Shard(path, 0)
    assert shard.get(1) is None and shard.applied == 6 and shard.info()["in_doubt"] is None
    shard.prepare("t3", "delete", {"ad_ids": [2]})
    shard.close()
    shard = Shard(path, 0)
    shard.resolve(("t2", 6))  # t3 was never decided: presumed abort
    assert shard.get(2) is not None and shard.info()["in_doubt"] is None
    shard.prepare("t4", "delete", {"ad_ids": [2]})
    shard.prepare("t5", "delete", {"ad_ids": [2]}, last=("t2", 6))  # t4's abort was lost
    assert shard.info()["in_doubt"] == "t5" and shard.get(2) is not None
    shard.abort("t4")  # an abort that comes late changes nothing
    assert shard.info()["in_doubt"] == "t5"
    shard.close()
    shard = Shard(path, 0)
    assert shard.info()["in_doubt"] == "t5" and shard.applied == 6
    shard.close()


def test_kill_during_upserts_loses_nothing_acknowledged(clusters, tmp_path):
    """Cross-shard upsert batches stream in while a shard is killed (ray.kill, then SIGKILL
    of its worker) and the coordinator is killed: every acknowledged batch is there after
    the restarts, and every batch is there entirely or not at all."""
    rng = np.random.default_rng(3)
    index = AdIndex(G, D, dtype=torch.float32, extra_fields=EXTRA)
    index.upsert([1], *ads([1], rng))
    cluster = start(tmp_path, index, clusters)
    acked: dict[int, list[int]] = {}  # version -> ids
    tried: list[list[int]] = []
    stop, first = threading.Event(), threading.Event()
    errors: list[Exception] = []

    def stream():
        n = 0
        while not stop.is_set():
            ids = list(range(100_000 + 10 * n, 100_000 + 10 * n + 6))  # spans the shards
            n += 1
            tried.append(ids)
            try:
                version = cluster.upsert(np.array(ids), *ads(ids, np.random.default_rng(n)))
            except Unavailable:
                continue  # not acknowledged
            except Exception as e:  # surfaced below
                errors.append(e)
                return
            acked[version] = ids
            first.set()

    writer = threading.Thread(target=stream)
    writer.start()
    try:
        assert first.wait(120), "no upsert acknowledged"
        for kill in ("ray.kill", "sigkill", "coordinator"):
            seen = len(acked)
            if kill == "ray.kill":
                ray.kill(cluster.shards[1], no_restart=False)
            elif kill == "sigkill":
                os.kill(ray.get(cluster.shards[2].pid.remote()), signal.SIGKILL)
            else:
                ray.kill(cluster.coordinator, no_restart=False)
            deadline = time.monotonic() + 120
            while len(acked) < seen + 3 and time.monotonic() < deadline and not errors:
                time.sleep(0.05)  # Ray gives no event for "the stream went on"
            assert len(acked) >= seen + 3, f"the stream stalled after {kill}"
    finally:
        stop.set()
        writer.join(120)
    assert not errors, errors[0]
    assert list(acked) == sorted(acked)  # each acknowledged batch a newer version
    present = {i for ids in tried for i in ids if cluster.get(i) is not None}
    for version, ids in acked.items():
        assert set(ids) <= present, version
    for ids in tried:
        assert set(ids) <= present or not set(ids) & present, ids
    assert not any(i["in_doubt"] for i in cluster.info())
    assert cluster.read_point()[0] >= max(acked)


def test_outage_policy_within_the_deadline(clusters, tmp_path):
    """A shard that stops answering: a read waits until its deadline, then fails naming the
    shard; the shard is down from then on, so a read that allows a partial answer does not
    wait for it: partial: true with the shard listed, exactly the other shards' ads. After
    the shard is killed Ray restarts it and reads wait for it and are whole again."""
    rng = np.random.default_rng(5)
    index = AdIndex(G, D, dtype=torch.float32, extra_fields=EXTRA)
    ids = rng.choice(10_000, 200, replace=False)
    index.upsert(ids, *ads(ids, rng))
    cluster = start(tmp_path, index, clusters)
    query = tuple(rng.normal(size=s).astype(np.float32) for s in ((1, E, G), (1, E, D), (1, E)))
    requests = [(AdRequest(None, 0, "feed", "ios"), {})]
    whole = cluster.search(query, requests, [50], time.monotonic() + 60)
    pid = ray.get(cluster.shards[1].pid.remote())
    os.kill(pid, signal.SIGSTOP)  # hung, not dead: no call fails, none is answered
    try:
        start_ = time.monotonic()
        with pytest.raises(Unavailable, match=r"shards \[1\]") as e:
            cluster.search(query, requests, [50], start_ + 1.5)
        assert e.value.shards == [1]
        # Not before the deadline (ray.wait may wake a ms early).
        assert time.monotonic() - start_ >= 1.4
        deadline = time.monotonic() + 300
        part = cluster.search(query, requests, [50], deadline, allow_partial=True)
        assert time.monotonic() < deadline  # not waited for: down since the deadline above
        assert part.missing == [1] and part.version == whole.version
        others = [i for i in whole.results[0].ad_ids.tolist() if shard_of([i], S)[0] != 1]
        assert part.results[0].ad_ids.tolist()[: len(others)] == others
        assert not set(part.results[0].ad_ids.tolist()) & set(ids[shard_of(ids, S) == 1])
    finally:
        os.kill(pid, signal.SIGKILL)
    # Ray restarts the shard; a read with room in its deadline waits for it.
    again = cluster.search(query, requests, [50], time.monotonic() + 120)
    assert not again.missing
    assert again.results[0].ad_ids.tolist() == whole.results[0].ad_ids.tolist()
    # A read that saw a shard fail does not wait for it when partial answers are allowed.
    ray.kill(cluster.shards[0], no_restart=False)
    quick = cluster.search(query, requests, [50], time.monotonic() + 120, allow_partial=True)
    assert quick.missing in ([], [0])


@pytest.mark.skipif(not channel.available(), reason="channels are Linux's")
def test_searches_go_through_the_shards_channels(clusters, tmp_path):
    """A shard's first answer comes through Ray and names its channel: later searches go
    through the channel, answering as Ray calls do (a handle that makes none), writes included;
    the handle's mutations and read points take the coordinator's channel once it knows it. A
    shard killed: its channel's calls fail as its Ray call would, the read asks it again
    through Ray until the restarted process answers, and connects to that one's channel."""
    rng = np.random.default_rng(11)
    index = AdIndex(G, D, dtype=torch.float32, extra_fields=EXTRA)
    ids = rng.choice(10_000, 200, replace=False)
    index.upsert(ids, *ads(ids, rng))
    cluster = start(tmp_path, index, clusters)
    by_ray = Cluster(cluster.shards, cluster.coordinator)
    by_ray.direct = False
    query = tuple(rng.normal(size=s).astype(np.float32) for s in ((2, E, G), (2, E, D), (2, E)))
    requests = [(AdRequest(None, 0, "feed", "ios", filter=FILTERS[i]), {}) for i in (0, 1)]

    def same(handle: Cluster, ks=(50, 7)):
        got = handle.search(query, requests, list(ks), time.monotonic() + 120)
        want = reference(index, query, requests, list(ks))
        assert [r.ad_ids.tolist() for r in got.results] == [r.ad_ids.tolist() for r in want]
        assert [r.scores.tolist() for r in got.results] == [r.scores.tolist() for r in want]
        return got

    assert not any(cluster.channel(s) for s in range(S))
    same(cluster)
    links = [cluster.channel(s) for s in range(S)]
    assert all(links)
    read = cluster.scatter(query, requests, [50, 7])
    assert all(isinstance(call, Future) for call in read.calls)  # no Ray call at all
    same(cluster)
    new = [20_000, 20_001, 20_002]
    made = ads(new, rng)
    index.upsert(new, *made)
    version = cluster.upsert(np.array(new), *made)
    assert same(cluster).version == version == same(by_ray).version
    assert not any(by_ray.channel(s) for s in range(S))
    until(lambda: cluster._writes.channel is not None, "the coordinator's channel")
    writes = cluster._writes.channel
    index.delete([new[0]])
    assert cluster.delete([new[0]]) == version + 1 and cluster._writes.channel is writes
    sent = writes._next  # calls made on the coordinator's channel
    read = cluster.scatter(query, requests, [50, 7])  # after its own write: asks a read point
    assert -1 in read.calls.values() and writes._next == sent + 1  # on the channel too
    assert same(cluster).version == version + 1

    os.kill(ray.get(cluster.shards[1].pid.remote()), signal.SIGKILL)
    same(cluster)
    assert links[1].closed and cluster.channel(1) not in (None, links[1])
    assert cluster.channel(0) is links[0] and cluster.channel(2) is links[2]


def test_reshard_offline_keeps_every_ad_and_the_version(clusters, tmp_path):
    """`m31 cluster init` then mutations on 2 shards; stopped, `m31 cluster reshard` to 3:
    the new cluster answers as the old one did, at the same version, and takes writes."""
    from typer.testing import CliRunner

    from m31.cli import app

    rng = np.random.default_rng(9)
    index = AdIndex(G, D, dtype=torch.float32, extra_fields=EXTRA)
    ids = rng.choice(10_000, 120, replace=False)
    index.upsert(ids, *ads(ids, rng))
    runner = CliRunner()
    snapshot = index.save(tmp_path / "snapshot")
    out = runner.invoke(app, ["cluster", "init", "--index", str(snapshot), "--shards", "2",
                              "--out", str(tmp_path / "two")])  # fmt: skip
    assert out.exit_code == 0, out.output
    old = Cluster.start(tmp_path / "two", ClusterOptions(shard_cpus=0))
    more = np.arange(50_000, 50_010)
    g, x, b, attrs = ads(more, rng)
    old.upsert(more, g, x, b, attrs)
    old.delete(ids[:5])
    old.update_attributes(int(ids[5]), {"tags": ["b"]})
    query = tuple(rng.normal(size=s).astype(np.float32) for s in ((2, E, G), (2, E, D), (2, E)))
    requests = [(AdRequest(None, 0, "feed", "ios", filter=f), {}) for f in FILTERS[1:3]]
    before = old.search(query, requests, [40, 200], time.monotonic() + 60)
    for actor in [*old.shards, old.coordinator]:
        ray.kill(actor, no_restart=True)  # offline: nothing serves the old state
    args = ["cluster", "reshard", "--from", str(tmp_path / "two"), "--shards", "3",
            "--out", str(tmp_path / "three")]  # fmt: skip
    deadline = time.monotonic() + 60
    while (out := runner.invoke(app, args)).exit_code != 0 and time.monotonic() < deadline:
        assert "already open" in out.output, out.output  # the killed processes still exiting
        time.sleep(0.1)
    assert out.exit_code == 0, out.output
    new = Cluster.start(tmp_path / "three", ClusterOptions(shard_cpus=0))
    clusters.append(new)
    assert len(new.shards) == 3 and sum(i["ads"] for i in new.info()) == 125
    after = new.search(query, requests, [40, 200], time.monotonic() + 60)
    assert after.version == before.version
    for a, w in zip(after.results, before.results, strict=True):
        assert a.ad_ids.tolist() == w.ad_ids.tolist()
    assert new.get(int(ids[5]))[0]["tags"] == ["b"]
    assert new.delete([int(more[0])]) == before.version + 1
    bad = runner.invoke(app, args)
    assert bad.exit_code == 2 and "exists" in bad.output
