"""Generate a synthetic ads marketplace: users, advertisers, ads, an event log, and its truth.

Shapes: U users, A ads, T leaf topics, C categories, L latent dim, F max facets per user,
n impressions in a chunk, c candidate ads per impression.

Everything is drawn from one `numpy.random.Generator` seeded by the caller, in a fixed order,
so one seed gives identical tables. Ids equal row numbers (user_id = user row, ad_id = ad row).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from m31.data import dataset
from m31.data.dataset import Dataset
from m31.data.schema import ADS, ADVERTISERS, AGE_EDGES, EVENTS, ORGANIC, USERS, age_bucket
from m31.vocabularies import (
    BUILT_IN_VOCAB,
    FORMATS,
    GENDERS,
    OBJECTIVES,
    ORGANIC_SURFACES,
    PLATFORMS,
    STATUSES,
    SURFACES,
)
from m31.world import vocab
from m31.world.config import DAY, EPOCH, WorldConfig
from m31.world.truth import GroundTruth

COUNTRIES = ("US", "GB", "DE", "FR", "BR", "IN", "JP", "CA")
COUNTRY_P = (0.30, 0.10, 0.10, 0.08, 0.12, 0.16, 0.08, 0.06)
PLATFORM_P = (0.40, 0.45, 0.15)
SURFACE_P = (0.45, 0.20, 0.20, 0.10, 0.05)
ORGANIC_USED = ORGANIC_SURFACES[:4]  # the marketplace's organic surfaces
FORMAT_P = (0.45, 0.35, 0.20)
OBJECTIVE_P = (0.35, 0.45, 0.20)
STATUS_P = (0.85, 0.10, 0.05)
# Impressions by hour of day (UTC): low at night, peaks at lunch and in the evening.
HOUR_P = np.array(
    [2, 1, 1, 1, 1, 2, 3, 4, 5, 5, 5, 6, 7, 6, 5, 5, 5, 6, 7, 8, 9, 8, 6, 4], dtype=np.float64
)
HOUR_P /= HOUR_P.sum()

# Logit bonus of (image, video, carousel) on each surface of SURFACES.
SURFACE_FORMAT = np.array(
    [
        [0.0, 0.1, 0.1],  # feed
        [-0.3, 0.5, -0.2],  # stories
        [-0.8, 0.9, -0.8],  # reels: video converts better
        [0.2, -0.5, 0.6],  # marketplace: carousels of products
        [0.4, -0.6, 0.1],  # search
    ],
    dtype=np.float32,
)
# Logit bonus of (clicks, conversions, app_installs) on (ios, android, web).
PLATFORM_OBJECTIVE = np.array(
    [[0.0, 0.1, 0.3], [0.0, 0.0, 0.3], [0.1, 0.2, -2.5]], dtype=np.float32
)

AUCTION_BLOCK = 50  # impressions that share one random candidate list (one dense product)

Progress = Callable[[str, int, int], None]


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _choice_rows(
    rng: np.random.Generator, probs: np.ndarray, rows: np.ndarray, k: int
) -> np.ndarray:
    """For each row index r in `rows`, k draws from the categorical `probs[r]`: [len(rows), k]."""
    cum = np.cumsum(probs, axis=1)[rows]  # [n, C]
    r = rng.random((len(rows), k))
    return np.minimum((cum[:, None, :] < r[:, :, None]).sum(-1), probs.shape[1] - 1)


def _list_column(mask: np.ndarray, names: tuple[str, ...], restricted: np.ndarray) -> pa.Array:
    """A list<string> column from bit masks; unrestricted rows get an empty list."""
    bits = ((mask[:, None] >> np.arange(len(names))) & 1).astype(bool)  # [A, len(names)]
    bits &= restricted[:, None]
    offsets = np.concatenate([[0], np.cumsum(bits.sum(1))]).astype(np.int32)
    values = np.array(names, dtype=object)[np.nonzero(bits)[1]]
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.string()))


class _Targeting:
    """Ad targeting as bit masks, so eligibility of [n, c] candidates is a few array ops."""

    def __init__(self, rng: np.random.Generator, n_ads: int, objective: np.ndarray) -> None:
        n_c = len(COUNTRIES)
        self.country_restricted = rng.random(n_ads) < 0.25
        k = rng.integers(1, 4, n_ads)
        ranks = rng.random((n_ads, n_c)).argsort(1).argsort(1)
        self.country_mask = np.where(
            self.country_restricted, ((ranks < k[:, None]) << np.arange(n_c)).sum(1), (1 << n_c) - 1
        )
        age_restricted = rng.random(n_ads) < 0.3
        self.age_min = np.where(age_restricted, rng.choice([18, 25, 35], n_ads), 0).astype(np.int16)
        self.age_max = np.where(age_restricted, rng.choice([34, 44, 65], n_ads), 120).astype(
            np.int16
        )
        self.gender_restricted = rng.random(n_ads) < 0.15
        self.gender_mask = np.where(self.gender_restricted, 1 << rng.integers(0, 2, n_ads), 3)
        # App installs only make sense on mobile; some other ads pick platforms too.
        app = objective == OBJECTIVES.index("app_installs")
        self.platform_restricted = app | (rng.random(n_ads) < 0.1)
        mobile = (1 << PLATFORMS.index("ios")) | (1 << PLATFORMS.index("android"))
        some = rng.integers(1, 1 << len(PLATFORMS), n_ads)
        self.platform_mask = np.where(app, mobile, np.where(self.platform_restricted, some, 7))

    def eligible(self, ads, country, age, gender, platform) -> np.ndarray:
        """ads [n, c]; user attributes [n] -> [n, c] bool."""
        return (
            ((self.country_mask[ads] >> country[:, None]) & 1).astype(bool)
            & (self.age_min[ads] <= age[:, None])
            & (age[:, None] <= self.age_max[ads])
            & ((self.gender_mask[ads] >> gender[:, None]) & 1).astype(bool)
            & ((self.platform_mask[ads] >> platform[:, None]) & 1).astype(bool)
        )

    def columns(self) -> dict[str, pa.Array]:
        return {
            "target_countries": _list_column(self.country_mask, COUNTRIES, self.country_restricted),
            "target_age_min": pa.array(self.age_min),
            "target_age_max": pa.array(self.age_max),
            "target_genders": _list_column(self.gender_mask, GENDERS, self.gender_restricted),
            "target_platforms": _list_column(
                self.platform_mask, PLATFORMS, self.platform_restricted
            ),
        }


def generate(
    cfg: WorldConfig, seed: int, progress: Progress | None = None
) -> tuple[Dataset, GroundTruth]:
    """Draw a whole world. `progress(stage, done, total)` is called as the event log grows."""
    rng = np.random.default_rng(seed)
    n_t, n_cat, dim = vocab.N_TOPICS, vocab.N_CATEGORIES, cfg.latent_dim
    span = cfg.days * DAY

    # Topic space: sibling leaves share their category's direction (cosine about 0.55).
    cat_vec = _unit(rng.standard_normal((n_cat, dim)))
    topic_cat = vocab.topic_category(np.arange(n_t))
    topic_vec = _unit(0.75 * cat_vec[topic_cat] + 0.66 * _unit(rng.standard_normal((n_t, dim))))
    topic_vec = topic_vec.astype(np.float32)  # [T, L]

    # Users and their interest facets; demographics shift which categories they like.
    n_u, n_f = cfg.n_users, cfg.max_facets
    country = rng.choice(len(COUNTRIES), n_u, p=COUNTRY_P)
    age = (18 + np.floor(rng.beta(2.0, 3.0, n_u) * 52)).astype(np.int16)
    gender = rng.integers(0, 2, n_u)
    platform = rng.choice(len(PLATFORMS), n_u, p=PLATFORM_P)
    group = age_bucket(age) * 2 + gender  # [U] demographic group
    n_groups = (len(AGE_EDGES) + 1) * 2
    group_pref = 0.7 * rng.dirichlet(np.full(n_cat, 0.5), n_groups) + 0.3 / n_cat  # [groups, C]
    facet_cat = _choice_rows(rng, group_pref, group, n_f)  # [U, F]
    facet_topic = facet_cat * vocab.LEAVES_PER_CATEGORY + rng.integers(
        0, vocab.LEAVES_PER_CATEGORY, (n_u, n_f)
    )
    n_facets = rng.integers(2, n_f + 1, n_u)
    valid = np.arange(n_f)[None, :] < n_facets[:, None]  # [U, F]
    noise = rng.standard_normal((n_u, n_f, dim)) / np.sqrt(dim)
    facet_vec = _unit(topic_vec[facet_topic] + cfg.facet_noise * noise).astype(np.float32)
    facet_vec[~valid] = 0.0
    spread = cfg.facet_weight_scale  # the same draws at any scale: only their size changes
    facet_w0 = np.where(valid, spread * rng.normal(0.0, 0.7, (n_u, n_f)), -1e4).astype(np.float32)
    facet_drift = np.where(valid, spread * rng.normal(0.0, 1.0, (n_u, n_f)), 0.0)
    facet_drift = facet_drift.astype(np.float32)
    facet_topic = np.where(valid, facet_topic, -1)
    activity = rng.lognormal(0.0, 1.0, n_u)
    user_created = EPOCH - rng.integers(0, 365 * DAY, n_u)
    cohort = (country * n_groups + group).astype(np.int32)

    # Advertisers, campaigns and ads.
    n_adv, n_a = cfg.n_advertisers, cfg.n_ads
    adv_cat = rng.integers(0, n_cat, n_adv)
    adv_names = vocab.make_advertiser_names(adv_cat, rng)
    adv_weight = rng.permutation(1.0 / (np.arange(n_adv) + 5.0) ** 0.8)
    ad_adv = rng.choice(n_adv, n_a, p=adv_weight / adv_weight.sum())
    n_campaigns = rng.integers(1, 5, n_adv)
    campaign_objective = rng.choice(len(OBJECTIVES), (n_adv, 4), p=OBJECTIVE_P)
    ad_campaign = np.floor(rng.random(n_a) * n_campaigns[ad_adv]).astype(np.int64)
    objective = campaign_objective[ad_adv, ad_campaign]
    in_category = rng.random(n_a) < 0.8
    topic = np.where(
        in_category,
        adv_cat[ad_adv] * vocab.LEAVES_PER_CATEGORY
        + rng.integers(0, vocab.LEAVES_PER_CATEGORY, n_a),
        rng.integers(0, n_t, n_a),
    )
    fmt = rng.choice(len(FORMATS), n_a, p=FORMAT_P)
    texts = vocab.make_texts(topic, fmt, rng)
    targeting = _Targeting(rng, n_a, objective)
    status = rng.choice(len(STATUSES), n_a, p=STATUS_P)
    budget = rng.lognormal(4.0, 1.0, n_a).astype(np.float32)
    quality = rng.standard_normal(n_a).astype(np.float32)
    # Its own stream, so that the estimate's noise leaves every other draw of the seed as it was.
    noise = np.random.default_rng((seed, 1)).standard_normal(n_a)
    quality_estimate = (quality + cfg.quality_noise * noise) / np.sqrt(1 + cfg.quality_noise**2)
    # Two thirds of the catalogue predates the log; the rest keeps arriving during it.
    ad_created = (EPOCH + span * rng.uniform(-2.0, 1.0, n_a)).astype(np.int64)
    ad_vec = _unit(topic_vec[topic] + cfg.ad_noise * rng.standard_normal((n_a, dim)) / np.sqrt(dim))

    hour_amp = rng.uniform(0.3, 0.8, n_cat)
    hour_peak = rng.uniform(0, 24, n_cat)
    hour_category = hour_amp * np.cos(2 * np.pi * (np.arange(24)[:, None] - hour_peak) / 24)

    truth = GroundTruth(
        facet_vec=facet_vec,
        facet_w0=facet_w0,
        facet_drift=facet_drift,
        facet_topic=facet_topic.astype(np.int32),
        ad_vec=ad_vec.astype(np.float32),
        ad_quality=quality,
        ad_format=fmt.astype(np.int64),
        ad_category=topic_cat[topic].astype(np.int64),
        ad_objective=objective.astype(np.int64),
        surface_format=SURFACE_FORMAT,
        hour_category=hour_category.astype(np.float32),
        platform_objective=PLATFORM_OBJECTIVE,
        topic_vec=topic_vec,
        t0=EPOCH,
        span=span,
        beta=cfg.facet_sharpness,
        kappa=cfg.match_gain,
    )

    events = _event_log(
        cfg, rng, truth, targeting, ad_created, activity, country, age, gender, platform, progress
    )
    organic = _organic(cfg, rng, facet_topic, valid, activity)

    users = pa.table(
        {
            "user_id": pa.array(np.arange(n_u, dtype=np.int64)),
            "age": pa.array(age),
            "gender": pa.array(np.array(GENDERS)[gender]),
            "country": pa.array(np.array(COUNTRIES)[country]),
            "platform": pa.array(np.array(PLATFORMS)[platform]),
            "cohort": pa.array(cohort),
            "created_at": pa.array(user_created.astype(np.int64)),
        },
        schema=USERS,
    )
    advertisers = pa.table(
        {
            "advertiser_id": pa.array(np.arange(n_adv, dtype=np.int64)),
            "name": pa.array(adv_names, pa.string()),
            "category": pa.array(adv_cat.astype(np.int32)),
        },
        schema=ADVERTISERS,
    )
    ads = pa.table(
        {
            "ad_id": pa.array(np.arange(n_a, dtype=np.int64)),
            "advertiser_id": pa.array(ad_adv.astype(np.int64)),
            "campaign_id": pa.array((ad_adv * 4 + ad_campaign).astype(np.int64)),
            "objective": pa.array(np.array(OBJECTIVES)[objective]),
            "format": pa.array(np.array(FORMATS)[fmt]),
            "topic": pa.array(topic.astype(np.int32)),
            "category": pa.array(topic_cat[topic].astype(np.int32)),
            "text": pa.array(texts, pa.string()),
            **targeting.columns(),
            "status": pa.array(np.array(STATUSES)[status]),
            "daily_budget": pa.array(budget),
            "quality": pa.array(quality_estimate.astype(np.float32)),
            "created_at": pa.array(ad_created),
        },
        schema=ADS,
    )
    meta = {
        "source": "synthetic",
        # The delivery policy draws each impression's candidates afresh and remembers nothing a
        # user saw or clicked, so the same ad is shown and clicked again (in the tiny world 12%
        # of clicks repeat an earlier click's user and ad): a seen ad stays a possible next one.
        "repeat_engagement": True,
        "vocab": {name: list(values) for name, values in BUILT_IN_VOCAB.items()},
        "seed": seed,
        "config": cfg.to_dict(),
        "time_range": [EPOCH, EPOCH + span],
        "topics": [
            {"id": i, "name": name, "category": int(topic_cat[i])}
            for i, name in enumerate(vocab.topic_names())
        ],
        "ids": "user_id and ad_id equal row numbers",
    }
    ds = Dataset(
        users=users, advertisers=advertisers, ads=ads, events=events, organic=organic, meta=meta
    )
    return ds, truth


def generate_folder(
    out: Path,
    cfg: WorldConfig,
    seed: int = 0,
    *,
    reuse: bool = False,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> tuple[Dataset, bool]:
    """(dataset, False): the world of `cfg` and `seed` written into the dataset folder `out`
    (atomically, with its ground truth and its generation time in the meta). With `reuse`, a
    folder made with the same settings is kept instead: (its dataset, True). Refuses to replace
    a folder without `overwrite`, naming the command line's options."""
    out = Path(out)
    if out.exists() and reuse:
        try:
            existing = dataset.load(out)
            same = WorldConfig.from_dict(existing.meta.get("config") or {}) == cfg
        except (dataset.DatasetError, TypeError, ValueError):
            existing, same = None, False
        if same and existing.meta.get("seed") == seed:
            return existing, True
        if not overwrite:
            raise ValueError(f"{out}: exists with other settings (pass --overwrite to replace it)")
    elif out.exists() and not overwrite:
        raise ValueError(f"{out}: already exists (pass --overwrite to replace it, or --reuse)")
    start = time.perf_counter()
    ds, truth = generate(cfg, seed, progress=progress)
    ds.meta["generated_in_s"] = round(time.perf_counter() - start, 2)
    dataset.save(ds, out, overwrite=True, extra=truth.to_arrays())
    return ds, False


