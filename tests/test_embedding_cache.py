"""The text-embedding cache (issue 10, item 5): one keyed store, so an upsert's lookup and store
cost the same however much is cached; earlier folders migrated; several processes at once."""

import logging
import signal
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest

from m31.features import embedding_cache, text_encoder
from m31.features.embedding_cache import DATABASE, EmbeddingCache, embed_texts, text_keys

MODEL = "test/model@fp32"
H = 384


def vectors(texts):
    """A fixed vector per text, so any process can tell what a key must map to: [n, H]."""
    return np.stack(
        [np.random.default_rng(zlib.crc32(t.encode())).standard_normal(H) for t in texts]
    ).astype(np.float32)


def test_lookup_after_store_across_a_reopen(tmp_path):
    texts = ["trail shoes", "a weekend in Lisbon", ""]
    cache = EmbeddingCache(tmp_path, MODEL)
    found, got = cache.lookup(text_keys(texts, MODEL))
    assert found.tolist() == [False] * 3 and got is None
    cache.store(text_keys(texts[:2], MODEL), vectors(texts[:2]))
    cache.store(text_keys(texts[:1], MODEL), np.zeros((1, H)))  # a known key keeps its vector
    cache.close()

    again = EmbeddingCache(tmp_path, MODEL)
    found, got = again.lookup(text_keys([texts[1], "unknown", texts[0]], MODEL))
    assert found.tolist() == [True, False, True] and got.dtype == np.float32
    np.testing.assert_array_equal(got[[0, 2]], vectors([texts[1], texts[0]]))
    np.testing.assert_array_equal(got[1], np.zeros(H))
    assert len(again) == 2
    assert EmbeddingCache(tmp_path, "another model").lookup(text_keys(texts, MODEL))[1] is None


def test_lookup_of_more_keys_than_one_query_binds(tmp_path):
    texts = [f"text {i}" for i in range(1_234)]
    cache = EmbeddingCache(tmp_path, MODEL)
    cache.store(text_keys(texts[::2], MODEL), vectors(texts[::2]))
    found, got = cache.lookup(text_keys(texts, MODEL))
    assert found.tolist() == [i % 2 == 0 for i in range(len(texts))]
    np.testing.assert_array_equal(got[found], vectors(texts[::2]))


@pytest.fixture
def fake_encoder(monkeypatch):
    """embed_texts with a stand-in encoder that records what it was asked to encode."""
    encoded = []

    def encode(texts, batch_size):
        encoded.extend(texts)
        return vectors(texts)

    monkeypatch.setattr(text_encoder, "encode_texts", encode)
    monkeypatch.setattr(text_encoder, "model_key", lambda: MODEL)
    return encoded


def test_many_upserts_neither_add_files_nor_reload_the_cache(tmp_path, fake_encoder, monkeypatch):
    for i in range(200):  # as 200 one-ad upserts through the ad encoder
        embed_texts([f"ad text {i}"], tmp_path)
    files = sorted(p.name for p in (tmp_path / MODEL.replace("/", "_")).iterdir())
    assert set(files) <= {DATABASE, f"{DATABASE}-wal", f"{DATABASE}-shm"}

    def no_reload(*args, **kwargs):
        raise AssertionError("opening the cache read cached files back")

    monkeypatch.setattr(np, "load", no_reload)
    got = embed_texts(["ad text 7", "ad text 199", "new"], tmp_path)
    np.testing.assert_array_equal(got, vectors(["ad text 7", "ad text 199", "new"]))
    assert fake_encoder == [f"ad text {i}" for i in range(200)] + ["new"]


