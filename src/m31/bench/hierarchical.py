"""Recall and speed-up of the hierarchical index against exhaustive scoring, by clusters probed.

    m31 bench hierarchical --data DIR --model CKPT [--clusters 256] [--requests 200] [--k 100]

DIR is a dataset folder with features (as `m31 train` leaves it), CKPT a retrieval checkpoint.
The index is `m31 index build`'s (`index_from_model`, bf16), clustered as `m31 index build
--clusters` clusters it (`Clusters.build`). Requests are the test split's; eligibility is every
ad (the index's own masks are exercised in the tests). Prints, per probe count, recall@K against
the exhaustive top-K, the share of ads scored, and the wall-time speed-up of `Prober.search`
(what `m31 serve --probe` runs) over the exhaustive `search` on the same requests (B = 1 each).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from m31.bench.results import Figure, short
from m31.engine import search
from m31.engine.build import index_from_model
from m31.engine.probe import Prober
from m31.eval import requests_from_split
from m31.features.folder import features_for
from m31.index.hierarchical import Clusters
from m31.model import Catalog, load_checkpoint, make_requests


def run(data: Path, model_path: Path, clusters: int, requests: int, k: int) -> list[Figure]:
    """`m31 bench hierarchical`: recall, share scored and speed-up per probe count, printed;
    the figures."""
    feats = features_for(data)
    model, _ = load_checkpoint(model_path, feats)
    catalog = Catalog.from_features(feats)
    view = index_from_model(data, model, feats, torch.bfloat16).frozen_view()
    req = requests_from_split(feats, "test", max_users=requests)
    with torch.no_grad():
        r = make_requests(
            feats, req.user, req.ts, req.surface, req.hour, req.platform, model.cfg.max_len
        )
        q, v, p = model.encode_requests(r, catalog)
    start = time.perf_counter()
    built = Clusters.build(view, clusters)
    build_s = time.perf_counter() - start

    def per_request(fn):
        start = time.perf_counter()
        out = [fn((q[i : i + 1], v[i : i + 1], p[i : i + 1])) for i in range(len(p))]
        return out, time.perf_counter() - start

    exact, t_exact = per_request(lambda qq: search(qq, view, None, [k])[0].ad_ids)
    n_ads = int(view.row_ids.shape[0])
    print(
        f"{n_ads:,} ads, {clusters} clusters (k-means in {build_s:.1f} s), "
        f"{len(p)} test requests, K = {k}"
    )
    print(f"{'probed':>7} {'recall@K':>9} {'ads scored':>11} {'speed-up':>9}")
    probes = sorted({1, 2, 4, 8, 16, 32, 64, 128, clusters} & set(range(1, clusters + 1)))
    built_case = f"N={short(n_ads)} clusters={clusters}"
    figures = [Figure("hierarchical", built_case, "k-means", "build_s", build_s, "s")]
    for n_probe in probes:
        prober = Prober(built, n_probe)
        prober.rows_by_cluster(view)  # once per version of the ads, not per request
        got, t = per_request(lambda qq, prober=prober: prober.search(qq, view, None, [k]))
        recall = np.mean(
            [
                len(set(g[0][0].ad_ids.tolist()) & set(e.tolist())) / len(e)
                for g, e in zip(got, exact, strict=True)
            ]
        )
        share = sum(g[1] for g in got) / (len(p) * n_ads)
        print(f"{n_probe:>7} {recall:>9.3f} {share:>10.1%} {t_exact / t:>8.1f}x")
        case = f"N={short(n_ads)} clusters={clusters} B=1 K={k} requests={len(p)}"
        variant = f"probe {n_probe}"
        figures += [
            Figure("hierarchical", case, variant, f"recall_at_{k}", float(recall)),
            Figure("hierarchical", case, variant, "ads_scored", 100 * share, "%"),
            Figure("hierarchical", case, variant, "speedup", t_exact / t, "x"),
        ]
    return figures
