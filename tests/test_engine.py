"""The engine end to end on a tiny world: the real model, the real index, brute force beside."""

import dataclasses

import numpy as np
import pytest
import torch

from m31.engine import AdRequest, Engagement, InlineUser, RequestError, Retriever
from m31.engine.build import index_from_table
from m31.index import RequestContext
from m31.index.testing import eligible
from m31.model import Catalog, build_model, encode_ads, model_preset, vocab_sizes
from m31.vocabularies import SURFACES


@pytest.fixture(scope="module")
def world(tiny_world):
    ds, feats = tiny_world.ds, tiny_world.feats
    torch.manual_seed(0)
    model = build_model(model_preset("tiny", "moe"), vocab_sizes(feats), 384, 32).eval()
    g, x, b = encode_ads(model, Catalog.from_features(feats))
    index = index_from_table(ds.ads, g, x, b, dtype=torch.float32)
    return ds, feats, model, index


def eligible_by_hand(ads, user, req):
    """The targeting rules (`m31.index.testing.eligible`) per ad of the ads table (whose
    schedule starts at `created_at`), for the stored `user` asking `req`."""
    context = RequestContext(
        user["country"],
        user["age"],
        user["gender"],
        req.platform,
        req.surface,
        req.ts,
        req.exclude_ads,
        req.exclude_advertisers,
    )
    return np.array(
        [
            eligible(a["ad_id"], {**a, "schedule_start": a["created_at"]}, context, req.filter)
            for a in ads
        ]
    )


def test_retrieve_equals_brute_force(world):
    ds, feats, model, index = world
    engine = Retriever(model, feats, index)
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
    from m31.model import ScoreFunction

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
    engine = Retriever(model, feats, index)
    ok = AdRequest(user_id=0, ts=ds.meta["time_range"][0], surface="feed", platform="ios")
    with pytest.raises(RequestError, match="user_id: unknown user 99999"):
        engine.retrieve([AdRequest(99999, ok.ts, "feed", "ios")], 5)
    with pytest.raises(RequestError, match=r"requests\[1\]\.surface"):
        engine.retrieve([ok, AdRequest(0, ok.ts, "tv", "ios")], 5)
    with pytest.raises(RequestError, match="k must be positive"):
        engine.retrieve([ok], 0)
    with pytest.raises(RequestError, match=r"requests\[0\]\.filter: .*unknown field"):
        engine.retrieve([AdRequest(0, ok.ts, "feed", "ios", filter={"eq": ["colour", "red"]})], 5)
    with pytest.raises(RequestError, match="exactly one of user_id and user"):
        engine.retrieve([AdRequest(None, ok.ts, "feed", "ios")], 5)
    user = InlineUser(country="nowhere", age=30, gender="F")
    with pytest.raises(RequestError, match=r"requests\[0\]\.user\.country"):
        engine.retrieve([AdRequest(None, ok.ts, "feed", "ios", user=user)], 5)
    user = InlineUser(country=ds.users["country"][0].as_py(), age=30, gender="F")
    for bad, field in (
        (dataclasses.replace(user, gender="x"), "gender"),
        (dataclasses.replace(user, age=-1), "age"),
        (dataclasses.replace(user, cohort=10**6), "cohort"),
        (dataclasses.replace(user, organic_topics=(10**6,)), "organic_topics"),
        (dataclasses.replace(user, history=(Engagement(0, 1, "tv"),)), r"history\[0\]\.surface"),
    ):
        with pytest.raises(RequestError, match=rf"requests\[0\]\.user\.{field}"):
            engine.retrieve([AdRequest(None, ok.ts, "feed", "ios", user=bad)], 5)


def inline_copy(feats, ds, user_id: int, ts: int, shuffle: bool) -> InlineUser:
    """The stored user `user_id` written out inline: demographics, cohort and histories."""
    row = int(np.flatnonzero(feats.users["user_id"] == user_id)[0])
    items, surfaces, times, _ = feats.history(np.array([row]), np.array([ts]))
    organic, _ = feats.organic_history(np.array([row]), np.array([ts]))
    keep = items[0] >= 0
    history = [
        Engagement(int(feats.ads["ad_id"][i]), int(t), SURFACES[s])
        for i, s, t in zip(items[0][keep], surfaces[0][keep], times[0][keep], strict=True)
    ]
    # Engagements at or after the request time are ignored, as for stored users.
    history.append(Engagement(int(feats.ads["ad_id"][0]), ts, "feed"))
    if shuffle:
        history = history[::-1]
    who = ds.users.to_pylist()[user_id]
    return InlineUser(
        country=who["country"],
        age=who["age"],
        gender=who["gender"],
        cohort=who["cohort"],
        history=tuple(history),
        organic_topics=tuple(int(t) for t in organic[0][organic[0] >= 0]),
    )


