"""Trained checkpoints through the simulated funnel and the auction on a synthetic world
(`m31 simulate`, `m31 auction`; DESIGN §8): the checkpoints loaded as `m31.eval.runs` loads
them, then `m31.eval.funnel.simulate` or `m31.eval.auction.run_auction`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from m31.eval.offline import requests_from_split
from m31.eval.runs import load_scorer
from m31.model import Catalog


def simulate_funnel(
    data: Path,
    retrievers: Sequence[tuple[str, Path]],
    ranker: Path,
    *,
    k: int = 500,
    slots: int = 4,
    requests: int = 2000,
    seed: int = 0,
    split: str = "leave-last-out",
    device: str = "cpu",
) -> dict:
    """The simulated funnel (`m31.eval.funnel.simulate`) of checkpoints on a synthetic world:
    each retriever's top `k` eligible ads, ordered by the ranking model `ranker`, `slots` of
    them shown; conversions drawn from the ground truth. `retrievers`: (name, checkpoint), the
    first the baseline; the name "" is the checkpoint's model kind."""
    from m31.data import dataset
    from m31.eval.funnel import funnel_eligibility, simulate
    from m31.eval.metrics import topk_rows
    from m31.features.folder import features_for
    from m31.world.truth import GroundTruth

    data = Path(data)
    if not (data / "truth.npz").is_file():
        raise ValueError(f"{data}: no truth.npz; the funnel needs a synthetic marketplace")
    feats = features_for(data, split)
    catalog = Catalog.from_features(feats).to(device)
    fns = {}
    for name, path in retrievers:
        fn = load_scorer(path, feats, device, catalog)
        name = name or fn.model.cfg.kind
        if name in fns:
            raise ValueError(f"two models are named {name!r}; name them NAME=PATH")
        fns[name] = fn
    rank = load_scorer(ranker, feats, device, catalog)
    truth = GroundTruth.from_arrays(dataset.load_truth(data))
    req = requests_from_split(feats, "test", max_users=requests, seed=seed)
    eligible = funnel_eligibility(data, feats)

    def retrieve_with(fn):
        # Retrieval scans only eligible ads, as the index does.
        return lambda r: topk_rows(np.where(eligible(r.ts), fn(r), -np.inf), k)

    return simulate(
        {name: retrieve_with(fn) for name, fn in fns.items()},
        rank.rank,
        truth,
        req,
        k=k,
        slots=slots,
        seed=seed,
        eligible=eligible(req.ts),  # never show an ineligible ad, however few are eligible
    )


def simulate_auction_run(
    data: Path,
    model: Path,
    ranker: Path,
    cfg,
    arms=None,
    split: str = "leave-last-out",
    device: str = "cpu",
    log=lambda _: None,
) -> dict:
    """The funnel as an auction (`m31.eval.auction.run_auction`) on a synthetic world: the
    retrieval checkpoint `model` indexes the world's ads with the market's bids, the checkpoint
    `ranker` (a ranking model, or any model) predicts conversions for the auction."""
    from m31.data import dataset
    from m31.eval.auction import ARMS, run_auction
    from m31.features.folder import features_for
    from m31.world.truth import GroundTruth

    data = Path(data)
    if not (data / "truth.npz").is_file():
        raise ValueError(f"{data}: no truth.npz; the auction needs a synthetic marketplace")
    feats = features_for(data, split)
    catalog = Catalog.from_features(feats).to(device)
    retrieval = load_scorer(model, feats, device, catalog).model
    rank = load_scorer(ranker, feats, device, catalog)
    truth = GroundTruth.from_arrays(dataset.load_truth(data))
    ads = dataset.load(data).ads
    return run_auction(ads, feats, retrieval, rank.rank, truth, cfg, arms or ARMS, log=log)
