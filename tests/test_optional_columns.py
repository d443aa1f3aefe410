"""A team's own data: only the required columns filled (every optional column null, no
advertisers, no organic engagement, no topics) plus two extra item attributes. It validates,
builds features, trains, indexes and answers (a stored and an inline user, a filter on an item
attribute, the server) with nothing invented for what it lacks: a null text is not embedded, a
null categorical is the zero unknown row, an ad without an advertiser is never blocked. A user's
gender, where given, moves the user's vector. Load and validate still refuse a required column
that is missing, mistyped or null.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from serve_helpers import ThreadServer
from typer.testing import CliRunner

from m31.cli import app
from m31.data import dataset
from m31.data.dataset import VOCABULARIES, DatasetError
from m31.data.schema import N_AGE_BUCKETS, TABLES
from m31.data.validate import ERROR, validate
from m31.engine import AdRequest, Engagement, InlineUser, Retriever
from m31.engine.ad_encoder import NewAd
from m31.engine.build import index_from_model
from m31.engine.load import load_engine, serving_folder
from m31.features import FeatureConfig, build_features
from m31.index import AdIndex, RequestContext
from m31.index.testing import reference_mask
from m31.model import build_model, load_checkpoint, model_preset, vocab_sizes
from m31.model.checkpoint import FORMAT
from m31.model.towers import advertiser_embedding
from m31.serve.app import ServeConfig, create_app
from m31.serve.local import LocalBackend

T0 = 1_700_000_000
N_USERS, N_ADS, PER_USER = 40, 30, 6
BRANDS = ("acme", "globex", "initech")
ATTRIBUTES = {"brand": "str", "categories": "str_list"}
runner = CliRunner()


def table(name: str, n: int, **given) -> pa.Table:
    """Table `name` of n rows: the columns given, every other one null."""
    return pa.table(
        {
            f.name: pa.array(given[f.name], f.type) if f.name in given else pa.nulls(n, f.type)
            for f in TABLES[name]
        },
        schema=TABLES[name],
    )


def own_data(demographics: bool = False, texts: bool = False) -> dataset.Dataset:
    """40 users, 30 items, 6 engagements each: the required columns only. `demographics`: the
    first half of the users have age, gender, country, platform and cohort; `texts`: the even
    items have a text."""
    users = {"user_id": np.arange(N_USERS) + 100}
    if demographics:
        half = N_USERS // 2
        users |= {
            "age": [30 + i % 20 for i in range(half)] + [None] * half,
            "gender": ["F" if i % 2 else "M" for i in range(half)] + [None] * half,
            "country": ["DE" if i % 3 else "FR" for i in range(half)] + [None] * half,
            "platform": ["web"] * half + [None] * half,
            "cohort": [i % 4 for i in range(half)] + [None] * half,
        }
    no_lists = [[] for _ in range(N_ADS)]
    ads = table(
        "ads",
        N_ADS,
        ad_id=np.arange(N_ADS) + 1000,
        target_countries=no_lists,
        target_genders=no_lists,
        target_platforms=no_lists,
        status=["active"] * N_ADS,
        **({"text": [f"item {j}" if j % 2 == 0 else None for j in range(N_ADS)]} if texts else {}),
    )
    ads = ads.append_column("brand", pa.array([BRANDS[j % 3] for j in range(N_ADS)]))
    ads = ads.append_column(
        "categories", pa.array([["sale"] if j % 5 == 0 else [] for j in range(N_ADS)])
    )
    user = np.repeat(np.arange(N_USERS), PER_USER)
    k = np.tile(np.arange(PER_USER), N_USERS)
    events = table(
        "events",
        len(user),
        user_id=user + 100,
        ad_id=(user * 7 + k * 3) % N_ADS + 1000,
        ts=T0 + user * 10_000 + k * 3_700,
        click=np.ones(len(user), bool),
        conversion=np.zeros(len(user), bool),
    )
    vocab = {name: [] for name in VOCABULARIES}
    if demographics:
        vocab |= {"gender": ["F", "M"], "platform": ["web"]}
    meta = {
        "source": "import",
        "repeat_engagement": True,
        "topics": [],
        "vocab": vocab,
        "item_attributes": ATTRIBUTES,
        "time_range": [T0, int(events["ts"].to_numpy().max())],
    }
    return dataset.Dataset(
        users=table("users", N_USERS, **users),
        advertisers=TABLES["advertisers"].empty_table(),
        ads=ads,
        events=events,
        organic=TABLES["organic"].empty_table(),
        meta=meta,
    )


def run(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The all-null dataset on disk, trained with `m31 train` and indexed with `m31 index
    build`: (root, data folder, checkpoint, snapshot)."""
    root = tmp_path_factory.mktemp("own-data")
    data = dataset.save(own_data(), root / "data")
    ckpt = root / "moe.pt"
    code, out = run(
        "train", "--model", "moe", "--data", data, "--out", ckpt, "--preset", "tiny",
        "--epochs", "1",
    )  # fmt: skip
    assert code == 0, out
    code, out = run("index", "build", "--data", data, "--model", ckpt, "--out", root / "index")
    assert code == 0, out
    return root, data, ckpt, root / "index"


