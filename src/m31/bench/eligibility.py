"""Eligibility masks per request: the column builder (before) against the row bitmaps (after),
beside the score·top-K pass they feed, on one index of N ads.

    m31 bench eligibility [--n 1M,10M] [--batches 1,64] [--repeat 5] [--engine]

The index is `m31 bench engine`'s (`m31.bench.engine.synthetic_index`: the `tiny` world's ad
attributes repeated, random bf16 vectors, E = 8, G = D = 64); requests are random users of the
world (country, age, gender) on a random platform and surface, at the end of the log. Per N and
B it prints milliseconds per request of:
* before: each request's mask from the attribute columns
  (`m31.index.testing.reference_mask`, the builder the engine used), stacked into [B, N] as
  the engine did;
* after, warm: `IndexView.eligible_bits` (what the engine asks for: one bitmap per targeting key,
  `m31.ops.PackedMask`, which the kernels take as it is) on a view whose caches already hold the
  batch's ages and second (every batch after the first of an index version);
* after, cold: the first batch of a new version (one attribute update before it), which computes
  the schedule at its second and the predicates it lacks; the view's copy of the bitmaps and of
  the attributes, made once per version, is shown apart;
* score·top-K: `score_topk` (K = 100, auto kernel) on the batch with the after (packed) mask;
and with --engine (first N only), `Retriever.retrieve` end to end with each builder
(`m31.bench.engine.run_engine`, which builds its own index).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import torch

from m31.bench.common import median_ms, random_query
from m31.bench.engine import synthetic_index
from m31.bench.results import Figure, short
from m31.index import AdIndex, RequestContext
from m31.index.testing import reference_mask
from m31.ops import score_topk
from m31.vocabularies import GENDERS, PLATFORMS, SURFACES

E, GDIM, DDIM, K = 8, 64, 64, 100


def _contexts(users, b: int, ts: int, rng) -> list[RequestContext]:
    rows = users.select(["country", "age", "gender"]).to_pylist()
    out = []
    for i in rng.integers(len(rows), size=b):
        u = rows[i]
        out.append(
            RequestContext(
                country=u["country"],
                age=u["age"],
                gender=u["gender"] if u["gender"] in GENDERS else None,
                platform=PLATFORMS[rng.integers(len(PLATFORMS))],
                surface=SURFACES[rng.integers(len(SURFACES))],
                ts=ts,
            )
        )
    return out


def _before(view, contexts) -> torch.Tensor:
    """The engine's masks before the bitmaps: one column pass per request, then a stack."""
    return torch.stack([reference_mask(view._index, c, None) for c in contexts])  # [B, N]


def _bitmap_bytes(index: AdIndex) -> int:
    bitmaps = index._bitmaps
    tensors = [bitmaps.live, bitmaps._cache, *(f.bits for f in bitmaps._families.values())]
    return sum(t.numel() for t in tensors)


