"""What engagement events cost retrieval inside one server process, without HTTP (docs/SERVING.md,
"Live users"): retrieves (B = 1, K = 100, stored users, one thread) timed in rounds that
alternate with and without a writer thread adding batches of events through the serving
folder's DurableIndex (logged, fsync'd, applied to the user store) at a given rate.

    python scripts/serve_limits.py build data/events --ads 50000      # a served world, once
    m31 bench events data/events --rate 2000,10000,20000

The HTTP figures (`m31 loadtest --event-clients`) add the HTTP stack and, on one machine, the
load generator's own CPU; these isolate the engine: the store, the log and the version churn.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from m31.bench.results import Figure
from m31.engine import AdRequest
from m31.engine.load import load_engine, serving_folder


def measure(engine, rate: float, rounds: int, per_round: int, batch: int, seed: int) -> dict:
    retriever = engine.retriever
    users, ads = retriever.feats.users["user_id"], retriever.feats.ads["ad_id"]
    surfaces = retriever.vocab["surface"] or (None,)
    platforms = retriever.vocab["platform"] or (None,)
    rng = np.random.default_rng(seed)
    writing, stop = threading.Event(), threading.Event()
    written = [0, 0.0]  # events, seconds writing

    def writer() -> None:
        wrng = np.random.default_rng(seed + 1)
        period = batch / rate
        while not stop.is_set():
            if not writing.is_set():
                time.sleep(0.005)
                continue
            t = time.perf_counter()
            engine.store.add_events(
                wrng.choice(users, batch).tolist(),
                wrng.choice(ads, batch).tolist(),
                [int(time.time())] * batch,
                [surfaces[0]] * batch,
            )
            spent = time.perf_counter() - t
            written[0] += batch
            written[1] += spent
            time.sleep(max(0.0, period - spent))

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        for r in range(rounds):
            with_events = r % 2 == 1
            (writing.set if with_events else writing.clear)()
            for _ in range(per_round):
                request = AdRequest(
                    int(rng.choice(users)),
                    surface=surfaces[int(rng.integers(len(surfaces)))],
                    platform=platforms[int(rng.integers(len(platforms)))],
                )
                t = time.perf_counter()
                retriever.retrieve([request], k=100)
                times[with_events].append(time.perf_counter() - t)
    finally:
        stop.set()
        thread.join()
    alone, beside = (np.array(times[w]) * 1000 for w in (False, True))
    return {
        "rate": rate,
        "events_per_s": written[0] / max(sum(times[True]), 1e-9),  # over the rounds with them
        "write_ms_per_call": 1000 * written[1] / max(written[0] / batch, 1),
        "alone": (np.percentile(alone, 50), np.percentile(alone, 99)),
        "beside": (np.percentile(beside, 50), np.percentile(beside, 99)),
    }


def run(
    world: Path, rates: Sequence[float], batch: int, rounds: int, per_round: int
) -> list[Figure]:
    """`m31 bench events`: one table row per rate, printed; the figures. `world` holds index/
    and runs/moe.pt, as `scripts/serve_limits.py build` writes them."""
    figures = []
    tmp = Path(tempfile.mkdtemp())
    try:
        state = serving_folder(world / "index", tmp / "serving")
        engine = load_engine(state, world / "runs" / "moe.pt")
        try:
            print(
                "| events / s asked | written / s | ms per call of the writer | "
                "retrieve p50 / p99 alone | beside the events | ratio p50 / p99 |"
            )
            print("|---:|---:|---:|---:|---:|---:|")
            for rate in rates:
                m = measure(engine, rate, rounds, per_round, batch, seed=0)
                (a50, a99), (b50, b99) = m["alone"], m["beside"]
                print(
                    f"| {rate:,.0f} | {m['events_per_s']:,.0f} | {m['write_ms_per_call']:.2f} "
                    f"| {a50:.1f} / {a99:.1f} | {b50:.1f} / {b99:.1f} "
                    f"| {b50 / a50:.2f}x / {b99 / a99:.2f}x |"
                )
                figures += _figures(m, batch, rounds * per_round)
        finally:
            engine.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return figures


def _figures(m: dict, batch: int, retrieves: int) -> list[Figure]:
    case = f"rate={m['rate']:.0f} batch={batch} B=1 K=100 retrieves={retrieves}"
    (a50, a99), (b50, b99) = m["alone"], m["beside"]
    return [
        Figure("events", case, "writer", "events_per_s", m["events_per_s"], "events/s"),
        Figure("events", case, "writer", "ms_per_call", m["write_ms_per_call"], "ms"),
        Figure("events", case, "retrieves alone", "p50_ms", a50, "ms"),
        Figure("events", case, "retrieves alone", "p99_ms", a99, "ms"),
        Figure("events", case, "retrieves beside the events", "p50_ms", b50, "ms"),
        Figure("events", case, "retrieves beside the events", "p99_ms", b99, "ms"),
        Figure("events", case, "beside vs alone", "p50_ratio", b50 / a50, "x"),
        Figure("events", case, "beside vs alone", "p99_ratio", b99 / a99, "x"),
    ]
