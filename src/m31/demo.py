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
    from m31.engine import Retriever
    from m31.engine.build import build_snapshot
    from m31.features.folder import features_for
    from m31.progress import progress_bar

    out = Path(out)
    data, runs = out / "world", out / "runs"
    timings = {}
    start = time.perf_counter()
    ds, truth = _world(data, world, log)
    timings["world"] = time.perf_counter() - start

    t = time.perf_counter()
    bar, callback = progress_bar()
    with bar:
        feats = features_for(data, progress=callback)
    timings["features"] = time.perf_counter() - t
    log(f"features: {feats.describe()}")

    models = {}
    for kind in ("moe", "two-tower"):
        t = time.perf_counter()
        models[kind] = _model(runs / f"{kind}.pt", kind, feats, models_preset, epochs, log)
        timings[f"train {kind}"] = time.perf_counter() - t

    t = time.perf_counter()
    index = build_snapshot(
        data, runs / "moe.pt", out / "index", overwrite=True
    )  # = m31 index build
    timings["index"] = time.perf_counter() - t
    log(f"index: {len(index):,} ads, bf16, version {index.version}, snapshot in {out / 'index'}")

    engine = Retriever(models["moe"], feats, index)
    requests = _show_requests(engine, ds, feats, truth)

    t = time.perf_counter()
    quality, funnel, fns = _quality(models, feats, truth, data, log)
    timings["quality"] = time.perf_counter() - t

    t = time.perf_counter()
    auction = _auction(ds, feats, models["moe"], fns["moe"], truth, log)
    timings["auction"] = time.perf_counter() - t

    ads_per_s = _throughput(engine, requests, len(index), log)
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


def _world(data: Path, world: str, log):
    """The marketplace of preset `world` in `data` (generated unless already there) and its
    ground truth."""
    from m31.data import dataset
    from m31.progress import progress_bar
    from m31.world.config import preset
    from m31.world.generate import generate
    from m31.world.truth import GroundTruth

    if not (data / "meta.json").is_file():
        log(f"generating the demo marketplace into {data}")
        bar, callback = progress_bar()
        with bar:
            ds, truth = generate(preset(world), seed=0, progress=callback)
        dataset.save(ds, data, overwrite=True, extra=truth.to_arrays())
    return dataset.load(data), GroundTruth.from_arrays(dataset.load_truth(data))


def _model(path: Path, kind: str, feats, models_preset: str, epochs: int, log):
    """The model of `kind` at `path`, trained (and saved there) unless one for these features
    is already there."""
    from m31.model import load_checkpoint, model_preset, save_checkpoint
    from m31.training import train

    if path.is_file():
        try:
            return load_checkpoint(path, feats)[0]
        except ValueError as e:  # an older format, or other features: train it again
            log(f"not reusing {path}: {e}")
    log(f"training {kind} ({epochs} epochs)")
    cfg = model_preset(models_preset, kind).with_overrides(epochs=epochs)
    model, history = train(cfg, feats, device="cpu", log=log)
    save_checkpoint(path, model, feats, history)
    return model


def _show_requests(engine, ds, feats, truth) -> list:
    """Three held-out requests answered and shown as a person would want to read them: the
    user's interests, each ad's topic, format, score and creative. Returns the requests."""
    from rich.console import Console
    from rich.table import Table

    from m31.engine import AdRequest

    test = feats.splits["test"]
    picks = np.random.default_rng(0).choice(len(test["user"]), 3, replace=False)
    topic_names = [t["name"] for t in ds.meta["topics"]]
    ads = ds.ads.select(["ad_id", "topic", "format", "text"]).to_pylist()
    vocab = feats.meta["vocab"]
    requests = [
        AdRequest(
            user_id=int(feats.users["user_id"][test["user"][i]]),
            ts=int(test["ts"][i]),
            surface=vocab["surface"][test["surface"][i]],
            platform=vocab["platform"][test["platform"][i]],
        )
        for i in picks
    ]
    answer = engine.retrieve(requests, k=8)
    console = Console()
    for req, i, res in zip(requests, picks, answer.results, strict=True):
        facets = [topic_names[f] for f in truth.facet_topic[test["user"][i]] if f >= 0]
        when = f"{req.surface} on {req.platform}, {(req.ts % 86400) // 3600}:00"
        title = f"user {req.user_id} — interests: {'; '.join(facets)} — {when}"
        table = Table(title=title, title_justify="left")
        for col in ("#", "ad", "topic", "format", "score", "creative"):
            table.add_column(col, overflow="fold")
        for rank, (ad_id, s) in enumerate(zip(res.ad_ids, res.scores, strict=True), 1):
            a = ads[int(ad_id)]
            topic = topic_names[a["topic"]]
            table.add_row(str(rank), str(ad_id), topic, a["format"], f"{s:.2f}", a["text"])
        console.print(table)
    return requests


def _quality(models: dict, feats, truth, data: Path, log):
    """Full-corpus quality on held-out requests, and the funnel against the two-tower
    baseline: (quality, funnel, each model's ScoreFunction)."""
    from m31.eval import (
        evaluate,
        format_funnel,
        format_table,
        requests_from_split,
        simulate,
        topk_rows,
    )
    from m31.eval.funnel import funnel_eligibility
    from m31.model import Catalog, ScoreFunction

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
    retrievers = {k: retriever(fns[k]) for k in ("two-tower", "moe")}
    funnel = simulate(
        retrievers, keep_order, truth, req, k=SLOTS, slots=SLOTS, eligible=eligible(req.ts)
    )
    log(f"funnel, each retriever's top {SLOTS} shown (no ranking stage):")
    log(format_funnel(funnel))
    return quality, funnel, fns


def _auction(ds, feats, moe, moe_fn, truth, log) -> dict:
    """The funnel as an auction: relevance- against value-ranked retrieval, with and without a
    cap per advertiser; second-price auctions, budgets, pacing through the index's PATCHes."""
    from m31.eval.auction import AuctionConfig, format_auction, run_auction

    cfg = AuctionConfig(minutes=AUCTION_MINUTES, per_minute=AUCTION_PER_MINUTE)
    auction = run_auction(ds.ads, feats, moe, moe_fn.rank, truth, cfg, log=log)
    log("the funnel as an auction (the demo trains no ranking model: the moe's own scores,")
    log("calibrated on the logged impressions, predict conversions; `m31 auction` takes one):")
    log(format_auction(auction))
    return auction


def _throughput(engine, requests: list, n_ads: int, log) -> float:
    """Ads scored per second by the engine end to end (encode requests, masks, exhaustive
    score and top-K) on a batch of 66 requests, after one warm-up batch."""
    from m31.engine import AdRequest

    batch = [AdRequest(r.user_id, r.ts, r.surface, r.platform) for r in requests] * 22  # B = 66
    engine.retrieve(batch, k=100)
    t = time.perf_counter()
    res = engine.retrieve(batch, k=100)
    dt = time.perf_counter() - t
    ads_per_s = len(batch) * n_ads / dt
    log(
        f"engine: B = {len(batch)} requests x {n_ads:,} ads in {dt * 1000:.0f} ms "
        f"({ads_per_s / 1e6:.1f} M ads scored per second on {torch.get_num_threads()} CPU threads; "
        f"encode {res.timings_ms['encode']:.0f} ms, masks {res.timings_ms['mask']:.0f} ms, "
        f"score and top-K {res.timings_ms['score_topk']:.0f} ms)"
    )
    return ads_per_s
