from pathlib import Path

import pytest

from m31.data.dataset import DatasetError
from m31.data.movielens import STANDARD_GENRES, load_movielens
from m31.data.schema import TABLES

REAL = Path(__file__).resolve().parents[2] / "shared/data/movielens-100k"

USERS = [
    "1|24|M|technician|85711",
    "2|53|F|other|94043",
    "3|17|M|student|32067",
    "4|23|F|technician|43537",
    "5|60|M|retired|15213",  # never rates
]


def item(mid, title, date, genres, n_genres=19):
    flags = ["1" if g in genres else "0" for g in range(n_genres)]
    return "|".join([str(mid), title, date, "", f"http://us.imdb.com/{mid}", *flags])


ITEMS = [
    item(1, "Toy Story (1995)", "01-Jan-1995", {3, 4, 5}),
    item(2, "Café au Lait (1993)", "15-Mar-1993", {8, 14}),
    item(3, "Mystery Film (1990)", "", set()),
    item(4, "Bad Date (1997)", "32-Foo-1997", {1}),
]

# (user, item, rating, ts), deliberately out of order and with ts ties.
RATINGS = [
    (1, 1, 5, 880000000),
    (2, 2, 3, 880003600),
    (1, 2, 4, 879990000),
    (3, 1, 1, 880003600),
    (4, 4, 2, 880100000),
    (2, 1, 4, 880003600),
]
T0 = 879990000


def write(folder, users=USERS, items=ITEMS, ratings=RATINGS, genres=STANDARD_GENRES):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "u.user").write_bytes(("\n".join(users) + "\n").encode("latin-1"))
    (folder / "u.item").write_bytes(("\n".join(items) + "\n").encode("latin-1"))
    data = "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in ratings)
    (folder / "u.data").write_bytes(data.encode("latin-1"))
    if genres is not None:
        lines = "".join(f"{g}|{i}\n" for i, g in enumerate(genres)) + "\n"
        (folder / "u.genre").write_bytes(lines.encode("latin-1"))
    return folder


def test_round_trip_exact_values(tmp_path):
    ds = load_movielens(write(tmp_path / "ml"))

    for name, schema in TABLES.items():
        assert ds.table(name).schema.equals(schema, check_metadata=False), name
    assert ds.counts() == {"users": 5, "advertisers": 19, "ads": 4, "events": 6, "organic": 0}

    # Cohorts are numbered in sorted (occupation, bucket) order:
    # (other, 45-54)=0, (retired, 55+)=1, (student, <18)=2, (technician, 18-24)=3.
    assert ds.users.to_pydict() == {
        "user_id": [1, 2, 3, 4, 5],
        "age": [24, 53, 17, 23, 60],
        "gender": ["M", "F", "M", "F", "M"],
        "country": ["US"] * 5,
        "platform": ["web"] * 5,
        "cohort": [3, 0, 2, 3, 1],
        "created_at": [879990000, 880003600, 880003600, 880100000, T0],
    }

    assert ds.advertisers.to_pydict() == {
        "advertiser_id": list(range(19)),
        "name": list(STANDARD_GENRES),
        "category": list(range(19)),
    }

    assert ds.ads.to_pydict() == {
        "ad_id": [1, 2, 3, 4],
        "advertiser_id": [3, 8, 0, 1],
        "campaign_id": [1, 2, 3, 4],
        "objective": ["conversions"] * 4,
        "format": ["video"] * 4,
        "topic": [3, 8, 0, 1],
        "category": [3, 8, 0, 1],
        "text": [
            "Toy Story (1995). Animation, Children's, Comedy film.",
            "Café au Lait (1993). Drama, Romance film.",
            "Mystery Film (1990). unknown film.",
            "Bad Date (1997). Action film.",
        ],
        "target_countries": [[]] * 4,
        "target_age_min": [0] * 4,
        "target_age_max": [120] * 4,
        "target_genders": [[]] * 4,
        "target_platforms": [[]] * 4,
        "status": ["active"] * 4,
        "daily_budget": [0.0] * 4,
        "quality": [0.0] * 4,
        # 1995-01-01 and 1993-03-15 at UTC midnight; empty and impossible dates fall back to T0.
        "created_at": [788918400, 732153600, T0, T0],
    }

    assert ds.events.to_pydict() == {
        "user_id": [1, 1, 2, 2, 3, 4],
        "ad_id": [2, 1, 1, 2, 1, 4],
        "ts": [879990000, 880000000, 880003600, 880003600, 880003600, 880100000],
        "surface": ["feed"] * 6,
        "hour": [1, 4, 5, 5, 5, 8],
        "platform": ["web"] * 6,
        "click": [True] * 6,
        "conversion": [True, True, True, False, False, False],
    }
    assert ds.organic.num_rows == 0

    assert ds.meta == {
        "source": "movielens",
        "repeat_engagement": False,
        "vocab": {
            "surface": ["feed"],
            "platform": ["web"],
            "format": ["video"],
            "objective": ["conversions"],
            "gender": ["F", "M"],
            "organic_surface": [],
        },
        "path": str(tmp_path / "ml"),
        "topics": [{"id": i, "name": g, "category": i} for i, g in enumerate(STANDARD_GENRES)],
        "n_ratings": 6,
        "time_range": [879990000, 880100000],
    }