def test_a_folder_of_an_earlier_version_is_migrated(tmp_path, caplog):
    folder = tmp_path / MODEL.replace("/", "_")
    folder.mkdir()
    old = [["one", "two"], ["three"]]
    for i, texts in enumerate(old):  # the earlier layout: shard-<n>-<pid>.npz of keys, vectors
        np.savez(
            folder / f"shard-{i:06d}-99.npz", keys=text_keys(texts, MODEL), vectors=vectors(texts)
        )
    (folder / "shard-000002-99.npz").write_bytes(b"damaged")

    with caplog.at_level(logging.INFO, logger=embedding_cache.__name__):
        cache = EmbeddingCache(tmp_path, MODEL)
    assert "unreadable cache shard" in caplog.text and "moved 3 embeddings" in caplog.text
    assert not list(folder.glob("shard-*")), "each shard is read once, then removed"
    texts = ["three", "two", "one"]
    found, got = cache.lookup(text_keys(texts, MODEL))
    assert found.all()
    np.testing.assert_array_equal(got, vectors(texts))
    cache.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=embedding_cache.__name__):
        assert len(EmbeddingCache(tmp_path, MODEL)) == 3
    assert "moved" not in caplog.text


WRITER = textwrap.dedent(
    """
    import sys, zlib
    import numpy as np
    from m31.features.embedding_cache import EmbeddingCache, text_keys

    folder, who, model, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    texts = [f"shared {i}" for i in range(n)] + [f"own {who} {i}" for i in range(n)]
    np.random.default_rng(who).shuffle(texts)
    cache = EmbeddingCache(folder, model)
    print("ready", flush=True)
    sys.stdin.readline()  # go: every writer starts at once
    for lo in range(0, len(texts), 3):  # as one-to-three-ad upserts
        batch = texts[lo : lo + 3]
        keys = text_keys(batch, model)
        found, _ = cache.lookup(keys)
        new = [t for t, f in zip(batch, found) if not f]
        vecs = [np.random.default_rng(zlib.crc32(t.encode())).standard_normal(384) for t in new]
        cache.store(keys[~found], np.array(vecs, dtype=np.float32).reshape(len(new), 384))
        if lo == 300:
            print("stored 100", flush=True)  # a hundred upserts are in: kill me from here on
    """
)


def _start(tmp_path, writers):
    """Processes that each store the vectors of 2n texts, n of them shared with the others,
    started together once all have opened the cache; `writers` is [(who, n)]."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), str(who), MODEL, str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for who, n in writers
    ]
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready"
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    return procs


def _integrity(tmp_path):
    import sqlite3

    with sqlite3.connect(tmp_path / MODEL.replace("/", "_") / DATABASE) as db:
        return db.execute("PRAGMA integrity_check").fetchone()[0]


def test_two_processes_store_at_once_without_corrupting_it(tmp_path):
    n = 400
    writers = _start(tmp_path, [(1, n), (2, n)])
    assert [w.wait(timeout=300) for w in writers] == [0, 0]
    assert _integrity(tmp_path) == "ok"
    texts = [f"shared {i}" for i in range(n)]
    texts += [f"own {who} {i}" for who in (1, 2) for i in range(n)]
    cache = EmbeddingCache(tmp_path, MODEL)
    assert len(cache) == len(texts)
    found, got = cache.lookup(text_keys(texts, MODEL))
    assert found.all()
    np.testing.assert_array_equal(got, vectors(texts))


def test_a_writer_killed_midway_leaves_a_usable_cache(tmp_path):
    n = 100_000  # more than it can store before it is killed
    (writer,) = _start(tmp_path, [(1, n)])
    assert writer.stdout.readline().strip() == "stored 100"
    writer.send_signal(signal.SIGKILL)
    assert writer.wait(timeout=60) == -signal.SIGKILL
    assert _integrity(tmp_path) == "ok"
    cache = EmbeddingCache(tmp_path, MODEL)
    texts = np.array([f"shared {i}" for i in range(n)] + [f"own 1 {i}" for i in range(n)])
    found, got = cache.lookup(text_keys(texts.tolist(), MODEL))
    assert 0 < found.sum() == len(cache) < len(texts)
    np.testing.assert_array_equal(got[found], vectors(texts[found].tolist()))
    cache.store(text_keys(["after"], MODEL), vectors(["after"]))
    assert cache.lookup(text_keys(["after"], MODEL))[0].tolist() == [True]
