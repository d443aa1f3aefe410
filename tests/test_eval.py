import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m31.eval import (
    Requests,
    crn_uniform,
    evaluate,
    format_funnel,
    format_table,
    hit_rate_at_k,
    ndcg_at_k,
    overlap_at_k,
    plot_recall_at_k,
    recall_at_k,
    requests_from_split,
    seen_mask,
    simulate,
    target_rank,
    topk_rows,
)
from m31.eval.plot import pareto_front, plot_pareto


@pytest.fixture(scope="module")
def world(tiny_world):
    return tiny_world.feats, tiny_world.truth


def true_conversion(truth):
    all_ads = np.arange(truth.n_ads)[None, :]  # one list shared by every request

    def score(req):
        return truth.probabilities(req.user, all_ads, req.surface, req.hour, req.platform, req.ts)[
            1
        ]

    return score


def random_scores(n_ads, seed):
    rng = np.random.default_rng(seed)
    return lambda req: rng.random((len(req), n_ads), dtype=np.float32)


# --- metrics ---------------------------------------------------------------------------------


def test_topk_ties_go_to_the_lower_row():
    s = np.array([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    assert topk_rows(s, 2).tolist() == [[1, 2], [0, 1]]
    assert topk_rows(s, 4).tolist() == [[1, 2, 4, 3], [0, 1, 2, 3]]


def test_topk_k_larger_than_corpus_and_edge_cases():
    s = np.array([[0.5, -np.inf, 2.0]], dtype=np.float32)
    assert topk_rows(s, 10).tolist() == [[2, 0, 1]]
    assert topk_rows(np.zeros((0, 7), np.float32), 3).shape == (0, 3)
    assert topk_rows(np.zeros((2, 0), np.float32), 3).shape == (2, 0)
    with pytest.raises(ValueError, match="positive"):
        topk_rows(s, 0)
    with pytest.raises(ValueError, match="NaN"):
        topk_rows(np.array([[np.nan, 1.0]]), 1)
    with pytest.raises(ValueError, match=r"\[n, A\]"):
        topk_rows(np.zeros(3), 1)


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 41),
    st.integers(1, 50),
    st.integers(0, 2**31),
    st.sampled_from([np.float32, np.float64, np.int64]),
)
def test_topk_matches_a_stable_sort(n, n_ads, k, seed, dtype):
    # Few distinct values, so most rows have ties across the k-th place; -inf where float.
    s = np.random.default_rng(seed).integers(-3, 3, size=(n, n_ads)).astype(dtype)
    if dtype != np.int64:
        s[s == -3] = -np.inf
    expected = np.argsort(-s, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(topk_rows(s, k), expected)


def test_target_rank_hr_and_ndcg_on_known_ranks():
    s = np.array(
        [
            [0.9, 0.1, 0.5, 0.3],  # target 0: rank 0
            [0.9, 0.1, 0.5, 0.3],  # target 3: rank 2
            [0.2, 0.2, 0.2, 0.2],  # target 2: rank 2 (ties, lower rows first)
            [0.0, 0.4, 0.3, 0.1],  # target 0: rank 3
        ]
    )
    ranks = target_rank(s, np.array([0, 3, 2, 0]))
    assert ranks.tolist() == [0, 2, 2, 3]
    assert hit_rate_at_k(ranks, 1) == 0.25
    assert hit_rate_at_k(ranks, 3) == 0.75
    assert ndcg_at_k(ranks, 3) == pytest.approx((1 + 2 / math.log2(4)) / 4)
    assert ndcg_at_k(ranks, 10) == pytest.approx((1 + 2 / math.log2(4) + 1 / math.log2(5)) / 4)
    with pytest.raises(ValueError, match="target rows"):
        target_rank(s, np.array([0, 1, 2, 4]))
    with pytest.raises(ValueError, match="target must be"):
        target_rank(s, np.array([0, 1]))


def test_recall_and_overlap_on_known_sets():
    retrieved = np.array([[3, 1, 4, 0], [5, 6, 7, 8]])
    relevant = np.array([[1, 2, 3], [9, 5, 8]])
    # top 2: {3, 1} and {5, 6} -> 2/3 and 1/3; top 4: {3, 1, 4, 0}, {5..8} -> 2/3 and 2/3
    assert recall_at_k(retrieved, relevant, 2) == pytest.approx(0.5)
    assert recall_at_k(retrieved, relevant, 4) == pytest.approx(2 / 3)
    other = np.array([[1, 0, 3, 4], [6, 5, 9, 9]])
    assert overlap_at_k(retrieved, other, 1) == pytest.approx(0.0)
    assert overlap_at_k(retrieved, other, 2) == pytest.approx((1 / 2 + 2 / 2) / 2)
    assert overlap_at_k(retrieved, other, 4) == pytest.approx((1 + 2 / 4) / 2)
    assert overlap_at_k(retrieved, retrieved, 3) == 1.0
    with pytest.raises(ValueError, match="differ"):
        overlap_at_k(retrieved, other[:, :2], 3)
    with pytest.raises(ValueError, match="requests"):
        recall_at_k(retrieved, relevant[:1], 2)


# --- offline evaluation ----------------------------------------------------------------------


def test_requests_validate_and_subset(world):
    feats, _ = world
    with pytest.raises(ValueError, match=r"Requests\.ts"):
        Requests(user=[1, 2], ts=[1], surface=[0, 0], hour=[0, 0], platform=[0, 0])
    full = requests_from_split(feats, "test")
    assert len(full) == len(feats.splits["test"]["user"])
    a, b = (requests_from_split(feats, "test", max_users=50, seed=3) for _ in range(2))
    assert len(a) == 50 and np.array_equal(a.user, b.user) and np.array_equal(a.ts, b.ts)
    with pytest.raises(ValueError, match="unknown split"):
        requests_from_split(feats, "nope")


def test_seen_mask_is_the_history_through_the_request_second(world):
    feats, _ = world
    req = requests_from_split(feats, "test")
    idx, items = seen_mask(feats, req)
    strict_idx, strict_items = seen_mask(feats, req, same_second=False)
    seq = feats.engagements
    for i in range(len(req)):
        u = req.user[i]
        lo, hi = seq.offsets[u], seq.offsets[u + 1]
        through = seq.ts[lo:hi] <= req.ts[i]
        before = seq.ts[lo:hi] < req.ts[i]
        assert sorted(items[idx == i]) == sorted(seq.values["item"][lo:hi][through])
        assert sorted(strict_items[strict_idx == i]) == sorted(seq.values["item"][lo:hi][before])
    assert len(idx) > len(req)  # most test users have a train and a val engagement


def test_exclude_seen_removes_seen_ads_but_not_the_target(world):
    feats, _ = world
    seq = feats.engagements
    users = np.flatnonzero(np.diff(seq.offsets) >= 2)[:40]
    # Requests after each user's last engagement whose target repeats their first one.
    test = {
        "user": users,
        "item": seq.values["item"][seq.offsets[users]],
        "ts": seq.ts[seq.offsets[users + 1] - 1] + 1,
        **{c: np.zeros(len(users), np.int64) for c in ("surface", "hour", "platform")},
    }
    feats = dataclasses.replace(feats, splits={"test": test})
    idx, items = seen_mask(feats, requests_from_split(feats))
    assert np.all(np.bincount(idx[items != test["item"][idx]], minlength=len(users)) > 0)

    def seen_first(r):
        s = np.zeros((len(r), feats.n_ads), np.float32)
        i, a = seen_mask(feats, r)
        s[i, a] = 2.0  # every seen ad ahead of the target ...
        s[np.arange(len(r)), test["item"][np.searchsorted(users, r.user)]] = 1.0  # ... but it
        return s

    kept = evaluate({"m": seen_first}, feats, ks=(1,))["m"]
    assert kept["hr@1"] == 1.0  # seen ads dropped, the (also seen) target kept at rank 0
    raw = evaluate({"m": seen_first}, feats, ks=(1,), exclude_seen=False)["m"]
    assert raw["hr@1"] == 0.0


def test_oracle_recalls_the_truth_and_random_recalls_k_over_a(world):
    feats, truth = world
    fns = {"oracle": true_conversion(truth), "random": random_scores(feats.n_ads, 0)}
    calls = []
    res = evaluate(
        fns,
        feats,
        ks=(100, 500, 5000),
        truth=truth,
        reference="oracle",
        batch=64,
        progress=lambda *a: calls.append(a),
    )
    n = len(feats.splits["test"]["user"])
    # the total first, then one call per batch
    assert calls[0] == ("evaluate", 0, n) and calls[-1] == ("evaluate", n, n)
    assert len(calls) == 1 + math.ceil(n / 64)
    for k in (100, 500, 5000):
        assert res["oracle"][f"truth_recall@{k}"] == 1.0
        assert res["oracle"][f"ref_overlap@{k}"] == 1.0
        expected = min(k / feats.n_ads, 1.0)
        assert res["random"][f"truth_recall@{k}"] == pytest.approx(expected, rel=0.15)
        assert res["random"][f"ref_overlap@{k}"] == res["random"][f"truth_recall@{k}"]
    assert res["oracle"]["hr@100"] > 3 * res["random"]["hr@100"]
    assert res["random"]["hr@5000"] == 1.0
    table = format_table(res)
    assert table.splitlines()[0].startswith("| model | hr@100 | hr@500 | hr@5000 | ndcg@100")
    assert "| oracle | " in table and "1.0000" in table


def test_evaluate_rejects_bad_arguments(world):
    feats, _ = world
    fns = {"a": random_scores(feats.n_ads, 0)}
    with pytest.raises(ValueError, match="reference"):
        evaluate(fns, feats, reference="b")
    with pytest.raises(ValueError, match="ks"):
        evaluate(fns, feats, ks=(10, 0))
    with pytest.raises(ValueError, match="shape"):
        evaluate({"bad": lambda r: np.zeros((len(r), 3))}, feats)
    with pytest.raises(ValueError, match="no models"):
        evaluate({}, feats)


def test_plot_recall_at_k(tmp_path):
    res = {"a": {"hr@10": 0.1, "hr@100": 0.4, "truth_recall@10": 0.2}, "b": {"hr@10": 0.2}}
    path = plot_recall_at_k(res, tmp_path / "hr.png", metric_prefix="hr")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="ndcg"):
        plot_recall_at_k(res, tmp_path / "x.png", metric_prefix="ndcg")


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from("abcdefg"),
                       st.tuples(st.integers(1, 5), st.integers(0, 5)), min_size=1))  # fmt: skip
