"""Multi-seed aggregation and the paired comparison of `m31.eval.stats` on hand-made cases."""

import json
import math

import numpy as np
import pytest

from m31.eval.stats import aggregate_seeds, format_paired, paired_comparison, seed_summary


def test_seed_summary_is_the_textbook_mean_and_sample_std():
    s = seed_summary([0.10, 0.12, 0.14, 0.16, 0.18])
    assert s.seeds == 5 and s.mean == pytest.approx(0.14)
    assert s.std == pytest.approx(math.sqrt(0.004 / 4))  # squares sum to 0.004, n - 1 = 4
    one = seed_summary([0.3])
    assert one.mean == 0.3 and math.isnan(one.std)
    with pytest.raises(ValueError, match="one value per seed"):
        seed_summary([])


def test_aggregate_seeds_per_metric():
    agg = aggregate_seeds([{"hr@10": 1.0, "ndcg@10": 0.5}, {"hr@10": 3.0, "ndcg@10": 0.5}])
    assert agg["hr@10"].mean == 2.0 and agg["hr@10"].std == pytest.approx(math.sqrt(2))
    assert agg["ndcg@10"].std == 0.0
    with pytest.raises(ValueError, match="different metrics"):
        aggregate_seeds([{"hr@10": 1.0}, {"ndcg@10": 1.0}])


def test_identical_models_give_a_zero_width_interval_at_zero():
    hits = np.random.default_rng(0).random((5, 400)) < 0.2
    c = paired_comparison(hits, hits)
    assert c.diff == 0.0 and c.diff_lo == 0.0 and c.diff_hi == 0.0
    assert c.ratio == 1.0 and c.ratio_lo == pytest.approx(1.0) and c.ratio_hi == pytest.approx(1.0)


def test_a_known_difference_gives_an_interval_around_it():
    rng = np.random.default_rng(1)
    n = 4000
    b = (rng.random(n) < 0.10).astype(float)
    a = b.copy()
    a[rng.choice(np.flatnonzero(b == 0), size=200, replace=False)] = 1.0  # +0.05 exactly
    c = paired_comparison(a, b)
    assert c.diff == pytest.approx(0.05)
    assert c.diff_lo < 0.05 < c.diff_hi and c.diff_lo > 0.0
    # Sampling error of a 0/1 difference with 5% ones: sd sqrt(0.05 * 0.95 / n) = 0.0034.
    assert c.diff_hi - c.diff_lo == pytest.approx(2 * 1.96 * math.sqrt(0.05 * 0.95 / n), rel=0.1)
    assert c.ratio == pytest.approx(c.mean_a / c.mean_b) and c.ratio_lo < c.ratio < c.ratio_hi
    assert paired_comparison(a, b) == c, "a fixed bootstrap seed: the same interval every time"


def test_seeds_are_averaged_per_request_before_the_difference():
    a = np.array([[1, 0, 1, 0], [1, 1, 1, 0]])  # per request over seeds: 1, .5, 1, 0
    b = np.array([1, 0, 0, 0])
    c = paired_comparison(a, b, resamples=200)
    assert c.mean_a == 0.625 and c.mean_b == 0.25 and c.diff == pytest.approx(0.375)
    assert c.requests == 4 and c.resamples == 200


def test_a_ratio_whose_denominator_resamples_to_zero_has_an_unbounded_upper_end():
    # b hits twice in 60 requests: about one resample in 8 holds neither hit, and a's ratio to
    # nothing is unbounded; the interval says so (inf), not NaN, and its lower end stays finite.
    a = np.zeros(60)
    a[:6] = 1.0
    b = np.zeros(60)
    b[[10, 20]] = 1.0
    c = paired_comparison(a, b)
    assert c.ratio == 3.0 and 0.0 < c.ratio_lo < 3.0 and c.ratio_hi == math.inf
    d = c.as_dict()
    assert d["ratio_hi"] is None and d["ratio_lo"] == c.ratio_lo
    json.dumps(d, allow_nan=False)  # strict JSON
    assert "inf]" in format_paired("a", "b", {"hr@10": c})
    # Neither model ever scores: no ratio at all.
    z = paired_comparison(np.zeros(5), np.zeros(5), resamples=100)
    assert math.isnan(z.ratio) and math.isnan(z.ratio_lo) and math.isnan(z.ratio_hi)
    assert z.as_dict()["ratio"] is None


def test_the_ratio_interval_is_numpys_linear_percentile_where_every_ratio_is_finite():
    rng = np.random.default_rng(3)
    a, b = rng.random((2, 400)) < 0.3
    c = paired_comparison(a, b, resamples=2000, seed=5)
    rng = np.random.default_rng(5)
    idx = rng.integers(0, 400, size=(2000, 400))
    ratio = a[idx].sum(1) / b[idx].sum(1)
    assert [c.ratio_lo, c.ratio_hi] == pytest.approx(np.percentile(ratio, [2.5, 97.5]), rel=1e-12)


def test_paired_comparison_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="different requests"):
        paired_comparison(np.zeros((2, 5)), np.zeros(4))
    with pytest.raises(ValueError, match="non-finite"):
        paired_comparison(np.array([np.nan, 1.0]), np.ones(2))
    with pytest.raises(ValueError, match="level"):
        paired_comparison(np.ones(3), np.ones(3), level=1.0)
