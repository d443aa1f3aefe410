"""`m31 bench engine`: `Retriever.retrieve` end to end (request encoding, eligibility masks,
score·top-K, ids and scores back) over an index of N ads.

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim, K results.

The `tiny` world gives users, histories and the ads whose attributes the N ads repeat; the
retrieval MoE of a model preset is untrained (its weights do not change the work done). The
index is not `m31.engine.build.index_from_model`'s: that encodes the ads of a dataset folder,
and 10 M ads repeating the tiny world's 2,000 encoded rows would tie 5,000 at a time, which
changes the top-K's work. So the attributes repeat while g, x, b are random
(`m31.bench.common.random_table`), and the index is made by `m31.engine.build.index_from_table`,
the constructor `index_from_model` ends in.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from m31.bench.common import (
    Log,
    device_name,
    fits,
    fmt_rate,
    random_table,
    time_call,
    to_stderr,
)


@dataclass
class EngineTiming:
    device: str
    dtype: str  # the index's table dtype (bfloat16, float32, int8, ...)
    n: int
    b: int
    k: int
    model: str
    e: int
    g: int
    d: int
    median_ms: float
    repeats: int
    ads_per_s: float
    pairs_per_s: float
    encode_ms: float  # medians of the engine's own breakdown (`RetrievalResult.timings_ms`)
    mask_ms: float
    score_topk_ms: float
    index_build_s: float
    max_per: int = 0  # the requests' cap per advertiser (`"max_per"`), 0: none
    rank: str = "relevance"  # the requests' ranking: relevance, or value (the value column)


def synthetic_index(
    ads,
    n: int,
    gdim: int,
    ddim: int,
    device: torch.device,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
):
    """An AdIndex of N ads in `dtype`: attributes repeat the rows of a dataset's ads table
    (targeting, status, schedules as real ads have them) under fresh ids 0..N-1, each advertiser
    id drawn among N / 50 (so that caps per advertiser find as many advertisers as a real index
    would), every ad with a bid (log-normal) and a pacing (uniform in (0, 1]), so that a
    value-ranked request finds the same eligible ads as the others; g, x, b are random."""
    import pyarrow as pa

    from m31.engine.build import index_from_table

    # The creative texts are the one bulky column and no attribute of the index.
    keep = [c for c in ads.column_names if c != "text"]
    table = ads.select(keep).take(pa.array(np.arange(n) % ads.num_rows))
    table = table.set_column(
        table.schema.get_field_index("ad_id"), "ad_id", pa.array(np.arange(n, dtype=np.int64))
    )
    rng = np.random.default_rng(seed)
    advertisers = rng.integers(0, max(n // 50, 1), n)
    table = table.set_column(
        table.schema.get_field_index("advertiser_id"), "advertiser_id", pa.array(advertisers)
    )
    table = table.append_column("bid", pa.array(rng.lognormal(0.0, 1.0, n)))
    table = table.append_column("pacing", pa.array(1.0 - rng.random(n)))  # (0, 1]
    (g, x, b), _ = random_table(n, gdim, ddim, device, seed)
    return index_from_table(table, g, x, b, device=device, dtype=dtype)


def run_engine(
    device: torch.device,
    n: int,
    batches: Sequence[int] = (1, 64, 256),
    k: int = 100,
    model: str = "demo",
    repeat: int = 5,
    budget_s: float = 2.0,
    seed: int = 0,
    log: Log = to_stderr,
    dtypes: Sequence[str] = ("bfloat16",),
    max_per: Sequence[int] = (0,),
    gate_dims: Sequence[int] | None = None,
    ranks: Sequence[str] = ("relevance",),
) -> list[EngineTiming]:
    """One row per table dtype, batch size B, cap and ranking: the median time of
    `Retriever.retrieve` on B random requests for K ads each (with `"max_per": {"advertiser":
    cap}` where cap > 0, `"rank": "value"` for the value column), and the medians of the
    engine's own encode, mask and score·top-K times. Every dtype's index holds the same ads and
    answers the same requests, with each cap and ranking. `gate_dims`: the preset's
    model again with each G (default: the preset's); G = 0 is scored as one folded query
    (`m31.engine.search.fold`: 2D + 1 FLOPs per pair)."""
    from m31.engine import AdRequest, Retriever
    from m31.features import FeatureConfig, build_features
    from m31.index.ad_table import TABLE_DTYPES
    from m31.model import build_model, model_preset, vocab_sizes
    from m31.world.config import preset
    from m31.world.generate import generate

    start = time.perf_counter()
    ds, _ = generate(preset("tiny"), seed=seed)
    feats = build_features(ds, FeatureConfig(text_embeddings=False))
    torch.manual_seed(seed)
    cfg = model_preset(model, "moe")
    log(f"engine: tiny world and features in {time.perf_counter() - start:.1f} s")
    # The bf16 table (int8: less); the arrow table the attributes come from, their encoding and
    # the frozen view's copy of it (about 850 bytes per ad together: the process peaked at
    # 11.7 GB with N = 10 M, B = 64 on CPU); a [B, N] bool mask per call and its copy for a retry.
    unknown = [d for d in dtypes if d not in TABLE_DTYPES]
    if unknown:
        raise ValueError(f"table dtype {unknown[0]!r} is not one of {', '.join(TABLE_DTYPES)}")
    per_ad = 2 * (cfg.gate_dim + cfg.value_dim) + 2 + 850 + 2 * max(batches)
    fits(n * per_ad, device, f"an index of {n:,} ads and its masks")
    user_ids = feats.users["user_id"]
    surfaces, platforms = feats.meta["vocab"]["surface"], feats.meta["vocab"]["platform"]
    ts = int(ds.meta["time_range"][1])  # the end of the log: every ad of the world is created
    rows = []
    for gdim, dtype in ((g, d) for g in gate_dims or (cfg.gate_dim,) for d in dtypes):
        cfg = dataclasses.replace(cfg, gate_dim=gdim)
        torch.manual_seed(seed)
        net = build_model(cfg, vocab_sizes(feats), feats.text_emb.shape[1], feats.cooc_emb.shape[1])
        start = time.perf_counter()
        index = synthetic_index(ds.ads, n, gdim, cfg.value_dim, device, seed, TABLE_DTYPES[dtype])
        build_s = time.perf_counter() - start
        log(f"engine: {dtype} index of {len(index):,} ads built in {build_s:.1f} s")
        engine = Retriever(net, feats, index)
        for b, cap, rank in ((b, c, r) for b in batches for c in max_per for r in ranks):
            rng = np.random.default_rng([seed, b])  # the same requests for each cap and rank
            requests = [
                AdRequest(
                    user_id=int(rng.choice(user_ids)),
                    ts=ts,
                    surface=surfaces[rng.integers(len(surfaces))],
                    platform=platforms[rng.integers(len(platforms))],
                    max_per={"advertiser": cap} if cap else None,
                    rank=rank,
                )
                for _ in range(b)
            ]
            parts: list[dict[str, float]] = []  # the engine's own breakdown of every call

            def call(engine=engine, requests=requests, parts=parts):
                res = engine.retrieve(requests, k)
                parts.append(res.timings_ms)
                return res

            t, reps, _ = time_call(call, device, repeat, budget_s)
            part = {p: statistics.median(c[p] for c in parts[1:]) for p in parts[0]}  # no warm-up
            row = EngineTiming(
                device=device_name(device),
                dtype=dtype,
                n=n,
                b=b,
                k=k,
                model=model,
                e=cfg.n_experts,
                g=cfg.gate_dim,
                d=cfg.value_dim,
                median_ms=1e3 * t,
                repeats=reps,
                ads_per_s=n / t,
                pairs_per_s=b * n / t,
                encode_ms=part["encode"],
                mask_ms=part["mask"],
                score_topk_ms=part["score_topk"],
                index_build_s=build_s,
                max_per=cap,
                rank=rank,
            )
            rows.append(row)
            log(
                f"engine {dtype} B = {b}{f', max {cap} per advertiser' if cap else ''}"
                f"{', ranked by value' if rank == 'value' else ''}: "
                f"{row.median_ms:.1f} ms, {fmt_rate(row.pairs_per_s)} "
                f"ads scored/s (encode {row.encode_ms:.1f}, masks {row.mask_ms:.1f}, "
                f"score·top-K {row.score_topk_ms:.1f} ms)"
            )
        del engine, index
    return rows
