"""The value term (issue 30 item 2, DESIGN §2 "The value term"): every kernel against the
reference with a value column (Triton under TRITON_INTERPRET=1), the reference against the plain
score plus the term; the index's bid and pacing (checks, PATCH visible at its version, snapshots
without them); value-ranked search against a plain ranking of score + term, mixed batches, caps,
S = 3 shards; the HTTP routes."""

from __future__ import annotations

import json
import math

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from serve_helpers import ADMIN, ThreadServer, World, fresh_state
from test_caps import FILTERS, make_index

from m31.cluster.layout import init_cluster, shard_dir
from m31.cluster.shard import Shard
from m31.engine import (
    AdRequest,
    RequestError,
    Retrieved,
    eligible_masks,
    merge,
    request_context,
    search,
)
from m31.engine.caps import reference as capped_walk
from m31.engine.prepare import HAS_BID
from m31.index import AdIndex, compile_filter
from m31.index.errors import AdIndexError
from m31.index.filters import with_clauses
from m31.ops import available_kernels, score_topk
from m31.ops.quant import quantize_ad_table
from m31.ops.reference import rounded_score, value_bias
from m31.ops.testing import check_topk
from m31.serve.app import ServeConfig, create_app
from m31.serve.local import LocalBackend

KERNELS = available_kernels("cpu")


def problem(seed: int, n: int, n_exp: int, gdim: int, ddim: int, n_req: int, tied: bool):
    """A random problem with a value column; `tied`: rows and values from a pool of three."""
    gen = torch.Generator().manual_seed(seed)
    q, v, p = (torch.randn(*s, generator=gen) for s in
               ((n_req, n_exp, gdim), (n_req, n_exp, ddim), (n_req, n_exp)))  # fmt: skip
    g, x, b = (
        torch.randn(n, gdim, generator=gen),
        torch.randn(n, ddim, generator=gen),
        torch.randn(n, generator=gen),
    )
    value = torch.randn(n, generator=gen) * 2
    if tied:
        pick = torch.randint(0, min(3, n), (n,), generator=gen)
        g, x, b, value = g[:3][pick], x[:3][pick], b[:3][pick], value[:3][pick]
    mask = torch.rand(n_req, n, generator=gen) < 0.7
    return (q, v, p), (g, x, b), value, mask


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 10_000),
    st.integers(1, 700),
    st.integers(1, 3),
    st.sampled_from([0, 3, 8]),
    st.integers(1, 70),
    st.booleans(),
)
def test_every_kernel_scores_the_value_column_as_the_reference(seed, n, n_exp, gdim, k, tied):
    """Odd sizes, G = 0, K above N, forced ties; bf16, fp32 and 8-bit tables."""
    query, (g, x, b), value, mask = problem(seed, n, n_exp, gdim, 5, 3, tied)
    tables = {
        "bf16": (g.bfloat16(), x.bfloat16(), b.bfloat16()),
        "fp32": (g, x, b),
        "int8": quantize_ad_table(g, x, b),
    }
    for name, table in tables.items():
        ref = score_topk(query, table, mask, k, kernel="torch", value=value)
        plain = table.dequantize() if name == "int8" else table
        scored = (*plain[:2], value_bias(plain[2], value))
        # the reference with a value column is the reference of the table with that bias
        same = score_topk(query, scored, mask, k, kernel="torch")
        assert torch.equal(ref[0], same[0]) and torch.equal(ref[1], same[1])
        for kernel in KERNELS[1:]:
            got = score_topk(query, table, mask, k, kernel=kernel, value=value)
            assert check_topk(got, ref, query, scored, mask) is None, (name, kernel)


def test_the_score_is_the_plain_score_plus_the_term():
    query, table, value, mask = problem(1, 513, 3, 8, 5, 4, False)
    k = 40
    scores, rows = score_topk(query, table, mask, k, kernel="torch", value=value)
    plain = rounded_score(*query, *table)  # [B, N]
    found = rows >= 0
    want = plain.gather(1, rows.clamp_min(0)) + value[rows.clamp_min(0)]
    # one fp32 rounding of b + value, one of the score: a few ulps of the magnitudes
    tol = 4 * 2.0**-23 * (want.abs() + value[rows.clamp_min(0)].abs() + 1)
    assert ((scores - want).abs() <= tol)[found].all()
    # and it ranks by it: the best eligible score + term comes first
    best = (plain + value).masked_fill(~mask, -math.inf).amax(1)
    torch.testing.assert_close(scores[:, 0], best, rtol=0, atol=float(tol.max()))


