"""`make demo`: the whole system on the default marketplace, end to end, in minutes on a CPU.

generate (or reuse) the world -> features -> train moe and two-tower (or reuse) -> build and
snapshot the ad index -> answer sample requests -> quality, the funnel as an auction, and
throughput.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

DEMO_EPOCHS = 3  # of the demo preset's 5: keeps `make demo` near 10 minutes on 2 cores
N_EVAL = 1000  # held-out requests for the quality figures
SLOTS = 4  # ads shown per request in the funnel
AUCTION_MINUTES, AUCTION_PER_MINUTE = 20, 20  # the demo's simulated auction day (a minute or two)


def run(
    out: Path,
    log=print,
    world: str = "demo",
    models_preset: str = "demo",
    epochs: int = DEMO_EPOCHS,
) -> dict:
    """Run everything into `out`; `world` and `models_preset` name presets (tests use tiny)."""
    from rich.console import Console
    from rich.table import Table

    from m31.data import dataset
    from m31.engine import AdRequest, Retriever
    from m31.engine.build import build_index
    from m31.eval import (
        evaluate,
        format_funnel,
        format_table,
        requests_from_split,
        simulate,
        topk_rows,
    )
    from m31.eval.auction import AuctionConfig, format_auction, run_auction
    from m31.model import (
        Catalog,
        ScoreFunction,
        load_checkpoint,
        model_preset,
        save_checkpoint,
    )
    from m31.pipeline import features_for, funnel_eligibility
    from m31.progress import progress_bar
    from m31.training import train
    from m31.world.config import preset
    from m31.world.generate import generate
    from m31.world.truth import GroundTruth

    console = Console()
    out = Path(out)
    data, runs = out / "world", out / "runs"
    timings = {}
    start = time.perf_counter()
    cfg = preset(world)
    if not (data / "meta.json").is_file():
        log(f"generating the demo marketplace into {data}")
        bar, callback = progress_bar()
        with bar:
            ds, truth = generate(cfg, seed=0, progress=callback)
        dataset.save(ds, data, overwrite=True, extra=truth.to_arrays())
    ds = dataset.load(data)
    truth = GroundTruth.from_arrays(dataset.load_truth(data))
    timings["world"] = time.perf_counter() - start

    t = time.perf_counter()
    bar, callback = progress_bar()
    with bar:
        feats = features_for(data, progress=callback)
    timings["features"] = time.perf_counter() - t
    log(f"features: {feats.describe()}")

    models = {}
    for kind in ("moe", "two-tower"):
        path = runs / f"{kind}.pt"
        t = time.perf_counter()
        models[kind] = None
        if path.is_file():
            try:
                models[kind], _ = load_checkpoint(path, feats)
            except ValueError as e:  # an older format, or other features: train it again
                log(f"not reusing {path}: {e}")
        if models[kind] is None:
            log(f"training {kind} ({epochs} epochs)")
            models[kind], history = train(
                model_preset(models_preset, kind).with_overrides(epochs=epochs),
                feats,
                device="cpu",
                log=log,
            )
            save_checkpoint(path, models[kind], feats, history)
        timings[f"train {kind}"] = time.perf_counter() - t

    t = time.perf_counter()
    index = build_index(data, runs / "moe.pt", out / "index", overwrite=True)  # = m31 index build
    timings["index"] = time.perf_counter() - t
    log(f"index: {len(index):,} ads, bf16, version {index.version}, snapshot in {out / 'index'}")

    # Sample requests, shown as a person would want to read them.
    engine = Retriever(models["moe"], feats, index)
    test = feats.splits["test"]
    rng = np.random.default_rng(0)
    picks = rng.choice(len(test["user"]), 3, replace=False)
    topic_names = [t["name"] for t in ds.meta["topics"]]
    ads = ds.ads.select(["ad_id", "topic", "format", "text"]).to_pylist()
    requests = [
        AdRequest(
            user_id=int(feats.users["user_id"][test["user"][i]]),
            ts=int(test["ts"][i]),
            surface=feats.meta["vocab"]["surface"][test["surface"][i]],
            platform=feats.meta["vocab"]["platform"][test["platform"][i]],
        )
        for i in picks
    ]
    answer = engine.retrieve(requests, k=8)
    for req, i, res in zip(requests, picks, answer.results, strict=True):
        facets = [topic_names[f] for f in truth.facet_topic[test["user"][i]] if f >= 0]
        table = Table(
            title=f"user {req.user_id} — interests: {'; '.join(facets)} — {req.surface} on {req.platform}, {(req.ts % 86400) // 3600}:00",
            title_justify="left",
        )
        for col in ("#", "ad", "topic", "format", "score", "creative"):
            table.add_column(col, overflow="fold")
        for rank, (ad_id, s) in enumerate(zip(res.ad_ids, res.scores, strict=True), 1):
            a = ads[int(ad_id)]
            table.add_row(
                str(rank), str(ad_id), topic_names[a["topic"]], a["format"], f"{s:.2f}", a["text"]
            )
        console.print(table)

    # Quality: full corpus on held-out requests; funnel against the two-tower baseline.
    t = time.perf_counter()
    catalog = Catalog.from_features(feats)
    fns = {kind: ScoreFunction(m, feats, catalog) for kind, m in models.items()}
    quality = evaluate(
        fns, feats, ks=(10, 50, 100), max_users=N_EVAL, exclude_seen=False, truth=truth
    )
    log(f"quality on {N_EVAL:,} held-out requests, all {feats.n_ads:,} ads scored:")
    shown = ("hr@", "truth_recall")
    log(
        format_table(
            {m: {k: v for k, v in r.items() if k.startswith(shown)} for m, r in quality.items()}
        )
    )
    eligible = funnel_eligibility(data, feats)
    req = requests_from_split(feats, "test", max_users=N_EVAL, seed=1)

    def retriever(fn):
        return lambda r: topk_rows(np.where(eligible(r.ts), fn(r), -np.inf), SLOTS)

    def keep_order(r, cand):
        return -np.broadcast_to(np.arange(cand.shape[1], dtype=np.float32), cand.shape)

    # No ranking stage here: each retriever's own top ads are shown, which isolates retrieval.
    # The funnel behind the heavy ranking model is scripts/quality.sh (docs/QUALITY.md).
    funnel = simulate(
        {k: retriever(fns[k]) for k in ("two-tower", "moe")},
        keep_order,
        truth,
        req,
        k=SLOTS,
        slots=SLOTS,
        eligible=eligible(req.ts),
    )
    log(f"funnel, each retriever's top {SLOTS} shown (no ranking stage):")
    log(format_funnel(funnel))
    timings["quality"] = time.perf_counter() - t

    # The funnel as an auction: relevance- against value-ranked retrieval, with and without a
    # cap per advertiser; second-price auctions, budgets, pacing through the index's PATCHes.
    t = time.perf_counter()
    cfg = AuctionConfig(minutes=AUCTION_MINUTES, per_minute=AUCTION_PER_MINUTE)
    auction = run_auction(ds.ads, feats, models["moe"], fns["moe"].rank, truth, cfg, log=log)
    log("the funnel as an auction (the demo trains no ranking model: the moe's own scores,")
    log("calibrated on the logged impressions, predict conversions; `m31 auction` takes one):")
    log(format_auction(auction))
    timings["auction"] = time.perf_counter() - t

    # Throughput of the engine end to end (encode requests, masks, exhaustive score and top-K).
    batch = [AdRequest(r.user_id, r.ts, r.surface, r.platform) for r in requests] * 22  # B = 66
    engine.retrieve(batch, k=100)
    t = time.perf_counter()
    res = engine.retrieve(batch, k=100)
    dt = time.perf_counter() - t
    ads_per_s = len(batch) * len(index) / dt
    log(
        f"engine: B = {len(batch)} requests x {len(index):,} ads in {dt * 1000:.0f} ms "
        f"({ads_per_s / 1e6:.1f} M ads scored per second on {torch.get_num_threads()} CPU threads; "
        f"encode {res.timings_ms['encode']:.0f} ms, masks {res.timings_ms['mask']:.0f} ms, "
        f"score and top-K {res.timings_ms['score_topk']:.0f} ms)"
    )
    timings["total"] = time.perf_counter() - start
    log("wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
    log(f"serve it: m31 serve --index {out / 'index'} --model {runs / 'moe.pt'}")
    return {
        "quality": quality,
        "funnel": funnel,
        "auction": auction,
        "ads_per_s": ads_per_s,
        "timings": timings,
    }
