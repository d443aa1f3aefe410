"""What the engine returns over a bfloat16 and an int8 ad table, against a float32 one.

    m31 bench table-dtypes --data runs/demo --model runs/demo/moe.pt [--requests 2000] [--k 100]

A trained retrieval model's ad tower encodes the dataset's catalogue into three indexes (float32,
bfloat16 and int8: `AdIndex(dtype=...)`); the same held-out test requests (a random sample of the
split's test events: user, time, surface, platform) go through `Retriever.retrieve` on each. Each
kernel is exact for the table it reads, so the differences are the tables' rounding alone. Prints
the mean overlap@k of each narrower table's results with float32's (the share of float32's top k
that it also returns), at k = 10 and the given K.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from m31.bench.results import Figure
from m31.engine import AdRequest, Retriever
from m31.engine.build import index_from_model
from m31.features.folder import features_for
from m31.index.ad_table import TABLE_DTYPES
from m31.model import load_checkpoint
from m31.vocabularies import PLATFORMS, SURFACES


def test_requests(feats, n: int, seed: int) -> list[AdRequest]:
    test = feats.splits["test"]
    rows = np.random.default_rng(seed).choice(len(test["user"]), min(n, len(test["user"])), False)
    ids = feats.users["user_id"]
    return [
        AdRequest(
            user_id=int(ids[test["user"][i]]),
            ts=int(test["ts"][i]),
            surface=SURFACES[int(test["surface"][i])],
            platform=PLATFORMS[int(test["platform"][i])],
        )
        for i in rows
    ]


def overlap(got, want, k: int) -> float:
    """Mean over requests of |got's top k ∩ want's top k| / |want's top k|."""
    return float(
        np.mean(
            [
                len(set(a.ad_ids[:k].tolist()) & set(b.ad_ids[:k].tolist())) / len(b.ad_ids[:k])
                for a, b in zip(got, want, strict=True)
                if len(b.ad_ids)
            ]
        )
    )


def run(
    data: Path, model_path: Path, split: str, n_requests: int, k: int, seed: int
) -> list[Figure]:
    """`m31 bench table-dtypes`: the overlaps of the bfloat16 and int8 tables, printed; the
    figures."""
    feats = features_for(data, split)
    model, _ = load_checkpoint(model_path, feats)
    requests = test_requests(feats, n_requests, seed)
    results = {}
    for name, dtype in TABLE_DTYPES.items():
        engine = Retriever(model, feats, index_from_model(data, model, feats, dtype))
        results[name] = [
            r
            for lo in range(0, len(requests), 100)
            for r in engine.retrieve(requests[lo : lo + 100], k).results
        ]
    print(f"{len(requests)} test requests, K = {k}; overlap with the float32 table's results")
    print("| table | overlap@10 | " + f"overlap@{k} |")
    print("| --- | ---: | ---: |")
    figures = []
    case = f"model={Path(model_path).name} split={split} requests={len(requests)} K={k}"
    for name in ("bfloat16", "int8"):
        got, want = results[name], results["float32"]
        at = {at: overlap(got, want, at) for at in (10, k)}
        print(f"| {name} | {at[10]:.4f} | {at[k]:.4f} |")
        figures += [
            Figure("table-dtypes", case, name, f"overlap_at_{n}_vs_float32", v)
            for n, v in at.items()
        ]
    return figures