def _event_log(
    cfg: WorldConfig,
    rng: np.random.Generator,
    truth: GroundTruth,
    targeting: _Targeting,
    ad_created: np.ndarray,
    activity: np.ndarray,
    country: np.ndarray,
    age: np.ndarray,
    gender: np.ndarray,
    platform: np.ndarray,
    progress: Progress | None,
    chunk: int = 50_000,
) -> pa.Table:
    """Impressions from a noisy-greedy delivery policy with exploration, and their outcomes.

    For each impression the policy draws `candidates` random ads (shared by a block of
    AUCTION_BLOCK impressions of different users), keeps those eligible (already
    created, targeting matches the user), and shows the one with the highest true click logit
    plus Gumbel noise, or (with probability `explore`) a uniformly random eligible one.
    """
    n_total, n_c = cfg.n_impressions, cfg.candidates
    user_p = activity / activity.sum()
    parts = []
    done = 0
    while done < n_total:
        n = min(chunk, n_total - done)
        u = rng.choice(cfg.n_users, n, p=user_p)
        day = rng.integers(0, cfg.days, n)
        hour = rng.choice(24, n, p=HOUR_P)
        ts = EPOCH + day * DAY + hour * 3600 + rng.integers(0, 3600, n)
        surface = rng.choice(len(SURFACES), n, p=SURFACE_P)
        plat = np.where(rng.random(n) < 0.85, platform[u], rng.integers(0, len(PLATFORMS), n))
        # Impressions in a block of AUCTION_BLOCK share one random candidate list.
        m = n // AUCTION_BLOCK if n % AUCTION_BLOCK == 0 else n
        lists = rng.integers(0, cfg.n_ads, (m, n_c))  # [m, c]
        cand = np.repeat(lists, n // m, axis=0)  # [n, c]
        ok = (ad_created[cand] <= ts[:, None]) & targeting.eligible(
            cand, country[u], age[u], gender[u], plat
        )
        click_logit, cvr_logit = truth.logits(u, lists, surface, hour, plat, ts)  # [n, c] each
        gumbel = torch.from_numpy(-np.log(-np.log(rng.random((n, n_c)) + 1e-12) + 1e-12))
        explore = torch.from_numpy(rng.random(n) < cfg.explore)[:, None]
        score = torch.where(explore, gumbel, click_logit + cfg.policy_noise * gumbel)
        score = score.masked_fill(~torch.from_numpy(ok), -torch.inf)
        pick = score.argmax(1, keepdim=True)  # [n, 1]
        shown = torch.from_numpy(ok).gather(1, pick)[:, 0].numpy()
        p_click = torch.sigmoid(click_logit.gather(1, pick))[:, 0].numpy()
        p_cvr = torch.sigmoid(cvr_logit.gather(1, pick))[:, 0].numpy()
        click = rng.random(n) < p_click
        conv = click & (rng.random(n) < p_cvr)
        ad = np.take_along_axis(cand, pick.numpy(), 1)[:, 0]
        keep = shown
        parts.append(
            {
                "user_id": u[keep],
                "ad_id": ad[keep],
                "ts": ts[keep],
                "surface": surface[keep],
                "hour": hour[keep],
                "platform": plat[keep],
                "click": click[keep],
                "conversion": conv[keep],
            }
        )
        done += n
        if progress:
            progress("impressions", done, n_total)
    return _events_table(parts)


def _events_table(parts: list[dict[str, np.ndarray]]) -> pa.Table:
    """The impressions' chunks as one events table, in time order (then user, then ad)."""
    cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    order = np.lexsort((cols["ad_id"], cols["user_id"], cols["ts"]))
    cols = {k: v[order] for k, v in cols.items()}
    return pa.table(
        {
            "user_id": pa.array(cols["user_id"].astype(np.int64)),
            "ad_id": pa.array(cols["ad_id"].astype(np.int64)),
            "ts": pa.array(cols["ts"].astype(np.int64)),
            "surface": pa.array(np.array(SURFACES)[cols["surface"]]),
            "hour": pa.array(cols["hour"].astype(np.int8)),
            "platform": pa.array(np.array(PLATFORMS)[cols["platform"]]),
            "click": pa.array(cols["click"]),
            "conversion": pa.array(cols["conversion"]),
        },
        schema=EVENTS,
    )


def _organic(
    cfg: WorldConfig,
    rng: np.random.Generator,
    facet_topic: np.ndarray,
    valid: np.ndarray,
    activity: np.ndarray,
) -> pa.Table:
    """Organic engagement: every facet equally (ads favour the strongest), plus 30% noise.

    It therefore reveals interests that the ad history under-shows, and exists for users with
    few or no ad events.
    """
    per_user = rng.poisson(cfg.organic_per_user * np.sqrt(activity / activity.mean()))
    u = np.repeat(np.arange(cfg.n_users), per_user)
    n = len(u)
    n_valid = valid.sum(1)[u]
    facet = np.floor(rng.random(n) * n_valid).astype(np.int64)
    topic = np.where(rng.random(n) < 0.7, facet_topic[u, facet], rng.integers(0, vocab.N_TOPICS, n))
    ts = EPOCH + rng.integers(-30 * DAY, cfg.days * DAY, n)
    surface = rng.integers(0, len(ORGANIC_USED), n)
    order = np.lexsort((u, ts))
    return pa.table(
        {
            "user_id": pa.array(u[order].astype(np.int64)),
            "topic": pa.array(topic[order].astype(np.int32)),
            "ts": pa.array(ts[order].astype(np.int64)),
            "surface": pa.array(np.array(ORGANIC_USED)[surface[order]]),
        },
        schema=ORGANIC,
    )
