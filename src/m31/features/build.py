"""From a dataset's tables to the inputs every model needs.

Shapes: U users, A ads, H text-embedding dim, d co-engagement dim, n examples, L sequence length.

Rows, not ids: users and ads are addressed by their row in the dataset's tables (`user_ids` and
`ad_ids` map back). Engagements are clicks (every rating, for MovieLens). A split assigns each
engagement to train, val or test (or to none: an engagement in the same second as a held-out one,
see `_split`), and gives each user a *train cutoff*: the time of their first
held-out engagement. Everything learnt from the log as a whole (co-engagement embeddings,
ranking-model impressions) uses only events before that cutoff, and every sequence is taken
strictly before its example's time, so no held-out event leaks into the features.

Nulls (the optional columns of `m31.data.schema`) become no input, never a made-up value: a
null gender, country, platform, cohort, surface, format or objective is its vocabulary's
unknown value (code `len(vocab)`), a null age the unknown age bucket (`N_AGE_BUCKETS`), a null
topic or category the unknown one (`n_topics`, `n_categories`); the models embed each of them
as a zero row. An ad without an advertiser has advertiser -1 (no advertiser input), a null text
embeds as zeros (only the non-null texts go to the text encoder), a null quality is 0 (the
prior's mean), a null created_at is `OPEN_START` (eligible from any time); a null event hour is
the hour of its time, UTC. The country and cohort vocabularies are the non-null values the users
hold; `n_topics` and `n_categories` count every id meta's topics list or a table holds.

The feature set itself (`Features`), its folder and its online part: `m31.features.feature_set`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from m31.data.dataset import (
    VOCABULARIES,
    Dataset,
    DatasetError,
    item_attributes,
    repeat_engagement,
    vocabularies,
)
from m31.data.schema import N_AGE_BUCKETS, age_bucket
from m31.features.attributes import attribute_tokens, token_columns
from m31.features.cooc import cooc_embeddings
from m31.features.feature_set import FeatureConfig, Features
from m31.features.sequences import EventSequences
from m31.features.text_encoder import EMBED_DIM

Progress = Callable[[str, int, int], None]
# Bumped whenever the rule that assigns engagements to splits changes, so that feature folders
# built under an older rule are rebuilt (2: same-second ties, `_split`).
SPLIT_RULE = 2
# Bumped whenever the folder's content changes (3: users' raw age, for targeting; 4: item
# attribute tokens), with the same effect.
FEATURES_FORMAT = 4
OPEN_START = np.iinfo(np.int64).min  # the created_at of an ad without one: no start
EXAMPLE_COLUMNS = ("user", "item", "ts", "surface", "hour", "platform", "click", "conversion")


def _codes(values: pa.ChunkedArray, vocab: tuple[str, ...], field: str) -> np.ndarray:
    """Codes [n] of categorical values in `vocab`: a null is the unknown value, len(vocab)."""
    codes = pc.index_in(values, value_set=pa.array(vocab, pa.string()))
    unknown = pc.and_(values.is_valid(), codes.is_null())
    if pc.any(unknown).as_py():
        raise DatasetError(
            f"{field}: unknown value {pc.filter(values, unknown)[0].as_py()!r} "
            f"(expected one of {', '.join(vocab)})"
        )
    return pc.fill_null(codes, len(vocab)).to_numpy().astype(np.int64)


def _ids(values: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(vocabulary: the distinct non-null values, sorted; codes [n] into it, null: its length)."""
    valid = values.is_valid().to_numpy(zero_copy_only=False)
    vocab, codes = np.unique(pc.drop_null(values).to_numpy(), return_inverse=True)
    out = np.full(len(values), len(vocab), dtype=np.int64)
    out[valid] = codes.reshape(-1)
    return vocab, out


def _count(*ids: int | None) -> int:
    """1 + the largest of `ids` (None: no id), 0 when there is none: an id vocabulary's size."""
    return 1 + max((int(i) for i in ids if i is not None), default=-1)


def _filled(values: pa.ChunkedArray, fill) -> np.ndarray:
    """The values [n] with each null replaced by `fill`."""
    return pc.fill_null(values, fill).to_numpy()


def _rows(ids: np.ndarray, sorted_ids: np.ndarray, order: np.ndarray, field: str) -> np.ndarray:
    pos = np.searchsorted(sorted_ids, ids)
    pos = np.minimum(pos, len(sorted_ids) - 1)
    bad = sorted_ids[pos] != ids if len(sorted_ids) else np.ones(len(ids), bool)
    if bad.any():
        raise DatasetError(f"{field}: id {ids[bad][0]} is not in its table")
    return order[pos]


def _col(table: pa.Table, name: str) -> np.ndarray:
    return table[name].to_numpy()


