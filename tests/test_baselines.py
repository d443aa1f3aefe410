"""The classic baselines of `m31.eval.baselines` on a hand-made MovieLens-format folder."""

import numpy as np
import pytest
from test_movielens import item, write

from m31.data.movielens import load_movielens
from m31.eval import Requests, evaluate
from m31.eval.baselines import (
    ALS,
    BASELINES,
    ItemKNN,
    Popularity,
    RecentPopularity,
    make_baselines,
)
from m31.features import FeatureConfig, build_features

T = 880_000_000
ITEMS = [item(m, f"Movie {m} (1995)", "01-Jan-1995", {m % 19}) for m in range(1, 8)]
USERS = [f"{u}|30|M|other|00000" for u in range(1, 13)]
TRAIN = [
    *((u, m, T + m) for u in range(1, 5) for m in (1, 2)),  # movies 1 and 2 go together
    *((u, m, T + m) for u in (5, 6) for m in (3, 4)),  # so do 3 and 4
    (7, 1, T),
    (7, 5, T + 1),
    (8, 3, T + 5),  # user 8 has seen only movie 3
    (9, 1, T),
    (9, 3, T + 20),  # user 9: movie 1, then movie 3
    *((u, 5, T + 500) for u in (10, 11, 12)),  # a burst of movie 5, later than the rest
]
# Movies 6 and 7, long after, are every user's val and test ratings: train is TRAIN.
RATINGS = [(u, m, 4, t) for u, m, t in TRAIN] + [
    (u, m, 4, T + 10_000 + m) for u in range(1, 13) for m in (6, 7)
]


@pytest.fixture(scope="module")
def feats(tmp_path_factory):
    folder = write(tmp_path_factory.mktemp("ml"), USERS, ITEMS, RATINGS)
    return build_features(load_movielens(folder), FeatureConfig(text_embeddings=False))


def req(users, ts):
    n = len(users)
    zeros = np.zeros(n, np.int64)
    return Requests(np.asarray(users) - 1, np.asarray(ts), zeros, zeros, zeros)


def best(scores, exclude=()):
    """Movie id of the best-scored movie of each request, `exclude` movie ids left out."""
    s = np.array(scores, dtype=np.float64)
    s[:, [m - 1 for m in exclude]] = -np.inf
    return (s.argmax(1) + 1).tolist()


def test_train_split_is_the_hand_made_one(feats):
    assert len(feats.splits["train"]["user"]) == len(TRAIN)


def test_popularity_ranks_the_most_engaged_first(feats):
    s = Popularity(feats)(req([1, 8], [T, T]))
    assert s.shape == (2, 7) and best(s) == [1, 1]
    np.testing.assert_array_equal(s[0], [6, 4, 4, 2, 4, 0, 0])


def test_recent_popularity_sees_only_the_window_strictly_before(feats):
    fn = RecentPopularity(feats)
    s = fn(req([1, 1, 1], [T + 500, T + 501, T + 500 + 8 * 86_400]))
    # At T+500 the burst of movie 5 is not yet known; a second later it counts.
    assert np.floor(s[0]).tolist() == [6, 4, 4, 2, 1, 0, 0]
    assert np.floor(s[1]).tolist() == [6, 4, 4, 2, 4, 0, 0]
    # Eight days on, nothing is in the window: train popularity breaks the tie.
    assert (np.floor(s[2]) == 0).all() and best(s[2:], exclude=[1]) in ([2], [3], [5])
    with pytest.raises(ValueError, match="window"):
        RecentPopularity(feats, window_s=0)


def test_item_knn_recommends_the_co_engaged_movie(feats):
    s = ItemKNN(feats)(req([8, 1], [T + 10, T + 2]))
    # User 8 saw 3, which goes with 4; user 1, before rating 2, saw 1, which goes with 2.
    assert best(s, exclude=[3]) == [4, 2]
    np.testing.assert_allclose(s[0, 3], 2 / np.sqrt(4 * 2), rtol=1e-6)  # cos(3, 4)


def test_recency_knn_weights_the_latest_history(feats):
    r = req([9], [T + 30])  # history: movie 1, then movie 3
    assert best(ItemKNN(feats)(r), exclude=[1, 3]) == [2]  # cos(1,2) 0.82 > cos(3,4) 0.71
    assert best(ItemKNN(feats, half_life=0.5)(r), exclude=[1, 3]) == [4]
    with pytest.raises(ValueError, match="half_life"):
        ItemKNN(feats, half_life=0)


def test_als_recommends_the_co_engaged_movie_from_the_history_before(feats):
    als = ALS(feats, factors=4, reg=0.1, alpha=20.0, iterations=20, seed=1)
    s = als(req([8, 2, 5, 6], [T + 10, T + 1, T, T]))
    assert best(s[:1], exclude=[3]) == [4]
    assert best(s[1:2], exclude=[1]) == [2]  # user 2 before rating 2: only 1 known
    np.testing.assert_allclose(s[2], s[3])  # no history before T: the same vector


def test_make_baselines_and_evaluate(feats):
    fns = make_baselines(BASELINES, feats)
    assert list(fns) == list(BASELINES)
    res = evaluate(fns, feats, ks=(1, 7))
    assert set(res) == set(BASELINES) and all(m["hr@7"] == 1.0 for m in res.values())
    with pytest.raises(ValueError, match="unknown baseline"):
        make_baselines(["nope"], feats)
