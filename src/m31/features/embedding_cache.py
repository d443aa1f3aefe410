"""Sentence-encoder embeddings of texts, cached on disk by content hash.

Shapes: n texts, u unique texts, H the encoder's dimension (384).

The cache of one model is one SQLite database, `FOLDER/<model>/embeddings.sqlite`, with one
table: `key` (BLOB primary key, the 16-byte hash of model name and text) -> `vector` (H float32,
little-endian). A lookup or a store touches only the keys it names, so its cost does not grow
with what the cache already holds. The database runs in WAL mode, so processes (a server and a
pipeline run, say) read and write it at once; each store is one transaction, so an interrupted
run loses only the batch in flight and never corrupts what is cached. The folder must be on a
local file system (SQLite's locks are not reliable over NFS). `embed_texts` keeps one open cache
per process and folder (`shared_cache`).

Folders of earlier versions hold `shard-*.npz` files (`keys` [u] S16, `vectors` [u, H]); the
first open moves their embeddings into the database and deletes them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]


def embedding_cache_dir() -> Path:
    """Where text embeddings are cached: $M31_CACHE/embeddings (default ~/.cache/m31)."""
    return Path(os.environ.get("M31_CACHE", "~/.cache/m31")).expanduser() / "embeddings"


DATABASE = "embeddings.sqlite"
_BUSY_TIMEOUT_S = 60.0  # how long a write waits for another process's transaction to end
_KEYS_PER_QUERY = 500  # bound parameters per SELECT: under the 999 old SQLite builds allow


def text_keys(texts: Sequence[str], model: str) -> np.ndarray:
    """16-byte content hashes: [n] of dtype S16."""
    prefix = model.encode() + b"\0"
    return np.array(
        [hashlib.blake2b(prefix + t.encode(), digest_size=16).digest() for t in texts], dtype="S16"
    )


def _blobs(keys: np.ndarray) -> list[bytes]:
    """Keys [n] S16 -> n blobs of 16 bytes (numpy's own bytes would drop trailing zero bytes)."""
    raw = np.ascontiguousarray(keys, dtype="S16").tobytes()
    return [raw[i : i + 16] for i in range(0, len(raw), 16)]


class EmbeddingCache:
    """The embeddings of one model under `folder`; see the module docstring. Safe to share
    between threads and, through the database, between processes."""

    def __init__(self, folder: Path | str, model: str) -> None:
        self.model = model
        self.folder = Path(folder) / model.replace("/", "_")
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # one connection, used by one thread at a time
        self._db = sqlite3.connect(
            self.folder / DATABASE, timeout=_BUSY_TIMEOUT_S, check_same_thread=False
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        # In WAL mode NORMAL never corrupts the database; a power cut may drop the last stores,
        # which a cache can recompute.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS vectors (key BLOB PRIMARY KEY, vector BLOB NOT NULL)"
        )
        self._migrate()

    def _migrate(self) -> None:
        """Move the shards of earlier versions into the database, then delete them."""
        shards = sorted(self.folder.glob("shard-*.npz"))
        if not shards:
            return
        moved = 0
        for path in shards:
            try:
                with np.load(path) as z:
                    keys, vectors = z["keys"], z["vectors"]
                self.store(keys, vectors)
                moved += len(keys)
            except FileNotFoundError:
                continue  # another process moved it first
            except (OSError, ValueError, KeyError) as e:
                logger.warning(
                    "%s: unreadable cache shard of an earlier version, dropped (%s)", path, e
                )
            path.unlink(
                missing_ok=True
            )  # after its store committed: a crash keeps it for next time
        logger.info(
            "%s: moved %d embeddings from %d shard files of an earlier version into %s",
            self.folder,
            moved,
            len(shards),
            DATABASE,
        )

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM vectors").fetchone()[0]

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(found [n] bool, vectors [n, H] with zeros where not found, or None if none found)."""
        wanted = _blobs(keys)
        stored: dict[bytes, bytes] = {}
        with self._lock:
            for lo in range(0, len(wanted), _KEYS_PER_QUERY):
                chunk = wanted[lo : lo + _KEYS_PER_QUERY]
                marks = ",".join("?" * len(chunk))
                query = f"SELECT key, vector FROM vectors WHERE key IN ({marks})"
                stored.update(self._db.execute(query, chunk))
        found = np.array([k in stored for k in wanted], dtype=bool)
        if not stored:
            return found, None
        dim = len(next(iter(stored.values()))) // 4
        out = np.zeros((len(wanted), dim), dtype=np.float32)  # [n, H]
        for i in np.flatnonzero(found):
            out[i] = np.frombuffer(stored[wanted[i]], dtype="<f4")
        return found, out

    def store(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Add keys [u] with their vectors [u, H] in one transaction; known keys keep theirs."""
        vectors = np.ascontiguousarray(vectors, dtype="<f4")  # [u, H]
        rows = [(k, v.tobytes()) for k, v in zip(_blobs(keys), vectors, strict=True)]
        with self._lock, self._db:  # commits, or rolls back on an exception
            self._db.executemany("INSERT OR IGNORE INTO vectors (key, vector) VALUES (?, ?)", rows)

    def close(self) -> None:
        with self._lock:
            self._db.close()


# One open cache per (process, folder, model): a call to `embed_texts` then costs its lookup
# and store alone, not opening the database and checkpointing it on close (an fsync, ~10 ms).
# Keyed by pid because a connection must not be used across fork.
_open: dict[tuple[int, Path, str], EmbeddingCache] = {}
_open_lock = threading.Lock()


def shared_cache(folder: Path | str, model: str) -> EmbeddingCache:
    """This process's open `EmbeddingCache(folder, model)`, opened on first use."""
    key = (os.getpid(), Path(folder).resolve(), model)
    with _open_lock:
        if key not in _open:
            _open[key] = EmbeddingCache(folder, model)
        return _open[key]


def embed_texts(
    texts: Sequence[str],
    cache_dir: Path | str | None,
    batch_size: int = 512,
    progress: Progress | None = None,
) -> np.ndarray:
    """Embeddings of `texts` ([n, H], float32, unit norm), each unique text encoded once."""
    from m31.features.text_encoder import encode_texts, model_key

    uniq, inverse = np.unique(np.asarray(texts, dtype=object), return_inverse=True)
    model = model_key()
    keys = text_keys(uniq.tolist(), model)
    cache = shared_cache(cache_dir, model) if cache_dir is not None else None
    found, vectors = cache.lookup(keys) if cache is not None else (np.zeros(len(uniq), bool), None)
    missing = np.flatnonzero(~found)
    parts = []
    for lo in range(0, len(missing), batch_size):
        rows = missing[lo : lo + batch_size]
        vec = encode_texts([uniq[i] for i in rows], batch_size=min(batch_size, 256))
        parts.append(vec)
        if cache is not None:
            cache.store(keys[rows], vec)
        if progress:
            progress("text embeddings", lo + len(rows), len(missing))
    if parts:
        new = np.concatenate(parts)
        if vectors is None:
            vectors = np.zeros((len(uniq), new.shape[1]), dtype=np.float32)
        vectors[missing] = new
    if vectors is None:  # no texts at all
        return np.zeros((0, 384), dtype=np.float32)
    return vectors[inverse.reshape(-1)]