def test_inline_user_equals_stored_user(world):
    ds, feats, model, index = world
    engine = Retriever(model, feats, index)
    t0, t1 = ds.meta["time_range"]
    rng = np.random.default_rng(3)
    users = [int(u) for u in rng.integers(0, ds.users.num_rows, 4)]
    times = [int(t) for t in rng.integers((t0 + t1) // 2, t1, 4)]
    stored = [AdRequest(u, t, "reels", "android") for u, t in zip(users, times, strict=True)]
    inline = [
        AdRequest(
            None,
            r.ts,
            r.surface,
            r.platform,
            user=inline_copy(feats, ds, r.user_id, r.ts, i % 2 == 0),
        )
        for i, r in enumerate(stored)
    ]
    # Mixed in one batch, in an interleaved order: each answer must match its stored twin.
    out = engine.retrieve([stored[0], inline[0], inline[1], stored[1], *inline[2:]], k=20)
    want = engine.retrieve(stored, k=20).results
    got = [out.results[i] for i in (1, 2, 4, 5)]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a.ad_ids, b.ad_ids)
        np.testing.assert_allclose(a.scores, b.scores, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.results[0].ad_ids, want[0].ad_ids)
    np.testing.assert_array_equal(out.results[3].ad_ids, want[1].ad_ids)


def test_nothing_eligible_and_k_above_eligible(world):
    ds, feats, model, index = world
    engine = Retriever(model, feats, index)
    early = ds.meta["time_range"][0] - 10**9  # before any ad was created
    out = engine.retrieve([AdRequest(0, early, "feed", "ios")], 10)
    assert len(out.results[0].ad_ids) == 0
    late = ds.meta["time_range"][1]
    threads = torch.get_num_threads()
    out = engine.retrieve([AdRequest(0, late, "feed", "ios")], 100_000)
    assert 0 < len(out.results[0].ad_ids) < ds.ads.num_rows
    assert torch.get_num_threads() == threads  # encoding ran on one core, and it is given back


def test_ad_encoder_matches_the_catalogue_encoding(world):
    """A catalogue ad sent as a new ad encodes like the catalogue does when its co-engagement
    embedding is the cold-start zero."""
    from m31.engine.ad_encoder import AdEncoder, NewAd

    ds, feats, model, _ = world
    encoder = AdEncoder(model, feats)
    rows = [0, 5, 17]
    ads = ds.ads.take(rows).to_pylist()
    new = [
        NewAd(a["ad_id"], a["advertiser_id"], a["objective"], a["format"], a["topic"],
              a["category"], a["text"], a["quality"])
        for a in ads
    ]  # fmt: skip
    catalog = Catalog.from_features(feats).take(torch.tensor(rows))
    catalog.cooc_emb = torch.zeros_like(catalog.cooc_emb)
    with torch.no_grad():
        want = model.encode_ads(catalog)
    got = encoder.encode(new)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    # A format the model's vocabulary does not hold is the unknown value, whose row is zero.
    unknown = catalog.take(torch.tensor([0]))
    unknown.format = torch.full_like(unknown.format, len(feats.meta["vocab"]["format"]))
    with torch.no_grad():
        want = model.encode_ads(unknown)
    got = encoder.encode([dataclasses.replace(new[0], format="hologram")])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    assert not model.ads.item.format.weight[-1].any()
    with pytest.raises(ValueError, match=r"ads\[0\]\.topic"):
        encoder.encode([dataclasses.replace(new[0], topic=10**6)])


def test_writers_do_not_wait_for_a_retrieves_masks(world, monkeypatch):
    """While a batch's masks are being built, an update and an upsert complete; the batch is
    answered at the version it started from."""
    import threading

    from m31.index import IndexView

    ds, feats, model, _ = world
    g, x, b = encode_ads(model, Catalog.from_features(feats))
    index = index_from_table(ds.ads, g, x, b, dtype=torch.float32)  # its own: it is mutated
    engine = Retriever(model, feats, index)
    request = AdRequest(0, ds.meta["time_range"][1], "feed", "ios")
    before = engine.retrieve([request], k=10)
    top = int(before.results[0].ad_ids[0])

    building, release = threading.Event(), threading.Event()
    build = IndexView.eligible_bits

    def held(view, *args):
        building.set()
        assert release.wait(60), "never released"
        return build(view, *args)

    monkeypatch.setattr(IndexView, "eligible_bits", held)
    answers, errors = [], []

    def retrieve():
        try:
            answers.append(engine.retrieve([request], k=10))
        except Exception as e:  # surfaced in the test's thread below
            errors.append(e)

    def write():
        index.pause(top)
        row = index.get(top)
        index.upsert([10**9], row.g[None], row.x[None], [row.b], [row.attributes])

    reader, writer = threading.Thread(target=retrieve), threading.Thread(target=write)
    reader.start()
    try:
        assert building.wait(60), "the retrieve never built a mask"
        writer.start()
        writer.join(60)
        assert not writer.is_alive(), "the writer waited for the retrieve's masks"
    finally:
        release.set()
        reader.join(60)
    assert not errors, errors[0]
    assert answers[0].version == before.version == index.version - 2
    np.testing.assert_array_equal(answers[0].results[0].ad_ids, before.results[0].ad_ids)
    monkeypatch.undo()
    after = engine.retrieve([request], k=10).results[0].ad_ids
    assert top not in after


@pytest.mark.parametrize("k", [1, 5, 70, 200])
def test_equal_scores_go_to_the_lower_ad_id(world, k):
    """Identical ads score identically; their rows are in descending ad-id order and more of
    them tie than the kernel's margin, so the lower row is not the lower id: the engine still
    returns them by ascending ad id, as the search and the merge of a sharded index do."""
    from m31.engine import TIE_MARGIN, eligible_masks, merge, request_context, search

    ds, feats, model, _ = world
    g, x, b = encode_ads(model, Catalog.from_features(feats))
    copies = 150  # more copies than TIE_MARGIN: the search must ask again
    assert copies > TIE_MARGIN
    ads = ds.ads.to_pylist()
    ids = list(range(10**6 + copies, 10**6, -1))  # descending ids in ascending rows
    index = index_from_table(ds.ads, g, x, b, dtype=torch.float32)
    best = index_from_table(ds.ads, g * 0, x * 0, b * 0 + 100, dtype=torch.float32)
    row = best.get(0)
    attrs = {**ads[0], "status": "active", "schedule_start": None, "schedule_end": None}
    attrs = {name: attrs.get(name) for name in index.schema}
    for name in ("target_countries", "target_genders", "target_platforms", "target_surfaces"):
        attrs[name] = []
    attrs["target_age_min"] = attrs["target_age_max"] = None
    index.upsert(
        ids, row.g.expand(copies, -1), row.x.expand(copies, -1), [row.b] * copies, [attrs] * copies
    )
    engine = Retriever(model, feats, index)
    request = AdRequest(0, ds.meta["time_range"][1], "feed", "ios")
    got = engine.retrieve([request], k=k).results[0]
    want = sorted(ids)[: min(k, copies)]
    assert got.ad_ids[: len(want)].tolist() == want
    assert (got.scores[: len(want)] == got.scores[0]).all()
    if k > copies:  # after the tied block, the rest in (score, ad id) order
        rest_scores, rest_ids = got.scores[copies:], got.ad_ids[copies:]
        assert (np.diff(rest_scores) <= 0).all() and len(rest_ids) == k - copies
    # The same rows split into two parts, searched apart and merged: the same answer.
    view = index.frozen_view()
    prepared = engine.prepare([request], k)
    query = engine.encode(prepared)
    ctx = [(request_context(p.request, p.targeting), p.filter) for p in prepared]
    whole = search(query, view, eligible_masks(view, ctx), [k])[0]
    np.testing.assert_array_equal(whole.ad_ids, got.ad_ids)
    rows = torch.arange(view.row_ids.shape[0])
    parts = []
    for keep in (rows % 2 == 0, rows % 2 == 1):
        mask = eligible_masks(view, ctx).unpack() & keep
        parts.append(search(query, view, mask, [k])[0])
    merged = merge(parts, k)
    np.testing.assert_array_equal(merged.ad_ids, got.ad_ids)
    np.testing.assert_array_equal(merged.scores, got.scores)


def test_an_8_bit_index_serves_what_its_dequantized_table_would(world):
    """The engine on an int8 index (the 8-bit kernel reads the codes) returns the ads and scores
    of the same engine on a float32 index of the dequantized rows."""
    from m31.ops.quant import quantize_ad_table

    ds, feats, model, _ = world
    g, x, b = encode_ads(model, Catalog.from_features(feats))
    int8 = index_from_table(ds.ads, g, x, b, dtype=torch.int8)
    plain = index_from_table(ds.ads, *quantize_ad_table(g, x, b).dequantize(), dtype=torch.float32)
    for index in (int8, plain):
        index.pause(7)
        index.delete([11, 12])
    t0, _ = ds.meta["time_range"]
    reqs = [
        AdRequest(user_id=u, ts=t0 + 86_400 * u, surface=s, platform="web")
        for u, s in zip(range(5), SURFACES, strict=True)
    ]
    got = Retriever(model, feats, int8).retrieve(reqs, k=40)
    want = Retriever(model, feats, plain).retrieve(reqs, k=40)
    for a, w in zip(got.results, want.results, strict=True):
        assert len(a.ad_ids) > 0 and not {7, 11, 12} & set(a.ad_ids.tolist())
        np.testing.assert_array_equal(a.ad_ids, w.ad_ids)
        np.testing.assert_allclose(a.scores, w.scores, rtol=1e-5, atol=1e-5)


def test_a_model_without_gate_keys_is_scored_as_one_query(world):
    """G = 0: every ad gets the same expert weights, so the engine folds the E experts into one
    query (one dot product per pair) and answers as the unfolded query does, up to fp32
    rounding: the same ads (but for near-ties) with the same scores to fp32 precision."""
    from m31.engine.search import fold
    from m31.ops.reference import rounded_score

    ds, feats, _, _ = world
    torch.manual_seed(1)
    cfg = dataclasses.replace(model_preset("tiny", "moe"), gate_dim=0)
    model = build_model(cfg, vocab_sizes(feats), 384, 32).eval()
    g, x, b = encode_ads(model, Catalog.from_features(feats))
    index = index_from_table(ds.ads, g, x, b, dtype=torch.float32)
    folded = Retriever(model, feats, index)
    plain = Retriever(model, feats, index)
    plain.fold = False
    ts = ds.meta["time_range"][1]
    users = feats.users["user_id"][:9].tolist()
    reqs = [AdRequest(u, ts, SURFACES[i % len(SURFACES)], "ios") for i, u in enumerate(users)]
    q, v, p = folded.encode(folded.prepare(reqs, 50))
    assert q.shape[1:] == (1, 0) and v.shape[1] == 1  # one expert, no gate keys
    uq, uv, up = plain.encode(plain.prepare(reqs, 50))
    assert uv.shape[1] == sum(cfg.experts.values()) > 1
    # The folded score of every ad is the unfolded one's to fp32 precision.
    full = rounded_score(uq, uv, up, g, x, b)
    one = rounded_score(q, v, p, g, x, b)
    torch.testing.assert_close(one, full, rtol=1e-5, atol=1e-5)
    assert fold(uq, uv, up)[1].shape == v.shape
    got = folded.retrieve(reqs, k=50).results
    want = plain.retrieve(reqs, k=50).results
    assert sum(len(w.ad_ids) for w in want) > 100  # not vacuous
    for a, w in zip(got, want, strict=True):
        np.testing.assert_allclose(a.scores, w.scores, rtol=1e-5, atol=1e-5)
        gap = np.abs(np.diff(w.scores)).min(initial=1.0) if len(w.scores) > 1 else 1.0
        if gap > 1e-4:  # no near-tie: the very same ads in the same order
            np.testing.assert_array_equal(a.ad_ids, w.ad_ids)
        else:
            assert len(set(a.ad_ids.tolist()) ^ set(w.ad_ids.tolist())) <= 2
