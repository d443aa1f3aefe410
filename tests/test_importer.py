"""`m31 data import` on files the tests write in every accepted form: interactions (CSV, TSV,
Parquet, JSON lines; with a time, with only an order), sequence files, catalogues (with list,
numeric and text columns, or an item -> attribute ids JSON map) and users. Nothing a source
lacks is invented, and every bad input is refused naming the file, row and column, with
nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from m31.cli import app
from m31.data import dataset
from m31.data.importer import ImportFailed, Interactions, Items, Users, import_dataset
from m31.data.validate import validate

DAY = 86_400


def write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def test_a_sequence_file_with_nothing_but_ids(tmp_path):
    seq = write(tmp_path / "Beauty.txt", "1 10 11 12\n2 11 13\n\n3 10 12 14 15\n")
    attrs = write(tmp_path / "attrs.json", json.dumps({"10": [1, 2], "11": [2], "12": [3]}))
    report = import_dataset(tmp_path / "ds", sequences=seq, items=Items(attrs))
    assert (report.users, report.items, report.events) == (3, 6, 9)
    assert report.clock == "order" and report.repeat_engagement is False
    ds = dataset.load(tmp_path / "ds")
    ev = ds.events.to_pydict()
    assert ev["user_id"] == [1, 1, 1, 2, 2, 3, 3, 3, 3]
    assert ev["ad_id"] == [10, 11, 12, 11, 13, 10, 12, 14, 15]
    # Only the order: a user's i-th event at day i, no hour of day, every event a click.
    assert ev["ts"] == [0, DAY, 2 * DAY, 0, DAY, 0, DAY, 2 * DAY, 3 * DAY]
    assert ev["hour"] == [None] * 9 and ev["surface"] == [None] * 9
    assert all(ev["click"]) and not any(ev["conversion"])
    # Nothing invented: no demographics, no text, no advertiser; attributes where the map
    # has them, the empty list where it does not.
    users = ds.users.to_pydict()
    for column in ("age", "gender", "country", "platform", "cohort"):
        assert users[column] == [None] * 3
    ads = ds.ads.to_pydict()
    assert ads["text"] == [None] * 6 and ads["advertiser_id"] == [None] * 6
    assert ads["attributes"] == [["1", "2"], ["2"], ["3"], [], [], []]
    assert ads["status"] == ["active"] * 6
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    assert meta["item_attributes"] == {"attributes": "str_list"}
    assert meta["clock"] == "order" and meta["repeat_engagement"] is False
    assert meta["vocab"]["surface"] == []
    assert not validate(tmp_path / "ds").errors


@pytest.mark.parametrize("form", ["csv", "tsv", "parquet", "jsonl"])
def test_interactions_in_every_form(tmp_path, form):
    rows = {
        "user": ["u2", "u1", "u1", "u2", "u1"],
        "item": ["b", "a", "b", "c", "a"],
        "timestamp": [1_700_000_100, 1_700_000_000, 1_700_003_600, 1_700_000_200, 1_700_090_000],
        "surface": ["feed", "search", "feed", None, "watch"],
        "event": ["view", "purchase", "view", "view", "view"],
    }
    path = tmp_path / f"events.{form}"
    table = pa.table(rows)
    if form == "parquet":
        pq.write_table(table, path)
    elif form == "jsonl":
        write(path, "".join(json.dumps({k: v[i] for k, v in rows.items()}) + "\n"
                            for i in range(5)))  # fmt: skip
    else:
        sep = "\t" if form == "tsv" else ","
        lines = [sep.join(rows)] + [
            sep.join("" if v[i] is None else str(v[i]) for v in rows.values()) for i in range(5)
        ]
        write(path, "\n".join(lines) + "\n")
    catalogue = write(
        tmp_path / "items.csv",
        "item_id,title,brand,price,tags,format\n"
        "a,Red lipstick,Acme,9.5,lips|red,story_ad\n"
        "b,Blue shampoo,,4.0,,\n"
        "c,Hand cream,Acme,,hands,image\n"
        "d,Unsold item,Other,1.0,x,image\n",
    )
    users = write(tmp_path / "users.csv", "user_id,country,age,segment\nu1,DE,31,gold\n")
    report = import_dataset(
        tmp_path / "ds",
        interactions=Interactions(path, conversion_events=("purchase",)),
        items=Items(catalogue, list_columns=("tags",)),
        users=Users(users),
    )
    assert (report.users, report.items, report.events) == (2, 4, 5)
    assert report.repeat_engagement is True  # u1 engaged with a twice
    assert report.item_attributes == {"brand": "str", "price": "float", "tags": "str_list"}
    assert any("segment" in note for note in report.notes)  # ignored, and said so
    ds = dataset.load(tmp_path / "ds")
    ev = ds.events.to_pydict()
    # Text ids become their rank among the sorted ids; the originals are kept.
    assert pq.read_table(tmp_path / "ds" / "user_ids.parquet").to_pydict() == {
        "id": [0, 1], "external_id": ["u1", "u2"]}  # fmt: skip
    assert ev["user_id"] == [0, 0, 0, 1, 1] and ev["ad_id"] == [0, 1, 0, 1, 2]
    assert ev["ts"] == [1_700_000_000, 1_700_003_600, 1_700_090_000, 1_700_000_100, 1_700_000_200]
    assert ev["hour"][0] == (1_700_000_000 // 3600) % 24
    assert ev["surface"] == ["search", "feed", "watch", "feed", None]
    assert ev["conversion"] == [True, False, False, False, False]
    ads = ds.ads.to_pydict()
    assert ads["text"] == ["Red lipstick", "Blue shampoo", "Hand cream", "Unsold item"]
    assert ads["brand"] == ["Acme", None, "Acme", "Other"]
    assert ads["price"] == [9.5, 4.0, None, 1.0]
    assert ads["tags"] == [["lips", "red"], [], ["hands"], ["x"]]
    assert ads["format"] == ["story_ad", None, "image", "image"]
    users_t = ds.users.to_pydict()
    assert users_t["country"] == ["DE", None] and users_t["age"] == [31, None]
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    assert meta["vocab"]["surface"] == ["feed", "search", "watch"]
    assert meta["vocab"]["format"] == ["image", "story_ad"]
    assert meta["clock"] == "unix"
    assert not validate(tmp_path / "ds").errors


def test_interactions_with_only_an_order(tmp_path):
    path = write(tmp_path / "log.csv", "user_id,item_id\n7,1\n7,2\n8,2\n7,3\n")
    report = import_dataset(tmp_path / "ds", interactions=Interactions(path))
    assert report.clock == "order"
    assert dataset.load(tmp_path / "ds").events.to_pydict()["ts"] == [0, DAY, 2 * DAY, 0]


BAD = [
    # (files, the import's arguments, the message it must hold)
    ({"e.csv": "user_id,item_id,ts\n1,2,10\n"}, {"interactions": "e.csv"}, None),
    ({"e.csv": "user_id,ts\n1,10\n"}, {"interactions": "e.csv"},
     "e.csv: no item id column (looked for item_id"),
    ({"e.csv": "user_id,item_id,ts\n1,2,10\n1,2,yesterday\n"}, {"interactions": "e.csv"},
     "e.csv: column 'ts': not a time"),
    ({"e.csv": "user_id,item_id,ts\n1,2,10\n1,3,5\n"}, {"interactions": "e.csv"},
     "e.csv: row 3, column 'ts': time goes backwards within the user"),
    ({"e.csv": "user_id,item_id,ts\n1,2,10\n,3,5\n"}, {"interactions": "e.csv"},
     "e.csv: row 3, column 'user_id': null id"),
    ({"e.csv": "user_id,item_id,ts\n1,2,10\n1,9,11\n", "i.csv": "item_id,title\n2,x\n"},
     {"interactions": "e.csv", "items": "i.csv"},
     "e.csv: row 3: item '9' is not in the catalogue"),
    ({"e.csv": "user_id,item_id,ts\n1,2,10\n", "i.csv": "item_id,title\n2,x\n2,y\n"},
     {"interactions": "e.csv", "items": "i.csv"},
     "i.csv: row 3, column 'item_id': duplicate id '2' (first at row 2)"),
    ({"e.csv": "user_id,item_id,ts\n1,2,10\n", "i.csv": "item_id,category\n2,hair\n"},
     {"interactions": "e.csv", "items": "i.csv"},
     "i.csv: column 'category': 'category' names the ads table's topic ids"),
    ({"e.csv": "user_id,item_id,ts\n1,2,10\n", "u.csv": "user_id,age\n1,old\n"},
     {"interactions": "e.csv", "users": "u.csv"}, "u.csv: column 'age': not int16"),
    ({"e.csv": ""}, {"interactions": "e.csv"}, "e.csv: empty file"),
    ({"s.txt": "1 2 3\n2 \xff 4\n".encode("latin-1")}, {"sequences": "s.txt"},
     "s.txt: row 2: not UTF-8"),
    ({"s.txt": "1 2 3\n2\n"}, {"sequences": "s.txt"}, "s.txt: row 2: a user without items"),
    ({"s.txt": "1 2 3\n2 4\n1 5\n"}, {"sequences": "s.txt"},
     "s.txt: row 3: user '1' again (first on row 1)"),
    ({"e.csv": "user_id,item_id,ts\n1,2,10\n"}, {"interactions": "missing.csv"},
     "missing.csv: no such file"),
]  # fmt: skip


@pytest.mark.parametrize(("files", "args", "message"), BAD)
def test_bad_input_is_refused_naming_where_and_nothing_is_written(tmp_path, files, args, message):
    for name, content in files.items():
        write(tmp_path / name, content)
    kwargs = {}
    for role, name in args.items():
        path = tmp_path / name
        kwargs[role] = {"interactions": Interactions, "items": Items, "users": Users}.get(
            role, lambda p: p
        )(path)
    out = tmp_path / "ds"
    if message is None:  # the valid one the others are variations of
        import_dataset(out, **kwargs)
        assert out.is_dir()
        return
    with pytest.raises(ImportFailed) as e:
        import_dataset(out, **kwargs)
    assert message in str(e.value), str(e.value)
    assert not out.exists() and not list(tmp_path.glob(".ds*"))


def test_the_command_imports_and_names_bad_input(tmp_path):
    seq = write(tmp_path / "s.txt", "1 10 11\n2 11 12 10\n")
    runner = CliRunner()
    ok = runner.invoke(app, ["data", "import", "--sequences", str(seq), "--out",
                             str(tmp_path / "ds")])  # fmt: skip
    assert ok.exit_code == 0, ok.output
    assert "2 users, 3 items, 5 events" in ok.output
    bad = write(tmp_path / "e.csv", "user_id,item_id,ts\n1,2,10\n1,3,5\n")
    out = runner.invoke(app, ["data", "import", "--interactions", str(bad), "--out",
                              str(tmp_path / "ds2")])  # fmt: skip
    assert out.exit_code == 2
    assert "row 3, column 'ts': time goes backwards" in out.output
    sorted_ = runner.invoke(app, ["data", "import", "--interactions", str(bad), "--sort",
                                  "--out", str(tmp_path / "ds2")])  # fmt: skip
    assert sorted_.exit_code == 0, sorted_.output
    assert dataset.load(tmp_path / "ds2").events.to_pydict()["ad_id"] == [3, 2]
