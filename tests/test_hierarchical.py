"""The hierarchical index (`m31.index.hierarchical`, `m31.engine.probe`): k-means, probing
every cluster equals the exhaustive pass (filters, ties, odd sizes, an 8-bit table), fewer
probes give the exact top-K of the probed clusters' eligible ads, updates are honoured, and
the clusters round-trip through their file."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from serve_helpers import ThreadServer, fresh_state

from m31.engine import AdRequest, eligible_masks, request_context, search
from m31.engine.probe import Prober
from m31.index import AdIndex, compile_filter
from m31.index.hierarchical import Clusters, kmeans
from m31.ops import rounded_score, score
from m31.serve.app import ServeConfig, create_app
from m31.serve.local import LocalBackend

G, D, E = 6, 5, 3
# A few distinct rows among random ones, so that equal scores (ties) are common.
POOL = np.random.default_rng(1).normal(size=(5, G + D + 1)).astype(np.float32)
FILTERS = [None, {"eq": ["format", "video"]}, {"not": {"in": ["advertiser_id", [0, 1]]}}]


def rows_of(n: int, rng) -> np.ndarray:
    out = rng.normal(size=(n, G + D + 1)).astype(np.float32)
    tied = rng.random(n) < 0.3
    out[tied] = POOL[rng.integers(0, len(POOL), int(tied.sum()))]
    return out


def attributes(n: int, rng) -> list[dict]:
    return [{"advertiser_id": int(rng.integers(0, 5)), "format": ["video", "image"][int(rng.integers(2))]}
            for _ in range(n)]  # fmt: skip


def make_index(n: int, seed: int = 0, dtype=torch.float32) -> AdIndex:
    rng = np.random.default_rng(seed)
    index = AdIndex(G, D, dtype=dtype, extra_fields={"format": "str"})
    t = rows_of(n, rng)
    ids = rng.permutation(10 * n)[:n] + 1
    index.upsert(ids, t[:, :G], t[:, G:-1], t[:, -1], attributes(n, rng))
    return index


def query(b: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, E, G, generator=gen), torch.randn(b, E, D, generator=gen),
            torch.randn(b, E, generator=gen))  # fmt: skip


def masks(index: AdIndex, view, b: int):
    requests = [AdRequest(user_id=0, filter=FILTERS[i % len(FILTERS)]) for i in range(b)]
    ctx = [(request_context(r, {}), compile_filter(r.filter, index.schema) if r.filter else None)
           for r in requests]  # fmt: skip
    return eligible_masks(view, ctx)


def same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.ad_ids, y.ad_ids)
        np.testing.assert_array_equal(x.scores, y.scores)


def test_kmeans_assigns_each_point_to_its_nearest_centroid():
    pts = torch.cat([torch.randn(50, 2) + 10, torch.randn(50, 2) - 10])
    centroids, assign = kmeans(pts, 2, seed=3)
    torch.testing.assert_close(assign, torch.cdist(pts, centroids).argmin(1))
    assert sorted(torch.bincount(assign).tolist()) == [50, 50]
    with pytest.raises(ValueError, match="n_clusters"):
        kmeans(pts, 101)


@pytest.mark.parametrize("n, clusters, dtype", [(397, 13, torch.float32), (61, 61, torch.float32),
                                                (250, 7, torch.int8), (1, 1, torch.float32)])  # fmt: skip
def test_probing_every_cluster_is_the_exhaustive_pass(n, clusters, dtype):
    index = make_index(n, dtype=dtype)
    view = index.frozen_view()
    prober = Prober(Clusters.build(view, clusters), clusters)
    q = query(5)
    ks = [1, 7, 20, n + 3, 2]
    for mask in (masks(index, view, 5), None):
        got, scored = prober.search(q, view, mask, ks)
        same(got, search(q, view, mask, ks))
        assert scored == 5 * n


def test_fewer_probes_give_the_exact_top_k_of_the_probed_clusters():
    index = make_index(800, seed=4)
    view = index.frozen_view()
    clusters = Clusters.build(view, 20)
    q, k = query(6, seed=5), 30
    mask = masks(index, view, 6).unpack()
    exact = search(q, view, mask, [k] * 6)
    recalls, costs = [], []
    for n_probe in (1, 4, 20):
        prober = Prober(clusters, n_probe)
        got, scored = prober.search(q, view, mask, [k] * 6)
        offsets, rows = prober.rows_by_cluster(view)
        coarse = score(*q, *clusters.rep).topk(n_probe, dim=1).indices
        for i, r in enumerate(got):  # the plain reference: every eligible row probed, sorted
            probed = np.concatenate([rows[offsets[c] : offsets[c + 1]] for c in coarse[i].tolist()])
            probed = probed[mask[i, probed].numpy()]
            # rounded_score, as the kernels rank: the fp32 `score` of a byte-identical ad depends
            # on where BLAS puts its row, so the tied ads here could come an ulp apart
            s = rounded_score(*(t[i : i + 1] for t in q), view.g[probed], view.x[probed],
                              view.b[probed])[0]  # fmt: skip
            ids = view.row_ids[probed].numpy()
            order = np.lexsort((ids, -s.numpy()))[:k]
            np.testing.assert_array_equal(r.ad_ids, ids[order])
            np.testing.assert_allclose(r.scores, s.numpy()[order], rtol=1e-6, atol=1e-6)
        recalls.append(np.mean([len(set(a.ad_ids) & set(e.ad_ids)) / len(e.ad_ids)
                                for a, e in zip(got, exact, strict=True)]))  # fmt: skip
        costs.append(scored)
    assert recalls == sorted(recalls) and recalls[-1] == 1.0
    assert costs == sorted(costs) and costs[0] < costs[-1] / 4
    with pytest.raises(ValueError, match="probe: must be in"):
        Prober(clusters, 21)


def test_updates_are_honoured_and_clusters_round_trip(tmp_path):
    index = make_index(300, seed=7)
    clusters = Clusters.build(index.frozen_view(), 9)
    clusters.save(tmp_path)
    back = Clusters.load(tmp_path)
    assert Clusters.load(tmp_path / "none") is None
    torch.testing.assert_close(back.centroids, clusters.centroids)
    np.testing.assert_array_equal(back.cluster, clusters.cluster)
    rng = np.random.default_rng(8)
    t = rows_of(40, rng)
    new_ids = np.arange(10**6, 10**6 + 40)
    index.upsert(new_ids, t[:, :G], t[:, G:-1], t[:, -1], attributes(40, rng))  # unknown to them
    gone = index.frozen_view().row_ids[:25].numpy()
    index.delete(gone)
    index.update_attributes(int(new_ids[0]), format="video")
    view = index.frozen_view()
    prober = Prober(back, 9)
    q, ks = query(4, seed=9), [50] * 4
    mask = masks(index, view, 4)
    got, _ = prober.search(q, view, mask, ks)
    same(got, search(q, view, mask, ks))  # every cluster probed: the exhaustive answer
    assigned = back.assign(view)
    fresh = np.isin(view.row_ids.numpy(), new_ids)
    points = torch.cat([view.g, view.x, view.b[:, None]], 1)[torch.as_tensor(fresh)]
    np.testing.assert_array_equal(assigned[fresh], torch.cdist(points, back.centroids).argmin(1))
    one, _ = Prober(back, 1).search(q, view, mask, ks)
    assert all(len(r.ad_ids) and not set(r.ad_ids) & set(gone) for r in one)


def test_index_build_writes_clusters_and_the_server_probes_them(served_world, tmp_path):
    """`build_snapshot(clusters=C)` (`m31 index build --clusters`) writes the clusters into the
    snapshot's online features; a server opened with `probe` = C answers as the exhaustive one,
    with fewer probes it answers from fewer ads; a folder without clusters is refused."""
    from m31.engine.build import build_snapshot
    from m31.engine.load import load_engine, serving_folder

    snapshot = tmp_path / "index"
    index = build_snapshot(served_world.data, served_world.model, snapshot, clusters=8)
    assert (snapshot / "online" / "clusters.npz").is_file()
    with pytest.raises(ValueError, match="--clusters: must be in"):
        build_snapshot(
            served_world.data, served_world.model, tmp_path / "x", clusters=len(index) + 1
        )
    state = serving_folder(snapshot, tmp_path / "serving")
    requests = [AdRequest(user_id=int(u), surface="feed") for u in (1, 2, 3)]
    exhaustive = load_engine(state, served_world.model)
    want = exhaustive.retriever.retrieve(requests, 20).results
    exhaustive.close()
    for probe in (8, 1):
        engine = load_engine(state, served_world.model, probe=probe)
        got = engine.retriever.retrieve(requests, 20).results
        engine.close()
        if probe == 8:
            same(got, want)
        else:
            assert all(0 < len(r.ad_ids) <= 20 for r in got)
    config = ServeConfig(index=state, model=served_world.model, probe=8, timeout_ms=60_000)
    with ThreadServer(create_app(config, LocalBackend.load)) as s:  # m31 serve --probe 8
        body = {"requests": [{"user_id": r.user_id, "surface": "feed", "k": 20} for r in requests]}
        got = httpx.post(f"{s.url}/v1/retrieve", json=body, timeout=120).json()["results"]
        assert [r["ad_ids"] for r in got] == [r.ad_ids.tolist() for r in want]
    with pytest.raises(ValueError, match="probe: must be in"):
        load_engine(state, served_world.model, probe=9)
    with pytest.raises(ValueError, match="holds no clusters"):
        load_engine(fresh_state(served_world, "no-clusters"), served_world.model, probe=2)