@pytest.fixture
def recorded_texts(monkeypatch):
    """What the text encoder is asked to embed: the real encoder, its calls recorded."""
    from m31.features import embedding_cache

    real = embedding_cache.embed_texts
    asked: list[list[str]] = []

    def embed_texts(texts, *args, **kwargs):
        asked.append(list(texts))
        return real(texts, *args, **kwargs)

    monkeypatch.setattr(embedding_cache, "embed_texts", embed_texts)
    return asked


# ---------------------------------------------------------------- the all-null dataset


def test_only_the_required_columns_validate(tmp_path):
    folder = dataset.save(own_data(), tmp_path / "data")
    report = validate(folder)
    assert report.ok, [str(i) for i in report.errors]
    assert not report.warnings, [str(i) for i in report.warnings]
    assert report.rows["advertisers"] == 0 and report.rows["organic"] == 0
    ds = dataset.load(folder)
    assert ds.ads.column_names[-2:] == ["brand", "categories"]
    assert ds.users["age"].null_count == N_USERS


def test_features_invent_nothing(recorded_texts):
    ds = own_data()
    feats = build_features(ds, FeatureConfig(max_len=8))
    assert recorded_texts == [], "no text: the encoder is never asked"
    assert not feats.text_emb.any()
    vocab = feats.meta["vocab"]
    assert vocab["country"] == [] and vocab["cohort"] == [] and vocab["advertiser"] == []
    assert feats.meta["n_topics"] == 0 and feats.meta["n_categories"] == 0
    u, a = feats.users, feats.ads
    assert (u["gender"] == len(vocab["gender"])).all() and (u["country"] == 0).all()
    assert (u["cohort"] == 0).all() and (u["age_bucket"] == N_AGE_BUCKETS).all()
    assert (a["advertiser"] == -1).all() and (a["topic"] == 0).all() and (a["category"] == 0).all()
    assert (a["format"] == 0).all() and (a["objective"] == 0).all() and not a["quality"].any()
    # A null hour is the hour of the event's time (UTC); a null surface the unknown value.
    seen = feats.splits["impressions"]
    assert (seen["hour"] == (seen["ts"] % 86_400) // 3600).all()
    assert (feats.splits["train"]["surface"] == 0).all()  # no surfaces: unknown is code 0


def test_the_text_encoder_sees_only_the_texts_there_are(recorded_texts):
    feats = build_features(own_data(texts=True), FeatureConfig(max_len=8))
    assert recorded_texts == [[f"item {j}" for j in range(0, N_ADS, 2)]]
    has_text = np.arange(N_ADS) % 2 == 0
    assert not feats.text_emb[~has_text].any()
    # The sentence encoder's embeddings are unit vectors.
    np.testing.assert_allclose(np.linalg.norm(feats.text_emb[has_text], axis=1), 1, rtol=1e-5)


def test_trained_model_answers_without_inventing(trained):
    root, _data, ckpt, snapshot = trained
    model, blob = load_checkpoint(ckpt)
    assert blob["format"] == FORMAT
    # Every unknown row is zero after training: nothing was read through it.
    user, item = model.user, model.user.item
    for emb in (user.gender, user.context.surface, user.context.platform, item.format):
        assert not emb.weight[-1].any()
    for name in ("cohort", "age", "country"):
        if hasattr(user, name):
            assert not getattr(user, name).weight[-1].any(), name
    assert not item.topic.weight.any() and not item.category.weight.any()  # only unknown rows
    assert blob["sizes"]["topic"] == 1 and blob["sizes"]["age"] == N_AGE_BUCKETS + 1
    # An ad without an advertiser has no advertiser input.
    table = model.ads.advertiser
    assert not advertiser_embedding(table, torch.tensor([-1, -1]), 2).any()
    assert advertiser_embedding(table, torch.tensor([0]), 2).any()

    index = AdIndex.load(snapshot)
    assert index.schema["brand"] == "str" and index.schema["categories"] == "str_list"
    engine = load_engine(serving_folder(snapshot, root / "serving"), ckpt)
    try:
        retriever = engine.retriever
        ts = T0 + 10**7
        stored = AdRequest(105, ts, None, None)
        inline = AdRequest(
            None, ts, None, None,
            user=InlineUser(history=(Engagement(1003, ts - 60, None), Engagement(1004, ts - 30, None))),
        )  # fmt: skip
        bare = AdRequest(None, ts, None, None, user=InlineUser())
        out = retriever.retrieve([stored, inline, bare], k=10)
        for r in out.results:
            assert len(r.ad_ids) == 10 and np.isfinite(r.scores).all()
        # A filter on an item attribute.
        acme = {"eq": ["brand", "acme"]}
        out = retriever.retrieve([AdRequest(105, ts, None, None, filter=acme)], k=N_ADS)
        got = sorted(out.results[0].ad_ids.tolist())
        assert got == [1000 + j for j in range(0, N_ADS, 3)]
        sale = {"contains": ["categories", "sale"]}
        out = retriever.retrieve([AdRequest(105, ts, None, None, filter=sale)], k=N_ADS)
        assert sorted(out.results[0].ad_ids.tolist()) == [1000 + j for j in range(0, N_ADS, 5)]
        # A new ad may lack everything the tower reads but its id.
        g, x, b = engine.encoder.encode([NewAd(5000, None, None, None, None, None, None, None)])
        assert torch.isfinite(g).all() and torch.isfinite(x).all() and torch.isfinite(b).all()
    finally:
        engine.close()


def untrained(folder):
    """(dataset, features, an untrained tiny moe, the index it makes of the folder's ads)."""
    ds = dataset.load(folder)
    feats = build_features(ds, FeatureConfig(max_len=8))
    torch.manual_seed(0)
    model = build_model(model_preset("tiny", "moe"), vocab_sizes(feats), 384, 32).eval()
    return ds, feats, model, index_from_model(folder, model, feats)


def test_ads_without_an_advertiser_or_a_start(tmp_path, recorded_texts):
    _, _, _, index = untrained(dataset.save(own_data(), tmp_path / "data"))
    # No start: eligible at any time. No advertiser: no exclusion or filter ever matches.
    everyone = RequestContext(None, None, None, None, None, ts=0)
    assert index.eligible_mask(everyone).all()
    blocked = RequestContext(None, None, None, None, None, ts=0, exclude_advertisers=(0, 1))
    assert index.eligible_mask(blocked).all()
    assert torch.equal(reference_mask(index, blocked, None), index.eligible_mask(blocked))
    assert not index.eligible_mask(everyone, {"in": ["advertiser_id", [0]]}).any()
    assert index.eligible_mask(everyone, {"not": {"eq": ["advertiser_id", 0]}}).all()
    # An upsert may leave the advertiser out.
    z = torch.zeros(1, index.dim_g), torch.zeros(1, index.dim_x), torch.zeros(1)
    index.upsert([7], *z, [{"status": "active", "brand": "acme"}])
    assert index.get(7).attributes["advertiser_id"] is None
    # An age-targeted ad does not reach a user without an age.
    index.upsert([8], *z, [{"target_age_min": 18, "brand": "acme"}])
    assert not bool(index.eligible_mask(everyone)[-1])
    assert bool(index.eligible_mask(RequestContext(None, 30, None, None, None, ts=0))[-1])


def test_the_server_answers_without_the_dataset(trained):
    """The index `m31 index build` wrote carries what serving reads: the server starts and
    answers with the dataset folder gone (and writes nothing into it)."""
    root, data, ckpt, snapshot = trained
    config = ServeConfig(index=serving_folder(snapshot, root / "served"), model=ckpt)
    hidden = data.rename(root / "hidden")
    try:
        with ThreadServer(create_app(config, LocalBackend.load)) as s:
            answer(s)
        assert not data.exists()
    finally:
        hidden.rename(data)


def answer(s: ThreadServer) -> None:
    """What the served all-null dataset must answer."""
    # No surface or platform: the data has none, and a request need not name one.
    body = {"user_id": 101, "k": 5}
    r = httpx.post(f"{s.url}/v1/retrieve", json={"requests": [body]})
    assert r.status_code == 200, r.text
    assert len(r.json()["results"][0]["ad_ids"]) == 5
    # An inline user with nothing but a history.
    history = [{"ad_id": 1003, "ts": T0}, {"ad_id": 1007, "ts": T0 + 60}]
    inline = {"user": {"history": history}, "k": 5}
    r = httpx.post(f"{s.url}/v1/retrieve", json={"requests": [inline]})
    assert r.status_code == 200, r.text
    assert len(r.json()["results"][0]["ad_ids"]) == 5
    r = httpx.post(f"{s.url}/v1/retrieve", json={"requests": [{**body, "surface": "x"}]})
    assert r.status_code == 422, r.text
    body["filter"] = {"eq": ["brand", "globex"]}
    r = httpx.post(f"{s.url}/v1/retrieve", json={"requests": [body]})
    assert r.status_code == 200, r.text
    ids = r.json()["results"][0]["ad_ids"]
    assert ids and all((i - 1000) % 3 == 1 for i in ids)


# ---------------------------------------------------------------- demographics where given


def test_a_given_gender_moves_the_users_vector(tmp_path, recorded_texts):
    folder = dataset.save(own_data(demographics=True), tmp_path / "data")
    _ds, feats, model, index = untrained(folder)
    vocab = feats.meta["vocab"]
    assert vocab["country"] == ["DE", "FR"] and vocab["cohort"] == [0, 1, 2, 3]
    half = N_USERS // 2
    u = feats.users
    assert (u["gender"][half:] == 2).all() and (u["gender"][:half] < 2).all()
    assert (u["country"][half:] == 2).all() and (u["cohort"][half:] == 4).all()
    assert (u["age_bucket"][half:] == N_AGE_BUCKETS).all()
    retriever = Retriever(model, feats, index)
    ts = T0 + 10**7
    history = (Engagement(1003, ts - 60, None),)

    def query(**who):
        request = AdRequest(None, ts, None, None, user=InlineUser(history=history, **who))
        return retriever.encode(retriever.prepare([request], 10))

    given, unknown = query(gender="F", country="DE"), query(country="DE")
    assert not torch.allclose(given[1], unknown[1])
    # A stored user without demographics and a stored one with them answer alike in shape.
    out = retriever.retrieve([AdRequest(100, ts, None, None), AdRequest(139, ts, None, None)], 5)
    assert all(len(r.ad_ids) == 5 for r in out.results)
    # Targeting: a user with no gender is reached only by ads that do not target a gender.
    z = torch.zeros(1, index.dim_g), torch.zeros(1, index.dim_x), torch.zeros(1)
    index.upsert([9], *z, [{"target_genders": ["F"]}])
    who = {"ts": ts, "platform": None, "surface": None, "age": None, "country": None}
    assert not bool(index.eligible_mask(RequestContext(gender=None, **who))[-1])
    assert bool(index.eligible_mask(RequestContext(gender="F", **who))[-1])


# ---------------------------------------------------------------- what load and validate refuse


def rewrite(folder, name, change):
    path = folder / f"{name}.parquet"
    pq.write_table(change(pq.read_table(path)), path)


def set_column(t: pa.Table, name: str, values: pa.Array) -> pa.Table:
    return t.set_column(t.schema.get_field_index(name), name, values)


def with_meta(folder, **changes):
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, **changes}))