def build_features(
    ds: Dataset,
    config: FeatureConfig | None = None,
    cache_dir: Path | str | None = None,
    progress: Progress | None = None,
) -> Features:
    config = config or FeatureConfig()
    users_t, ads_t, events_t = ds.users, ds.ads, ds.events
    n_u, n_a = users_t.num_rows, ads_t.num_rows
    if n_u == 0 or n_a == 0:
        raise DatasetError("dataset has no users or no ads")

    user_ids, ad_ids = _col(users_t, "user_id"), _col(ads_t, "ad_id")
    u_order, a_order = np.argsort(user_ids, kind="stable"), np.argsort(ad_ids, kind="stable")
    u_sorted, a_sorted = user_ids[u_order], ad_ids[a_order]
    for ids, name in ((u_sorted, "users.user_id"), (a_sorted, "ads.ad_id")):
        if len(ids) > 1 and (np.diff(ids) == 0).any():
            raise DatasetError(f"{name}: duplicate id {ids[1:][np.diff(ids) == 0][0]}")

    countries = tuple(sorted(set(pc.drop_null(users_t["country"]).to_pylist())))
    vocab = vocabularies(ds.meta, countries)
    advertiser_vocab, advertiser = _ids(ads_t["advertiser_id"])
    advertiser[advertiser == len(advertiser_vocab)] = -1  # no advertiser
    cohort_vocab, users = _user_columns(users_t, user_ids, vocab, countries)
    topics = ds.meta.get("topics") or []
    org_t = ds.organic
    organic_topic = _col(org_t, "topic").astype(np.int64)
    # Topic and category ids index embeddings: every id meta lists or a table holds has a row,
    # and one more row (n_topics, n_categories) is the unknown value of a null.
    n_topics = _count(
        *(t["id"] for t in topics), pc.max(ads_t["topic"]).as_py(), pc.max(org_t["topic"]).as_py()
    )
    n_categories = _count(*(t["category"] for t in topics), pc.max(ads_t["category"]).as_py())
    ads = {
        "ad_id": ad_ids,
        "advertiser": advertiser,
        "objective": _codes(ads_t["objective"], vocab["objective"], "ads.objective"),
        "format": _codes(ads_t["format"], vocab["format"], "ads.format"),
        "topic": _filled(ads_t["topic"], n_topics).astype(np.int64),
        "category": _filled(ads_t["category"], n_categories).astype(np.int64),
        "quality": _filled(ads_t["quality"], 0.0).astype(np.float32),
        "created_at": _filled(ads_t["created_at"], OPEN_START).astype(np.int64),
    }

    ev = {
        "user": _rows(_col(events_t, "user_id"), u_sorted, u_order, "events.user_id"),
        "item": _rows(_col(events_t, "ad_id"), a_sorted, a_order, "events.ad_id"),
        **_event_columns(events_t, vocab),
    }
    eng = {k: v[ev["click"]] for k, v in ev.items()}
    split_of, cutoff = _split(eng["user"], eng["item"], eng["ts"], n_u, config)

    splits = {
        name: {k: eng[k][split_of == i] for k in EXAMPLE_COLUMNS}
        for i, name in enumerate(("train", "val", "test"))
    }
    before_cut = ev["ts"] < cutoff[ev["user"]]
    splits["impressions"] = {k: ev[k][before_cut] for k in EXAMPLE_COLUMNS}

    engagements = EventSequences.from_events(
        eng["user"], eng["ts"], n_u, item=eng["item"], surface=eng["surface"]
    )
    organic = EventSequences.from_events(
        _rows(_col(org_t, "user_id"), u_sorted, u_order, "organic.user_id"),
        _col(org_t, "ts"),
        n_u,
        topic=organic_topic,
        surface=_codes(org_t["surface"], vocab["organic_surface"], "organic.surface"),
    )

    tr = splits["train"]
    cooc = cooc_embeddings(
        tr["user"], tr["item"], tr["ts"], n_a, config.cooc_dim, config.cooc_window
    )

    text_emb = _text_embeddings(ads_t["text"], config, cache_dir, progress)

    kinds = item_attributes(ds.meta)
    attr_tokens = attribute_tokens(
        {name: ads_t[name].to_pylist() for name in token_columns(kinds)}, kinds, n_a
    )

    meta = {
        "source": ds.meta.get("source"),
        "repeat_engagement": repeat_engagement(ds.meta),
        "split_rule": SPLIT_RULE,
        "features_format": FEATURES_FORMAT,
        "n_users": n_u,
        "n_ads": n_a,
        "n_topics": n_topics,
        "n_categories": n_categories,
        "vocab": {
            "country": list(countries),
            "advertiser": advertiser_vocab.tolist(),
            "cohort": cohort_vocab.tolist(),
            **{name: list(vocab[name]) for name in VOCABULARIES},
        },
        "time_range": [int(ev["ts"].min()), int(ev["ts"].max())] if len(ev["ts"]) else None,
        # the item attributes that became `attr_tokens`, column -> kind: how a new ad's are read
        "attribute_tokens": {name: kinds[name] for name in token_columns(kinds)},
    }
    return Features(
        config=config,
        meta=meta,
        ads=ads,
        users=users,
        text_emb=text_emb.astype(np.float32),
        cooc_emb=cooc,
        engagements=engagements,
        organic=organic,
        splits=splits,
        attr_tokens=attr_tokens,
    )


