import pytest
import torch

from m31.index.hierarchical import HierarchicalIndex, kmeans
from m31.ops import score_topk


def table(n, gdim=6, ddim=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, gdim, generator=gen),
        torch.randn(n, ddim, generator=gen),
        torch.randn(n, generator=gen),
    )


def query(b, e=3, gdim=6, ddim=5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, e, gdim, generator=gen),
        torch.randn(b, e, ddim, generator=gen),
        torch.randn(b, e, generator=gen),
    )


def test_kmeans_assigns_each_point_to_its_nearest_centroid():
    pts = torch.cat([torch.randn(50, 2) + 10, torch.randn(50, 2) - 10])
    centroids, assign = kmeans(pts, 2, seed=3)
    torch.testing.assert_close(assign, torch.cdist(pts, centroids).argmin(1))
    assert sorted(torch.bincount(assign).tolist()) == [50, 50]
    with pytest.raises(ValueError, match="n_clusters"):
        kmeans(pts, 101)


@pytest.mark.parametrize("masked", [False, True])
def test_probing_every_cluster_is_exact(masked):
    g, x, b = table(397)
    q = query(4)
    mask = (torch.arange(397) % 3 != 0) if masked else None
    hier = HierarchicalIndex(g, x, b, n_clusters=13)
    s, r, scored = hier.search(q, mask, k=20, n_probe=13)
    want_s, want_r = score_topk(q, (g, x, b), mask, 20)
    assert torch.equal(r, want_r) and scored == 4 * 397
    torch.testing.assert_close(s, want_s)


def test_fewer_probes_score_fewer_ads_and_recall_rises_with_probes():
    g, x, b = table(2000, seed=5)
    q = query(8, seed=6)
    _, exact = score_topk(q, (g, x, b), None, 50)
    hier = HierarchicalIndex(g, x, b, n_clusters=40)
    recalls, costs = [], []
    for n_probe in (1, 5, 20, 40):
        _, rows, scored = hier.search(q, None, 50, n_probe)
        recalls.append(
            sum(len(set(a.tolist()) & set(e.tolist())) for a, e in zip(rows, exact, strict=True))
            / exact.numel()
        )
        costs.append(scored)
    assert recalls == sorted(recalls) and recalls[-1] == 1.0 and recalls[0] < 1.0
    assert costs == sorted(costs) and costs[0] < costs[-1] / 10
    with pytest.raises(ValueError, match="n_probe"):
        hier.search(q, None, 5, 41)