BROKEN = {  # name -> (table, change, file, column, words of validate's message and load's)
    "int32_id": (
        "users",
        lambda t: set_column(t, "user_id", t["user_id"].cast(pa.int32())),
        "user_id",
        "int32, expected int64",
    ),
    "missing_ts": ("events", lambda t: t.drop_columns(["ts"]), "ts", "missing"),
    "null_click": (
        "events",
        lambda t: set_column(t, "click", pa.array([None] + [True] * (t.num_rows - 1))),
        "click",
        "null",
    ),
    "float_quality": (
        "ads",
        lambda t: set_column(t, "quality", t["quality"].cast(pa.float64())),
        "quality",
        "double, expected float",
    ),
    "missing_brand": ("ads", lambda t: t.drop_columns(["brand"]), "brand", "missing"),
    "int_brand": (
        "ads",
        lambda t: set_column(t, "brand", pa.array(range(t.num_rows), pa.int64())),
        "brand",
        "int64, expected string",
    ),
    "null_in_a_list": (
        "ads",
        lambda t: set_column(
            t,
            "categories",
            pa.array([["a", None]] + [[]] * (t.num_rows - 1), pa.list_(pa.string())),
        ),
        "categories",
        "a list holds a null",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_load_and_validate_refuse_a_broken_required_column(tmp_path, case):
    table, change, column, words = BROKEN[case]
    folder = dataset.save(own_data(), tmp_path / "data")
    rewrite(folder, table, change)
    with pytest.raises(DatasetError, match=rf"{table}\.parquet: .*{column!r}.*{words}"):
        dataset.load(folder)
    errors = [i for i in validate(folder).errors if i.check == "types"]
    assert [(i.file, i.column) for i in errors] == [(f"{table}.parquet", column)], errors
    assert words in errors[0].message


def test_an_absent_optional_column_reads_as_nulls(tmp_path):
    folder = dataset.save(own_data(demographics=True), tmp_path / "data")
    rewrite(folder, "users", lambda t: t.drop_columns(["age"]))
    assert dataset.load(folder).users["age"].null_count == N_USERS
    report = validate(folder)
    assert report.ok
    assert [(i.column, i.message) for i in report.warnings] == [
        ("age", "absent: read as null (int16)")
    ]


def test_item_attributes_are_checked(tmp_path):
    folder = dataset.save(own_data(), tmp_path / "data")
    for bad, words in (
        (["brand"], "must be an object"),
        ({"brand": "text"}, "kind 'text' is not one of"),
        ({"format": "str"}, "a column of the ads schema"),
        ({"tags": "str"}, "the index's own attribute"),
    ):
        with_meta(folder, item_attributes=bad)
        with pytest.raises(DatasetError, match=words):
            dataset.load(folder)
        issues = [i for i in validate(folder).errors if i.column == "item_attributes"]
        assert len(issues) == 1 and words in issues[0].message, issues
    # An extra column meta does not declare is ignored, and said so.
    with_meta(folder, item_attributes={"brand": "str"})
    assert "categories" not in dataset.load(folder).ads.column_names
    warned = [i for i in validate(folder).warnings if i.column == "categories"]
    assert len(warned) == 1 and "item_attributes (ignored)" in warned[0].message


def test_a_dataset_in_memory_is_held_to_the_schema():
    ds = own_data()
    with pytest.raises(DatasetError, match="table 'events': column 'hour': int64, expected int8"):
        dataset.Dataset(
            users=ds.users, advertisers=ds.advertisers, ads=ds.ads, organic=ds.organic,
            events=set_column(ds.events, "hour", ds.events["hour"].cast(pa.int64())),
            meta=ds.meta,
        )  # fmt: skip


def test_validate_reports_nulls_only_where_they_are_not_allowed(tmp_path):
    folder = dataset.save(own_data(demographics=True), tmp_path / "data")
    report = validate(folder)
    assert report.ok and not report.warnings, [str(i) for i in report.issues]
    # A non-null value is still checked: an unknown gender next to the nulls.
    rewrite(
        folder,
        "users",
        lambda t: set_column(t, "gender", pa.array(["X", *t["gender"].to_pylist()[1:]])),
    )
    errors = validate(folder).errors
    assert [(i.check, i.row, i.column) for i in errors] == [("vocabularies", 0, "gender")]
    assert errors[0].level == ERROR and errors[0].count == 1