def _user_columns(users_t: pa.Table, user_ids: np.ndarray, vocab: Mapping, countries: tuple):
    """(the cohorts' vocabulary, the users' columns as codes [U] each): an unknown value is the
    code after the vocabulary's last, a null age -1 for targeting."""
    cohort_vocab, cohort = _ids(users_t["cohort"])
    age = users_t["age"]
    has_age = age.is_valid().to_numpy(zero_copy_only=False)
    bucket = np.where(has_age, age_bucket(_filled(age, 0)), N_AGE_BUCKETS)
    users = {
        "user_id": user_ids,
        "cohort": cohort,
        "age": np.where(has_age, _filled(age, 0), -1).astype(np.int64),  # targeting; -1: null
        "age_bucket": bucket.astype(np.int64),
        "gender": _codes(users_t["gender"], vocab["gender"], "users.gender"),
        "country": _codes(users_t["country"], countries, "users.country"),
        "platform": _codes(users_t["platform"], vocab["platform"], "users.platform"),
    }
    return cohort_vocab, users


def _event_columns(events_t: pa.Table, vocab: Mapping) -> dict[str, np.ndarray]:
    """The events' time, context and outcome columns [n] each; a null hour is the time's."""
    ts = _col(events_t, "ts")
    hour = np.where(
        events_t["hour"].is_valid().to_numpy(zero_copy_only=False),
        _filled(events_t["hour"], 0),
        (ts % 86_400) // 3600,
    )
    return {
        "ts": ts,
        "surface": _codes(events_t["surface"], vocab["surface"], "events.surface"),
        "hour": hour.astype(np.int64),
        "platform": _codes(events_t["platform"], vocab["platform"], "events.platform"),
        "click": _col(events_t, "click"),
        "conversion": _col(events_t, "conversion"),
    }


def _text_embeddings(text: pa.ChunkedArray, config, cache_dir, progress) -> np.ndarray:
    """[A, H] the ads' text embeddings (`config.text_embeddings`), a null text zeros."""
    out = np.zeros((len(text), EMBED_DIM), dtype=np.float32)
    has_text = text.is_valid().to_numpy(zero_copy_only=False)
    if config.text_embeddings and has_text.any():
        from m31.features.embedding_cache import embed_texts

        texts = pc.drop_null(text).to_pylist()
        out[has_text] = embed_texts(texts, cache_dir, progress=progress)
    return out


def _tiebreak(user: np.ndarray, item: np.ndarray) -> np.ndarray:
    """A stable pseudo-random key per (user row, item row): splitmix64 of the pair, [n] uint64."""
    x = (user.astype(np.uint64) << np.uint64(32)) ^ item.astype(np.uint64)
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _split(user: np.ndarray, item: np.ndarray, ts: np.ndarray, n_users: int, config: FeatureConfig):
    """(split of each engagement: 0 train, 1 val, 2 test, -1 none; [U] train cutoff per user).

    Leave-last-out: a user's last engagement is test, the one before it val (3+ engagements); the
    cutoff is the time of the first held-out one. Time split: the cutoff is the val quantile.

    Same-second events. Timestamps are whole seconds and people rate in bursts: in MovieLens-100K,
    415 of the 943 users rated other movies in the very second of their last rating. Which of
    them came "last" is not in the data, so:

    * ties in time are ordered by a stable pseudo-random key of (user, item), never by item id: an
      id tiebreak makes the held-out movie depend on which movie it is (ML-100K: mean held-out id
      602 under it, against 461 over the tied ratings themselves);
    * the other engagements in the second of a held-out one (its siblings) belong to no split. A
      request at time t knows only what happened strictly before t, so they are not in its
      history; training on them would train on the test moment itself. Offline evaluation leaves
      them out of the ranked list, as it leaves out what the user engaged with before
      (`m31.eval.offline.seen_mask`): a sibling is another answer of the same request, neither a
      hit nor a miss. Every train engagement is then strictly before its user's cutoff.
    """
    split_of = np.zeros(len(user), dtype=np.int8)
    if config.split == "time":
        t_val, t_test = np.quantile(ts, config.time_split) if len(ts) else (0, 0)
        split_of[ts >= t_val] = 1
        split_of[ts >= t_test] = 2
        return split_of, np.full(n_users, int(t_val), dtype=np.int64)
    order = np.lexsort((_tiebreak(user, item), ts, user))
    counts = np.bincount(user, minlength=n_users)
    ends = np.cumsum(counts)  # exclusive end of each user's run in `order`
    rank_from_end = ends[user[order]] - np.arange(len(order))  # 1 = last
    n_of = counts[user[order]]
    s = np.zeros(len(order), dtype=np.int8)
    s[(rank_from_end == 1) & (n_of >= 2)] = 2
    s[(rank_from_end == 2) & (n_of >= 3)] = 1
    split_of[order] = s
    cutoff = np.full(n_users, np.iinfo(np.int64).max, dtype=np.int64)
    held = split_of > 0
    np.minimum.at(cutoff, user[held], ts[held])
    split_of[(split_of == 0) & (ts >= cutoff[user])] = -1  # same-second siblings
    return split_of, cutoff