def test_latin1_title_is_decoded(tmp_path):
    folder = write(tmp_path / "ml")
    assert b"Caf\xe9 au Lait" in (folder / "u.item").read_bytes()
    ds = load_movielens(folder)
    assert ds.ads["text"][1].as_py().startswith("Café au Lait (1993).")


def test_deterministic_and_independent_of_line_order(tmp_path):
    a = load_movielens(write(tmp_path / "a"))
    b = load_movielens(write(tmp_path / "a"))
    c = load_movielens(
        write(tmp_path / "c", users=USERS[::-1], items=ITEMS[::-1], ratings=RATINGS[::-1])
    )
    for name in TABLES:
        assert a.table(name).equals(b.table(name)), name
        assert a.table(name).equals(c.table(name)), name


def test_cohort_age_bucket_edges(tmp_path):
    ages = [17, 18, 24, 25, 34, 35, 44, 45, 54, 55, 90]
    users = [f"{i}|{age}|F|writer|00000" for i, age in enumerate(ages, 1)]
    ds = load_movielens(write(tmp_path / "ml", users=users, ratings=[(1, 1, 3, 5)]))
    assert ds.users["cohort"].to_pylist() == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]


def test_genre_names_from_u_genre_or_standard(tmp_path):
    genres = ["none", "Drama", "Comedy"]
    items = [item(1, "A", "", {2}, n_genres=3), item(2, "B", "", {1, 2}, n_genres=3)]
    ds = load_movielens(
        write(tmp_path / "custom", items=items, ratings=[(1, 2, 4, 0)], genres=genres)
    )
    assert ds.advertisers["name"].to_pylist() == genres
    assert ds.ads["text"].to_pylist() == ["A. Comedy film.", "B. Drama, Comedy film."]
    assert [t["name"] for t in ds.meta["topics"]] == genres

    ds = load_movielens(write(tmp_path / "std", genres=None))
    assert ds.advertisers["name"].to_pylist() == list(STANDARD_GENRES)


def _bad_data(folder, line):
    (folder / "u.data").write_text(f"1\t1\t5\t880000000\n\n{line}\n")


def _edit(name, old, new):
    def edit(folder):
        path = folder / name
        path.write_bytes(path.read_bytes().replace(old.encode(), new.encode(), 1))

    return edit