def test_a_bad_value_column_is_refused():
    query, table, value, mask = problem(2, 50, 2, 3, 4, 2, False)
    for bad, message in (
        (value.double(), "float32"),
        (value[:-1], r"\[50\]"),
        ([0.0] * 50, "tensor"),
    ):
        for kernel in KERNELS:
            with pytest.raises(ValueError, match=message):
                score_topk(query, table, mask, 5, kernel=kernel, value=bad)


def test_a_non_finite_value_is_an_ad_never_returned():
    """As a non-finite b: the ad scores NaN or -inf (never returned), or +inf (first)."""
    query, table, value, mask = problem(3, 300, 2, 3, 4, 2, False)
    value[[5, 6, 7]] = torch.tensor([math.nan, -math.inf, math.inf])
    mask[:] = True
    for kernel in KERNELS:
        _, rows = score_topk(query, table, mask, 299, kernel=kernel, value=value)
        for r in range(2):
            got = rows[r].tolist()
            assert got[0] == 7 and 5 not in got and 6 not in got, kernel


def with_bid(tree, schema):
    """A filter as `Retriever.prepare` compiles it for a value-ranked request."""
    return with_clauses(compile_filter(tree, schema) if tree else None, [HAS_BID], schema)


def inputs(index: AdIndex, b: int, rng):
    """(view, masks, query) of b value-ranked requests, with the filters of `test_caps`."""
    view = index.frozen_view()
    filters = [with_bid(FILTERS[i % len(FILTERS)], index.schema) for i in range(b)]
    ctx = [(request_context(AdRequest(user_id=0), {}), f) for f in filters]
    query = tuple(torch.as_tensor(rng.normal(size=s).astype(np.float32))
                  for s in ((b, 2, 4), (b, 2, 4), (b, 2)))  # fmt: skip
    return view, eligible_masks(view, ctx), query


# ---- the index: bid and pacing ------------------------------------------------------------


def valued_index(n: int, rng, dtype=torch.float32) -> AdIndex:
    """`make_index` with a bid on about 80% of the ads and a pacing on half of those."""
    index = make_index(n, rng, dtype, share_tied=0.3)
    ids = index.ids().tolist()
    for ad in ids:
        if rng.random() < 0.8:
            change = {"bid": float(rng.choice([0.5, 1.0, 2.0, 7.25]))}
            if rng.random() < 0.5:
                change["pacing"] = float(rng.choice([0.1, 0.5, 1.0]))
            index.update_attributes(ad, **change)
    return index


def test_bid_and_pacing_are_checked():
    index = valued_index(5, np.random.default_rng(0))
    ad = int(index.ids()[0])
    for bad in ({"bid": 0.0}, {"bid": -1.0}, {"bid": math.nan}, {"bid": math.inf},
                {"pacing": 0.0}, {"pacing": 1.5}, {"pacing": math.nan}, {"bid": "2"}):  # fmt: skip
        with pytest.raises(AdIndexError, match=next(iter(bad))):
            index.update_attributes(ad, **bad)
    version = index.version
    with pytest.raises(AdIndexError, match="bid"):
        index.upsert([10_000], np.zeros((1, 4)), np.zeros((1, 4)), [0.0], [{"bid": -2.0}])
    assert index.version == version and 10_000 not in index


def test_the_value_term_is_log_bid_times_pacing():
    index = AdIndex(2, 2, dtype=torch.float32)
    attrs = [{"bid": 2.0}, {"bid": 2.0, "pacing": 0.25}, {}, {"pacing": 0.5}]
    index.upsert([1, 2, 3, 4], np.zeros((4, 2)), np.zeros((4, 2)), np.zeros(4), attrs)
    term = index.frozen_view().value_term().tolist()
    assert term == pytest.approx([math.log(2.0), math.log(0.5), 0.0, 0.0])


def test_a_patch_of_bid_is_seen_at_the_version_it_returns():
    rng = np.random.default_rng(1)
    index = valued_index(60, rng)
    view, mask, query = inputs(index, 3, rng)
    before = search(query, view, mask, [60] * 3, valued=[True] * 3)
    ad = int(before[0].ad_ids[-1])  # the last of request 0
    version = index.update_attributes(ad, bid=1e6)
    after_view = index.frozen_view()
    assert after_view.version == version
    after = search(query, after_view, mask, [60] * 3, valued=[True] * 3)
    assert after[0].ad_ids[0] == ad
    old = before[0].scores[before[0].ad_ids.tolist().index(ad)]
    bids = view.attributes.numeric("bid")[0].tolist()
    bid_before = dict(zip(view.row_ids.tolist(), bids, strict=True))[ad]
    pacing = index.get(ad).attributes["pacing"] or 1.0
    assert after[0].scores[0] == pytest.approx(
        old - math.log(bid_before * pacing) + math.log(1e6 * pacing), rel=1e-5
    )
    # the old view still answers as before
    again = search(query, view, mask, [60] * 3, valued=[True] * 3)
    assert again[0].ad_ids.tolist() == before[0].ad_ids.tolist()


