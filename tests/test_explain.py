"""Explanations (`m31.engine.explain`) on the tiny world's real model and index, against plain
references: the stage counts against per-ad eligibility, each result's split against its
score, and every why-not against a brute-force ranking of the eligible ads."""

import dataclasses
import json
import re

import numpy as np
import pytest
import torch

from m31.engine import AdRequest, RequestError, Retriever
from m31.engine.build import index_from_table
from m31.engine.explain import MAX_WHY_NOT, slot_names
from m31.index import RequestContext
from m31.index.stages import STAGES
from m31.index.testing import refusing_stage
from m31.model import Catalog, build_model, encode_ads, model_preset, vocab_sizes
from m31.ops.reference import rounded_score


@pytest.fixture(scope="module", params=["gated", "folded", "int8"])
def world(tiny_world, request):
    """The tiny world's moe (with gate keys, or without: its query folded to one slot), on a
    float32 index, or on an 8-bit one; some ads paused and deleted."""
    ds, feats = tiny_world.ds, tiny_world.feats
    torch.manual_seed(0)
    cfg = model_preset("tiny", "moe")
    if request.param == "folded":
        cfg = dataclasses.replace(cfg, gate_dim=0)
    model = build_model(cfg, vocab_sizes(feats), 384, 32).eval()
    g, x, b = encode_ads(model, Catalog.from_features(feats))
    dtype = torch.int8 if request.param == "int8" else torch.float32
    index = index_from_table(ds.ads, g, x, b, dtype=dtype)
    index.pause(7)
    index.delete([11, 12])
    return ds, feats, model, index


def _requests(ds, n: int, **extra) -> list[AdRequest]:
    t0, t1 = ds.meta["time_range"]
    rng = np.random.default_rng(3)
    surfaces = ["feed", "reels", "stories", "search", "marketplace"]
    return [
        AdRequest(
            user_id=int(rng.integers(0, ds.users.num_rows)),
            ts=int(rng.integers(t0, t1)),
            surface=surfaces[i % len(surfaces)],
            platform=["ios", "android", "web"][i % 3],
            exclude_ads=(3, 5),
            exclude_advertisers=(1,),
            filter=[None, {"eq": ["format", "video"]}][i % 2],
            **extra,
        )
        for i in range(n)
    ]


def _context(ds, req: AdRequest) -> RequestContext:
    user = ds.users.to_pylist()[req.user_id]
    return RequestContext(
        user["country"], user["age"], user["gender"], req.platform, req.surface, req.ts,
        req.exclude_ads, req.exclude_advertisers,
    )  # fmt: skip


def _stored(index) -> dict[int, dict]:
    """ad id -> attributes of every live ad, as the index reads them back."""
    with index.snapshot_view() as view:
        ids = view.row_ids[view.live_mask()].tolist()
    return {a: index.get(a).attributes for a in ids}


def test_explained_stages_count_what_per_ad_eligibility_keeps(world):
    ds, feats, model, index = world
    reqs = _requests(ds, 6, explain=True)
    out = Retriever(model, feats, index).retrieve(reqs, k=20).results
    ads = _stored(index)
    for req, got in zip(reqs, out, strict=True):
        e = got.explanation
        assert list(e.eligible) == list(STAGES) and e.eligible["live"] == len(ads)
        context = _context(ds, req)
        first = {a: refusing_stage(a, attrs, context, req.filter) for a, attrs in ads.items()}
        for i, stage in enumerate(STAGES[1:], start=1):
            gone = sum(f in STAGES[1 : i + 1] for f in first.values())
            assert e.eligible[stage] == len(ads) - gone, stage
        assert e.eligible["filter"] >= len(got.ad_ids)
        assert e.kth_score == (float(got.scores[-1]) if len(got.scores) else None)


def test_each_result_is_split_into_what_adds_up_to_its_score(world):
    ds, feats, model, index = world
    out = Retriever(model, feats, index).retrieve(_requests(ds, 4, explain=True), k=15).results
    names = slot_names(model.user.slots)
    assert sum(len(r.ad_ids) for r in out) > 20  # not vacuous
    for got in out:
        e = got.explanation
        assert e.experts == names and [a.ad_id for a in e.ads] == got.ad_ids.tolist()
        for ad, score in zip(e.ads, got.scores.tolist(), strict=True):
            assert len(ad.gate) == len(ad.contributions) == len(names)
            assert sum(ad.gate) == pytest.approx(1.0, abs=1e-5) and min(ad.gate) >= 0
            assert sum(ad.contributions) + ad.bias == pytest.approx(score, rel=1e-4, abs=1e-4)
            assert ad.score == score and ad.value is None


