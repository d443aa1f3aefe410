"""Cost of the text-embedding cache per upsert, with --cached texts already in it.

    python bench/embedding_cache.py [--cached 3000] [--batch 1 10 100] [--repeat 20]

Fills a fresh cache folder with --cached texts, one `store` each (as that many one-ad upserts
leave it), then times `embed_texts` on upserts of --batch texts, half of them cached already:
what the ad encoder runs per upsert. The sentence encoder is replaced by random vectors
(H = 384), so only the cache is timed. Prints the median milliseconds per upsert and the files
in the cache folder.

Run it against another checkout to compare: PYTHONPATH=OTHER/src python bench/embedding_cache.py
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from m31.features import text_encoder
from m31.features.embedding_cache import EmbeddingCache, embed_texts, text_keys

MODEL = "bench-model"
DIM = 384


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cached", type=int, default=3_000)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 10, 100])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    text_encoder.encode_texts = lambda texts, batch_size: rng.standard_normal(
        (len(texts), DIM)
    ).astype(np.float32)
    text_encoder.model_key = lambda: MODEL
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cache = EmbeddingCache(folder, MODEL)
        start = time.perf_counter()
        for i in range(args.cached):
            cache.store(text_keys([f"cached text {i}"], MODEL), rng.standard_normal((1, DIM)))
        fill_s = time.perf_counter() - start
        del cache  # upserts find the folder as a fresh process would
        files = sum(1 for p in folder.rglob("*") if p.is_file())
        print(f"{args.cached:,} texts cached in {fill_s:.1f} s, {files:,} files in the folder")
        print(f"{'texts per upsert':>16} {'ms per upsert':>14}")
        fresh = 0
        for batch in args.batch:
            times = []
            for _ in range(args.repeat):
                old = [f"cached text {i}" for i in rng.integers(0, args.cached, batch // 2)]
                new = [f"new text {fresh + j}" for j in range(batch - len(old))]
                fresh += len(new)
                start = time.perf_counter()
                embed_texts(old + new, folder)
                times.append(time.perf_counter() - start)
            print(f"{batch:>16} {1e3 * statistics.median(times):>14.2f}")


if __name__ == "__main__":
    main()
