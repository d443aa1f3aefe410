"""Evaluation records on disk (`m31.eval.records`): what is written is what is read, and a
record that is not whole is refused. The records joining `m31 eval` are tested in test_cli."""

import json

import numpy as np
import pytest

from m31.eval.offline import Requests
from m31.eval.records import (
    Record,
    RecordedRun,
    load_record,
    requests_fingerprint,
    save_record,
)


def _requests(n: int, seed: int = 0) -> tuple[Requests, np.ndarray]:
    rng = np.random.default_rng(seed)
    cols = {k: rng.integers(0, 50, n) for k in ("user", "ts", "surface", "hour", "platform")}
    return Requests(**cols), rng.integers(0, 1000, n)


def test_a_record_reads_back_as_written(tmp_path):
    n = 7
    small = np.array([0, 3, 65_535, 9, 1, 2, 4])  # fits 16 bits
    large = np.array([0, 70_000, 5, 1, 2, 3, 4_000_000_000])  # does not
    truth = {"truth_recall@10": np.linspace(0, 1, n), "truth_recall@50": np.ones(n)}
    history = [  # epoch 0: a ranking model's base, before training
        {"epoch": 0, "loss": None, "val_hr@10": 0.3},
        {"epoch": 1, "loss": 2.5, "val_hr@10": 0.1, "seconds": 100.0},
        {"epoch": 2, "loss": 2.4, "val_hr@10": 0.2, "seconds": 80.0},
        {"epoch": 3, "loss": 2.3, "val_hr@10": 0.15, "seconds": 60.0},
    ]
    record = Record(
        "f" * 32,
        "w",
        (10, 50),
        [
            RecordedRun("moe", small, truth, "moe-s0.pt", history, "hr@10"),
            RecordedRun("popularity", large, truth, "baseline"),
        ],
        {"moe": 2049},
    )
    path = save_record(record, tmp_path / "sub" / "r.npz")
    back = load_record(path)
    assert (back.fingerprint, back.data, back.ks, back.flops) == (
        "f" * 32,
        "w",
        (10, 50),
        record.flops,
    )
    assert back.requests == n
    for got, want in zip(back.runs, record.runs, strict=True):
        assert (got.model, got.source, got.history, got.val_metric) == (
            want.model,
            want.source,
            want.history,
            want.val_metric,
        )
        assert got.ranks.dtype == np.int64 and np.array_equal(got.ranks, want.ranks)
        assert got.truth_recall.keys() == truth.keys()
        for k, v in truth.items():
            assert np.array_equal(got.truth_recall[k], v)
    assert back.runs[0].training() == "best epoch 2 of 3 (validation hr@10 0.2000), 4 min"
    assert back.runs[1].training() is None  # a baseline
    assert not list(tmp_path.glob("sub/.*")), "no temporary file left behind"
    assert path.stat().st_mode & 0o777 == 0o644, "a result to share"
    with pytest.raises(ValueError, match="at least one"):
        save_record(Record("f" * 32, "w", (10,), []), tmp_path / "empty.npz")


def test_a_record_that_is_not_whole_is_refused(tmp_path):
    run = RecordedRun("moe", np.arange(5), None, "moe.pt")
    path = save_record(Record("a" * 32, "w", (10,), [run]), tmp_path / "r.npz")
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays["meta"].tobytes())

    def written(name, **changes):
        doc = {**meta, **changes.pop("meta", {})}
        out = {**arrays, "meta": np.frombuffer(json.dumps(doc).encode(), np.uint8), **changes}
        np.savez(tmp_path / name, **out)
        return tmp_path / name

    cases = {
        "other format": written("a.npz", meta={"format": "m31-eval-record-0"}),
        "arrays differ": written("b.npz", ranks_0=np.arange(4)),
        "missing": written("c.npz", meta={"runs": [{"model": "moe"}]}),
    }
    for what, bad in cases.items():
        with pytest.raises(ValueError, match="evaluation record") as refused:
            load_record(bad)
        assert str(bad) in str(refused.value), what  # the message names the file
    with pytest.raises(FileNotFoundError):
        load_record(tmp_path / "none.npz")


def test_the_fingerprint_names_the_requests_and_nothing_else():
    req, target = _requests(30)
    base = requests_fingerprint(req, target, 1000, True)
    assert base == requests_fingerprint(*_requests(30), 1000, True)  # the same requests
    assert base != requests_fingerprint(req, target, 1001, True)
    assert base != requests_fingerprint(req, target, 1000, False)
    assert base != requests_fingerprint(req.take(slice(0, 29)), target[:29], 1000, True)
    moved = target.copy()
    moved[3] += 1
    assert base != requests_fingerprint(req, moved, 1000, True)
    later = Requests(req.user, req.ts + 1, req.surface, req.hour, req.platform)
    assert base != requests_fingerprint(later, target, 1000, True)
