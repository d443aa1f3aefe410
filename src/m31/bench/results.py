"""Benchmark results as rows: one table, `bench/results.csv`, that every `m31 bench` subcommand
and `m31 loadtest` append their measurements to, and that bench/RESULTS.md, docs/SERVING.md and
docs/SCALING.md cite by row id (`r123`).

One row per measured figure:

    id       r1, r2, ...: given at append, never reused (the table only grows)
    what     the benchmark: kernels, engine, loadtest, ... (the subcommand)
    case     the problem measured: "N=1M B=64 K=100", "concurrency=8"
    variant  what was measured on it: a kernel, a baseline, "batching", "before"
    machine  where: "AMD EPYC 7B13 (2 cores)", "NVIDIA H200 / <host cpu> (16 cores)"
    date     ISO day, UTC ("unrecorded" where a document gave none)
    commit   `git rev-parse --short HEAD` of the code measured (-dirty: with uncommitted changes);
             "unknown" outside a checkout,
             "unrecorded" for figures the documents gave without one
    metric   the quantity: pairs_per_s, median_ms, p99_ms, recall_at_100, ...
    value    a finite number, in `unit`
    unit     pairs/s, ms, x (a ratio), % ...

A run's rows are appended all or none: checked first, then the table rewritten to a temporary
file beside it and renamed over it, under a lock on its folder (two runs may append at once).
Nothing here imports PyTorch: `m31.bench.cli` imports this module.
"""

from __future__ import annotations

import csv
import datetime
import fcntl
import io
import math
import numbers
import os
import platform
import re
import stat
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from m31.files import write_file_atomic

COLUMNS = ("id", "what", "case", "variant", "machine", "date", "commit", "metric", "value", "unit")
ENV = "M31_BENCH_RESULTS"  # the --results default, when set (the tests point it elsewhere)
_CHECKOUT = Path(__file__).resolve().parents[3]  # src/m31/bench/results.py -> the repository
_ID = re.compile(r"r([1-9][0-9]*)")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}|unrecorded")
_COMMIT = re.compile(r"[0-9a-f]{7,40}(-dirty)?|unknown|unrecorded")
_NAME = re.compile(r"[a-z0-9][a-z0-9_@.-]*")  # what and metric: greppable words


@dataclass(frozen=True)
class Figure:
    """One measured figure of a run; `append` adds the machine, date, commit and id."""

    what: str
    case: str
    variant: str
    metric: str
    value: float
    unit: str = ""


def check_figure(f: Figure) -> None:
    """ValueError unless `f` can be a row: names as `_NAME`, one-line text, a finite number."""
    for field in ("what", "metric"):
        if not isinstance(getattr(f, field), str) or not _NAME.fullmatch(getattr(f, field)):
            raise ValueError(f"{field} {getattr(f, field)!r}: lower-case words, digits, _@.-")
    for field in ("case", "variant", "unit"):
        _check_text(field, getattr(f, field))
    v = f.value
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise ValueError(f"{f.what} {f.case} {f.metric}: value {v!r} is not a finite number")


def _check_text(field: str, text, empty: bool = True) -> None:
    """A string of one line without surrounding spaces (and not empty unless `empty`)."""
    if not isinstance(text, str) or (not empty and not text):
        raise ValueError(f"{field} {text!r}: a{'' if empty else ' non-empty'} string")
    if text != text.strip() or any(ord(c) < 32 for c in text):
        raise ValueError(f"{field} {text!r}: one line, no surrounding spaces")


def check_row(row: dict) -> None:
    """ValueError unless `row` (a table row, strings as read) fits the schema."""
    if tuple(row) != COLUMNS:
        raise ValueError(f"columns {tuple(row)}, expected {COLUMNS}")
    if not _ID.fullmatch(row["id"]):
        raise ValueError(f"id {row['id']!r}: r1, r2, ...")
    for field in ("machine", "date", "commit"):
        _check_text(field, row[field], empty=False)
    if not _DATE.fullmatch(row["date"]):
        raise ValueError(f"{row['id']}: date {row['date']!r} is not YYYY-MM-DD")
    if row["date"] != "unrecorded":
        datetime.date.fromisoformat(row["date"])
    if not _COMMIT.fullmatch(row["commit"]):
        raise ValueError(
            f"{row['id']}: commit {row['commit']!r}: a short hash (-dirty), unknown or unrecorded"
        )
    try:
        value = float(row["value"])
    except ValueError:
        raise ValueError(f"{row['id']}: value {row['value']!r} is not a number") from None
    check_figure(
        Figure(row["what"], row["case"], row["variant"], row["metric"], value, row["unit"])
    )


