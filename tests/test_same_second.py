"""Same-second engagements under leave-last-out (`m31.features.build._split`), on a tiny
MovieLens-format folder written here: ties are broken by a stable pseudo-random key, the other
ratings of a held-out rating's second belong to no split, and evaluation leaves them out."""

import random

import numpy as np
import pytest
from test_movielens import item, write

from m31.data.movielens import load_movielens
from m31.eval import evaluate, requests_from_split
from m31.features import FeatureConfig, build_features

T = 880_000_000
N_ITEMS = 12
ITEMS = [item(m, f"Movie {m} (1995)", "01-Jan-1995", {m % 19}) for m in range(1, N_ITEMS + 1)]
USERS = [f"{u}|30|M|other|00000" for u in range(1, 45)]
# (user, item, rating, ts)
RATINGS = [
    # user 1: two earlier ratings, then a burst of four in one second: test and val come from the
    # burst, the other two are siblings of the held-out pair.
    (1, 1, 4, T),
    (1, 2, 4, T + 10),
    *((1, m, 4, T + 100) for m in (3, 4, 5, 6)),
    # user 2: a burst among the train ratings, then val and test in their own seconds.
    (2, 1, 4, T),
    (2, 2, 4, T),
    (2, 3, 4, T + 50),
    (2, 4, 4, T + 60),
    # user 3: val with one sibling, then test in its own second.
    (3, 7, 4, T),
    (3, 8, 4, T + 20),
    (3, 9, 4, T + 20),
    (3, 10, 4, T + 30),
]
# users 4..44: one earlier rating, then two movies in one second (test and val).
RATINGS += [r for u in range(4, 45) for r in ((u, 1, 3, T), (u, 2, 5, T + 9), (u, 3, 5, T + 9))]


def features(folder):
    return build_features(load_movielens(folder), FeatureConfig(text_embeddings=False))


@pytest.fixture(scope="module")
def feats(tmp_path_factory):
    return features(write(tmp_path_factory.mktemp("ml"), USERS, ITEMS, RATINGS))


def by_user(split, u):
    """Movie ids of user id u in one split."""
    rows = split["user"] == u - 1
    return sorted((split["item"][rows] + 1).tolist())


def test_siblings_of_a_held_out_rating_belong_to_no_split(feats):
    sp = feats.splits
    train, val, test = sp["train"], sp["val"], sp["test"]
    # user 1: test and val are two of the burst {3, 4, 5, 6}; the other two are in no split.
    held = by_user(val, 1) + by_user(test, 1)
    assert len(held) == 2 and set(held) <= {3, 4, 5, 6}
    assert by_user(train, 1) == [1, 2]
    # user 2: a same-second pair inside train stays in train.
    assert (by_user(train, 2), by_user(val, 2), by_user(test, 2)) == ([1, 2], [3], [4])
    # user 3: val is 8 or 9, its sibling dropped; test is 10.
    assert by_user(train, 3) == [7] and by_user(val, 3) in ([8], [9])
    assert by_user(test, 3) == [10]
    total = sum(len(sp[s]["user"]) for s in ("train", "val", "test"))
    assert total == len(RATINGS) - 3  # two siblings of user 1, one of user 3
    # Every train rating is strictly before its user's first held-out one.
    cutoff = np.full(feats.n_users, np.iinfo(np.int64).max)
    for s in (val, test):
        np.minimum.at(cutoff, s["user"], s["ts"])
    assert (train["ts"] < cutoff[train["user"]]).all()
    assert (sp["impressions"]["ts"] < cutoff[sp["impressions"]["user"]]).all()


def test_history_of_a_test_request_holds_nothing_of_its_second(feats):
    test = feats.splits["test"]
    items, _, ts, lengths = feats.history(test["user"], test["ts"])
    assert ((ts < test["ts"][:, None]) | (ts == -1)).all()
    row = np.flatnonzero(test["user"] == 0)[0]  # user 1: history is movies 1 and 2 only
    assert lengths[row] == 2 and sorted(items[row][items[row] >= 0] + 1) == [1, 2]


def test_ties_are_broken_by_a_stable_key_not_by_item_id(tmp_path, feats):
    # Users 4..44 rated movies 2 and 3 in one second: an id tiebreak would always hold out 3.
    test = feats.splits["test"]
    held = test["item"][test["user"] >= 3] + 1
    assert set(held.tolist()) == {2, 3}
    assert 10 <= int((held == 3).sum()) <= 31  # 41 fair coin flips
    # The same choice whatever the order of u.data's lines.
    shuffled = RATINGS[:]
    random.Random(0).shuffle(shuffled)
    again = features(write(tmp_path / "ml", USERS, ITEMS, shuffled)).splits
    for name in ("train", "val", "test"):
        for col in ("user", "item", "ts"):
            np.testing.assert_array_equal(again[name][col], feats.splits[name][col])


def test_evaluation_leaves_same_second_ratings_out_of_the_ranking(feats):
    test = feats.splits["test"]
    target = dict(zip(test["user"].tolist(), test["item"].tolist(), strict=True))
    seq = feats.engagements

    def same_second_first(req):
        # Every rating of the request's second ranks first, then the target, then the rest.
        s = np.zeros((len(req), feats.n_ads), np.float32)
        for i, (u, t) in enumerate(zip(req.user, req.ts, strict=True)):
            lo, hi = seq.offsets[u], seq.offsets[u + 1]
            s[i, seq.values["item"][lo:hi][seq.ts[lo:hi] == t]] = 2.0
            s[i, target[u]] = 1.0
        return s

    assert evaluate({"m": same_second_first}, feats, ks=(1,))["m"]["hr@1"] == 1.0
    req = requests_from_split(feats)
    assert len(req) == 44
