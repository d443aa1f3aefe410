"""A dataset's checks (`m31.data.validate`, `m31 data validate`) and its repeat_engagement.

Every broken case writes its own copy of one valid synthetic world and breaks one thing; the
report must name the file, the row and the column, and the command must exit 1 on an error.
"""

import importlib
import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_movielens import write as write_movielens
from typer.testing import CliRunner

from m31.cli import app
from m31.data import dataset
from m31.data.dataset import DatasetError, repeat_engagement, vocabularies
from m31.data.movielens import load_movielens
from m31.data.schema import TABLES
from m31.data.validate import CHECKS, ERROR, WARNING, validate
from m31.features import FeatureConfig, Features, build_features
from m31.model import model_preset
from m31.vocabularies import SURFACES
from m31.world.config import preset
from m31.world.generate import generate

# the module: the package exports its function `train` under the same name
training = importlib.import_module("m31.training.train")
runner = CliRunner()
CFG = preset("tiny").with_overrides(n_impressions=12_000)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    ds, _ = generate(CFG, seed=3)
    folder = tmp_path_factory.mktemp("valid") / "world"
    dataset.save(ds, folder)
    return folder, ds


def cli(*args):
    result = runner.invoke(app, ["data", "validate", *map(str, args)])
    return result.exit_code, result.output


def copy(world, tmp_path):
    return shutil.copytree(world[0], tmp_path / "broken")


def set_values(folder, table, column, rows_values):
    """Rewrite one column of `table` with `rows_values` ({row: value}) put in."""
    path = folder / f"{table}.parquet"
    t = pq.read_table(path)
    values = t[column].to_pylist()
    for row, value in rows_values.items():
        values[row] = value
    i = t.schema.get_field_index(column)
    pq.write_table(
        t.set_column(i, t.schema.field(i), pa.array(values, t.schema.field(i).type)), path
    )


def set_meta(folder, **changes):
    meta = json.loads((folder / "meta.json").read_text())
    for key, value in changes.items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    (folder / "meta.json").write_text(json.dumps(meta))


def only(report, check, level=ERROR):
    issues = [i for i in report.issues if i.check == check and i.level == level]
    assert len(issues) == 1, [str(i) for i in report.issues]
    return issues[0]


# ---------------------------------------------------------------- a valid folder


def test_a_generated_world_is_valid_with_the_right_counts(world):
    folder, ds = world
    report = validate(folder)
    assert report.ok, [str(i) for i in report.errors]
    # The generator draws the two ends of an age range apart, so a few ads have an empty one.
    assert {(i.check, i.file, i.column) for i in report.warnings} <= {
        ("numbers", "ads.parquet", "target_age_min")
    }
    assert report.rows == ds.counts()
    assert report.rows["users"] == CFG.n_users and report.rows["ads"] == CFG.n_ads
    assert report.engagements == int(ds.events["click"].to_numpy().sum())
    ts = ds.events["ts"].to_numpy()
    assert report.time_range == (int(ts.min()), int(ts.max()))
    assert set(report.found()) == set(CHECKS)
    assert all(found[ERROR] == 0 for found in report.found().values())

    code, out = cli(folder)
    assert code == 0, out
    assert f"{CFG.n_users:,} users, {CFG.n_ads:,} items, {ds.events.num_rows:,} events" in out
    assert "source 'synthetic', repeat_engagement true" in out
    assert "\nvalid: 0 errors" in out
    assert all(f"\n{check} " in out for check in CHECKS)
    code, out = cli(folder, "--json")
    assert code == 0 and json.loads(out)["rows"] == ds.counts()


def test_a_movielens_folder_is_valid(tmp_path):
    folder = tmp_path / "ml"
    dataset.save(load_movielens(write_movielens(tmp_path / "raw")), folder)
    report = validate(folder)
    assert report.ok and not report.warnings, [str(i) for i in report.issues]
    assert report.rows["events"] == 6 and report.rows["organic"] == 0


def test_a_folder_that_is_not_there_is_an_input_error(tmp_path):
    with pytest.raises(DatasetError, match="no such dataset folder"):
        validate(tmp_path / "nope")
    code, out = cli(tmp_path / "nope")
    assert code == 2 and "no such dataset folder" in out


# ---------------------------------------------------------------- broken copies


def drop_organic(folder):
    (folder / "organic.parquet").unlink()


def hour_as_int64(folder):
    path = folder / "events.parquet"
    t = pq.read_table(path)
    i = t.schema.get_field_index("hour")
    pq.write_table(t.set_column(i, "hour", t["hour"].cast(pa.int64())), path)


def duplicate_ad_id(folder):
    set_values(folder, "ads", "ad_id", {10: 4})


def unknown_surface(folder):
    set_values(folder, "events", "surface", {11: "tv"})


def unknown_target_gender(folder):
    set_values(folder, "ads", "target_genders", {2: ["X"]})


def nan_quality(folder):
    set_values(folder, "ads", "quality", {6: float("nan")})


def age_over_150(folder):
    set_values(folder, "users", "age", {4: 200})


def negative_topic(folder):
    set_values(folder, "ads", "topic", {5: -3})