def read(path: Path) -> list[dict]:
    """The table's rows (strings as stored), each checked, ids unique and increasing; ValueError
    naming the line otherwise."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise ValueError(f"{path}: header {reader.fieldnames}, expected {','.join(COLUMNS)}")
        rows, last = [], 0
        for row in reader:
            try:
                check_row(row)
            except ValueError as e:
                raise ValueError(f"{path}, line {reader.line_num}: {e}") from None
            number = int(row["id"][1:])
            if number <= last:
                raise ValueError(f"{path}, line {reader.line_num}: id {row['id']} after r{last}")
            rows.append(row)
            last = number
    return rows


def machine(gpu: str | None = None) -> str:
    """This machine in a few words: the CPU model and the cores this process may use, after the
    GPU's name when one was measured."""
    cpu = platform.processor() or platform.machine() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    host = f"{' '.join(cpu.split())} ({cores} cores)"
    return f"{gpu} / {host}" if gpu else host


def commit(where: Path = _CHECKOUT) -> str:
    """The short hash of HEAD in the checkout at `where`, with "-dirty" when the checkout's
    tracked files differ from it (the code measured is then not that commit's); "unknown"
    without git or a checkout."""
    try:
        head = _git(where, "rev-parse", "--short", "HEAD").strip()
        changed = _git(where, "status", "--porcelain", "--untracked-files=no").strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    text = head + ("-dirty" if changed else "")
    return text if _COMMIT.fullmatch(text) else "unknown"


def _git(where: Path, *args: str) -> str:
    out = subprocess.run(
        ["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10, check=True
    )
    return out.stdout


def default_path() -> Path | None:
    """Where a run's rows go without --results: $M31_BENCH_RESULTS, else the checkout's
    bench/results.csv when this code runs from one (None when installed elsewhere)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    if (_CHECKOUT / "bench" / "RESULTS.md").is_file():
        return _CHECKOUT / "bench" / "results.csv"
    return None


def short(n: int) -> str:
    """A count as cases name it: 10_000_000 -> "10M", 20_000 -> "20k", 100_003 -> "100003"."""
    for scale, suffix in ((10**9, "G"), (10**6, "M"), (10**3, "k")):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{suffix}"
    return str(n)


def _format(value: float) -> str:
    return f"{float(value):.12g}"


def append(
    path: Path,
    figures: Iterable[Figure],
    *,
    machine: str,
    date: str | None = None,
    commit: str = "unknown",
) -> list[str]:
    """Append `figures` to the table at `path` (made with its header if missing), all or none:
    the ids given. ValueError, with nothing written, if a figure or the table is not valid."""
    figures = list(figures)
    date = date or datetime.datetime.now(datetime.UTC).date().isoformat()
    for f in figures:
        check_figure(f)
    run = {"machine": machine, "date": date, "commit": commit}
    # the run's own fields, checked as a row's
    check_row(dict(zip(COLUMNS, ("r1", "x", "", "", *run.values(), "x", "0", ""), strict=True)))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)  # held until closed: one appender at a time
        old = path.read_text() if path.exists() else ""
        rows = read(path) if old else []  # a table that is not one is left as it is
        last = int(rows[-1]["id"][1:]) if rows else 0
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        if not old:
            writer.writerow(COLUMNS)
        elif not old.endswith("\n"):
            out.write("\n")
        ids = [f"r{last + 1 + i}" for i in range(len(figures))]
        for row_id, f in zip(ids, figures, strict=True):
            value = _format(f.value)
            writer.writerow(
                (row_id, f.what, f.case, f.variant, *run.values(), f.metric, value, f.unit)
            )
        text = (old + out.getvalue()).encode()
        mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o644
        write_file_atomic(path, lambda f: f.write(text), mode)
        os.fsync(folder)
    finally:
        os.close(folder)
    return ids


def record(figures: Sequence[Figure], path: Path | None = None, gpu: str | None = None) -> None:
    """A command's last step: append its run's figures to `path` (default: `default_path`) with
    this machine (and `gpu`'s name), today's date and the checkout's commit; say where on stderr."""
    path = path or default_path()
    if not figures:
        return
    if path is None:
        print("not run from a checkout: --results PATH keeps these figures", file=sys.stderr)
        return
    ids = append(path, figures, machine=machine(gpu), commit=commit())
    print(f"rows {ids[0]}-{ids[-1]} appended to {path}", file=sys.stderr)
