"""The engine end to end on a tiny world: the real model, the real index, brute force beside."""

import numpy as np
import pytest
import torch

from m31.engine import AdRequest, RequestError, Retriever
from m31.features import FeatureConfig, build_features
from m31.index import AdIndex
from m31.model import Catalog, model_preset
from m31.model.train import build_model, encode_ads, vocab_sizes
from m31.world.config import preset
from m31.world.generate import generate


@pytest.fixture(scope="module")
def world():
    ds, _ = generate(preset("tiny").with_overrides(n_impressions=10_000), seed=4)
    feats = build_features(ds, FeatureConfig(max_len=8, text_embeddings=False))
    torch.manual_seed(0)
    model = build_model(model_preset("tiny", "moe"), vocab_sizes(feats), 384, 32).eval()
    g, x, b = encode_ads(model, Catalog.from_features(feats))
    index = AdIndex.from_table(ds.ads, g, x, b, dtype=torch.float32)
    return ds, feats, model, index


def eligible_by_hand(ads, user, req):
    """The targeting rules, written out per ad."""
    out = []
    for a in ads:
        out.append(
            a["status"] == "active"
            and a["created_at"] <= req.ts
            and (not a["target_countries"] or user["country"] in a["target_countries"])
            and (not a["target_genders"] or user["gender"] in a["target_genders"])
            and (not a["target_platforms"] or req.platform in a["target_platforms"])
            and a["target_age_min"] <= user["age"] <= a["target_age_max"]
            and a["ad_id"] not in req.exclude_ads
            and a["advertiser_id"] not in req.exclude_advertisers
            and (req.filter is None or a["format"] == req.filter["eq"][1])
        )
    return np.array(out)


def test_retrieve_equals_brute_force(world):
    ds, feats, model, index = world
    engine = Retriever(model, feats, index, ds.users)
    t0, t1 = ds.meta["time_range"]
    rng = np.random.default_rng(0)
    reqs = [
        AdRequest(
            user_id=int(u),
            ts=int(rng.integers(t0, t1)),
            surface=s,
            platform=p,
            exclude_ads=(3, 5, 8),
            exclude_advertisers=(1,),
            filter=f,
        )
        for u, s, p, f in zip(
            rng.integers(0, ds.users.num_rows, 6),
            ["feed", "reels", "stories", "search", "marketplace", "feed"],
            ["ios", "android", "web", "ios", "android", "web"],
            [None, {"eq": ["format", "video"]}, None, None, {"eq": ["format", "image"]}, None],
            strict=True,
        )
    ]
    out = engine.retrieve(reqs, k=25)
    assert out.version == index.version and set(out.timings_ms) == {"encode", "mask", "score_topk"}

    from m31.eval import Requests
    from m31.model.train import ScoreFunction

    fn = ScoreFunction(model, feats, Catalog.from_features(feats))
    ads, users = ds.ads.to_pylist(), ds.users.to_pylist()
    for req, got in zip(reqs, out.results, strict=True):
        hour = (req.ts % 86_400) // 3600
        dense = fn(
            Requests(
                np.array([req.user_id]),
                np.array([req.ts]),
                np.array(
                    [["feed", "stories", "reels", "marketplace", "search"].index(req.surface)]
                ),
                np.array([hour]),
                np.array([["ios", "android", "web"].index(req.platform)]),
            )
        )[0]
        ok = eligible_by_hand(ads, users[req.user_id], req)
        order = np.argsort(-np.where(ok, dense, -np.inf), kind="stable")[: min(25, ok.sum())]
        np.testing.assert_array_equal(got.ad_ids, order)  # ad_id == row in the synthetic world
        np.testing.assert_allclose(got.scores, dense[order], rtol=1e-4, atol=1e-4)


def test_bad_requests(world):
    ds, feats, model, index = world
    engine = Retriever(model, feats, index, ds.users)
    ok = AdRequest(user_id=0, ts=ds.meta["time_range"][0], surface="feed", platform="ios")
    with pytest.raises(RequestError, match="user_id: unknown user 99999"):
        engine.retrieve([AdRequest(99999, ok.ts, "feed", "ios")], 5)
    with pytest.raises(RequestError, match=r"requests\[1\]\.surface"):
        engine.retrieve([ok, AdRequest(0, ok.ts, "tv", "ios")], 5)
    with pytest.raises(RequestError, match="k must be positive"):
        engine.retrieve([ok], 0)
    from m31.index import FilterError

    with pytest.raises(FilterError, match="unknown field"):
        engine.retrieve([AdRequest(0, ok.ts, "feed", "ios", filter={"eq": ["colour", "red"]})], 5)


def test_nothing_eligible_and_k_above_eligible(world):
    ds, feats, model, index = world
    engine = Retriever(model, feats, index, ds.users)
    early = ds.meta["time_range"][0] - 10**9  # before any ad was created
    out = engine.retrieve([AdRequest(0, early, "feed", "ios")], 10)
    assert len(out.results[0].ad_ids) == 0
    late = ds.meta["time_range"][1]
    out = engine.retrieve([AdRequest(0, late, "feed", "ios")], 100_000)
    assert 0 < len(out.results[0].ad_ids) < ds.ads.num_rows