def test_a_snapshot_written_before_the_value_fields_loads(tmp_path):
    rng = np.random.default_rng(2)
    index = make_index(20, rng, torch.float32)
    path = index.save(tmp_path / "snap")
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["fields"]["bid"], manifest["fields"]["pacing"]
    table = pq.read_table(path / "attributes.parquet").drop_columns(["bid", "pacing"])
    pq.write_table(table, path / "attributes.parquet")
    manifest["files"]["attributes.parquet"]["bytes"] = (path / "attributes.parquet").stat().st_size
    (path / "manifest.json").write_text(json.dumps(manifest))
    loaded = AdIndex.load(path)
    assert len(loaded) == 20 and loaded.schema["bid"] == "float"
    ad = int(loaded.ids()[0])
    loaded.update_attributes(ad, bid=3.0)
    assert loaded.get(ad).attributes["bid"] == 3.0


# ---- value-ranked search ------------------------------------------------------------------


def ranked_by_value(view, query, mask, k: int, kernel: str):
    """The reference: every eligible ad (the masks hold only ads with a bid) by (score + term,
    ad id), from a plain relevance ranking and the view's own columns."""
    n = int(view.row_ids.shape[0])
    full = search(query, view, mask, [n] * query[0].shape[0], kernel)
    term = view.value_term().numpy()
    at = {int(i): r for r, i in enumerate(view.row_ids.tolist())}
    out = []
    for f in full:
        rows = np.array([at[int(i)] for i in f.ad_ids], np.int64)
        ids, scores = f.ad_ids, f.scores.astype(np.float64) + term[rows]
        order = np.lexsort((ids, -scores))[:k]
        out.append((ids[order], scores[order]))
    return out


def same_up_to_near_ties(got: Retrieved, want, tol=1e-5) -> None:
    ids, scores = want
    assert len(got.ad_ids) == len(ids)
    np.testing.assert_allclose(got.scores, scores, rtol=tol, atol=tol)
    differ = got.ad_ids != ids
    if differ.any():  # only where the scores tie within rounding
        assert np.allclose(got.scores[differ], scores[differ], rtol=tol, atol=tol)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_value_ranked_search_is_score_plus_term_on_every_kernel(kernel, dtype):
    rng = np.random.default_rng(3)
    for n in (1, 37, 300):
        index = valued_index(n, rng, dtype)
        view, mask, query = inputs(index, 3, rng)
        for k in (1, 17, n + 2):
            got = search(query, view, mask, [k] * 3, kernel, valued=[True] * 3)
            for r, want in zip(got, ranked_by_value(view, query, mask, k, kernel), strict=True):
                same_up_to_near_ties(r, want)


def test_a_mixed_batch_answers_each_request_as_alone():
    rng = np.random.default_rng(4)
    index = valued_index(200, rng)
    view, mask, query = inputs(index, 4, rng)
    valued = [True, False, False, True]
    caps = [None, ("advertiser_id", 1), ("advertiser_id", 2), ("advertiser_id", 1)]
    got = search(query, view, mask, [9, 10, 11, 12], caps=caps, valued=valued)
    for r in range(4):
        one = tuple(t[r : r + 1] for t in query)
        alone = search(one, view, mask.select(torch.tensor([r])), [9 + r], caps=[caps[r]],
                       valued=[valued[r]])[0]  # fmt: skip
        assert got[r].ad_ids.tolist() == alone.ad_ids.tolist()
        np.testing.assert_array_equal(got[r].scores, alone.scores)


