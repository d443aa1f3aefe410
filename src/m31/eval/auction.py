"""The funnel as an auction (DESIGN §8, "The auction"): retrieval, the ranking model, a
second-price auction on predicted conversion × paced bid, ads spending against their daily
budgets, and a pacing controller that sets each ad's multiplier every simulated minute through
the index's attribute updates (what `PATCH /v1/ads/{id}` applies).

Shapes: n requests of a simulated day, b requests of one minute, k retrieved candidates, S
slots, A ads of the catalogue, V advertisers.

One simulated day per arm — relevance or value ranking (`"rank"`), each with and without a cap
per advertiser (`"max_per"`) — over the same requests, each arm from the same start (bids set,
every pacing 1, every ad active). Per minute: the minute's requests are retrieved in one batch by
the real engine over the index, each request's candidates are scored by the ranker and
calibrated to a conversion probability p̂ (`calibrate`), and each request holds a generalised
second-price auction on e = p̂ · bid · pacing: the S best win a slot and pay, per impression,
the next entrant's e. A shown ad converts with its true probability (common random numbers:
the draw of (request, ad) is the same in every arm, `m31.eval.funnel.crn_uniform`). An ad whose
spend reaches its budget is paused (`status` budget_exhausted); at each minute's end the
controller moves each spending ad's pacing toward spending its budget evenly over the day.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np

from m31.eval.funnel import crn_uniform, paired
from m31.eval.offline import Requests

Predict = Callable[[Requests, np.ndarray], np.ndarray]  # candidate rows [b, k] -> p̂ [b, k]
ARMS = (("relevance", None), ("value", None), ("relevance", 2), ("value", 2))  # default arms
_PACING_MIN = 0.02  # the controller's floor: an ad is never throttled to nothing
_PATCH_STEP = 0.05  # a pacing change below this relative step is not sent


@dataclass(frozen=True)
class AuctionConfig:
    minutes: int = 60  # the simulated day: one pacing update per minute
    per_minute: int = 25  # requests per simulated minute (one batch)
    k: int = 100  # candidates retrieved per request
    slots: int = 4  # winners per auction
    budget_share: float = 0.5  # budgets: this share of what the ads spend with no budget
    gain: float = 1.0  # the pacing controller's gain
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("minutes", "per_minute", "k", "slots"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("budget_share", "gain"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive finite number, got {v!r}")
        if self.slots > self.k:
            raise ValueError(f"slots ({self.slots}) must not exceed k ({self.k})")


@dataclass
class Market:
    """Who owns each ad of the catalogue (rows), what a conversion is worth to its advertiser
    (the ad's bid: advertisers bid their value), and each ad's daily budget (relative, scaled by
    `simulate_auction` to the simulated day)."""

    ad_ids: np.ndarray  # [A] int64
    advertiser: np.ndarray  # [A] int64, -1: none
    bid: np.ndarray  # [A] float64 > 0
    budget: np.ndarray  # [A] float64 > 0
    row_of: dict[int, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.row_of = {int(a): i for i, a in enumerate(self.ad_ids.tolist())}

    @classmethod
    def of(cls, ads, seed: int = 0, value_sigma: float = 0.75) -> Market:
        """The market of an ads table (columns ad_id, advertiser_id, daily_budget): each
        advertiser's value per conversion log-normal (median 1, `value_sigma`), drawn from
        `seed`; an ad without a budget gets the median budget."""
        ids = np.asarray(ads["ad_id"].to_numpy(), np.int64)
        adv = np.asarray(ads["advertiser_id"].fill_null(-1).to_numpy(), np.int64)
        budget = np.asarray(ads["daily_budget"].to_numpy(zero_copy_only=False), np.float64)
        fine = np.isfinite(budget) & (budget > 0)
        budget = np.where(fine, budget, np.median(budget[fine]) if fine.any() else 1.0)
        rng = np.random.default_rng(seed)
        value = rng.lognormal(0.0, value_sigma, int(adv.max(initial=-1)) + 2)  # [V + 1]
        return cls(ids, adv, value[adv], budget)  # an ad without an advertiser: the last value


def calibrate(rank_fn, feats, n: int = 4000, seed: int = 0, chunk: int = 256):
    """Platt scaling of a ranker's scores to conversion probabilities: (a, c) of
    p̂ = sigmoid(a·s + c), fitted by Newton's method on up to n logged impressions of the
    features (`splits["impressions"]`: who saw which ad, and whether they converted)."""
    imp = feats.splits["impressions"]
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(imp["user"]), min(n, len(imp["user"])), replace=False)
    req = Requests(*(imp[c][pick] for c in ("user", "ts", "surface", "hour", "platform")))
    y = imp["conversion"][pick].astype(np.float64)
    if y.min(initial=0) == y.max(initial=0):
        raise ValueError("the impressions hold no conversions (or nothing else): nothing to fit")
    items = imp["item"][pick].astype(np.int64)
    parts = [
        rank_fn(req.take(slice(lo, lo + chunk)), items[lo : lo + chunk, None])[:, 0]
        for lo in range(0, len(items), chunk)
    ]
    s = np.concatenate(parts)
    return platt(s, y)


def platt(s: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(a, c) maximising the likelihood of labels y [n] (0 or 1) under p = sigmoid(a·s + c),
    by Newton's method from the base rate."""
    s, y = np.asarray(s, np.float64), np.asarray(y, np.float64)
    a, c = 0.0, math.log(y.mean() / (1 - y.mean()))
    for _ in range(100):
        p = 1 / (1 + np.exp(-(a * s + c)))
        w = np.maximum(p * (1 - p), 1e-12)
        grad = np.array([((p - y) * s).sum(), (p - y).sum()])
        hess = np.array([[(w * s * s).sum(), (w * s).sum()], [(w * s).sum(), w.sum()]])
        step = np.linalg.solve(hess + 1e-9 * np.eye(2), grad)
        a, c = a - step[0], c - step[1]
        if np.abs(step).max() < 1e-10:
            break
    return float(a), float(c)


def predictor(rank_fn, a: float, c: float) -> Predict:
    """p̂ [b, k] of candidate rows: the ranker's scores through the Platt scaling (a, c)."""

    def predict(req: Requests, cand: np.ndarray) -> np.ndarray:
        s = np.asarray(rank_fn(req, cand), np.float64)
        return 1 / (1 + np.exp(-(a * s + c)))

    return predict


def gsp(e: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """A generalised second-price auction over entrants' values e [m] (≥ 0): (winners [≤ S]
    positions in e, best first; prices [≤ S], each the next entrant's e, 0 after the last).
    Ties go to the earlier entrant (the retrieval order)."""
    order = np.argsort(-e, kind="stable")
    order = order[e[order] > 0]
    win = order[:slots]
    nxt = np.append(e[order[1 : slots + 1]], np.zeros(max(0, slots + 1 - len(order))))
    return win, nxt[: len(win)]


@dataclass
class _Day:
    """Per-request outcomes of one arm's day."""

    conversions: np.ndarray
    expected: np.ndarray
    value: np.ndarray
    expected_value: np.ndarray
    spend: np.ndarray
    advertisers_retrieved: np.ndarray  # distinct advertisers among the k retrieved
    advertisers_shown: np.ndarray  # distinct advertisers among the auction's winners
    ad_spend: np.ndarray  # [A] spend per ad over the day
    exhausted: int
    patches: int


class _Bids:
    """The index's pacing of every ad and the ads the auction paused, mirrored here and changed
    only through `update_attributes` (what `PATCH /v1/ads/{id}` applies), so the auction and
    value-ranked retrieval read the same numbers. (Ads inactive from the start are left as they
    are: retrieval never returns them.)"""

    def __init__(self, index, market: Market):
        self.index, self.market = index, market
        self.pacing = np.ones(len(market.ad_ids))
        self.paused = np.zeros(len(market.ad_ids), bool)
        self.patches = 0

    def set_pacing(self, rows: np.ndarray, pacing: np.ndarray) -> None:
        for r, m in zip(rows.tolist(), pacing.tolist(), strict=True):
            self.index.update_attributes(int(self.market.ad_ids[r]), pacing=float(m))
            self.pacing[r] = m
            self.patches += 1

    def pause(self, row: int) -> None:
        self.index.update_attributes(int(self.market.ad_ids[row]), status="budget_exhausted")
        self.paused[row] = True
        self.patches += 1

    def reset(self) -> None:
        """Every pacing 1 and every ad the auction paused active again: the start of a day."""
        for r in np.flatnonzero(self.paused).tolist():
            self.index.update_attributes(int(self.market.ad_ids[r]), status="active")
        moved = np.flatnonzero(self.pacing != 1.0)
        self.set_pacing(moved, np.ones(len(moved)))
        self.paused[:] = False
        self.patches = 0


def _day(
    engine,
    bids: _Bids,
    requests,
    req: Requests,
    predict: Predict,
    truth,
    cfg: AuctionConfig,
    rank: str,
    cap: int | None,
    budget: np.ndarray | None,
) -> _Day:
    """One arm's simulated day; `budget` None: no budgets, no pacing (the calibration run)."""
    market, n = bids.market, len(req)
    per_request = [
        f.name for f in fields(_Day) if f.name not in ("ad_spend", "exhausted", "patches")
    ]
    out = {name: np.zeros(n) for name in per_request}
    ad_spend = np.zeros(len(market.ad_ids))
    for minute in range(cfg.minutes):
        lo, hi = minute * cfg.per_minute, min((minute + 1) * cfg.per_minute, n)
        if lo >= hi:
            break
        max_per = None if cap is None else {"advertiser": cap}
        batch = [replace(r, rank=rank, max_per=max_per) for r in requests[lo:hi]]
        found = engine.retrieve(batch, cfg.k).results
        width = max(len(f.ad_ids) for f in found)
        cand = np.zeros((hi - lo, max(width, 1)), np.int64)  # [b, k] catalogue rows
        real = np.zeros(cand.shape, bool)
        for i, f in enumerate(found):
            cand[i, : len(f.ad_ids)] = [market.row_of[int(a)] for a in f.ad_ids]
            real[i, : len(f.ad_ids)] = True
        sub = req.take(slice(lo, hi))
        p_hat = np.where(real, predict(sub, cand), 0.0)  # [b, k]
        e = p_hat * market.bid[cand] * bids.pacing[cand]  # [b, k]
        p_true = truth.probabilities(sub.user, cand, sub.surface, sub.hour, sub.platform, sub.ts)[1]
        for i in range(hi - lo):
            r = lo + i
            live = real[i] & ~bids.paused[cand[i]]  # paused this minute: out of the auction
            win, price = gsp(np.where(live, e[i], 0.0), cfg.slots)
            rows = cand[i, win]
            u = crn_uniform(cfg.seed, np.full(len(rows), r), rows)
            conv = u < p_true[i, win]
            out["conversions"][r] = conv.sum()
            out["expected"][r] = p_true[i, win].sum()
            out["value"][r] = (conv * market.bid[rows]).sum()
            out["expected_value"][r] = (p_true[i, win] * market.bid[rows]).sum()
            out["spend"][r] = price.sum()
            np.add.at(ad_spend, rows, price)
            out["advertisers_retrieved"][r] = len(np.unique(market.advertiser[cand[i, real[i]]]))
            out["advertisers_shown"][r] = len(np.unique(market.advertiser[rows]))
            if budget is not None:
                for row in rows[(ad_spend[rows] >= budget[rows]) & ~bids.paused[rows]].tolist():
                    bids.pause(row)
        if budget is not None:
            _pace(bids, ad_spend, budget, (minute + 1) / cfg.minutes, cfg.gain)
    return _Day(**out, ad_spend=ad_spend, exhausted=int(bids.paused.sum()), patches=bids.patches)


def _pace(bids: _Bids, spend: np.ndarray, budget: np.ndarray, elapsed: float, gain: float):
    """The controller: each ad that has spent, and is not paused, moves its pacing by
    exp(gain · (1 - spent / (its budget · the day's elapsed share))), within [floor, 1]; only
    changes of at least `_PATCH_STEP` are sent."""
    rows = np.flatnonzero((spend > 0) & ~bids.paused)
    ratio = spend[rows] / (budget[rows] * elapsed)
    new = np.clip(bids.pacing[rows] * np.exp(gain * (1 - ratio)), _PACING_MIN, 1.0)
    moved = np.abs(new / bids.pacing[rows] - 1) >= _PATCH_STEP
    bids.set_pacing(rows[moved], new[moved])


def simulate_auction(
    engine,
    market: Market,
    truth,
    requests: Sequence,
    req: Requests,
    predict: Predict,
    cfg: AuctionConfig = AuctionConfig(),
    arms: Sequence[tuple[str, int | None]] = ARMS,
    log: Callable[[str], None] = lambda _: None,
) -> dict:
    """Each arm's day over the same requests (`requests`: the engine's AdRequests, `req`: the
    same as `Requests` of feature rows, in arrival order; `cfg.minutes · cfg.per_minute` of them
    are used), after a calibration day: relevance ranking with no budgets, whose spend per ad
    sets the budgets (`budget_share` of it, in proportion to the market's relative budgets
    among the ads that spent). `engine`: a `Retriever` over an index whose ads carry the
    market's bids (`m31.eval.runs.auction_index`).

    Returns {"config", "requests", "budget_total", "arms": {name: {per-1k figures, spend /
    budget, exhausted ads, distinct advertisers, patches}}, "pairs": [paired differences per
    1,000 requests with 95% CIs]}."""
    n = min(len(req), cfg.minutes * cfg.per_minute)
    if n == 0:
        raise ValueError("no requests to simulate")
    requests, req = list(requests)[:n], req.take(slice(0, n))
    bids = _Bids(engine.index, market)
    log(f"auction: calibration day, {n:,} requests, no budgets")
    free = _day(engine, bids, requests, req, predict, truth, cfg, "relevance", None, None)
    spent = free.ad_spend > 0
    if not spent.any():
        raise ValueError("nothing was spent in the calibration day: no budgets to set")
    # budgets in proportion to the market's, scaled so that the ads that spent have, together,
    # `budget_share` of what they spent; every other ad the same scale
    scale = cfg.budget_share * free.ad_spend[spent].sum() / market.budget[spent].sum()
    budget = market.budget * scale
    days, names = {}, []
    for rank, cap in arms:
        name = f"{rank}{'' if cap is None else f', max {cap} per advertiser'}"
        bids.reset()
        log(f"auction: {name}")
        days[name] = _day(engine, bids, requests, req, predict, truth, cfg, rank, cap, budget)
        names.append(name)
    bids.reset()
    report = {}
    for name, d in days.items():
        had = d.ad_spend > 0
        report[name] = {
            "conversions_per_1k": 1000 * d.conversions.mean(),
            "expected_per_1k": 1000 * d.expected.mean(),
            "value_per_1k": 1000 * d.value.mean(),
            "expected_value_per_1k": 1000 * d.expected_value.mean(),
            "spend_per_1k": 1000 * d.spend.mean(),
            "spend_of_budget": float(d.ad_spend.sum() / budget[had].sum()) if had.any() else 0.0,
            "ads_spending": int(had.sum()),
            "ads_exhausted": d.exhausted,
            "advertisers_per_request": float(d.advertisers_retrieved.mean()),
            "advertisers_per_auction": float(d.advertisers_shown.mean()),
            "patches": d.patches,  # pacing changes and pauses
        }
    pairs = []
    for model, base in _pairs(arms, names):
        x, y = days[model], days[base]
        pair = {"model": model, "baseline": base}
        for what in ("conversions", "value", "expected_value", "advertisers_retrieved"):
            prefix = "advertisers_" if what == "advertisers_retrieved" else f"{what}_"
            pair |= paired(getattr(x, what), getattr(y, what), prefix)
        pairs.append(pair)
    return {
        "config": cfg.__dict__,
        "requests": n,
        "budget_total": float(budget.sum()),
        "arms": report,
        "pairs": pairs,
    }


def _pairs(arms, names) -> list[tuple[str, str]]:
    """(value vs relevance at each cap) and (capped vs not at each ranking), as named."""
    at = dict(zip(arms, names, strict=True))
    out = []
    for (rank, cap), name in at.items():
        if rank == "value" and ("relevance", cap) in at:
            out.append((name, at["relevance", cap]))
    for (rank, cap), name in at.items():
        if cap is not None and (rank, None) in at:
            out.append((name, at[rank, None]))
    return out


def format_auction(result: dict) -> str:
    """Markdown: one row per arm, then the paired differences with their 95% CIs."""

    def ci(lo_hi) -> str:
        return f"[{lo_hi[0]:+.2f}, {lo_hi[1]:+.2f}]"

    cfg = result["config"]
    lines = [
        f"{result['requests']:,} requests over {cfg['minutes']} simulated minutes, "
        f"{cfg['k']} retrieved, {cfg['slots']} slots (second price), budgets "
        f"{cfg['budget_share']:.0%} of the unconstrained day's spend",
        "",
        "| arm | conversions / 1k | value / 1k | spend / 1k | spend / budget | ads exhausted "
        "| advertisers / request | advertisers / auction | PATCHes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in result["arms"].items():
        lines.append(
            f"| {name} | {m['conversions_per_1k']:.1f} | {m['value_per_1k']:.1f} "
            f"| {m['spend_per_1k']:.1f} | {m['spend_of_budget']:.0%} | {m['ads_exhausted']} "
            f"| {m['advertisers_per_request']:.1f} | {m['advertisers_per_auction']:.2f} "
            f"| {m['patches']:,} |"
        )
    if result["pairs"]:
        lines += [
            "",
            "| arm vs baseline | Δ conversions / 1k [95% CI] | Δ value / 1k [95% CI] "
            "| Δ expected value / 1k [95% CI] | Δ advertisers / request |",
            "|---|---:|---:|---:|---:|",
        ]
        for p in result["pairs"]:
            lines.append(
                f"| {p['model']} vs {p['baseline']} "
                f"| {p['conversions_diff_per_1k']:+.1f} {ci(p['conversions_ci_per_1k'])} "
                f"| {p['value_diff_per_1k']:+.1f} {ci(p['value_ci_per_1k'])} "
                f"| {p['expected_value_diff_per_1k']:+.1f} "
                f"{ci(p['expected_value_ci_per_1k'])} "
                f"| {p['advertisers_diff_per_1k'] / 1000:+.2f} |"
            )
    return "\n".join(lines)


def run_auction(
    ads,
    feats,
    model,
    rank_fn,
    truth,
    cfg: AuctionConfig = AuctionConfig(),
    arms: Sequence[tuple[str, int | None]] = ARMS,
    log: Callable[[str], None] = lambda _: None,
) -> dict:
    """`simulate_auction` on a synthetic world: its ads table `ads` (the catalogue of `feats`)
    indexed by the retrieval `model` with the market's bids (`Market.of`, every pacing 1), the
    ranker `rank_fn` (candidate rows -> scores, `ScoreFunction.rank`) calibrated on the logged
    impressions, and the test split's requests in arrival order."""
    import pyarrow as pa

    from m31.engine import AdRequest, Retriever
    from m31.engine.build import index_of
    from m31.eval.offline import requests_from_split

    if not np.array_equal(np.asarray(ads["ad_id"]), feats.ads["ad_id"]):
        raise ValueError("the ads table and the features' catalogue list different ads")
    market = Market.of(ads, cfg.seed)
    priced = ads.append_column("bid", pa.array(market.bid))
    priced = priced.append_column("pacing", pa.array(np.ones(len(market.bid))))
    engine = Retriever(model, feats, index_of(priced, model, feats))
    a, c = calibrate(rank_fn, feats, seed=cfg.seed)
    log(f"auction: the ranker's scores calibrated to conversions: sigmoid({a:.3f} s {c:+.3f})")
    req = requests_from_split(feats, "test", max_users=cfg.minutes * cfg.per_minute, seed=cfg.seed)
    req = req.take(np.argsort(req.ts, kind="stable"))  # in arrival order
    vocab = feats.meta["vocab"]
    user_ids = feats.users["user_id"]
    requests = [
        AdRequest(
            int(user_ids[u]), int(t), surface=vocab["surface"][s], platform=vocab["platform"][p]
        )
        for u, t, s, p in zip(req.user.tolist(), req.ts, req.surface, req.platform, strict=True)
    ]
    predict = predictor(rank_fn, a, c)
    result = simulate_auction(engine, market, truth, requests, req, predict, cfg, arms, log)
    result["calibration"] = {"a": a, "c": c}
    return result
