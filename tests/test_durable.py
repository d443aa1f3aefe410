import inspect
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from m31.index import AdIndex, AdIndexError, DurableIndex, DurableIndexError, read_manifest
from m31.index.wal import LOG, LOG_HEADER

G, D = 3, 5
EXTRA = {"price": "float"}  # floats in attributes must round-trip exactly too


def new_index(dtype=torch.float32) -> AdIndex:
    return AdIndex(G, D, dtype=dtype, extra_fields=EXTRA)


def ads(ids, seed):
    """Random float32 embeddings and varied attributes for `ids`."""
    gen = torch.Generator().manual_seed(seed)
    n = len(ids)
    attrs = [
        {
            "advertiser_id": seed * 100 + i,
            "tags": [f"t{seed}", f"ad{i}"],
            "target_countries": ["US", "DE"][: i % 3],
            "target_age_min": 18 + i if i % 2 else None,
            "status": ["active", "paused", None][i % 3],
            "price": i / 3,
        }
        for i in range(n)
    ]
    return (
        ids,
        torch.randn(n, G, generator=gen),
        torch.randn(n, D, generator=gen),
        torch.randn(n, generator=gen) * 1e3,
        attrs,
    )


def contents(index: AdIndex) -> dict:
    """Everything observable per ad, plus the version, in plain comparable values."""
    out = {"version": index.version, "model_hash": index.model_hash}
    for i in sorted(index.ids().tolist()):
        row = index.get(i)
        out[i] = (row.g.float().tolist(), row.x.float().tolist(), row.b, row.attributes)
    return out


def mutate(d: DurableIndex, seed: int) -> None:
    """A mix of every kind of mutation, with fresh ids per seed (and some replacements)."""
    base = seed * 10
    d.upsert(*ads(list(range(base, base + 6)), seed))
    d.upsert(*ads([base + 1, base + 7], seed + 1000))  # replaces base+1
    d.update_attributes(base + 2, tags=["x", "y"], target_age_max=60, status=None, price=0.1)
    d.pause(base + 3)
    d.resume(base + 4)
    d.delete([base, base + 5])


def log_bytes(path) -> bytes:
    return (path / LOG).read_bytes()


@pytest.fixture
def fresh(tmp_path):
    index = new_index()
    index.model_hash = "m-1"
    d = DurableIndex.create(tmp_path / "dur", index)
    yield d
    d.close()