def test_why_not_names_the_first_stage_or_the_rank_of_every_ad(world):
    """Every live ad, a paused one, deleted and unknown ids: the refusing stage the plain
    definition gives, or, for an eligible ad, its rank in a brute-force order of every
    eligible ad's score (ties to the lower id); the returned ones at their positions."""
    ds, feats, model, index = world
    engine = Retriever(model, feats, index)
    ads = _stored(index)
    k = 10
    for req in _requests(ds, 3):
        asked = [*sorted(set(ads) - {7})[: MAX_WHY_NOT - 3], 7, 11, 10**9]
        req = dataclasses.replace(req, why_not=asked)
        got = engine.retrieve([req], k=k).results[0]
        why = {w.ad_id: w for w in got.explanation.why_not}
        assert list(why) == asked
        assert why[11].stage == why[10**9].stage == "unknown"
        assert why[7].stage == "status" and "paused" in why[7].reason
        context = _context(ds, req)
        prepared = engine.prepare([req], k)
        q, v, p = engine.encode(prepared)
        live = {a: refusing_stage(a, attrs, context, req.filter) for a, attrs in ads.items()}
        eligible = sorted(a for a, f in live.items() if f is None)
        with index.snapshot_view() as view:
            rows = {int(a): r for r, a in enumerate(view.row_ids.tolist()) if view.live_mask()[r]}
            g, x, b = (view.ad_table.dequantize() if view.scales is not None else
                       (view.g, view.x, view.b))  # fmt: skip
            at = torch.tensor([rows[a] for a in eligible], dtype=torch.long)
            s = rounded_score(q, v, p, g[at], x[at], b[at])[0].tolist()
        order = sorted(range(len(eligible)), key=lambda i: (-s[i], eligible[i]))
        rank = {eligible[i]: r + 1 for r, i in enumerate(order)}
        assert got.ad_ids.tolist() == [eligible[i] for i in order[:k]]
        seen = {why[a].stage for a in asked[:-3]}
        assert {"rank", "excluded"} <= seen and len(seen) >= 4  # not vacuous
        for a in asked[:-3]:
            w = why[a]
            if live[a] is not None:
                assert w.stage == live[a] and w.score is None and w.reason
            elif rank[a] <= k:
                assert w.stage == "returned" and w.rank == rank[a]
            else:
                assert w.stage == "rank" and w.rank == rank[a] and w.score < got.scores[-1]


def test_why_not_says_a_cap_kept_an_eligible_ad_out(world):
    """With at most one ad per advertiser, an eligible ad ranked above the K-th but behind its
    advertiser's best is out by the cap; one ranked past the answer's end by its rank."""
    ds, feats, model, index = world
    engine = Retriever(model, feats, index)
    req = _requests(ds, 1)[0]
    uncapped = engine.retrieve([req], k=30).results[0].ad_ids.tolist()
    capped_req = dataclasses.replace(req, max_per={"advertiser": 1}, why_not=uncapped)
    got = engine.retrieve([capped_req], k=5).results[0]
    returned = got.ad_ids.tolist()
    advertisers = {a: index.get(a).attributes["advertiser_id"] for a in uncapped}
    walked = uncapped[: uncapped.index(returned[-1]) + 1]  # what the walk went through
    stages = {w.ad_id: w.stage for w in got.explanation.why_not}
    assert any(s == "cap" for s in stages.values())  # not vacuous
    for a in uncapped:
        if a in returned:
            assert stages[a] == "returned"
        elif a in walked:
            best = next(r for r in returned if advertisers[r] == advertisers[a])
            assert stages[a] == "cap" and uncapped.index(best) < uncapped.index(a)
        else:
            assert stages[a] == "rank"


def test_why_not_names_the_filter_clause_an_ad_fails(world):
    """Of a filter that is an `all`, the first clause the ad fails and the ad's values of the
    fields it reads; an `any` is one clause."""
    ds, feats, model, index = world
    engine = Retriever(model, feats, index)
    req = _requests(ds, 1)[0]
    req = dataclasses.replace(req, exclude_ads=(), exclude_advertisers=())
    context = _context(ds, req)
    # ads this request could get but for the filter
    ads = {a: x for a, x in _stored(index).items() if not refusing_stage(a, x, context, None)}
    video = next(a for a, attrs in ads.items() if attrs["format"] == "video")
    image = next(a for a, attrs in ads.items() if attrs["format"] == "image")
    expr = {
        "all": [{"in": ["format", ["video", "carousel"]]}, {"not": {"eq": ["format", "video"]}}]
    }
    either = {"any": [{"eq": ["format", "carousel"]}, {"eq": ["advertiser_id", -1]}]}
    for f, ad, clause, shown in (
        (expr, image, expr["all"][0], "format='image'"),
        (expr, video, expr["all"][1], "format='video'"),
        (either, image, either, "format='image', advertiser_id="),
    ):
        asked = dataclasses.replace(req, filter=f, why_not=[ad])
        w = engine.retrieve([asked], k=5).results[0].explanation.why_not[0]
        assert w.stage == "filter" and json.dumps(clause) in w.reason and shown in w.reason