# (case, how to break a good folder, file named in the message, text also expected there)
BAD = [
    ("missing u.data", lambda f: (f / "u.data").unlink(), "u.data", "missing"),
    ("missing u.user", lambda f: (f / "u.user").unlink(), "u.user", "missing"),
    ("missing u.item", lambda f: (f / "u.item").unlink(), "u.item", "missing"),
    ("data field count", lambda f: _bad_data(f, "1\t2\t3"), "u.data", "line 3"),
    ("data extra field", lambda f: _bad_data(f, "1\t2\t3\t4\t5"), "u.data", "got 5"),
    ("data spaces", lambda f: _bad_data(f, "1 2 3 4"), "u.data", "line 3"),
    ("data non-int user", lambda f: _bad_data(f, "x\t2\t3\t4"), "u.data", "user_id 'x'"),
    ("data non-int item", lambda f: _bad_data(f, "1\t2.5\t3\t4"), "u.data", "item_id '2.5'"),
    ("data empty field", lambda f: _bad_data(f, "1\t\t3\t4"), "u.data", "item_id ''"),
    ("data huge ts", lambda f: _bad_data(f, "1\t2\t3\t" + "9" * 20), "u.data", "line 3"),
    ("rating 6", lambda f: _bad_data(f, "1\t2\t6\t4"), "u.data", "rating 6"),
    ("rating 0", lambda f: _bad_data(f, "1\t2\t0\t4"), "u.data", "rating 0"),
    ("unknown user", lambda f: _bad_data(f, "99\t2\t3\t4"), "u.data", "user_id 99"),
    ("unknown item", lambda f: _bad_data(f, "1\t99\t3\t4"), "u.data", "item_id 99"),
    ("no ratings", lambda f: (f / "u.data").write_text("\n"), "u.data", "no ratings"),
    ("rated twice", lambda f: _bad_data(f, "1\t1\t2\t4"), "u.data", "line 3: user 1 rated item 1"),
    ("user field count", _edit("u.user", "|85711", ""), "u.user", "line 1"),
    ("user non-int id", _edit("u.user", "2|53", "two|53"), "u.user", "line 2"),
    ("user bad gender", _edit("u.user", "|53|F|", "|53|X|"), "u.user", "gender"),
    ("user duplicate", _edit("u.user", "2|53", "1|53"), "u.user", "duplicate"),
    ("item too few flags", _edit("u.item", "|0\n", "\n"), "u.item", "genre flags"),
    ("item too many flags", _edit("u.item", "|0\n", "|0|0\n"), "u.item", "line 1"),
    ("item bad flag", _edit("u.item", "|0\n", "|2\n"), "u.item", "expected 0 or 1"),
    ("item non-int id", _edit("u.item", "3|Mystery", "x|Mystery"), "u.item", "line 3"),
    ("genre gap", _edit("u.genre", "Action|1", "Action|40"), "u.genre", "without gaps"),
    ("genre field count", _edit("u.genre", "Action|1", "Action"), "u.genre", "line 2"),
]


@pytest.mark.parametrize(
    ("break_it", "file", "detail"), [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_bad_input_raises_dataset_error_naming_the_file(tmp_path, break_it, file, detail):
    folder = write(tmp_path / "ml")
    break_it(folder)
    with pytest.raises(DatasetError) as info:
        load_movielens(folder)
    message = str(info.value)
    assert file in message
    assert detail in message
    assert "\n" not in message


def test_missing_folder(tmp_path):
    with pytest.raises(DatasetError, match="nope"):
        load_movielens(tmp_path / "nope")
    (tmp_path / "file").write_text("")
    with pytest.raises(DatasetError, match="file"):
        load_movielens(tmp_path / "file")


@pytest.mark.skipif(not REAL.is_dir(), reason=f"{REAL} not present")
def test_real_movielens_100k():
    ds = load_movielens(REAL)
    assert ds.counts() == {
        "users": 943,
        "advertisers": 19,
        "ads": 1682,
        "events": 100_000,
        "organic": 0,
    }
    assert ds.meta["n_ratings"] == 100_000