def bench_n(n: int, batches: Sequence[int], repeat: int, ds) -> list[Figure]:
    start = time.perf_counter()
    index = synthetic_index(ds.ads, n, GDIM, DDIM, torch.device("cpu"))
    build_s = time.perf_counter() - start
    ts = int(ds.meta["time_range"][1])
    rng = np.random.default_rng(0)
    print(
        f"N = {n:,}: index built in {build_s:.1f} s; bitmaps {_bitmap_bytes(index) / 1e6:.1f} MB",
        flush=True,
    )
    figures = [
        Figure("eligibility", f"N={short(n)}", "", "index_build_s", build_s, "s"),
        Figure("eligibility", f"N={short(n)}", "bitmaps", "bytes", _bitmap_bytes(index), "B"),
    ]
    for b in batches:
        contexts = _contexts(ds.users, b, ts, rng)
        view = index.frozen_view()
        before = median_ms(lambda: _before(view, contexts), repeat)  # noqa: B023
        after = view.eligible_bits(contexts)  # the engine's: bitmaps, one per targeting key
        assert torch.equal(after.unpack(), _before(view, contexts)), "the builders disagree"
        warm = median_ms(lambda: view.eligible_bits(contexts), repeat)  # noqa: B023
        cold, copies = [], []
        for _ in range(max(1, repeat // 2)):
            ad = int(view.row_ids[0])
            index.update_attributes(ad, tags=index.get(ad).attributes["tags"])
            start = time.perf_counter()
            view = index.frozen_view()
            copies.append(time.perf_counter() - start)
            start = time.perf_counter()
            view.eligible_bits(contexts)
            cold.append(time.perf_counter() - start)
        copy_start = time.perf_counter()
        index._bitmaps.copy(index.num_rows)
        bitmap_copy = time.perf_counter() - copy_start
        query = random_query(b, E, GDIM, DDIM, torch.device("cpu"), 0)
        table = (view.g, view.x, view.b)
        score = median_ms(lambda: score_topk(query, table, after, K), max(1, repeat // 2))  # noqa: B023
        keys = len({(c.country, c.age, c.gender, c.platform, c.surface) for c in contexts})
        row = {
            "n": n,
            "b": b,
            "keys": keys,
            "before_ms": before / b,
            "warm_ms": warm / b,
            "cold_ms": 1e3 * statistics.median(cold) / b,
            "version_copy_ms": 1e3 * statistics.median(copies),
            "bitmap_copy_ms": 1e3 * bitmap_copy,
            "score_topk_ms": score,
        }
        figures += _figures(row)
        print(
            f"  B = {b} ({keys} keys): mask ms/request before {row['before_ms']:.3f}, after "
            f"warm {row['warm_ms']:.3f}, cold {row['cold_ms']:.3f} (view copy per version "
            f"{row['version_copy_ms']:.0f} ms, of which bitmaps {row['bitmap_copy_ms']:.1f}); "
            f"score·top-K {score:.1f} ms for the batch",
            flush=True,
        )
    return figures


_VARIANTS = {
    "before_ms": ("column builder", "mask_ms_per_request"),
    "warm_ms": ("bitmaps warm", "mask_ms_per_request"),
    "cold_ms": ("bitmaps first batch of a version", "mask_ms_per_request"),
    "version_copy_ms": ("bitmaps", "view_copy_ms"),
    "bitmap_copy_ms": ("bitmaps", "bitmap_copy_ms"),
    "score_topk_ms": ("bitmaps", "score_topk_ms"),
}


def _figures(row: dict) -> list[Figure]:
    case = f"N={short(row['n'])} B={row['b']} keys={row['keys']}"
    return [
        Figure("eligibility", case, variant, metric, row[key], "ms")
        for key, (variant, metric) in _VARIANTS.items()
    ]


@contextmanager
def _column_masks():
    """The engine with the mask builder it had before the bitmaps."""
    import m31.engine.retriever as retriever

    def old(view, requests):
        return _before(view, [c for c, _ in requests]) if requests else None

    saved = retriever.eligible_masks
    retriever.eligible_masks = old
    try:
        yield
    finally:
        retriever.eligible_masks = saved


def run(ns: Sequence[int], batches: Sequence[int], repeat: int, engine: bool) -> list[Figure]:
    """`m31 bench eligibility`: each N's masks, then with `engine` the engine at the first N;
    the figures."""
    from m31.world.config import preset
    from m31.world.generate import generate

    ds, _ = generate(preset("tiny"), seed=0)
    print(f"{torch.get_num_threads()} threads, PyTorch {torch.__version__}", flush=True)
    figures = [f for n in ns for f in bench_n(n, batches, repeat, ds)]
    if engine:
        from m31.bench.engine import run_engine
        from m31.bench.suite import engine_figures

        for label, ctx in (("before", _column_masks()), ("after", _nothing())):
            with ctx:
                timed = run_engine(
                    torch.device("cpu"),
                    ns[0],
                    batches,
                    K,
                    repeat=repeat,
                    budget_s=30.0,
                    log=lambda _: None,
                )
                figures += [
                    replace(f, what="eligibility", variant=f"engine {label}: {f.variant}")
                    for f in engine_figures(timed)
                ]
                for r in timed:
                    print(
                        f"engine {label}, N = {r.n:,}, B = {r.b}: {r.median_ms:.1f} ms, "
                        f"{r.pairs_per_s / 1e6:.1f} M ads scored/s (encode {r.encode_ms:.1f}, "
                        f"masks {r.mask_ms:.1f}, score·top-K {r.score_topk_ms:.1f} ms)",
                        flush=True,
                    )
    return figures


@contextmanager
def _nothing():
    yield