def null_status(folder):
    """A null in a required column (users' country may be null: no country)."""
    path = folder / "ads.parquet"
    t = pq.read_table(path)
    values = t["status"].to_pylist()
    values[8] = None
    i = t.schema.get_field_index("status")
    pq.write_table(t.set_column(i, pa.field("status", pa.string()), pa.array(values)), path)


def event_outside_time_range(folder):
    last = json.loads((folder / "meta.json").read_text())["time_range"][1]
    set_values(folder, "events", "ts", {13: last + 1})


def unreadable_meta(folder):
    (folder / "meta.json").write_text('{"source": "synthetic",\n  "seed": }\n')


def repeat_engagement_not_a_bool(folder):
    set_meta(folder, repeat_engagement="no")


def empty_events(folder):
    pq.write_table(TABLES["events"].empty_table(), folder / "events.parquet")


# (break, check, file, row, column, words of the message)
BROKEN = [
    (drop_organic, "files", "organic.parquet", None, None, "missing"),
    (hour_as_int64, "types", "events.parquet", None, "hour", "int64, expected int8"),
    (duplicate_ad_id, "duplicates", "ads.parquet", 10, "ad_id", "ad_id 4 repeats row 4"),
    (unknown_surface, "vocabularies", "events.parquet", 11, "surface", "unknown surface 'tv'"),
    (unknown_target_gender, "vocabularies", "ads.parquet", 2, "target_genders", "'X'"),
    (nan_quality, "numbers", "ads.parquet", 6, "quality", "nan is not a finite number"),
    (age_over_150, "numbers", "users.parquet", 4, "age", "200 is outside 0..150"),
    (negative_topic, "numbers", "ads.parquet", 5, "topic", "-3 is negative"),
    (null_status, "types", "ads.parquet", 8, "status", "null (a required column)"),
    (event_outside_time_range, "time", "events.parquet", 13, "ts", "outside meta.json's"),
    (unreadable_meta, "meta", "meta.json", 2, None, "not valid JSON"),
    (repeat_engagement_not_a_bool, "meta", "meta.json", None, "repeat_engagement", "'no'"),
    (empty_events, "empty", "events.parquet", None, None, "no rows"),
]


@pytest.mark.parametrize(
    "breaker,check,file,row,column,words", BROKEN, ids=[b[0].__name__ for b in BROKEN]
)
def test_each_broken_copy_is_reported_where_it_is_broken(
    world, tmp_path, breaker, check, file, row, column, words
):
    folder = copy(world, tmp_path)
    breaker(folder)
    report = validate(folder)
    assert not report.ok
    issue = only(report, check)
    assert (issue.file, issue.row, issue.column) == (file, row, column), str(issue)
    assert words in issue.message, str(issue)
    assert issue.count == 1

    code, out = cli(folder)
    assert code == 1, out
    assert f"\n  {issue}" in out and "\ninvalid: " in out


def test_an_event_naming_an_absent_user_and_ad(world, tmp_path):
    folder = copy(world, tmp_path)
    set_values(folder, "events", "user_id", {5: 10**6, 7: 10**6 + 1})
    set_values(folder, "events", "ad_id", {9: 10**7})
    report = validate(folder)
    refs = {i.column: i for i in report.errors if i.check == "references"}
    assert set(refs) == {"user_id", "ad_id"} and len(report.errors) == 2
    user, ad = refs["user_id"], refs["ad_id"]
    assert (user.file, user.row, user.count) == ("events.parquet", 5, 2)
    assert user.message == "user_id 1000000 is not in users.parquet"
    assert (ad.file, ad.row, ad.count) == ("events.parquet", 9, 1)
    assert ad.message == "ad_id 10000000 is not in ads.parquet"
    code, out = cli(folder)
    assert code == 1
    assert "events.parquet row 5, column user_id: user_id 1000000 is not in users" in out
    assert "(and 1 more rows)" in out


def test_an_empty_age_range_is_a_warning_naming_the_ad(world, tmp_path):
    folder = copy(world, tmp_path)
    before = validate(folder).warnings
    already = sum(i.count for i in before)
    set_values(folder, "ads", "target_age_min", {0: 60})
    set_values(folder, "ads", "target_age_max", {0: 20})
    report = validate(folder)
    assert report.ok
    issue = only(report, "numbers", WARNING)
    assert (issue.file, issue.row, issue.column) == ("ads.parquet", 0, "target_age_min")
    assert "60 is above target_age_max 20" in issue.message
    assert issue.count == already + 1
    code, out = cli(folder)
    assert code == 0 and "ads.parquet row 0, column target_age_min: 60 is above" in out


def test_an_event_before_its_ad_was_created_is_a_warning(world, tmp_path):
    folder, ds = world
    folder = copy(world, tmp_path)
    ad = int(ds.events["ad_id"][3].as_py())
    set_values(folder, "ads", "created_at", {ad: int(ds.events["ts"][3].as_py()) + 1})
    report = validate(folder)
    assert report.ok
    issue = only(report, "time", WARNING)
    assert (issue.file, issue.row, issue.column) == ("events.parquet", 3, "ts")
    assert f"of its ad (ad_id {ad})" in issue.message


