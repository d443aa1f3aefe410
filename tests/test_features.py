import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m31.data.dataset import DatasetError
from m31.features import EventSequences, FeatureConfig, Features, build_features
from m31.features.attributes import MAX_TOKENS, attribute_tokens, token
from m31.features.cooc import cooc_embeddings, cooccurrence_pairs


@pytest.fixture(scope="module")
def tiny(tiny_world):
    return tiny_world.ds


@pytest.fixture(scope="module")
def feats(tiny_world):
    return tiny_world.feats


def brute_force_before(user, ts, item, u, cutoff, max_len):
    rows = sorted(
        (t, i)
        for k, (uu, t) in enumerate(zip(user, ts, strict=True))
        if uu == u and t < cutoff
        for i in [item[k]]
    )
    return [i for _, i in rows][-max_len:]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 30), st.integers(0, 99)), max_size=60),
    st.lists(st.tuples(st.integers(0, 4), st.integers(-5, 35)), min_size=1, max_size=10),
    st.integers(1, 7),
)
def test_sequences_match_brute_force(events, queries, max_len):
    user = np.array([e[0] for e in events], dtype=np.int64)
    ts = np.array([e[1] for e in events], dtype=np.int64)
    # Distinct items per (user, ts) are ambiguous in order; make the item a function of ts.
    item = ts * 1000 + np.array([e[2] for e in events], dtype=np.int64) % 7
    keep = np.unique(np.stack([user, ts], 1), axis=0, return_index=True)[1] if len(events) else []
    user, ts, item = user[keep], ts[keep], item[keep]
    seqs = EventSequences.from_events(user, ts, 5, item=item)
    qu = np.array([q[0] for q in queries])
    qt = np.array([q[1] for q in queries])
    values, seq_ts, lengths = seqs.before(qu, qt, max_len)
    for r, (u, c) in enumerate(queries):
        want = brute_force_before(user, ts, item, u, c, max_len)
        got = values["item"][r]
        assert lengths[r] == len(want)
        assert got[max_len - len(want) :].tolist() == want, "right-aligned, oldest first"
        assert (got[: max_len - len(want)] == -1).all()
        assert (seq_ts[r][seq_ts[r] >= 0] < c).all(), "nothing at or after the cutoff"


def test_sequences_empty_and_bad_rows():
    seqs = EventSequences.from_events(
        np.array([], dtype=np.int64),
        np.array([], dtype=np.int64),
        3,
        item=np.array([], dtype=np.int64),
    )
    values, _, lengths = seqs.before(np.array([0, 2]), np.array([10, 10]), 4)
    assert (lengths == 0).all() and (values["item"] == -1).all()
    with pytest.raises(ValueError, match="user rows"):
        EventSequences.from_events(np.array([3]), np.array([1]), 3)


def test_leave_last_out_split(tiny, feats):
    sp = feats.splits
    eng_user = np.concatenate([sp[s]["user"] for s in ("train", "val", "test")])
    assert len(eng_user) == int(tiny.events["click"].to_numpy().sum())
    counts = np.bincount(eng_user, minlength=feats.n_users)
    assert np.bincount(sp["test"]["user"], minlength=feats.n_users).max() == 1
    np.testing.assert_array_equal(np.unique(sp["test"]["user"]), np.flatnonzero(counts >= 2))
    np.testing.assert_array_equal(np.unique(sp["val"]["user"]), np.flatnonzero(counts >= 3))
    # The test event is each user's last; nothing of theirs in train comes after val or test.
    last_train = np.full(feats.n_users, -1)
    np.maximum.at(last_train, sp["train"]["user"], sp["train"]["ts"])
    assert (last_train[sp["test"]["user"]] <= sp["test"]["ts"]).all()
    assert (last_train[sp["val"]["user"]] <= sp["val"]["ts"]).all()
    first_held = np.full(feats.n_users, np.iinfo(np.int64).max)
    for s in ("val", "test"):
        np.minimum.at(first_held, sp[s]["user"], sp[s]["ts"])
    imp = sp["impressions"]
    assert (imp["ts"] < first_held[imp["user"]]).all(), "ranking impressions stop at the cutoff"


def test_history_has_no_leakage(feats):
    test = feats.splits["test"]
    items, surfaces, ts, _ = feats.history(test["user"], test["ts"])
    assert items.shape == (len(test["user"]), 8)
    assert ((ts < test["ts"][:, None]) | (ts == -1)).all()
    assert ((items >= 0) == (ts >= 0)).all() and ((surfaces >= 0) == (ts >= 0)).all()
    topics, _ = feats.organic_history(test["user"], test["ts"])
    assert topics.shape == (len(test["user"]), feats.config.organic_len)


def test_time_split(tiny):
    f = build_features(tiny, FeatureConfig(split="time", text_embeddings=False))
    sp = f.splits
    assert sp["train"]["ts"].max() < sp["val"]["ts"].min()
    assert sp["val"]["ts"].max() < sp["test"]["ts"].min()
    assert (sp["impressions"]["ts"] < sp["val"]["ts"].min()).all()


