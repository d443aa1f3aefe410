"""The results table (`m31.bench.results`): rows appended all or none, the schema, strict
inputs, and bench/RESULTS.md, docs/SERVING.md and docs/SCALING.md citing rows that exist."""

import csv
import math
import re
import threading
from pathlib import Path

import pytest

from m31.bench import results
from m31.bench.cli import main
from m31.bench.loadtest import figures as load_figures
from m31.bench.results import COLUMNS, Figure

ROOT = Path(__file__).parents[1]
TABLE = ROOT / "bench" / "results.csv"
CITING = ("bench/RESULTS.md", "docs/SERVING.md", "docs/SCALING.md")
RUN = {"machine": "test box (2 cores)", "date": "2026-12-05", "commit": "abc1234"}


def figure(value=1.5, **over) -> Figure:
    fields = {"what": "engine", "case": "N=1M B=64", "variant": "int8", "metric": "median_ms"}
    return Figure(**{**fields, **over}, value=value, unit="ms")


def test_rows_are_appended_with_increasing_ids(tmp_path):
    path = tmp_path / "sub" / "results.csv"  # the folder and the header are made
    assert results.append(path, [figure(1.5), figure(2.0, metric="p99_ms")], **RUN) == ["r1", "r2"]
    assert results.append(path, [figure(3e9, metric="pairs_per_s")], **RUN) == ["r3"]
    assert results.append(path, [], **RUN) == []
    rows = results.read(path)
    assert path.read_text().splitlines()[0] == ",".join(COLUMNS)
    assert [r["id"] for r in rows] == ["r1", "r2", "r3"]
    assert rows[2] == {
        "id": "r3",
        "what": "engine",
        "case": "N=1M B=64",
        "variant": "int8",
        **RUN,
        "metric": "pairs_per_s",
        "value": "3000000000",
        "unit": "ms",
    }
    assert float(rows[0]["value"]) == 1.5
    assert path.stat().st_mode & 0o777 == 0o644  # not the temporary file's 0o600
    path.chmod(0o664)
    results.append(path, [figure()], **RUN)
    assert path.stat().st_mode & 0o777 == 0o664


def test_a_failed_append_writes_nothing(tmp_path, monkeypatch):
    path = tmp_path / "results.csv"
    results.append(path, [figure()], **RUN)
    before = path.read_bytes()
    with pytest.raises(ValueError, match="not a finite number"):
        results.append(path, [figure(), figure(math.nan), figure()], **RUN)
    assert path.read_bytes() == before

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(results.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        results.append(path, [figure(), figure()], **RUN)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["results.csv"]  # no temporary file left


@pytest.mark.parametrize(
    "bad",
    [
        figure(math.nan),
        figure(math.inf),
        figure(-math.inf),
        figure(True),
        figure("1.5"),
        figure(None),
        figure(what="Engine"),
        figure(what="two words"),
        figure(what=""),
        figure(metric="ms/req"),
        figure(case="N=1M\nB=1"),
        figure(variant=" int8"),
        figure(case=None),
    ],
)
def test_strict_figures(tmp_path, bad):
    with pytest.raises(ValueError):
        results.append(tmp_path / "results.csv", [bad], **RUN)
    assert not (tmp_path / "results.csv").exists()


@pytest.mark.parametrize(
    "over",
    [
        {"machine": ""},
        {"date": "5 Dec 2026"},
        {"date": "2026-13-01"},
        {"commit": "HEAD"},
        {"commit": ""},
        {"machine": "two\nlines"},
    ],
)
def test_strict_run_fields(tmp_path, over):
    with pytest.raises(ValueError):
        results.append(tmp_path / "results.csv", [figure()], **{**RUN, **over})
    assert not (tmp_path / "results.csv").exists()


def _write(path, header, *rows):
    with path.open("w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(header)
        w.writerows(rows)


GOOD = ["r1", "engine", "", "", "box", "2026-12-05", "unrecorded", "median_ms", "1", "ms"]


def good_but(column: str, value: str) -> list[str]:
    row = list(GOOD)
    row[COLUMNS.index(column)] = value
    return row


@pytest.mark.parametrize(
    "rows",
    [
        [good_but("what", "Engine")],
        [good_but("value", "fast")],
        [good_but("value", "nan")],
        [good_but("date", "yesterday")],
        [good_but("commit", "")],
        [good_but("id", "x1")],
        [GOOD, GOOD],  # an id twice
        [good_but("id", "r2"), GOOD],  # ids out of order
        [GOOD[:9]],  # a column short
    ],
)
def test_the_schema_is_checked_on_read_and_before_an_append(tmp_path, rows):
    path = tmp_path / "results.csv"
    _write(path, COLUMNS, *rows)
    before = path.read_bytes()
    with pytest.raises(ValueError, match="line"):
        results.read(path)
    with pytest.raises(ValueError):
        results.append(path, [figure()], **RUN)
    assert path.read_bytes() == before


def test_a_foreign_csv_is_not_appended_to(tmp_path):
    path = tmp_path / "other.csv"
    _write(path, ("a", "b"), (1, 2))
    with pytest.raises(ValueError, match="header"):
        results.append(path, [figure()], **RUN)
    assert path.read_text() == "a,b\n1,2\n"


def test_appends_at_once_keep_every_row(tmp_path):
    path = tmp_path / "results.csv"

    def run(i):
        for _ in range(5):
            results.append(path, [figure(i), figure(i, metric="p99_ms")], **RUN)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = results.read(path)
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(1, 41)]
    for first, second in zip(rows[::2], rows[1::2], strict=True):  # a run's rows stay together
        assert first["value"] == second["value"] and second["metric"] == "p99_ms"


def test_a_commit_with_changes_is_marked_dirty(tmp_path):
    """A run on a checkout whose tracked files differ from HEAD measured other code than the
    commit: its rows say so."""
    import subprocess

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "code.py")
    git("-c", "user.name=t", "-c", "user.email=t@example.org", "commit", "-qm", "one")
    clean = results.commit(tmp_path)
    assert re.fullmatch(r"[0-9a-f]{7,40}", clean)
    (tmp_path / "notes.txt").write_text("untracked files are not the code measured\n")
    assert results.commit(tmp_path) == clean
    (tmp_path / "code.py").write_text("x = 2\n")
    assert results.commit(tmp_path) == clean + "-dirty"


