"""What explaining an answer costs: `Retriever.retrieve` of one request (B = 1, K results) plain,
with `explain`, and with `explain` and a why-not of W ads, on a served index and its model.

    m31 bench explain --index DIR --model CKPT [--k 100] [--why-not 100] [--repeat 40]

The three variants run interleaved (plain, explain, why-not, plain, ...) on the same random
stored users, so that a busy machine slows each alike; the median of each and its ratio to the
plain retrieve measured in the same run are printed and recorded. The why-not's ids are spread
over the index's ads (every N / W-th), so that most are eligible and ranked: its cost is one
scoring of the eligible ads in fp64 (`m31.engine.explain`).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from m31.bench.results import Figure

VARIANTS = ("plain", "explain", "why-not")


def run(index: Path, model: Path, k: int, why_not: int, repeat: int, seed: int = 0):
    import m31
    from m31.bench.loadtest import inputs
    from m31.engine import AdRequest

    users, _, vocab = inputs(Path(index))  # the served index's online/ users and vocabularies
    rng = np.random.default_rng(seed)

    def pick(name: str) -> str | None:
        return vocab[name][rng.integers(len(vocab[name]))] if vocab[name] else None

    def request() -> AdRequest:
        return AdRequest(int(rng.choice(users)), surface=pick("surface"), platform=pick("platform"))

    with m31.Engine.open(index, model) as engine:
        with engine.index.snapshot_view() as view:
            ids = view.row_ids[view.live_mask()].numpy()
        asked = ids[:: max(1, len(ids) // why_not)][:why_not].tolist() if why_not else []

        def call(variant: str, r: AdRequest) -> float:
            t = time.perf_counter()
            if variant == "plain":
                engine.retrieve(r, k)
            elif variant == "explain":
                engine.retrieve(r, k, explain=True)
            else:
                engine.retrieve(r, k, explain=True, why_not=asked)
            return 1000 * (time.perf_counter() - t)

        for variant in VARIANTS:  # warm: the view's copies, the row map, the kernels
            call(variant, request())
        ms: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(repeat):
            r = request()
            for variant in VARIANTS:
                ms[variant].append(call(variant, r))
        n_ads = len(ids)
    case = f"N={n_ads} B=1 K={k} why_not={len(asked)}"
    median = {v: statistics.median(t) for v, t in ms.items()}
    print(f"{case}, median of {repeat} interleaved calls each")
    print(f"{'variant':>9} {'ms':>8} {'÷ plain':>8}")
    figures = []
    for v in VARIANTS:
        ratio = median[v] / median["plain"]
        print(f"{v:>9} {median[v]:>8.2f} {ratio:>7.2f}×")
        figures.append(Figure("explain", case, v, "median_ms", median[v], "ms"))
        figures.append(Figure("explain", case, v, "ratio_to_plain", ratio, "x"))
    return figures