def test_a_repeated_engagement_where_meta_says_none_repeat(world, tmp_path):
    folder, ds = world
    folder = copy(world, tmp_path)
    set_meta(folder, repeat_engagement=False)
    report = validate(folder)
    clicks = ds.events.filter(ds.events["click"])
    pairs = list(zip(clicks["user_id"].to_pylist(), clicks["ad_id"].to_pylist(), strict=True))
    repeats = len(pairs) - len(set(pairs))
    assert repeats > 0, "the generator lets a user click an ad again"
    issue = only(report, "duplicates", WARNING)
    assert issue.count == repeats and issue.column == "ad_id"
    assert "but meta.json says repeat_engagement false" in issue.message
    assert not any(i.check == "duplicates" for i in validate(world[0]).issues)


def test_a_folder_written_before_repeat_engagement_is_a_warning(world, tmp_path):
    folder = copy(world, tmp_path)
    set_meta(folder, repeat_engagement=None)
    report = validate(folder)
    issue = only(report, "meta", WARNING)
    assert issue.column == "repeat_engagement" and "derived from source" in issue.message
    assert report.ok


def test_an_extra_column_is_a_warning_and_a_missing_one_an_error(world, tmp_path):
    folder = copy(world, tmp_path)
    path = folder / "advertisers.parquet"
    t = pq.read_table(path)
    pq.write_table(t.drop(["category"]).append_column("budget", pa.array([1.0] * len(t))), path)
    report = validate(folder)
    missing = only(report, "types")
    assert (missing.file, missing.column) == ("advertisers.parquet", "category")
    assert missing.message == "missing (expected int32)"
    assert only(report, "types", WARNING).column == "budget"


def test_vocabularies_are_the_schema_constants_and_the_countries_present():
    meta = {
        "topics": [{"id": 0, "name": "a", "category": 0}, {"id": 1, "name": "b", "category": 0}]
    }
    vocab = vocabularies(meta, ["US", "DE", "US"])
    assert vocab["surface"] == SURFACES and vocab["country"] == ("DE", "US")
    assert vocab["topic"] == (0, 1) and vocab["category"] == (0,)
    assert "topic" not in vocabularies({})


# ---------------------------------------------------------------- repeat_engagement


@pytest.mark.parametrize(
    "source,repeat,excluded",
    [
        ("movielens", True, False),
        ("synthetic", False, True),
        ("movielens", None, True),  # written before the key: derived from the source
        ("synthetic", None, False),
    ],
)
def test_repeat_engagement_alone_decides_whether_history_is_excluded(
    world, tmp_path, monkeypatch, source, repeat, excluded
):
    ds = world[1]
    meta = {**ds.meta, "source": source}
    if repeat is None:
        meta.pop("repeat_engagement")
    else:
        meta["repeat_engagement"] = repeat
    ds = dataset.Dataset(
        users=ds.users, advertisers=ds.advertisers, ads=ds.ads, events=ds.events,
        organic=ds.organic, meta=meta,
    )  # fmt: skip
    feats = build_features(ds, FeatureConfig(max_len=8, text_embeddings=False))
    assert feats.meta["repeat_engagement"] is (not excluded)
    if repeat is None:  # a feature folder written before the key existed, too
        del feats.meta["repeat_engagement"]

    seen = []
    real = training.evaluate
    monkeypatch.setattr(
        training, "evaluate", lambda *a, **kw: seen.append(kw["exclude_seen"]) or real(*a, **kw)
    )
    cfg = model_preset("tiny", "two-tower").with_overrides(epochs=1, val_requests=50)
    training.train(cfg, feats, device="cpu", log=lambda _: None, progress=False)
    assert seen == [excluded], "training's validation"

    folder = feats.save(tmp_path / "features")
    assert Features.load(folder).meta.get("repeat_engagement") == feats.meta.get(
        "repeat_engagement"
    )
    args = ["--baselines", "popularity", "--ks", "10", "--max-users", "50"]
    result = runner.invoke(app, ["eval", "--data", str(folder), *args])
    assert result.exit_code == 0, result.output
    assert f"seen ads {'excluded' if excluded else 'kept'}" in result.output, "m31 eval"


def test_repeat_engagement_is_written_by_every_source_and_checked(world, tmp_path):
    assert world[1].meta["repeat_engagement"] is True
    assert load_movielens(write_movielens(tmp_path / "ml")).meta["repeat_engagement"] is False
    assert repeat_engagement({"source": "anything", "repeat_engagement": False}) is False
    with pytest.raises(DatasetError, match="repeat_engagement: expected true or false"):
        repeat_engagement({"source": "synthetic", "repeat_engagement": 1})
    ds = world[1]
    bad = dataset.Dataset(
        users=ds.users, advertisers=ds.advertisers, ads=ds.ads, events=ds.events,
        organic=ds.organic, meta={**ds.meta, "repeat_engagement": None},
    )  # fmt: skip
    with pytest.raises(DatasetError, match="repeat_engagement"):
        build_features(bad, FeatureConfig(max_len=8, text_embeddings=False))