def test_pareto_front_is_the_models_no_cheaper_model_matches(raw):
    points = {name: (float(f), float(m), math.nan) for name, (f, m) in raw.items()}
    front = pareto_front(points)

    # The reference: a model is on the front when no model at its FLOPs or fewer scores as much
    # (a tie at equal FLOPs keeps the first by name's sort; ties at fewer FLOPs drop it).
    def beaten(n):
        f, m, _ = points[n]
        return any(
            (g < f and v >= m) or (g == f and (v > m or (v == m and o < n)))
            for o, (g, v, _) in points.items()
            if o != n
        )

    assert sorted(front) == sorted(n for n in points if not beaten(n))
    assert [points[n][0] for n in front] == sorted(points[n][0] for n in front)


def test_plot_pareto(tmp_path):
    points = {"moe": (2049, 0.2, 0.01), "dense": (99137, 0.21, math.nan), "tt": (129, 0.15, 0.0)}
    path = plot_pareto(points, "hr@10", tmp_path / "p.png", title="ml100k")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with_line = plot_pareto(points, "hr@10", tmp_path / "b.png", "ml100k", {"recency-knn": 0.18})
    assert with_line.read_bytes() != path.read_bytes()  # the baseline's line drawn
    with pytest.raises(ValueError, match="baselines have none"):
        plot_pareto({}, "hr@10", tmp_path / "x.png")