def stored(index: AdIndex) -> list[torch.Tensor]:
    """The live rows' table as stored (an 8-bit table's codes and scales), in id order."""
    with index.snapshot_view() as view:
        order = torch.tensor([index._row_of(i) for i in sorted(index.ids().tolist())])
        return [t[order].clone() for t in (view.g, view.x, view.b, *(view.scales or ()))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_mutations_survive_reopen(tmp_path, dtype):
    with DurableIndex.create(tmp_path / "dur", new_index(dtype)) as d:
        mutate(d, 1)
        mutate(d, 2)
        assert d.version == d.index.version == 12
        expected, table = contents(d.index), stored(d.index)
    with DurableIndex.open(tmp_path / "dur") as d:
        assert d.index.dtype == dtype and d.snapshot_version == 0
        assert contents(d.index) == expected  # exact floats, attributes and version
        assert all(map(torch.equal, stored(d.index), table))  # replayed to the same bytes
        mutate(d, 3)
        d.snapshot()  # an 8-bit snapshot keeps codes and scales as they are
        mutate(d, 4)
        expected, table = contents(d.index), stored(d.index)
    with DurableIndex.open(tmp_path / "dur") as d:
        assert contents(d.index) == expected
        assert all(map(torch.equal, stored(d.index), table))


def test_snapshot_then_more_mutations(fresh):
    d, path = fresh, fresh.path
    mutate(d, 1)
    version = d.snapshot()
    assert version == d.version == 7  # 6 mutations and the compaction
    assert d.index.num_rows == len(d.index)  # tombstones reclaimed in memory too
    assert log_bytes(path) == LOG_HEADER
    assert os.readlink(path / "snapshot") == f"snapshot-{version:012d}"
    assert read_manifest(path / "snapshot")["index_version"] == version
    assert sorted(p.name for p in path.iterdir()) == [
        "LOCK",
        "snapshot",
        f"snapshot-{version:012d}",
        "wal.log",
    ]  # the first snapshot is gone
    assert d.snapshot() == version  # nothing new: nothing written
    mutate(d, 2)
    expected = contents(d.index)
    d.close()
    with DurableIndex.open(path) as d:
        assert d.snapshot_version == version
        assert contents(d.index) == expected
        assert d.index.model_hash == "m-1"


def test_crash_between_snapshot_swap_and_log_truncation(fresh, tmp_path):
    d, path = fresh, fresh.path
    mutate(d, 1)
    old_log = tmp_path / "old.log"
    shutil.copy(path / LOG, old_log)
    old_snapshot = os.readlink(path / "snapshot")
    shutil.copytree(path / old_snapshot, tmp_path / old_snapshot)
    version = d.snapshot()
    expected = contents(d.index)
    d.close()
    # What a crash right after the link swap leaves: the new snapshot, the old folder, the
    # old log (whose records are all in the new snapshot).
    shutil.copy(old_log, path / LOG)
    shutil.copytree(tmp_path / old_snapshot, path / old_snapshot)
    with DurableIndex.open(path) as d:
        assert contents(d.index) == expected and d.snapshot_version == version
        assert not (path / old_snapshot).exists()
        mutate(d, 2)  # appended after the skipped records
        expected = contents(d.index)
    with DurableIndex.open(path) as d:
        assert contents(d.index) == expected


def test_crash_before_snapshot_swap(fresh, tmp_path):
    d, path = fresh, fresh.path
    d.upsert(*ads([1, 2, 3], 0))
    d.update_attributes(2, tags=["z"])
    d.close()
    before = tmp_path / "before"
    shutil.copytree(path, before, symlinks=True)
    with DurableIndex.open(path) as d:
        version = d.snapshot()  # no tombstones: nothing logged, so `before` has the full log
        expected = contents(d.index)
    # What a crash before the swap leaves: the complete new folder, plus write_folder_atomic's
    # temporary of a later attempt, next to the old link and the full log.
    name = f"snapshot-{version:012d}"
    shutil.copytree(path / name, before / name)
    (before / f".{name}.tmp-abc").mkdir()
    with DurableIndex.open(before) as d:
        assert contents(d.index) == expected and d.snapshot_version == 0
        assert os.readlink(before / "snapshot") == "snapshot-000000000000"
        assert not (before / name).exists() and not (before / f".{name}.tmp-abc").exists()


@pytest.mark.parametrize("damage", ["cut", "flip_payload", "flip_length", "zeros"])
def test_torn_tail_is_cut_off(fresh, caplog, damage):
    d, path = fresh, fresh.path
    d.upsert(*ads([1, 2], 0))
    d.delete([2])
    before_last = contents(d.index)
    last_start = torn_start = (path / LOG).stat().st_size
    d.upsert(*ads([3, 4, 5], 1))
    with_last = contents(d.index)
    d.close()
    data = bytearray(log_bytes(path))
    if damage == "cut":
        data = data[: (last_start + len(data)) // 2]
    elif damage == "flip_payload":
        data[-3] ^= 0x40
    elif damage == "flip_length":
        data[last_start + 6] ^= 0x01
    else:  # the last record is intact
        torn_start = len(data)
        data += bytes(100)  # a crash after the size grew but before the data landed
    (path / LOG).write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="m31.index.recovery"):
        d = DurableIndex.open(path)
    assert "torn record" in caplog.text and f"byte {torn_start}" in caplog.text
    assert contents(d.index) == (with_last if damage == "zeros" else before_last)
    assert (path / LOG).stat().st_size == torn_start  # cut off on disk too
    d.upsert(*ads([6], 2))
    expected = contents(d.index)
    d.close()
    with DurableIndex.open(path) as d:
        assert contents(d.index) == expected


def test_corruption_in_the_middle_is_an_error(fresh):
    d, path = fresh, fresh.path
    ends = []
    for call in (lambda: d.upsert(*ads([1, 2], 0)), lambda: d.pause(1), lambda: d.delete([2])):
        call()
        ends.append((path / LOG).stat().st_size)
    d.close()
    data = bytearray(log_bytes(path))
    data[ends[0] + 20] ^= 0xFF  # inside the second record
    (path / LOG).write_bytes(bytes(data))
    for _ in range(2):  # the same error again: the failed open released the lock
        with pytest.raises(DurableIndexError, match=rf"byte {ends[0]}, .* byte {ends[1]}"):
            DurableIndex.open(path)
    assert log_bytes(path) == data  # nothing cut off


@pytest.mark.parametrize(
    "bad_call",
    [
        lambda d: d.upsert([7, 8], torch.zeros(2, G + 1), torch.zeros(2, D), [0, 0], [{}] * 2),
        lambda d: d.upsert([7], [[0.0, float("nan"), 0.0]], torch.zeros(1, D), [0], [{}]),
        lambda d: d.upsert([7, 7], torch.zeros(2, G), torch.zeros(2, D), [0, 0], [{}] * 2),
        lambda d: d.upsert([7], torch.zeros(1, G), torch.zeros(1, D), [0], [{"colour": 1}]),
        lambda d: d.upsert(
            [7], torch.zeros(1, G), torch.zeros(1, D), [0], [{"target_genders": ["X"]}]
        ),
        lambda d: d.update_attributes(99, tags=["a"]),
        lambda d: d.update_attributes(1, colour="red"),
        lambda d: d.update_attributes(1, status="sleeping"),
        lambda d: d.pause(99),
        lambda d: d.delete([1, 99]),
        lambda d: d.delete([1, 1]),
        lambda d: d.delete([[1]]),
    ],
)
def test_invalid_mutation_logs_nothing(fresh, bad_call):
    d, path = fresh, fresh.path
    d.upsert(*ads([1, 2], 0))
    before, log = contents(d.index), log_bytes(path)
    with pytest.raises(AdIndexError):
        bad_call(d)
    assert contents(d.index) == before and d.version == 1
    assert log_bytes(path) == log
    d.pause(1)  # still usable
    assert d.version == 2


def test_second_open_is_refused(fresh):
    with pytest.raises(DurableIndexError, match=f"already open .*pid {os.getpid()}"):
        DurableIndex.open(fresh.path)
    fresh.close()
    with pytest.raises(DurableIndexError, match="closed"):
        fresh.pause(1)
    with DurableIndex.open(fresh.path) as d:
        assert d.version == 0


def test_mutation_outside_the_durable_index_is_refused(fresh):
    fresh.upsert(*ads([1], 0))
    fresh.index.pause(1)  # bypasses the log
    with pytest.raises(DurableIndexError, match="outside this DurableIndex"):
        fresh.resume(1)


def test_folder_started_from_a_plain_snapshot(tmp_path):
    index = new_index(torch.bfloat16)
    index.upsert(*ads([1, 2, 3], 0))
    path = tmp_path / "dur"
    index.save(path / "snapshot", model_hash="m-2")  # no log, no link: assembled by hand
    with DurableIndex.open(path) as d:
        assert d.version == 1 and d.index.model_hash == "m-2"
        d.delete([2])
        version = d.snapshot()  # moves the plain folder aside and links the new one
        assert (path / "snapshot").is_symlink()
        d.pause(1)
        expected = contents(d.index)
    with DurableIndex.open(path) as d:
        assert contents(d.index) == expected
    # A crash between moving a plain folder aside and linking: no `snapshot` at all.
    with DurableIndex.open(path) as d:
        d.upsert(*ads([4], 1))
        expected = contents(d.index)
    (path / "snapshot").unlink()
    with DurableIndex.open(path) as d:
        assert contents(d.index) == expected
        assert os.readlink(path / "snapshot") == f"snapshot-{version:012d}"


def test_create_from_a_snapshot_folder_and_bad_folders(tmp_path):
    index = new_index()
    index.upsert(*ads([1, 2], 0))
    index.save(tmp_path / "snap")
    with DurableIndex.create(tmp_path / "dur", tmp_path / "snap") as d:
        assert d.version == 1 and len(d.index) == 2
    with pytest.raises(DurableIndexError, match="not an empty folder"):
        DurableIndex.create(tmp_path / "dur", index)
    with pytest.raises(DurableIndexError, match="no such durable index folder"):
        DurableIndex.open(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DurableIndexError, match="not a durable index folder"):
        DurableIndex.open(tmp_path / "empty")
    (tmp_path / "dur" / LOG).write_bytes(b"hello")
    with pytest.raises(DurableIndexError, match="bad header"):
        DurableIndex.open(tmp_path / "dur")


def test_log_that_does_not_continue_the_snapshot(tmp_path):
    path = tmp_path / "dur"
    with DurableIndex.create(path, new_index()) as d:
        d.upsert(*ads([1], 0))
        d.upsert(*ads([2], 1))
    # A snapshot at version 5 in place of version 0: records 1 and 2 count as in it.
    other = new_index()
    for _ in range(5):
        other.upsert([], torch.zeros(0, G), torch.zeros(0, D), [], [])
    shutil.rmtree(path / "snapshot-000000000000")
    other.save(path / "snapshot-000000000000")
    with DurableIndex.open(path) as d:
        assert d.version == 5 and len(d.index) == 0
        d.upsert(*ads([3], 2))  # version 6, after the stale records 1 and 2
    with DurableIndex.open(path) as d:
        assert d.version == 6 and d.index.ids().tolist() == [3]
    shutil.rmtree(path / "snapshot-000000000000")
    new_index().save(path / "snapshot-000000000000")  # version 0: 1, 2 replay, 3..5 missing
    with pytest.raises(DurableIndexError, match=r"byte \d+ has version 6 but the index is at 2"):
        DurableIndex.open(path)


# ---- kill -9 ---------------------------------------------------------------------------------


def batch(k):
    """Batch k of the crash test: 3 new ads and, from k = 2 on, 2 replaced ones."""
    ids = [3 * k, 3 * k + 1, 3 * k + 2] + ([3 * k - 6, 3 * k - 5] if k >= 2 else [])
    j = np.arange(len(ids), dtype=np.float32)
    g = np.full((len(ids), G), k, dtype=np.float32) + 0.25 * j[:, None]
    x = np.full((len(ids), D), -k, dtype=np.float32) + 0.5 * j[:, None]
    b = 10.0 * k + j
    attrs = [{"advertiser_id": k, "tags": [f"batch{k}", f"pos{i}"]} for i in range(len(ids))]
    return ids, g, x, b, attrs


CHILD = f"""
import sys
import numpy as np
from m31.index import DurableIndex
G, D = {G}, {D}
{textwrap.dedent(inspect.getsource(batch))}
d = DurableIndex.open(sys.argv[1])
k = int(sys.argv[2])
while True:
    args = batch(k)
    version = d.upsert(*args)
    print(k, version, *args[0], flush=True)  # acknowledged
    k += 1
    if k % 4 == 0:
        d.snapshot()
"""


def expected_after(m: int) -> dict:
    """ad id -> (batch, position) after batches 0..m-1."""
    out = {}
    for k in range(m):
        for pos, i in enumerate(batch(k)[0]):
            out[i] = (k, pos)
    return out


def matches(index: AdIndex, m: int) -> bool:
    want = expected_after(m)
    if sorted(index.ids().tolist()) != sorted(want):
        return False
    for i, (k, pos) in want.items():
        row = index.get(i)
        if row.b != 10.0 * k + pos or row.attributes["tags"] != [f"batch{k}", f"pos{pos}"]:
            return False
        if row.g.tolist() != [k + 0.25 * pos] * G or row.x.tolist() != [-k + 0.5 * pos] * D:
            return False
    return True


@pytest.mark.slow
def test_kill_9_loses_no_acknowledged_batch(tmp_path):
    path = tmp_path / "dur"
    DurableIndex.create(path, new_index()).close()
    rng = random.Random(31)
    done = 0  # batches in the index
    for _trial in range(3):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path), str(done)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        acked = []
        for _ in range(rng.randint(2, 12)):
            line = child.stdout.readline()
            assert line, f"child died: {child.stderr.read()}"
            acked.append(int(line.split()[0]))
        time.sleep(rng.uniform(0, 0.02))
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        acked += [int(line.split()[0]) for line in child.stdout.read().splitlines()]
        child.stdout.close()
        child.stderr.close()
        assert acked == list(range(done, done + len(acked)))
        with DurableIndex.open(path) as d:
            # Every acknowledged batch is there whole; the one in flight wholly or not at all.
            present = [m for m in (acked[-1] + 1, acked[-1] + 2) if matches(d.index, m)]
            assert len(present) == 1, (
                f"acked up to batch {acked[-1]}, index {sorted(d.index.ids().tolist())}"
            )
            done = present[0]
