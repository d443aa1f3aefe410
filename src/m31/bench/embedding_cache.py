"""Cost of the text-embedding cache per upsert, with --cached texts already in it.

    m31 bench embedding-cache [--cached 3000] [--batch 1,10,100] [--repeat 20]

Fills a fresh cache folder with --cached texts, one `store` each (as that many one-ad upserts
leave it), then times `embed_texts` on upserts of --batch texts, half of them cached already:
what the ad encoder runs per upsert. The sentence encoder is replaced by random vectors
(H = 384), so only the cache is timed. Prints the median milliseconds per upsert and the files
in the cache folder.

Run it against another checkout to compare: PYTHONPATH=OTHER/src python -m m31.bench
embedding-cache
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from m31.bench.results import Figure
from m31.features import text_encoder
from m31.features.embedding_cache import EmbeddingCache, embed_texts, text_keys

MODEL = "bench-model"
DIM = 384


@contextmanager
def _random_encoder(rng: np.random.Generator):
    """The sentence encoder replaced by random vectors while the bench runs, then restored."""
    saved = text_encoder.encode_texts, text_encoder.model_key
    text_encoder.encode_texts = lambda texts, batch_size: rng.standard_normal(
        (len(texts), DIM)
    ).astype(np.float32)
    text_encoder.model_key = lambda: MODEL
    try:
        yield
    finally:
        text_encoder.encode_texts, text_encoder.model_key = saved


def run(cached: int, batches: Sequence[int], repeat: int) -> list[Figure]:
    """`m31 bench embedding-cache`: fill the cache, then time upserts of each batch size; the
    figures."""
    rng = np.random.default_rng(0)
    with _random_encoder(rng), tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cache = EmbeddingCache(folder, MODEL)
        start = time.perf_counter()
        for i in range(cached):
            cache.store(text_keys([f"cached text {i}"], MODEL), rng.standard_normal((1, DIM)))
        fill_s = time.perf_counter() - start
        del cache  # upserts find the folder as a fresh process would
        files = sum(1 for p in folder.rglob("*") if p.is_file())
        print(f"{cached:,} texts cached in {fill_s:.1f} s, {files:,} files in the folder")
        case = f"cached={cached}"
        figures = [
            Figure("embedding-cache", case, "fill", "seconds", fill_s, "s"),
            Figure("embedding-cache", case, "fill", "files", files),
        ]
        print(f"{'texts per upsert':>16} {'ms per upsert':>14}")
        fresh = 0
        for batch in batches:
            times = []
            for _ in range(repeat):
                old = [f"cached text {i}" for i in rng.integers(0, cached, batch // 2)]
                new = [f"new text {fresh + j}" for j in range(batch - len(old))]
                fresh += len(new)
                start = time.perf_counter()
                embed_texts(old + new, folder)
                times.append(time.perf_counter() - start)
            ms = 1e3 * statistics.median(times)
            print(f"{batch:>16} {ms:>14.2f}")
            figures.append(
                Figure("embedding-cache", f"{case} batch={batch}", "upsert", "median_ms", ms, "ms")
            )
    return figures