def test_requests_that_do_not_ask_are_not_explained_and_bad_asks_are_refused(world):
    ds, feats, model, index = world
    engine = Retriever(model, feats, index)
    plain, asked = _requests(ds, 2)
    out = engine.retrieve([plain, dataclasses.replace(asked, why_not=[1])], k=5).results
    assert out[0].explanation is None and out[1].explanation.why_not[0].ad_id == 1
    assert out[1].explanation.ads == []  # why-not alone: no split of the results
    too_many = dataclasses.replace(plain, why_not=list(range(MAX_WHY_NOT + 1)))
    for bad, field in (
        (too_many, "why_not"),
        (dataclasses.replace(plain, why_not=["12"]), "why_not[0]"),
        (dataclasses.replace(plain, why_not=[True]), "why_not[0]"),
        (dataclasses.replace(plain, explain="yes"), "explain"),
    ):
        with pytest.raises(RequestError, match=re.escape(f"requests[0].{field}:")):
            engine.retrieve([bad], k=5)


def test_the_explain_benchmark_times_three_variants_on_a_served_index(served_world):
    """`m31 bench explain`'s run on the serving tests' world: each variant's median and its
    ratio to the plain retrieve of the same run."""
    from m31.bench import explain as bench

    figures = bench.run(served_world.snapshot, served_world.model, k=5, why_not=3, repeat=2)
    got = {(f.variant, f.metric): f.value for f in figures}
    assert set(got) == {(v, m) for v in bench.VARIANTS for m in ("median_ms", "ratio_to_plain")}
    assert got["plain", "ratio_to_plain"] == 1.0 and all(v > 0 for v in got.values())
    assert {f.case for f in figures} == {f.case for f in figures[:1]} and "why_not=3" in figures[
        0
    ].case


def test_ranked_by_value_the_split_holds_the_value_term_and_no_bid_is_said(world):
    """Ranked by value, each result's parts and its value term add up to its score; an ad
    without a bid is out at the filter stage, for that reason."""
    ds, feats, model, index = world
    ads = _stored(index)
    bids = [a for a in sorted(ads) if a % 3 and ads[a].get("bid") is None][:60]
    for a in bids:
        index.update_attributes(a, bid=float(1 + a % 5), pacing=0.5 if a % 2 else None)
    try:
        engine = Retriever(model, feats, index)
        req = dataclasses.replace(_requests(ds, 1)[0], exclude_ads=(), exclude_advertisers=(),
                                  filter=None, rank="value", explain=True)  # fmt: skip
        context = _context(ds, req)
        none = next(a for a in sorted(ads) if a not in bids and ads[a].get("bid") is None
                    and refusing_stage(a, ads[a], context, None) is None)  # fmt: skip
        got = engine.retrieve([dataclasses.replace(req, why_not=[none])], k=8).results[0]
        e = got.explanation
        assert len(e.ads) > 0 and all(ads[a].get("bid") or a in bids for a in got.ad_ids.tolist())
        for ad, score in zip(e.ads, got.scores.tolist(), strict=True):
            assert ad.value is not None
            total = sum(ad.contributions) + ad.bias + ad.value
            assert total == pytest.approx(score, rel=1e-4, abs=1e-4)
        (w,) = e.why_not
        assert w.stage == "filter" and "no bid" in w.reason
    finally:  # the module's other tests see the index as it was
        for a in bids:
            index.update_attributes(a, bid=None, pacing=None)