def test_cooccurrence_matches_brute_force():
    rng = np.random.default_rng(0)
    user = rng.integers(0, 6, 80)
    ts = rng.permutation(80)
    item = rng.integers(0, 10, 80)
    rows, cols, counts = cooccurrence_pairs(user, item, ts, window=2)
    want = {}
    for u in range(6):
        seq = item[user == u][np.argsort(ts[user == u])]
        for i in range(len(seq)):
            for j in range(i + 1, min(i + 3, len(seq))):
                if seq[i] != seq[j]:
                    for a, b in ((seq[i], seq[j]), (seq[j], seq[i])):
                        want[(a, b)] = want.get((a, b), 0) + 1
    assert (
        dict(zip(zip(rows.tolist(), cols.tolist(), strict=True), counts.tolist(), strict=True))
        == want
    )


def test_cooc_embeddings_group_co_engaged_items():
    # Two communities of items: users engage within one only.
    rng = np.random.default_rng(1)
    user = np.repeat(np.arange(40), 10)
    item = np.where(
        user[:, None] % 2 == 0, rng.integers(0, 5, (400, 1)), rng.integers(5, 10, (400, 1))
    )[:, 0]
    emb = cooc_embeddings(user, item, np.tile(np.arange(10), 40), n_items=12, dim=4)
    assert emb.shape == (12, 4) and (emb[10:] == 0).all(), "never engaged -> zero"
    unit = emb[:10] / np.linalg.norm(emb[:10], axis=1, keepdims=True)
    sim = unit @ unit.T
    within = (sim[:5, :5].sum() - 5) / 20
    across = sim[:5, 5:].mean()
    assert within > across + 0.5


def test_features_round_trip(feats, tmp_path):
    out = feats.save(tmp_path / "f")
    again = Features.load(out)
    assert again.config == feats.config and again.meta == feats.meta
    for name, cols in feats.splits.items():
        for k, v in cols.items():
            np.testing.assert_array_equal(again.splits[name][k], v)
    for k, v in feats.ads.items():
        np.testing.assert_array_equal(again.ads[k], v)
    np.testing.assert_array_equal(again.cooc_emb, feats.cooc_emb)
    test = feats.splits["test"]
    for a, b in zip(
        again.history(test["user"], test["ts"]),
        feats.history(test["user"], test["ts"]),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def test_bad_feature_config():
    with pytest.raises(ValueError, match="split must be one of"):
        FeatureConfig(split="random")
    with pytest.raises(ValueError, match="time_split"):
        FeatureConfig(time_split=(0.9, 0.8))


def test_events_with_unknown_ids_are_rejected(tiny):
    import pyarrow as pa

    from m31.data.dataset import Dataset

    bad = tiny.events.set_column(
        1, tiny.events.schema.field("ad_id"), pa.array(np.full(tiny.events.num_rows, 10**9))
    )
    ds = Dataset(tiny.users, tiny.advertisers, tiny.ads, bad, tiny.organic, tiny.meta)
    with pytest.raises(DatasetError, match=r"events\.ad_id: id 1000000000"):
        build_features(ds, FeatureConfig(text_embeddings=False))


def test_embedding_cache_encodes_each_text_once(tmp_path):
    from m31.features.embedding_cache import EmbeddingCache, embed_texts
    from m31.features.text_encoder import model_key

    texts = [
        "trail running shoes for race day",
        "a weekend in Lisbon",
        "trail running shoes for race day",
    ]
    first = embed_texts(texts, tmp_path)
    assert first.shape == (3, 384)
    np.testing.assert_array_equal(first[0], first[2])
    cache = EmbeddingCache(tmp_path, model_key())
    assert len(cache) == 2
    (cache.folder / "shard-999999-0.npz").write_bytes(b"damaged")  # a half-written shard
    more = embed_texts([*texts, "organic dog food"], tmp_path)
    np.testing.assert_array_equal(more[:3], first)
    assert len(EmbeddingCache(tmp_path, model_key())) == 3, "only the new text was encoded"
    assert float(more[0] @ more[1]) < 0.5 < float(more[0] @ embed_texts(["running shoes"], None)[0])


def test_attribute_tokens_by_hand():
    kinds = {"brand": "str", "cats": "str_list", "price": "float", "size": "str"}
    columns = {
        "brand": ["acme", None, "acme"],
        "cats": [["b", "a", "b"], None, []],
        "size": [None, "xl", None],
    }
    out = attribute_tokens(columns, kinds, 3)  # price is a filter field only, not read
    a, b = token("cats", "a"), token("cats", "b")
    assert out.tolist() == [
        [token("brand", "acme"), a, b],  # columns in declared order, values sorted, deduplicated
        [token("size", "xl"), -1, -1],
        [token("brand", "acme"), -1, -1],
    ]
    assert token("brand", "acme") != token("size", "acme") and 0 <= a < 2**63
    many = attribute_tokens({"cats": [[f"w{i:02d}" for i in range(40)]]}, {"cats": "str_list"}, 1)
    assert many.shape == (1, MAX_TOKENS)  # the first MAX_TOKENS in sorted order
    assert many[0].tolist() == [token("cats", f"w{i:02d}") for i in range(MAX_TOKENS)]
    assert attribute_tokens({}, {"price": "float"}, 2).shape == (2, 0)
    with pytest.raises(ValueError, match="cats: 1 values for 2 ads"):
        attribute_tokens({"cats": [None]}, {"cats": "str_list"}, 2)