# --- funnel ----------------------------------------------------------------------------------


def test_common_random_numbers_are_a_function_of_seed_request_and_ad():
    r = np.array([0, 5, 5, 7])
    a = np.array([3, 3, 9, 3])
    u = crn_uniform(11, r, a)
    assert np.array_equal(u, crn_uniform(11, r, a))
    assert crn_uniform(11, r[::-1], a[::-1])[::-1].tolist() == u.tolist()
    assert crn_uniform(11, np.array([[5]]), np.array([[9]]))[0, 0] == u[2]
    assert not np.array_equal(u, crn_uniform(12, r, a))
    grid = crn_uniform(0, np.arange(300)[:, None], np.arange(300)[None, :])
    assert grid.min() >= 0.0 and grid.max() < 1.0
    assert abs(grid.mean() - 0.5) < 0.005 and len(np.unique(grid)) == grid.size


def funnel_parts(world):
    feats, truth = world
    score = true_conversion(truth)
    req = requests_from_split(feats, "test")
    req = req.take(np.tile(np.arange(len(req)), 4))  # more requests, fresh draws for each copy

    def oracle(r):
        return topk_rows(score(r), 50)

    def random(r):
        return np.argsort(np.random.default_rng(1).random((len(r), feats.n_ads)), 1)[:, :50]

    def rank(r, cand):
        return truth.probabilities(r.user, cand, r.surface, r.hour, r.platform, r.ts)[1]

    return truth, req, oracle, random, rank