def test_parts_of_a_split_index_merge_into_the_whole_indexs_explanation(tiny_world):
    """The corpus split over two indexes (by ad id parity, as shards hold it): each index's
    `explain_part`, the eligible counts `ranked_before` summed over both, and `finish` on the
    merged answer give the explanation of the whole index — what a sharded server merges."""
    from m31.engine.explain import explain_part, finish, ranked_before
    from m31.engine.search import eligible_masks, fold, merge, request_context, search

    ds, feats = tiny_world.ds, tiny_world.feats
    torch.manual_seed(0)
    model = build_model(model_preset("tiny", "moe"), vocab_sizes(feats), 384, 32).eval()
    g, x, b = encode_ads(model, Catalog.from_features(feats))
    whole = index_from_table(ds.ads, g, x, b, dtype=torch.float32)
    ids = np.asarray(ds.ads.column("ad_id").to_numpy())
    halves = []
    for parity in (0, 1):
        rows = np.flatnonzero(ids % 2 == parity)
        halves.append(index_from_table(ds.ads.take(rows), g[rows], x[rows], b[rows],
                                       dtype=torch.float32))  # fmt: skip
    engine = Retriever(model, feats, whole)
    names = slot_names(model.user.slots)
    k = 6
    for i, req in enumerate(_requests(ds, 4)):
        cap = {"advertiser": 1} if i % 2 else None
        req = dataclasses.replace(req, explain=True, why_not=list(range(0, 120, 3)), max_per=cap)
        want = engine.retrieve([req], k=k).results[0]
        (one,) = engine.prepare([req], k)
        experts = engine.encode_experts([one])  # the query per expert slot, as retrieve keeps it
        scored = fold(*experts)
        context = request_context(one.request, one.targeting)
        group = None if cap is None else ("advertiser_id", 1)
        parts, answers = [], []
        for index in halves:
            view = index.frozen_view()
            mask = eligible_masks(view, [(context, one.filter)])
            (found,) = search(scored, view, mask, [k], caps=[group], valued=[False])
            answers.append(found)
            parts.append((view, found))
        merged = merge(answers, k, group)
        assert merged.ad_ids.tolist() == want.ad_ids.tolist()
        q1 = tuple(t[0] for t in experts)
        s1 = tuple(t[0] for t in scored)
        pieces = [
            explain_part(view, context, one.filter, q1, s1, found, False, req.why_not, req.filter)
            for view, found in parts
        ]
        pairs = [pair for p in pieces for pair in p.scores.items()]
        before = dict.fromkeys((a for a, _ in pairs), 0)
        for view, _ in parts:
            for (a, _), n in zip(pairs, ranked_before(view, context, one.filter, s1, False, pairs),
                                 strict=True):  # fmt: skip
                before[a] += n
        got = finish(pieces, before, merged, k, group, names, req.why_not)
        e = want.explanation
        assert got.eligible == e.eligible and got.kth_score == e.kth_score
        assert [a.ad_id for a in got.ads] == [a.ad_id for a in e.ads]
        for a, w in zip(got.ads, e.ads, strict=True):
            np.testing.assert_allclose(a.contributions, w.contributions, rtol=1e-9, atol=1e-9)
        assert got.why_not == e.why_not


def test_a_calls_timings_add_a_stage_only_some_of_its_engine_calls_had():
    """A call split over engine calls (`m31.serve.backend.assemble`): one of them explained,
    the other not; the explain time counts where it ran, the other stages add up."""
    from m31.serve.backend import assemble

    plain = ([], 4, {"encode": 1.0, "mask": 0.5, "score_topk": 2.0}, 8, [])
    explained = ([], 3, {"encode": 1.5, "mask": 0.5, "score_topk": 2.5, "explain": 0.75}, 5, [1])
    for parts in ([plain, explained], [explained, plain]):
        _, version, timings, batch, missing = assemble(parts)
        assert timings == {"encode": 2.5, "mask": 1.0, "score_topk": 4.5, "explain": 0.75}
        assert (version, batch, missing) == (3, 8, [1])


def test_an_eligible_ad_an_approximate_search_passed_over_is_said_to_be_missed():
    """`finish` on answers an exact pass cannot give: an eligible ad ranked within the top k
    but not returned (a hierarchical index's probe skipped it) is "missed", not "rank"."""
    from m31.engine.explain import Part, finish
    from m31.engine.search import Retrieved

    found = Retrieved(np.array([5, 9]), np.array([3.0, 1.0], np.float32))
    part = Part({s: 10 for s in STAGES}, [], {}, {7: 2.0, 8: 0.5})
    why = finish([part], {7: 1, 8: 2}, found, 3, None, ["sequence"], [7, 8]).why_not
    assert [(w.ad_id, w.stage, w.rank) for w in why] == [(7, "missed", 2), (8, "missed", 3)]
    why = finish([part], {7: 1, 8: 2}, found, 2, None, ["sequence"], [7, 8]).why_not
    assert [(w.stage, w.rank) for w in why] == [("missed", 2), ("rank", 3)]
