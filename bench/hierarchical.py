"""Recall and speed-up of the hierarchical index against exhaustive scoring, by clusters probed.

    python bench/hierarchical.py --data DIR --model CKPT [--clusters 256] [--requests 200] [--k 100]

DIR is a dataset folder with features (as `m31 train` leaves it), CKPT a retrieval checkpoint.
Requests are the test split's; eligibility is every ad (the index's own masks are exercised in
the tests). Prints, per probe count, recall@K against exhaustive top-K, the share of ads scored,
and the wall-time speed-up over exhaustive `score_topk` on the same requests (B = 1 each).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from m31.eval import requests_from_split
from m31.index.hierarchical import HierarchicalIndex
from m31.model import Catalog, encode_ads, load_checkpoint, make_requests
from m31.ops import score_topk
from m31.pipeline import features_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--clusters", type=int, default=256)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--k", type=int, default=100)
    args = ap.parse_args()
    feats = features_for(args.data)
    model, _ = load_checkpoint(args.model, feats)
    catalog = Catalog.from_features(feats)
    table = tuple(t.to(torch.bfloat16) for t in encode_ads(model, catalog))
    req = requests_from_split(feats, "test", max_users=args.requests)
    with torch.no_grad():
        r = make_requests(
            feats, req.user, req.ts, req.surface, req.hour, req.platform, model.cfg.max_len
        )
        q, v, p = model.encode_requests(r, catalog)
    start = time.perf_counter()
    hier = HierarchicalIndex(*table, n_clusters=args.clusters)
    build_s = time.perf_counter() - start

    def per_request(fn):
        start = time.perf_counter()
        out = [fn((q[i : i + 1], v[i : i + 1], p[i : i + 1])) for i in range(len(p))]
        return out, time.perf_counter() - start

    exact, t_exact = per_request(lambda qq: score_topk(qq, table, None, args.k)[1][0])
    n_ads = table[0].shape[0]
    print(
        f"{n_ads:,} ads, {args.clusters} clusters (k-means in {build_s:.1f} s), {len(p)} test requests, K = {args.k}"
    )
    print(f"{'probed':>7} {'recall@K':>9} {'ads scored':>11} {'speed-up':>9}")
    probes = sorted({1, 2, 4, 8, 16, 32, 64, 128, args.clusters} & set(range(1, args.clusters + 1)))
    for n_probe in probes:
        got, t = per_request(lambda qq, n_probe=n_probe: hier.search(qq, None, args.k, n_probe))
        recall = np.mean(
            [
                len(set(g[1][0].tolist()) & set(e.tolist())) / len(e)
                for g, e in zip(got, exact, strict=True)
            ]
        )
        share = sum(g[2] for g in got) / (len(p) * n_ads)
        print(f"{n_probe:>7} {recall:>9.3f} {share:>10.1%} {t_exact / t:>8.1f}x")


if __name__ == "__main__":
    main()
