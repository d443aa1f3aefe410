"""Sentence-encoder embeddings of texts, cached on disk by content hash.

Shapes: n texts, u unique texts, H the encoder's dimension (384).

The cache is a folder of shards, each an `.npz` of `keys` ([u] 16-byte hashes of model name and
text) and `vectors` ([u, H] float32). New embeddings go to a new shard written atomically, so an
interrupted run loses only the batch in flight and never corrupts what is cached.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

Progress = Callable[[str, int, int], None]


def text_keys(texts: Sequence[str], model: str) -> np.ndarray:
    """16-byte content hashes: [n] of dtype S16."""
    prefix = model.encode() + b"\0"
    return np.array(
        [hashlib.blake2b(prefix + t.encode(), digest_size=16).digest() for t in texts], dtype="S16"
    )


class EmbeddingCache:
    def __init__(self, folder: Path | str, model: str) -> None:
        self.model = model
        self.folder = Path(folder) / model.replace("/", "_")
        self._index: dict[bytes, tuple[int, int]] = {}
        self._shards: list[np.ndarray] = []
        if self.folder.is_dir():
            for path in sorted(self.folder.glob("shard-*.npz")):
                try:
                    with np.load(path) as z:
                        self._add(z["keys"], z["vectors"])
                except (OSError, ValueError, KeyError):
                    continue  # a damaged shard is a cache miss, never an error

    def _add(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        shard = len(self._shards)
        self._shards.append(vectors)
        for i, k in enumerate(keys.tolist()):
            self._index[k] = (shard, i)

    def __len__(self) -> int:
        return len(self._index)

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(found [n] bool, vectors [n, H] with zeros where not found, or None if none found)."""
        hits = [self._index.get(k) for k in keys.tolist()]
        found = np.array([h is not None for h in hits], dtype=bool)
        if not found.any():
            return found, None
        dim = self._shards[0].shape[1]
        out = np.zeros((len(keys), dim), dtype=np.float32)
        for i, h in enumerate(hits):
            if h is not None:
                out[i] = self._shards[h[0]][h[1]]
        return found, out

    def store(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".shard-", suffix=".npz", dir=self.folder)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, keys=keys, vectors=vectors.astype(np.float32))
            f.flush()
            os.fsync(f.fileno())
        name = f"shard-{len(list(self.folder.glob('shard-*.npz'))):06d}-{os.getpid()}.npz"
        os.replace(tmp, self.folder / name)
        self._add(keys, vectors.astype(np.float32))


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
    cache = EmbeddingCache(cache_dir, model) if cache_dir is not None else None
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