def test_machine_commit_and_counts(tmp_path, monkeypatch):
    assert re.fullmatch(r".+ \(\d+ cores\)", results.machine())
    assert results.machine("NVIDIA H200").startswith("NVIDIA H200 / ")
    assert results.commit(tmp_path) == "unknown"  # not a checkout
    monkeypatch.setenv("PATH", str(tmp_path))  # no git at all: still no failure
    assert results.commit() == "unknown"
    assert [results.short(n) for n in (10_000_000, 20_000, 100_003, 64, 2 * 10**9)] == [
        "10M",
        "20k",
        "100003",
        "64",
        "2G",
    ]


def test_the_default_table(tmp_path, monkeypatch, bench_results):
    assert results.default_path() == bench_results  # conftest: the run's own table
    monkeypatch.delenv(results.ENV)
    assert results.default_path() == TABLE  # tests run from a checkout


def test_a_bench_appends_its_rows(tmp_path, capsys):
    path = tmp_path / "results.csv"
    argv = ["embedding-cache", "--cached", "5", "--batch", "1,2", "--repeat", "1"]
    assert main([*argv, "--results", str(path)]) == 0
    rows = results.read(path)
    assert {r["what"] for r in rows} == {"embedding-cache"}
    assert [(r["case"], r["metric"]) for r in rows] == [
        ("cached=5", "seconds"),
        ("cached=5", "files"),
        ("cached=5 batch=1", "median_ms"),
        ("cached=5 batch=2", "median_ms"),
    ]
    assert rows[0]["commit"] == results.commit() and rows[0]["machine"] == results.machine()
    assert f"rows r1-r4 appended to {path}" in capsys.readouterr().err


def test_loadtest_rows_leave_out_latencies_of_calls_not_made():
    nan = float("nan")
    base = {"requests_per_device_call": 0.0, "ads_scored_per_s": 0.0, "errors": 0}
    events_alone = base | {
        "concurrency": 0,
        "calls": 0,
        "qps": 0.0,
        "p50_ms": nan,
        "p99_ms": nan,
        "events_per_s": 4e4,
        "event_p99_ms": 9.0,
        "event_clients": 2,
        "event_rate": 0.0,
    }
    retrieves = base | {
        "concurrency": 8,
        "calls": 900,
        "qps": 90.0,
        "p50_ms": 60.0,
        "p99_ms": 80.0,
        "events_per_s": 0.0,
        "event_p99_ms": 0.0,
        "event_clients": 0,
        "event_rate": 0.0,
    }
    got = load_figures([events_alone, retrieves], "max-batch-size 64", 100, 10.0)
    assert {(f.case, f.metric) for f in got if f.case.startswith("concurrency=0")} == {
        ("concurrency=0 K=100 seconds=10 event_clients=2 event_rate=0", m)
        for m in ("errors", "events_per_s", "event_p99_ms")
    }
    assert [f.metric for f in got if f.case.startswith("concurrency=8")] == [
        "qps",
        "p50_ms",
        "p99_ms",
        "requests_per_device_call",
        "ads_scored_per_s",
        "errors",
    ]
    for f in got:
        results.check_figure(f)


def _cited(text: str) -> set[str]:
    """Row ids a document cites: r12, and every id of a range r12–r15."""
    ids = set()
    for first, last in re.findall(r"\br(\d+)(?:[–-]r(\d+))?\b", text):
        ids.update(f"r{i}" for i in range(int(first), int(last or first) + 1))
    return ids


def test_the_documents_cite_rows_of_the_table():
    rows = {r["id"]: r for r in results.read(TABLE)}
    for name in CITING:
        cited = _cited((ROOT / name).read_text())
        assert cited, f"{name} cites no row"
        missing = sorted(cited - rows.keys(), key=lambda i: int(i[1:]))
        assert not missing, f"{name} cites rows that bench/results.csv lacks: {missing[:10]}"