def test_identical_retrievers_differ_by_exactly_zero(world):
    truth, req, _, random, rank = funnel_parts(world)
    out = simulate({"a": random, "b": random}, rank, truth, req, k=50, batch=100)
    (pair,) = out["pairs"]
    assert (pair["model"], pair["baseline"]) == ("b", "a")
    for prefix in ("", "expected_"):
        assert pair[f"{prefix}diff_per_1k"] == 0.0
        assert pair[f"{prefix}ci_per_1k"] == (0.0, 0.0)
    assert out["models"]["a"] == out["models"]["b"]


def test_oracle_retriever_beats_random(world):
    truth, req, oracle, random, rank = funnel_parts(world)
    out = simulate({"random": random, "oracle": oracle}, rank, truth, req, k=50, slots=2)
    (pair,) = out["pairs"]
    assert pair["ci_per_1k"][0] > 0 and pair["expected_ci_per_1k"][0] > 0
    assert pair["lift_pct"] > 0
    m = out["models"]
    assert m["oracle"]["conversions_per_1k"] > m["random"]["conversions_per_1k"]
    assert pair["expected_diff_per_1k"] == pytest.approx(
        m["oracle"]["expected_per_1k"] - m["random"]["expected_per_1k"]
    )
    text = format_funnel(out)
    assert "| oracle vs random |" in text and "| random |" in text


def test_funnel_batches_and_eligibility(world):
    truth, req, oracle, _, rank = funnel_parts(world)
    req = req.take(np.arange(300))
    one = simulate({"o": oracle}, rank, truth, req, k=50, seed=4, batch=len(req))
    many = simulate({"o": oracle}, rank, truth, req, k=50, seed=4, batch=37)
    # Draws depend on the request, not its batch; truth's float sums may differ in the last bit.
    assert one["models"]["o"] == pytest.approx(many["models"]["o"], rel=1e-6)
    nothing = simulate({"o": oracle}, rank, truth, req, eligible=np.zeros(truth.n_ads, bool))
    assert nothing["models"]["o"] == {"conversions_per_1k": 0.0, "expected_per_1k": 0.0}
    with pytest.raises(ValueError, match="eligible"):
        simulate({"o": oracle}, rank, truth, req, eligible=np.ones(3, bool))
    with pytest.raises(ValueError, match="slots"):
        simulate({"o": oracle}, rank, truth, req, slots=0)
    with pytest.raises(ValueError, match="outside"):
        simulate({"o": lambda r: np.full((len(r), 5), truth.n_ads)}, rank, truth, req)


