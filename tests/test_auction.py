"""The funnel as an auction (`m31.eval.auction`, issue 30 item 3): the second-price auction and
the Platt fit against hand-checked and known answers, the pacing controller, and a whole
simulated day on a tiny world through the real engine and index: the index holds what the
auction read, every ad is restored afterwards, budgets hold up to one impression, caps hold in
retrieval, and the same seed gives the same figures; `m31 auction` on the command line."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from m31.cli import app
from m31.data import dataset
from m31.eval.auction import (
    AuctionConfig,
    Market,
    _Bids,
    _pace,
    format_auction,
    gsp,
    platt,
    run_auction,
)
from m31.features.folder import features_for
from m31.index import AdIndex
from m31.model import (
    Catalog,
    ScoreFunction,
    build_model,
    model_preset,
    save_checkpoint,
    vocab_sizes,
)
from m31.world.truth import GroundTruth


def test_gsp_winners_pay_the_next_value():
    win, price = gsp(np.array([0.5, 2.0, 0.0, 1.0, 2.0]), 3)
    assert win.tolist() == [1, 4, 3]  # a tie goes to the earlier entrant
    assert price.tolist() == [2.0, 1.0, 0.5]
    win, price = gsp(np.array([0.0, 3.0, 0.0]), 2)  # one entrant: it pays nothing
    assert win.tolist() == [1] and price.tolist() == [0.0]
    win, price = gsp(np.zeros(4), 2)
    assert len(win) == len(price) == 0


def test_platt_recovers_a_known_scaling():
    rng = np.random.default_rng(0)
    s = rng.normal(size=200_000)
    y = rng.random(len(s)) < 1 / (1 + np.exp(-(1.7 * s - 3.0)))
    a, c = platt(s, y)
    assert a == pytest.approx(1.7, abs=0.05) and c == pytest.approx(-3.0, abs=0.05)


def test_the_config_is_checked():
    for bad in ({"minutes": 0}, {"k": 2, "slots": 3}, {"gain": math.nan}, {"per_minute": 1.5}):
        with pytest.raises(ValueError):
            AuctionConfig(**bad)


def test_the_controller_paces_toward_an_even_spend():
    index = AdIndex(2, 2, dtype=torch.float32)
    index.upsert([10, 11, 12, 13], np.zeros((4, 2)), np.zeros((4, 2)), np.zeros(4),
                 [{"bid": 1.0}] * 4)  # fmt: skip
    market = Market(np.array([10, 11, 12, 13]), np.array([0, 0, 1, -1]), np.ones(4), np.ones(4))
    bids = _Bids(index, market)
    bids.set_pacing(np.array([1]), np.array([0.5]))
    # half the day gone: ad 10 spent all of its budget so far (the even pace: 0.5), ad 11 a
    # tenth of its half, ad 12 nothing, ad 13 the even pace within 1%
    _pace(bids, np.array([1.0, 0.05, 0.0, 0.502]), np.ones(4), 0.5, gain=1.0)
    assert bids.pacing[0] == pytest.approx(math.exp(-1.0))  # overspending: slower
    assert bids.pacing[1] == pytest.approx(min(1.0, 0.5 * math.exp(0.9)))  # behind: faster
    assert bids.pacing[2] == 1.0 and bids.pacing[3] == 1.0  # no spend; a change under 5%
    for row, ad in enumerate(market.ad_ids.tolist()):
        assert (index.get(ad).attributes["pacing"] or 1.0) == pytest.approx(bids.pacing[row])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_world):
    """A tiny marketplace with its truth, features and an untrained moe (retriever and ranker)."""
    root = tmp_path_factory.mktemp("auction")
    data, ds = tiny_world.folder, tiny_world.ds
    feats = features_for(data)
    torch.manual_seed(0)
    net = build_model(model_preset("tiny", "moe"), vocab_sizes(feats), feats.text_emb.shape[1],
                      feats.cooc_emb.shape[1]).eval()  # fmt: skip
    save_checkpoint(root / "moe.pt", net, feats, [])
    truth = GroundTruth.from_arrays(dataset.load_truth(data))
    return data, ds, feats, net, truth, root / "moe.pt"


CFG = AuctionConfig(minutes=6, per_minute=8, k=30, slots=2, seed=1)


def test_a_simulated_day_through_the_engine(tiny, monkeypatch):
    _, ds, feats, net, truth, _ = tiny
    rank = ScoreFunction(net, feats, Catalog.from_features(feats)).rank
    seen = {}
    import m31.eval.auction as auction

    day = auction._day

    def watched(engine, bids, requests, req, predict, truth_, cfg, rank_, cap, budget):
        out = day(engine, bids, requests, req, predict, truth_, cfg, rank_, cap, budget)
        index = engine.index
        # what the auction read is what the index holds, at the end of each day
        for row, ad in enumerate(bids.market.ad_ids.tolist()):
            attrs = index.get(ad).attributes
            assert (attrs["pacing"] or 1.0) == pytest.approx(bids.pacing[row])
            assert attrs["status"] == "budget_exhausted" or not bids.paused[row]
            assert attrs["bid"] == pytest.approx(bids.market.bid[row])
        if budget is not None:  # paused exactly when the spend reached the budget
            reached = out.ad_spend >= budget
            assert np.array_equal(reached, bids.paused), (reached.sum(), bids.paused.sum())
        seen[(rank_, cap)] = (out, engine)
        return out

    monkeypatch.setattr(auction, "_day", watched)
    result = run_auction(ds.ads, feats, net, rank, truth, CFG)
    assert set(seen) == {("relevance", None), ("value", None), ("relevance", 2), ("value", 2)}
    assert result["requests"] == 48 and len(result["pairs"]) == 4
    engine = seen["value", 2][1]
    status = dict(zip(ds.ads["ad_id"].to_pylist(), ds.ads["status"].to_pylist(), strict=True))
    for ad in engine.index.ids().tolist():  # the day is undone: statuses as given, pacing 1
        attrs = engine.index.get(ad).attributes
        assert attrs["status"] == status[ad] and (attrs["pacing"] or 1.0) == 1.0
    for name, arm in result["arms"].items():
        assert 0 < arm["advertisers_per_auction"] <= CFG.slots, name
        assert arm["advertisers_per_request"] <= CFG.k
    capped = result["arms"]["relevance, max 2 per advertiser"]
    assert (
        capped["advertisers_per_request"] >= result["arms"]["relevance"]["advertisers_per_request"]
    )
    text = format_auction(result)
    assert "value, max 2 per advertiser vs relevance, max 2 per advertiser" in text
    # the same seed, the same day
    monkeypatch.setattr(auction, "_day", day)
    again = run_auction(ds.ads, feats, net, rank, truth, CFG)
    assert again["arms"] == result["arms"]


def test_the_auction_command(tiny, tmp_path):
    data, *_, ckpt = tiny
    out = tmp_path / "auction.json"
    args = ["auction", "--data", str(data), "--model", str(ckpt), "--ranker", str(ckpt),
            "--minutes", "3", "--per-minute", "5", "--k", "20", "--slots", "1", "--json", str(out)]  # fmt: skip
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "value, max 2 per advertiser" in r.output
    assert json.loads(out.read_text())["requests"] == 15
    r = CliRunner().invoke(app, [*args[:-2], "--slots", "50"])
    assert r.exit_code != 0 and "slots" in r.output