def test_caps_walk_the_value_ranking():
    rng = np.random.default_rng(5)
    index = valued_index(300, rng)
    view, mask, query = inputs(index, 3, rng)
    values, valid = (t.numpy() for t in view.attributes.numeric("advertiser_id"))
    at = {int(i): r for r, i in enumerate(view.row_ids.tolist())}
    full = search(query, view, mask, [300] * 3, valued=[True] * 3)
    for cap, k in ((1, 5), (2, 20)):
        got = search(query, view, mask, [k] * 3, caps=[("advertiser_id", cap)] * 3,
                     valued=[True] * 3)  # fmt: skip
        for r, f in zip(got, full, strict=True):
            rows = np.array([at[int(i)] for i in f.ad_ids], np.int64)
            pick = capped_walk(f.ad_ids, f.scores, values[rows], valid[rows], cap, k)
            assert r.ad_ids.tolist() == f.ad_ids[pick].tolist()


def test_three_shards_merge_to_the_one_index(tmp_path):
    rng = np.random.default_rng(6)
    index = valued_index(400, rng)
    state = init_cluster(index.save(tmp_path / "snapshot"), tmp_path / "state", 3)
    shards = [Shard(shard_dir(state, s), s) for s in range(3)]
    view, mask, query = inputs(index, 3, rng)
    try:
        for cap, k in ((None, 30), (2, 25)):
            max_per = None if cap is None else {"advertiser": cap}
            group = None if cap is None else ("advertiser_id", cap)
            # As the ingress sends them: the request's own filter, and the engine's clause.
            asked = [
                AdRequest(0, filter=FILTERS[i], max_per=max_per, rank="value") for i in range(3)
            ]
            requests = [(r, {}, (HAS_BID,)) for r in asked]
            payload = (tuple(t.numpy() for t in query), requests, [k] * 3)
            answers = [s.search(payload) for s in shards]
            want = search(query, view, mask, [k] * 3, caps=[group] * 3, valued=[True] * 3)
            for r in range(3):
                got = merge([Retrieved(*a.results[r]) for a in answers], k, group)
                assert got.ad_ids.tolist() == want[r].ad_ids.tolist(), (cap, k, r)
                np.testing.assert_array_equal(got.scores, want[r].scores)
    finally:
        for s in shards:
            s.close()


# ---- HTTP ---------------------------------------------------------------------------------


def test_bids_are_patched_and_ranked_over_http(served_world: World):
    world = served_world
    config = ServeConfig(
        index=fresh_state(world, "value"), model=world.model, admin_token=ADMIN, timeout_ms=60_000
    )
    app = create_app(config, LocalBackend.load)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with ThreadServer(app) as s:
        retriever = app.state.backend.retriever
        with pytest.raises(RequestError, match="rank"):
            retriever.prepare([AdRequest(user_id=1, rank="money")], 5)
        body = {"user_id": 1, "surface": "feed", "k": 20}
        plain = httpx.post(f"{s.url}/v1/retrieve", json={"requests": [body]}).json()
        ads = plain["results"][0]["ad_ids"]
        # no ad has a bid yet: a value-ranked request has nothing to rank
        r = httpx.post(f"{s.url}/v1/retrieve", json={"requests": [{**body, "rank": "value"}]})
        assert r.status_code == 200 and r.json()["results"][0]["ad_ids"] == [], r.text
        for bad in ({"bid": 0}, {"bid": -1.5}, {"pacing": 1.01}, {"pacing": 0}, {"bid": "2"}):
            r = httpx.patch(f"{s.url}/v1/ads/{ads[0]}", json=bad, headers=admin)
            assert r.status_code == 422 and next(iter(bad)) in r.text, r.text
        versions = []
        for i, ad in enumerate(ads[:5]):  # the fifth best by relevance bids the most
            change = {"bid": 1.0 + 1e3 * (i == 4), "pacing": 1}
            r = httpx.patch(f"{s.url}/v1/ads/{ad}", json=change, headers=admin)
            assert r.status_code == 200, r.text
            versions.append(r.json()["index_version"])
        got = httpx.get(f"{s.url}/v1/ads/{ads[4]}").json()
        assert got["attributes"]["bid"] == 1001.0 and got["attributes"]["pacing"] == 1.0
        r = httpx.post(f"{s.url}/v1/retrieve", json={"requests": [{**body, "rank": "value"}]})
        out = r.json()
        assert out["index_version"] >= versions[-1]
        ranked = out["results"][0]
        assert ranked["ad_ids"][0] == ads[4] and sorted(ranked["ad_ids"]) == sorted(ads[:5])
        score = dict(zip(ads, plain["results"][0]["scores"], strict=True))
        assert ranked["scores"][0] == pytest.approx(score[ads[4]] + math.log(1001.0), rel=1e-5)
        r = httpx.post(f"{s.url}/v1/retrieve", json={"requests": [{**body, "rank": "money"}]})
        assert r.status_code == 422 and "rank" in r.text