def test_evaluate_returns_each_requests_target_rank(world):
    feats, _ = world
    fns = {"random": random_scores(feats.n_ads, 3)}
    metrics, ranks = evaluate(fns, feats, ks=(10, 100), return_ranks=True)
    r = ranks["random"]
    assert r.shape == (len(feats.splits["test"]["user"]),)
    assert metrics["random"]["hr@10"] == pytest.approx(np.mean(r < 10))
    assert metrics["random"]["ndcg@100"] == pytest.approx(
        np.mean(np.where(r < 100, 1 / np.log2(r + 2.0), 0.0))
    )


def test_evaluate_returns_each_requests_truth_recall(world):
    feats, truth = world
    fns = {"oracle": true_conversion(truth), "random": random_scores(feats.n_ads, 3)}
    metrics, ranks, rows = evaluate(
        fns, feats, ks=(10, 100), truth=truth, return_ranks=True, return_truth_recall=True, batch=64
    )
    n = len(feats.splits["test"]["user"])
    for name in fns:
        assert ranks[name].shape == (n,) and set(rows[name]) == {
            "truth_recall@10",
            "truth_recall@100",
        }
        for key, values in rows[name].items():
            assert values.shape == (n,) and ((values >= 0) & (values <= 1)).all()
            assert metrics[name][key] == pytest.approx(values.mean())
    assert (rows["oracle"]["truth_recall@100"] == 1.0).all()
    tenths = rows["random"]["truth_recall@10"] * 10  # a count out of 10 per request
    np.testing.assert_allclose(tenths, np.round(tenths))
    with pytest.raises(ValueError, match="return_truth_recall needs"):
        evaluate(fns, feats, ks=(10,), return_ranks=True, return_truth_recall=True)
    with pytest.raises(ValueError, match="return_truth_recall needs"):
        evaluate(fns, feats, ks=(10,), truth=truth, return_truth_recall=True)


def test_rerank_orders_the_first_stages_top_k(world):
    """A two-stage model: the first stage's top k (after the exclusions), ordered by the second.
    An oracle second stage over random candidates hits exactly when the target is a candidate,
    and no seen ad (but the target) is ever a candidate."""
    feats, _ = world
    test = feats.splits["test"]
    target_of = dict(zip(test["user"].tolist(), test["item"].tolist(), strict=False))

    def oracle(r, cand):  # the target first, then the rest in candidate order
        target = np.array([target_of[u] for u in r.user.tolist()])
        idx, ads = seen_mask(feats, r)
        seen = ads != target[idx]
        assert not np.isin(
            idx[seen] * feats.n_ads + ads[seen], np.arange(len(r))[:, None] * feats.n_ads + cand
        ).any()
        hit = cand == target[:, None]
        return np.where(hit, 1.0, -np.arange(cand.shape[1], dtype=np.float64)[None, :])

    k = 50
    metrics, ranks = evaluate(
        {"first": random_scores(feats.n_ads, 5)}, feats, ks=(1, 10, k),
        rerank={"two": ("first", oracle, k)}, return_ranks=True, batch=64,
    )  # fmt: skip
    assert np.array_equal(ranks["two"] == 0, ranks["first"] < k)  # a hit exactly when a candidate
    assert metrics["two"]["hr@1"] == pytest.approx(metrics["first"][f"hr@{k}"])
    assert metrics["two"][f"hr@{k}"] == pytest.approx(metrics["first"][f"hr@{k}"])
    fns = {"first": random_scores(feats.n_ads, 5)}
    with pytest.raises(ValueError, match="first stage"):
        evaluate(fns, feats, rerank={"two": ("nope", oracle, k)})
    with pytest.raises(ValueError, match="k must be positive"):
        evaluate(fns, feats, rerank={"two": ("first", oracle, 0)})
